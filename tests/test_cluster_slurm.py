"""Ranks started through ipyparallel's SLURM launcher on a real single-node SLURM
cluster (the session's ``local_slurm`` fixture: Debian's slurm-wlm and munge,
configured in a temporary folder): torch DDP, TensorFlow MultiWorkerMirroredStrategy
and ``jax.distributed`` ranks, each a task of one ``sbatch`` job, a collective
across them, and after ``stop`` an empty queue and no process left.
Skipped with the reason where SLURM cannot run (not root on Linux, no slurm-wlm)."""

from __future__ import annotations

import contextlib
import io
import time

import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]



def identity(rank: str) -> str:
    """Code binding ``_who``: the rank as the wiring gave it (``rank``, an expression), then
    the rank, job and task count as SLURM gave them."""
    return (
        "import json, os, socket\n"
        f"_who = ({rank}, int(os.environ['SLURM_PROCID']), os.environ['SLURM_JOB_ID'], int(os.environ['SLURM_NTASKS']))\n"
    )


TORCH_RANK = "int(os.environ['RANK'])"
TF_RANK = "json.loads(os.environ['TF_CONFIG'])['task']['index']"


def processes_of(cluster_id: str) -> list[psutil.Process]:
    """Processes on this machine started for the cluster (engines carry its id in their arguments)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(cluster_id in a for a in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def step_daemons() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name", "status"]) if p.info["name"] == "slurmstepd" and p.info["status"] != psutil.STATUS_ZOMBIE}


@contextlib.contextmanager
def slurm_ranks(local_slurm, framework: str, n: int, **options):
    """Ranks in a SLURM job; afterwards the queue is empty and no process is left."""
    from vgpu_magic.ranks import RankCluster

    steps = step_daemons()
    ranks = RankCluster(n, framework, launcher="slurm", launcher_options={"time": "10"}, **options).start()
    cluster_id = ranks.cluster_id
    try:
        # A running job of n tasks while the ranks are up.
        queue = local_slurm.squeue()
        assert len(queue) == 1 and queue[0].split()[1] == "RUNNING" and cluster_id in queue[0], queue
        yield ranks
    finally:
        ranks.stop()
    assert local_slurm.squeue() == []
    # slurmstepd reaps its tasks and exits just after the job ends: allow it a moment.
    deadline = time.monotonic() + 20
    while (processes_of(cluster_id) or step_daemons() - steps) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(cluster_id) == []
    assert step_daemons() <= steps


def quiet_run(ranks, code: str):
    """Run ``code``; the value of its last expression on each rank, the ranks' output kept aside."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return ranks.run(code, output=True)


def check_slurm_tasks(found, n: int):
    """Every rank is the SLURM task of the same number, all in one job of n tasks."""
    ranks = [who[0] for who in found]
    assert ranks == list(range(n))
    assert [who[1] for who in found] == ranks
    assert len({who[2] for who in found}) == 1
    assert {who[3] for who in found} == {n}


def test_torch_ddp_ranks_are_tasks_of_one_slurm_job(local_slurm):
    with slurm_ranks(local_slurm, "torch", 2) as ranks:
        assert "ipyparallel engines in one SLURM job (sbatch + srun), job " in ranks.describe()[0]
        found = quiet_run(
            ranks,
            identity(TORCH_RANK) + "import torch, torch.distributed as dist\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "(*_who, dist.get_world_size(), t.item())",
        )
    check_slurm_tasks(found, 2)
    assert [who[-2:] for who in found] == [(2, 3.0), (2, 3.0)]


def test_tensorflow_multiworker_ranks_in_slurm(local_slurm):
    with slurm_ranks(local_slurm, "tensorflow", 2) as ranks:
        found = quiet_run(
            ranks,
            identity(TF_RANK) + "import tensorflow as tf\n"
            "strategy = tf.distribute.MultiWorkerMirroredStrategy()\n"
            "task = strategy.cluster_resolver.task_id\n"
            "@tf.function\n"
            "def step():\n"
            "    context = tf.distribute.get_replica_context()\n"
            "    return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(float(task + 1)))\n"
            "total = strategy.experimental_local_results(strategy.run(step))[0]\n"
            "(*_who, strategy.num_replicas_in_sync, task, float(total))",
        )
    check_slurm_tasks(found, 2)
    assert [who[-3:] for who in found] == [(2, 0, 3.0), (2, 1, 3.0)]


def test_jax_distributed_ranks_in_slurm(local_slurm):
    with slurm_ranks(local_slurm, "jax", 2) as ranks:
        found = quiet_run(
            ranks,
            "import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
            + identity("jax.process_index()")
            + "gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))\n"
            "(*_who, jax.process_index(), jax.process_count(), gathered.ravel().tolist())",
        )
    check_slurm_tasks(found, 2)
    assert [who[-3:] for who in found] == [(0, 2, [10, 11]), (1, 2, [10, 11])]


def test_slurm_options_reach_the_batch_script(local_slurm):
    """Partition, time limit and extra #SBATCH lines are what sbatch runs, as the job shows."""
    from vgpu_magic.ranks import RankCluster

    ranks = RankCluster(
        1, "torch", launcher="slurm",
        launcher_options={"partition": "debug", "time": "7", "sbatch": ["--comment=vgpu-test"]},
    ).start()
    try:
        job = next(iter(ranks.cluster.engines.values())).job_id
        shown = local_slurm.scontrol("show", "job", job)
    finally:
        ranks.stop()
    assert "Partition=debug" in shown and "TimeLimit=00:07:00" in shown and "Comment=vgpu-test" in shown
    assert local_slurm.squeue() == []
