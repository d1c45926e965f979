"""Under SLURM the ranks' wiring equals what the frameworks' own SLURM support
computes from the same environment: JAX's ``SlurmCluster`` (coordinator,
process id and count, local id), TensorFlow's ``SlurmClusterResolver`` (task
type and index, cluster spec, each task's GPU) and the usual torchrun-under-SLURM
mapping (``RANK=SLURM_PROCID``, ``LOCAL_RANK=SLURM_LOCALID``,
``WORLD_SIZE=SLURM_NTASKS``, ``GROUP_RANK=SLURM_NODEID``, ``MASTER_ADDR`` the
first host of the job). The environments are recorded ``srun`` task
environments of a 1-node and a 2-node step; the frameworks read them from
``os.environ``, vgpu_magic from the engines' host reports. Pure: no process starts.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from vgpu_magic.frameworks import get
from vgpu_magic.inventory import GPUInfo
from vgpu_magic.layout import HostReport, expand_hostlist, layout_ranks
from vgpu_magic.ranks.launchers import SlurmLauncher

slurm_cluster = pytest.importorskip("jax._src.clusters.slurm_cluster")
resolver = pytest.importorskip("tensorflow.python.distribute.cluster_resolver.slurm_cluster_resolver")


def srun_tasks(job_id: int, nodelist: str, hosts: list[str], per_node: int, per_node_text: str) -> list[dict[str, str]]:
    """The environment ``srun`` gives each task of a block-distributed step (recorded variable set)."""
    ntasks = per_node * len(hosts)
    tasks = []
    for procid in range(ntasks):
        node = procid // per_node
        tasks.append(
            {
                "SLURM_JOB_ID": str(job_id),
                "SLURM_JOBID": str(job_id),
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": str(procid),
                "SLURM_LOCALID": str(procid % per_node),
                "SLURM_NODEID": str(node),
                "SLURM_NTASKS": str(ntasks),
                "SLURM_NPROCS": str(ntasks),
                "SLURM_STEP_NUM_TASKS": str(ntasks),
                "SLURM_STEP_NUM_NODES": str(len(hosts)),
                "SLURM_JOB_NUM_NODES": str(len(hosts)),
                "SLURM_STEP_NODELIST": nodelist,
                "SLURM_JOB_NODELIST": nodelist,
                "SLURM_NODELIST": nodelist,
                "SLURM_TASKS_PER_NODE": per_node_text,
                "SLURM_STEP_TASKS_PER_NODE": per_node_text,
                "SLURMD_NODENAME": hosts[node],
            }
        )
    return tasks


ONE_NODE = srun_tasks(4242, "node07", ["node07"], 2, "2")
TWO_NODES = srun_tasks(131071, "gpu[01-02]", ["gpu01", "gpu02"], 2, "2(x2)")
GPUS_PER_NODE = 2


def reports(tasks: list[dict[str, str]]) -> list[HostReport]:
    """What each task's engine reports: engine ids in another order than the SLURM ranks (engines register
    in any order), each node's address, its 2 GPUs, a port chosen there, the SLURM variables."""
    found = []
    for engine_id, env in zip(reversed(range(len(tasks))), tasks):
        node = int(env["SLURM_NODEID"])
        gpus = tuple(
            GPUInfo(i, "GPU", total_mib=81920, free_mib=81000, compute_capability=(9, 0), nvml_index=i)
            for i in range(GPUS_PER_NODE)
        )
        launcher = {k: v for k, v in env.items() if k.startswith(SlurmLauncher.task_variables)}
        found.append(
            HostReport(
                engine_id,
                env["SLURMD_NODENAME"],
                f"10.0.0.{node + 1}",
                100 + engine_id,
                gpus,
                30000 + engine_id,
                launcher,
            )
        )
    return found


def under(env: dict[str, str]):
    """``os.environ`` is exactly this task's environment while a framework reads it."""
    return mock.patch.dict(os.environ, env, clear=True)


@pytest.mark.parametrize("port", [None, 9000], ids=["job id port", "--port as the override"])
@pytest.mark.parametrize("tasks", [ONE_NODE, TWO_NODES], ids=["1 node", "2 nodes"])
def test_jax_coordinator_and_process_ids_equal_jaxs_slurm_cluster(tasks, port):
    plans = get("jax").plan_ranks(layout_ranks(reports(tasks), None, SlurmLauncher.launched), None, None, port)
    layout = layout_ranks(reports(tasks), None, SlurmLauncher.launched)
    for env in tasks:
        with under(env):
            cluster = slurm_cluster.SlurmCluster
            assert cluster.is_env_present()
            expected = (
                cluster.get_coordinator_address(None, None if port is None else str(port)),
                cluster.get_process_count(),
                cluster.get_process_id(),
            )
            local = cluster.get_local_process_id()
        rank = int(env["SLURM_PROCID"])
        coordinator, count, process_id, gpu = plans[rank].args[:4]
        assert (coordinator, count, process_id) == expected
        assert layout.places[rank].local_rank == local
        assert gpu == local  # one GPU per local rank on every node, CUDA's index on its host


@pytest.mark.parametrize("port", [None, 9000], ids=["default ports", "--port as port_base"])
@pytest.mark.parametrize("tasks", [ONE_NODE, TWO_NODES], ids=["1 node", "2 nodes"])
def test_tf_config_equals_tensorflows_slurm_cluster_resolver(tasks, port):
    plans = get("tensorflow").plan_ranks(layout_ranks(reports(tasks), None, SlurmLauncher.launched), None, None, port)
    base = {} if port is None else {"port_base": port}
    for env in tasks:
        with under(env):
            found = resolver.SlurmClusterResolver(gpus_per_node=GPUS_PER_NODE, auto_set_gpu=False, **base)
            spec = found.cluster_spec().as_dict()
            task_type, task_id = found.get_task_info()
            gpu = int(found._gpu_allocation[found._rank])
        rank = int(env["SLURM_PROCID"])
        config = json.loads(plans[rank].env["TF_CONFIG"])
        assert config == {"cluster": spec, "task": {"type": task_type, "index": task_id}}
        assert plans[rank].args[0] == gpu  # the GPU the resolver gives the task is the worker's


@pytest.mark.parametrize("tasks", [ONE_NODE, TWO_NODES], ids=["1 node", "2 nodes"])
def test_torch_environment_is_the_usual_torchrun_mapping_of_slurm(tasks):
    plans = get("torch").plan_ranks(layout_ranks(reports(tasks), None, SlurmLauncher.launched), None, None, None)
    for env in tasks:
        rank = int(env["SLURM_PROCID"])
        first_host = resolver.expand_hostlist(env["SLURM_JOB_NODELIST"])[0]  # scontrol show hostnames ... | head -1
        expected = {
            "RANK": env["SLURM_PROCID"],
            "LOCAL_RANK": env["SLURM_LOCALID"],
            "WORLD_SIZE": env["SLURM_NTASKS"],
            "GROUP_RANK": env["SLURM_NODEID"],
            "LOCAL_WORLD_SIZE": str(
                resolver.expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])[int(env["SLURM_NODEID"])]
            ),
            "MASTER_ADDR": first_host,
        }
        assert {k: plans[rank].env[k] for k in expected} == expected
        # A GPU per local rank on each node: each rank its own, so NCCL.
        assert plans[rank].args[:2] == ("nccl", int(env["SLURM_LOCALID"]))
    assert len({p.env["MASTER_PORT"] for p in plans}) == 1


def test_ranks_follow_slurm_not_the_engines_order():
    layout = layout_ranks(reports(TWO_NODES), None, SlurmLauncher.launched)
    assert [p.rank for p in layout.places] == [0, 1, 2, 3]
    assert [p.engine_id for p in layout.places] == [3, 2, 1, 0]
    assert [(p.hostname, p.node_rank, p.local_rank, p.local_world_size) for p in layout.places] == [
        ("gpu01", 0, 0, 2),
        ("gpu01", 0, 1, 2),
        ("gpu02", 1, 0, 2),
        ("gpu02", 1, 1, 2),
    ]


@pytest.mark.parametrize(
    "hostlist", ["node07", "gpu[01-02]", "n[1-2],m5,o[3-4,6,7-9]", "node[001-003,010],login1", "a1,b2,c[8-11]"]
)
def test_host_lists_expand_as_tensorflows_resolver_expands_them(hostlist):
    assert expand_hostlist(hostlist) == resolver.expand_hostlist(hostlist)
