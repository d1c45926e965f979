"""Ranks started through ipyparallel's SLURM launcher on a real SLURM cluster
(the session's ``local_slurm`` fixture: Debian's slurm-wlm and munge,
configured in a temporary folder): torch DDP, TensorFlow MultiWorkerMirroredStrategy
and ``jax.distributed`` ranks, each a task of one ``sbatch`` job, a collective
across them, and after ``stop`` an empty queue and no process left. Then the
same on two nodes (``two_node_slurm``: a second slurmd on a second host, a
network namespace of its own), where the collective crosses the hosts and the
wiring carries rank 0's real address.
Skipped with the reason where SLURM cannot run (not root on Linux, no slurm-wlm)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from support import TF_ALL_REDUCE, again_after_torchs_exit_abort, failure_text, no_warm_spares, processes_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Seconds a cell may run on the ranks (a collective that cannot connect fails instead of hanging).
RUN_TIMEOUT = 120


def identity(rank: str) -> str:
    """Code binding ``_who``: the rank as the wiring gave it (``rank``, an expression), then
    the rank, job and task count as SLURM gave them."""
    return (
        "import json, os, socket\n"
        f"_who = ({rank}, int(os.environ['SLURM_PROCID']), os.environ['SLURM_JOB_ID'], "
        "int(os.environ['SLURM_NTASKS']))\n"
    )


TORCH_RANK = "int(os.environ['RANK'])"
TF_RANK = "json.loads(os.environ['TF_CONFIG'])['task']['index']"


@contextlib.contextmanager
def slurm_ranks(slurm, framework: str, n: int, launcher_options: dict | None = None, scripts: bool = False, **options):
    """Ranks in a SLURM job, with warm spares only where ``scripts`` run; afterwards the queue is empty and no
    process is left."""
    from vgpu_magic.ranks import RankCluster

    steps = slurm.step_daemons()
    launcher_options = {"time": "10", **(launcher_options or {})}
    ranks = RankCluster(n, framework, launcher="slurm", launcher_options=launcher_options, join=True, **options)
    with contextlib.nullcontext() if scripts else no_warm_spares():
        ranks.start()
    cluster_id = ranks.cluster_id
    profile = Path(ranks.cluster.profile_dir)
    try:
        # A running job of n tasks while the ranks are up.
        queue = slurm.squeue()
        assert len(queue) == 1 and queue[0].split()[1] == "RUNNING" and cluster_id in queue[0], queue
        yield ranks
    finally:
        ranks.stop()
    assert slurm.squeue() == []
    # slurmstepd reaps its tasks and exits just after the job ends: allow it a moment.
    deadline = time.monotonic() + 20
    while (processes_of(cluster_id) or slurm.step_daemons() - steps) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(cluster_id) == []
    assert slurm.step_daemons() <= steps
    # No batch script left behind, in the working folder (ipyparallel's default) or beside the engines' logs.
    assert not Path("slurm_engine.sbatch").exists()
    assert not list((profile / "log").glob(f"ipengine-{cluster_id}.*"))


@pytest.fixture
def slurm(local_slurm, monkeypatch):
    """The single-node cluster, the one SLURM commands reach during the test."""
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))
    return local_slurm


def test_only_this_clusters_step_daemons_are_counted(slurm, tmp_path, no_process_left_behind):
    # A job of another SLURM on the machine (another test run's, a user's) starts and ends when it will.
    impostor = tmp_path / "slurmstepd"
    shutil.copy(shutil.which("sleep"), impostor)
    (tmp_path / "another").mkdir()
    # As a real step daemon holds its slurmd's log open (its environment is not readable: its title overwrites it).
    logs = [open(folder / "impostor.log", "w") for folder in (slurm.folder, tmp_path / "another")]  # noqa: SIM115
    ours, theirs = (subprocess.Popen([impostor, "60"], stdout=log) for log in logs)
    try:
        found = slurm.step_daemons()
        assert ours.pid in found and theirs.pid not in found
    finally:
        for proc, log in zip((ours, theirs), logs):
            proc.kill()
            proc.wait(timeout=10)
            log.close()
            os.unlink(log.name)


def quiet_run(ranks, code: str):
    """Run ``code``; the value of its last expression on each rank, the ranks' output kept aside."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return ranks.run(code, output=True, timeout=RUN_TIMEOUT)


def check_slurm_tasks(found, n: int):
    """Every rank is the SLURM task of the same number, all in one job of n tasks."""
    ranks = [who[0] for who in found]
    assert ranks == list(range(n))
    assert [who[1] for who in found] == ranks
    assert len({who[2] for who in found}) == 1
    assert {who[3] for who in found} == {n}


def test_torch_ddp_ranks_are_tasks_of_one_slurm_job(slurm):
    """Also: partition, time limit and extra #SBATCH lines are what sbatch ran, as the job shows, and the
    launcher's environment reaches every task (through sbatch's own, ``--export=ALL``)."""
    options = {
        "partition": "debug",
        "time": "7",
        "sbatch": ["--comment=vgpu-test"],
        "environment": {"VGPU_SLURM_PROBE": "a b {x}"},
    }
    with slurm_ranks(slurm, "torch", 2, options) as ranks:
        assert "ipyparallel engines in one SLURM job (sbatch + srun), job " in ranks.describe()[0]
        shown = slurm.scontrol("show", "job", next(iter(ranks.cluster.engines.values())).job_id)
        found = quiet_run(
            ranks,
            identity(TORCH_RANK) + "import torch, torch.distributed as dist\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "import os\n"
            "(*_who, dist.get_world_size(), t.item(), os.environ.get('VGPU_SLURM_PROBE'))",
        )
    check_slurm_tasks(found, 2)
    assert [who[-3:] for who in found] == [(2, 3.0, "a b {x}"), (2, 3.0, "a b {x}")]
    assert "Partition=debug" in shown and "TimeLimit=00:07:00" in shown and "Comment=vgpu-test" in shown


def test_a_ddp_script_runs_twice_from_the_jobs_tasks(slurm, tmp_path, monkeypatch):
    """Issue 22: a script run is a launch under SLURM too: the job stays, its engines start new processes
    each run (SLURM's variables theirs), and the second run resumes from the first one's snapshot."""
    import json

    scripts = Path(__file__).parent / "scripts"
    for name in ("ddp_train.py", "ddp_settings.py"):
        (tmp_path / name).write_text((scripts / name).read_text())
    monkeypatch.chdir(tmp_path)
    with slurm_ranks(slurm, "torch", 2, scripts=True) as ranks:
        job = next(iter(ranks.cluster.engines.values())).job_id
        for run, epochs in enumerate((4, 8)):
            said = io.StringIO()

            def launch(epochs: int = epochs, run: int = run, said: io.StringIO = said) -> None:
                with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                    ranks.run_script("ddp_train.py", [str(epochs), "2", "--out", f"run{run}"], timeout=RUN_TIMEOUT)

            def what_was_said(error: BaseException, said: io.StringIO = said) -> str:
                return failure_text(error) + said.getvalue()

            try:
                results = [tmp_path / f"run{run}.{rank}" for rank in range(2)]
                again_after_torchs_exit_abort(launch, what_was_said, tmp_path, results)
            except Exception as exc:
                raise AssertionError(f"run {run} failed; the ranks said:\n{said.getvalue()[-4000:]}") from exc
            found = [json.loads((tmp_path / f"run{run}.{r}").read_text()) for r in range(2)]
            assert [f["resumed_at"] for f in found] == [(0, 4)[run]] * 2
            assert found[0]["weights"] == found[1]["weights"]
        assert slurm.squeue()[0].split()[0] == str(job)


#: Writes the ``SLURM_*`` variables it was given to ``ARGV[1]-PROCID.json``.
SLURM_DUMP = """
import json, os, sys
given = {k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "SLURMD_"))}
json.dump(given, open(f"{sys.argv[1]}-{os.environ['SLURM_PROCID']}.json", "w"))
"""


def test_a_launched_script_has_the_slurm_variables_srun_gives_a_task_of_the_job(slurm, tmp_path, monkeypatch):
    """Issue 46: a script that ``%vgpu_run`` launched from the job's engines had none of SLURM's step variables
    (only the kernel's ``SLURM_CONF``): a launch started from the kernel's environment. Now it has the names that
    ``srun python dump.py`` in the job's batch script gives a task (srun run with that script's environment), with
    the same per-task values."""
    import json
    import subprocess
    import sys

    (tmp_path / "dump.py").write_text(SLURM_DUMP)
    monkeypatch.chdir(tmp_path)
    with slurm_ranks(slurm, "torch", 2, scripts=True) as ranks:
        job = next(iter(ranks.cluster.engines.values())).job_id
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ranks.run_script("dump.py", ["ours"], timeout=RUN_TIMEOUT)
        assert slurm.step_daemons()  # the job's, which the check that none is left looks for
        [batch] = [
            p.environ()
            for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [""])[-1].endswith("slurm_script") and p.environ().get("SLURM_JOB_ID") == job
        ]
        srun = ["srun", "--overlap", "-n", "2", sys.executable, "dump.py", "srun"]
        ran = subprocess.run(srun, env=batch, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
        assert ran.returncode == 0, ran.stderr
    per_task = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_JOB_ID", "SLURM_NTASKS")
    for rank in (0, 1):
        ours, theirs = (json.loads((tmp_path / f"{who}-{rank}.json").read_text()) for who in ("ours", "srun"))
        assert set(ours) ^ set(theirs) == set()
        assert [ours[name] for name in per_task] == [theirs[name] for name in per_task]


def test_tensorflow_multiworker_ranks_in_slurm(slurm):
    with slurm_ranks(slurm, "tensorflow", 2) as ranks:
        found = quiet_run(
            ranks,
            identity(TF_RANK) + TF_ALL_REDUCE + "(*_who, strategy.num_replicas_in_sync, task, float(total))",
        )
    check_slurm_tasks(found, 2)
    assert [who[-3:] for who in found] == [(2, 0, 3.0), (2, 1, 3.0)]


def test_jax_distributed_ranks_in_slurm(slurm):
    with slurm_ranks(slurm, "jax", 2) as ranks:
        found = quiet_run(
            ranks,
            "import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
            + identity("jax.process_index()")
            + "gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))\n"
            "(*_who, jax.process_index(), jax.process_count(), gathered.ravel().tolist())",
        )
    check_slurm_tasks(found, 2)
    assert [who[-3:] for who in found] == [(0, 2, [10, 11]), (1, 2, [10, 11])]


@pytest.fixture
def two_nodes(two_node_slurm, monkeypatch):
    """The two-node cluster, the one SLURM commands reach during the test."""
    monkeypatch.setenv("SLURM_CONF", str(two_node_slurm.conf))
    return two_node_slurm


def on_two_nodes(two_hosts) -> dict:
    """One task per node; engines reach the controller at this host's address on the veth pair."""
    return {"sbatch": ["--nodes=2", "--ntasks-per-node=1"], "controller_address": two_hosts.first.address}


def test_torch_ddp_across_two_slurm_nodes(two_nodes, two_hosts):
    """One SLURM task per node, ranks in SLURM_PROCID order, both engines reaching the
    controller, and a gloo all-reduce across the nodes wired with rank 0's host."""
    addresses = {two_hosts.first.hostname: two_hosts.first.address, two_hosts.second.hostname: two_hosts.second.address}
    with slurm_ranks(two_nodes, "torch", 2, on_two_nodes(two_hosts)) as ranks:
        hosts = [place.hostname for place in ranks.layout.places]
        found = quiet_run(
            ranks,
            identity(TORCH_RANK) + "import torch, torch.distributed as dist\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "(*_who, socket.gethostname(), os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], "
            "int(os.environ['SLURM_NNODES']), t.item())",
        )
    check_slurm_tasks(found, 2)
    first_host = found[0][4]
    assert sorted(hosts) == sorted(addresses) and [f[4] for f in found] == hosts
    # MASTER_ADDR is rank 0's host (the job's first node, as torchrun under SLURM has it): its name, which
    # resolves to its real address, or that address; each rank is local rank 0 on its node.
    assert found[0][5] in (first_host, addresses[first_host]) and found[1][5] == found[0][5]
    assert [f[6:] for f in found] == [("0", 2, 3.0)] * 2


def test_jax_distributed_across_two_slurm_nodes(two_nodes, two_hosts):
    addresses = {two_hosts.first.hostname: two_hosts.first.address, two_hosts.second.hostname: two_hosts.second.address}
    with slurm_ranks(two_nodes, "jax", 2, on_two_nodes(two_hosts)) as ranks:
        found = quiet_run(
            ranks,
            "import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
            "from jax._src import distributed\n"
            + identity("jax.process_index()")
            + "gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))\n"
            "(*_who, socket.gethostname(), distributed.global_state.coordinator_address, gathered.ravel().tolist())",
        )
    check_slurm_tasks(found, 2)
    first_host = found[0][4]
    assert {f[4] for f in found} == set(addresses)
    # The coordinator runs on rank 0's host (the job's first node, as JAX's SLURM support has it).
    coordinator = found[0][5].rsplit(":", 1)[0]
    assert coordinator in (first_host, addresses[first_host]) and found[1][5] == found[0][5]
    assert [f[6] for f in found] == [[10, 11]] * 2


def test_a_killed_kernel_takes_its_slurm_job_with_it(slurm):
    """A kernel killed by SIGKILL runs no atexit and no stop(): the watch started next to it
    (``lifetime --then 'scancel JOBID'``) cancels the batch job, and the job's engines go."""
    import json
    import os
    import signal
    import subprocess

    from support import kernel_run, kernel_stdout, started_kernel

    job = ""
    try:
        with started_kernel({"SLURM_CONF": str(slurm.conf)}) as (_km, kc):
            start = "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework tensorflow --launcher slurm"
            reply = kernel_run(kc, start)
            assert not [m for m in reply if m["msg_type"] == "error"], kernel_stdout(reply)
            reply = kernel_run(
                kc,
                "import json, os, vgpu_magic\n"
                "r = vgpu_magic.cluster()\n"
                "print(json.dumps([os.getpid(), [es.job_id for es in r.cluster.engines.values()][0], r.cluster_id]))",
            )
            kernel, job, cluster_id = json.loads(kernel_stdout(reply).strip().splitlines()[-1])
            assert job and queued(job)
            os.kill(kernel, signal.SIGKILL)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (queued(job) or processes_of(cluster_id)):
                time.sleep(0.25)
            assert not queued(job), f"job {job} still in squeue 15 s after its kernel was killed"
            assert processes_of(cluster_id) == []
    finally:
        if job:
            subprocess.run(["scancel", "-s", "KILL", job], capture_output=True, check=False)


def queued(job: str) -> bool:
    import subprocess

    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True, check=False)
    return out.returncode == 0 and bool(out.stdout.strip())
