"""``%vgpu_job`` / ``vgpu_magic.submit``: the rehearsed script as a batch job on the real SLURM the suite starts
(``local_slurm``, ``two_node_slurm``): torch DDP = torchrun's weights, by the API and by the exported script
``sbatch``-ed by hand; JAX's argument-less ``jax.distributed.initialize()``; TensorFlow's
MultiWorkerMirroredStrategy; each task's environment = the rehearsal's rank's; a failing rank; cancel; a job
found by a new kernel after its own was killed; two nodes. Skipped with the reason where SLURM cannot run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError

from support import (
    CHILD_ENV,
    ROOT,
    again_after_torchs_exit_abort,
    kernel_run,
    kernel_stdout,
    started_kernel,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPTS = Path(__file__).parent / "scripts"
#: Seconds a job may take (the suite's SLURM runs on a busy machine).
JOB_TIMEOUT = 240
SLEEPER = "import os, time\nprint('started', os.environ['RANK'], flush=True)\ntime.sleep(300)\n"


@pytest.fixture(autouse=True)
def own_index(monkeypatch, tmp_path):
    """Each test's own index of jobs (the user's lists the jobs of every cluster, whose ids start again at 1)."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))


@pytest.fixture
def slurm(local_slurm, monkeypatch, tmp_path):
    """The single-node cluster, reached by SLURM's commands; the test runs in its own folder."""
    monkeypatch.setenv("SLURM_CONF", str(local_slurm.conf))
    monkeypatch.chdir(tmp_path)
    yield local_slurm
    left = local_slurm.squeue()
    subprocess.run(["scancel", "--user", "root"], env=local_slurm.env(), check=False)
    assert left == []


@pytest.fixture(scope="module")
def torchrun_weights(tmp_path_factory):
    """ddp_parity.py's final weights under torchrun, 2 ranks."""
    from test_cluster_torch import torchrun_two_ranks

    folder = tmp_path_factory.mktemp("torchrun")
    torchrun_two_ranks(
        SCRIPTS / "ddp_parity.py",
        env={**CHILD_ENV, "PARITY_OUT": str(folder / "w")},
        results=str(folder / "w"),
        writes=folder,
    )
    return [json.loads((folder / f"w.{r}").read_text()) for r in range(2)]


def ended(job, state: str = "COMPLETED"):
    """``job`` once it ended in ``state``; its logs and summary otherwise."""
    assert job.wait(timeout=JOB_TIMEOUT) == state, job.summary() + "\n" + job.logs()
    return job


def weights_of_a_job(folder: Path, submit) -> list:
    """ddp_parity.py's weights from the job ``submit(script)`` returns; again (counted) after torch's exit
    abort where both ranks had written their weights (:func:`again_after_torchs_exit_abort`)."""
    os.environ["PARITY_OUT"] = str(folder / "w")
    results = [folder / f"w.{r}" for r in range(2)]
    try:
        again_after_torchs_exit_abort(lambda: ended(submit(folder / "ddp_parity.py")), str, folder, results)
        return [json.loads(path.read_text()) for path in results]
    finally:
        del os.environ["PARITY_OUT"]


def copied(folder: Path, *names: str) -> Path:
    for name in names:
        (folder / name).write_text((SCRIPTS / name).read_text())
    return folder


class SubmittedByHand:
    """A job ``sbatch``-ed from a file, read from the folder its tasks fill (``.vgpu_jobs/<id>/``)."""

    def __init__(self, script_file: Path, folder: Path, ranks: int) -> None:
        from vgpu_magic.batch.slurm import SlurmJobs

        out = subprocess.run(["sbatch", "--parsable", str(script_file)], capture_output=True, text=True, check=True)
        self.job_id, self.folder, self.ranks, self.backend = out.stdout.strip(), folder, ranks, SlurmJobs()

    def wait(self, timeout: float) -> str:
        from vgpu_magic.batch import ENDED

        deadline = time.monotonic() + timeout
        while (state := self.backend.state(self.job_id, self.folder / ".vgpu_jobs" / self.job_id)[0]) not in ENDED:
            assert time.monotonic() < deadline, f"job {self.job_id} still {state}"
            time.sleep(0.5)
        return state

    def logs(self) -> str:
        return "".join(self.backend.logs(self.folder / ".vgpu_jobs" / self.job_id, r) for r in range(self.ranks))

    def summary(self) -> str:
        return f"job {self.job_id} by hand"


def test_a_torch_ddp_job_and_its_exported_script_by_hand_give_torchruns_weights(slurm, tmp_path, torchrun_weights):
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    folder = copied(tmp_path, "ddp_parity.py")
    ours = weights_of_a_job(folder, lambda script: vgpu_magic.submit(script, framework="torch", ranks_per_node=2))
    assert ours == torchrun_weights
    job = vgpu_magic.jobs()[0]
    assert job.exit_codes == [0, 0] and job.state == "COMPLETED"
    assert "MASTER_ADDR:MASTER_PORT" in job.logs(rank=0) and "no per-rank memory caps" in job.logs(rank=0)

    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    text = ip.run_line_magic("vgpu_job", "script --framework torch --ranks-per-node 2 ddp_parity.py")
    assert "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --nodes=1" in text
    (folder / "job.sbatch").write_text(text)
    for r in range(2):
        (folder / f"w.{r}").unlink()
    by_hand = weights_of_a_job(folder, lambda script: SubmittedByHand(folder / "job.sbatch", folder, 2))
    assert by_hand == torchrun_weights


def test_a_jax_job_joins_with_an_argument_less_initialize(slurm, tmp_path):
    import vgpu_magic

    copied(tmp_path, "jax_processes.py")
    job = ended(vgpu_magic.submit("jax_processes.py", ["--out", "seen"], framework="jax", ranks_per_node=2))
    found = [json.loads((tmp_path / f"seen.{r}").read_text()) for r in range(2)]
    assert [f["seen"] for f in found] == [[0, 2, 1, 2], [1, 2, 1, 2]]
    assert found[0]["gathered"] == found[1]["gathered"] == [0, 10]
    assert job.exit_codes == [0, 0]


def test_a_tensorflow_multiworker_job_trains_as_one(slurm, tmp_path, monkeypatch):
    import vgpu_magic

    copied(tmp_path, "mwms_parity.py")
    monkeypatch.setenv("PARITY_OUT", str(tmp_path / "w"))
    ended(vgpu_magic.submit("mwms_parity.py", framework="tf", ranks_per_node=2))
    weights = [json.loads((tmp_path / f"w.{r}").read_text()) for r in range(2)]
    assert weights[0] == weights[1] and len(weights[0]) == 4


@pytest.mark.parametrize("framework", ["torch", "tensorflow", "jax"])
def test_each_tasks_environment_is_the_rehearsals_ranks(slurm, tmp_path, framework):
    """The same layout (2 tasks on the one node, the same port): the rehearsal's ranks under --launcher slurm and
    the job's tasks get the same values for every variable the wiring sets (the run id is each job's own)."""
    import vgpu_magic
    from test_launcher_slurm import quiet_run, slurm_ranks
    from vgpu_magic.ranks.hosts import free_port

    port = free_port()
    with slurm_ranks(slurm, framework, 2, port=port) as ranks:
        planned = [plan.env for plan in ranks.plans]
        theirs = quiet_run(ranks, "import os\ndict(os.environ)")
        their_job = theirs[0]["SLURM_JOB_ID"]
    (tmp_path / "env.py").write_text(
        "import json, os\njson.dump(dict(os.environ), open(f\"env.{os.environ['SLURM_PROCID']}\", 'w'))\n"
    )
    job = ended(vgpu_magic.submit("env.py", framework=framework, ranks_per_node=2, port=port))
    ours = [json.loads((tmp_path / f"env.{r}").read_text()) for r in range(2)]
    for plan, their_env, our_env in zip(planned, theirs, ours):
        assert set(plan) <= set(our_env)
        for name in plan:
            value = their_env[name].replace(their_job, job.job_id) if name == "TORCHELASTIC_RUN_ID" else their_env[name]
            assert our_env[name] == value, name


def test_a_failing_rank_fails_the_job_with_its_status_and_last_lines(slurm, tmp_path):
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    (tmp_path / "fails.py").write_text(
        "import os, time\nif os.environ['RANK'] == '1':\n    raise ValueError('rank 1 gives up')\ntime.sleep(300)\n"
    )
    job = ended(vgpu_magic.submit("fails.py", ranks_per_node=2), "FAILED")
    # Rank 0 was ended with the step (srun's SIGTERM on a bad exit): by SIGTERM's 143 where its wrapper recorded
    # that before it went, else with no status; either way not a failure of its own.
    assert job.exit_codes in ([None, 1], [143, 1])
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    shown = ip.run_line_magic("vgpu_job", f"status {job.job_id}")[0].summary()
    assert f"{job.job_id} fails.py: FAILED" in shown
    assert "rank 1 exited with status 1:" in shown and "ValueError: rank 1 gives up" in shown
    assert "[rank 1] ValueError: rank 1 gives up" in job.logs()
    # As python's own: from the script's first frame, none of the task's (it runs the script in its own process).
    assert job.logs(rank=1).splitlines()[:2] == [
        "[rank 1] Traceback (most recent call last):",
        f'[rank 1]   File "{tmp_path / "fails.py"}", line 3, in <module>',
    ]


def test_a_job_with_restarts_launches_every_task_again_and_resumes_as_one_that_never_failed(slurm, tmp_path, capsys):
    """resume_train.py, whose rank 1 exits with status 3 at step 5 of the first attempt: with ``--max-restarts 1``
    both tasks are launched again and resume from the checkpoint (the weights of a job that never failed); without,
    the job fails as any job whose rank fails."""
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    copied(tmp_path, "resume_train.py")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    for line, said in (
        ("submit --max-restarts -1 resume_train.py", "--max-restarts -1 is negative; use 0..100"),
        ("submit --max-restarts 101 resume_train.py", "--max-restarts 101 is out of range; use 0..100"),
        ("logs 1 --max-restarts 1", "logs does not take --max-restarts"),
    ):
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("vgpu_job", line)
        assert said in str(info.value) and "\n" not in str(info.value)
    for bad in (-1, 101, True, "2"):
        with pytest.raises(ValueError) as info:
            vgpu_magic.submit("resume_train.py", max_restarts=bad)
        assert f"--max-restarts {bad!r} is not a count; use 0..100" in str(info.value)
    assert not (tmp_path / ".vgpu_jobs").exists()

    never = vgpu_magic.submit("resume_train.py", [tmp_path / "never"], ranks_per_node=2)
    fails = vgpu_magic.submit("resume_train.py", [tmp_path / "fails", 5], ranks_per_node=2)
    restarted = ip.run_line_magic("vgpu_job", f"submit -n 2 --max-restarts 1 resume_train.py {tmp_path / 'w'} 5")
    ended(restarted)
    assert restarted.exit_codes == [0, 0] and restarted.attempt == 2
    ended(never)
    reference = json.loads((tmp_path / "never").read_text())["weights"]
    assert json.loads((tmp_path / "w").read_text()) == {"weights": reference, "attempt": 1}
    capsys.readouterr()
    ip.run_line_magic("vgpu_job", f"status {restarted.job_id}")
    shown = capsys.readouterr().out
    assert f"{restarted.job_id} resume_train.py: COMPLETED" in shown and "[0, 0], attempt 2 of 2" in shown

    ended(fails, "FAILED")
    assert fails.exit_codes[1] == 3 and fails.attempt == 1 and "attempt" not in fails.summary().splitlines()[0]
    assert not (tmp_path / "fails").exists()


def test_slurm_refusing_is_one_usage_error_and_nothing_is_submitted(slurm, tmp_path):
    from IPython.testing.globalipapp import get_ipython

    (tmp_path / "train.py").write_text("print('never')\n")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    with pytest.raises(UsageError, match=r"^SLURM refused the job: .*[Pp]artition") as info:
        ip.run_line_magic("vgpu_job", "submit --partition nosuch train.py")
    assert "\n" not in str(info.value)
    assert slurm.squeue() == [] and not (tmp_path / ".vgpu_jobs").exists()


def processes_running(path: Path, ranks_only: bool = False) -> list[int]:
    """The processes whose command line names ``path`` (``ranks_only``: the tasks', ``python -m
    vgpu_magic.batch.slurm ... PATH``, only; else the batch script, ``srun`` and the tasks' wrappers too)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        words = proc.info["cmdline"] or []
        if words.count(str(path)) and (not ranks_only or words[1:3] == ["-m", "vgpu_magic.batch.slurm"]):
            found.append(proc.pid)
    return found


def started(job) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT
    while job.logs().count("started") < job.spec.ranks:
        assert time.monotonic() < deadline and job.state in ("PENDING", "RUNNING"), job.summary()
        time.sleep(0.5)


def test_cancel_leaves_nothing_in_the_queue_or_the_process_table(slurm, tmp_path):
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    (tmp_path / "sleeps.py").write_text(SLEEPER)
    job = vgpu_magic.submit("sleeps.py", ranks_per_node=2)
    started(job)
    assert len(processes_running(tmp_path / "sleeps.py", ranks_only=True)) == 2
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    ip.run_line_magic("vgpu_job", f"cancel {job.job_id}")
    assert job.wait(timeout=60) == "CANCELLED"
    deadline = time.monotonic() + 30
    while (slurm.squeue() or processes_running(tmp_path / "sleeps.py")) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert slurm.squeue() == [] and processes_running(tmp_path / "sleeps.py") == []


def _said_from(kc, folder: Path, code: str) -> str:
    """What ``code`` printed, run by the kernel behind ``kc`` from ``folder`` (``os`` imported there)."""
    return kernel_stdout(kernel_run(kc, f"import os\nos.chdir({str(folder)!r})\n{code}"))


def test_a_job_outlives_its_killed_kernel_and_a_new_kernel_finds_it(slurm, tmp_path):
    (tmp_path / "sleeps.py").write_text(SLEEPER.replace("300", "8"))
    env = {"SLURM_CONF": str(slurm.conf), "PYTHONPATH": str(ROOT), "XDG_DATA_HOME": os.environ["XDG_DATA_HOME"]}
    with started_kernel(env) as (_, kc):
        said = _said_from(
            kc,
            tmp_path,
            "%load_ext vgpu_magic\njob = %vgpu_job submit --ranks-per-node 2 sleeps.py\nprint(job.job_id, os.getpid())",
        )
        job_id, pid = said.split()[-2:]
        os.kill(int(pid), signal.SIGKILL)
    with started_kernel(env) as (_, kc):
        said = _said_from(
            kc,
            tmp_path,
            "import vgpu_magic\nfound = vgpu_magic.jobs()\n"
            "print([j.job_id for j in found], found[0].wait(timeout=240), found[0].exit_codes)",
        )
    assert said.strip().splitlines()[-1] == f"[{job_id!r}] COMPLETED [0, 0]"


def test_a_two_node_job_gives_torchruns_weights(two_node_slurm, tmp_path, monkeypatch, torchrun_weights):
    import vgpu_magic

    monkeypatch.setenv("SLURM_CONF", str(two_node_slurm.conf))
    monkeypatch.chdir(tmp_path)
    folder = copied(tmp_path, "ddp_parity.py")
    ours = weights_of_a_job(folder, lambda script: vgpu_magic.submit(script, framework="torch", nodes=2))
    assert ours == torchrun_weights
    assert "world size 2" in vgpu_magic.jobs()[0].logs(rank=0)
    assert two_node_slurm.squeue() == []


def test_logs_follow_until_the_job_ends(slurm, tmp_path, capsys):
    from IPython.testing.globalipapp import get_ipython

    (tmp_path / "counts.py").write_text("import os\nfor i in range(3):\n    print('line', i, flush=True)\n")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    job = ip.run_line_magic("vgpu_job", "submit --ranks-per-node 2 counts.py")
    capsys.readouterr()
    ip.run_line_magic("vgpu_job", f"logs {job.job_id} --follow --rank 1")
    out = capsys.readouterr().out
    assert "[rank 1] line 0\n[rank 1] line 1\n[rank 1] line 2\n" in out and "[rank 0]" not in out
    assert f"{job.job_id} counts.py: COMPLETED" in out


def test_each_task_plans_the_whole_layout_alone_from_slurms_variables():
    """No SLURM needed: what rank 3 of 2 nodes × 2 tasks computes is torchrun's environment for that place, with
    the job's id as the run id every task agrees on, and rank 0's port the one the batch script found free."""
    from vgpu_magic.batch.slurm import plan_tasks

    env = {
        "SLURM_JOB_ID": "4321",
        "SLURM_STEP_NODELIST": "node[07-08]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
    }
    plans = plan_tasks("torch", env, free=41234)
    assert [p.env["RANK"] for p in plans] == ["0", "1", "2", "3"]
    assert [p.env["GROUP_RANK"] for p in plans] == ["0", "0", "1", "1"]
    assert {p.env["MASTER_ADDR"] for p in plans} == {"node07"} and {p.env["MASTER_PORT"] for p in plans} == {"41234"}
    assert {p.env["TORCHELASTIC_RUN_ID"] for p in plans} == {"4321"}
    assert plans[3].env["LOCAL_WORLD_SIZE"] == "2" and plans[3].env["WORLD_SIZE"] == "4"
    workers = json.loads(plan_tasks("tensorflow", env, port=9000)[3].env["TF_CONFIG"])
    assert workers == {
        "cluster": {"worker": ["node07:9000", "node07:9001", "node08:9000", "node08:9001"]},
        "task": {"type": "worker", "index": 3},
    }


def test_the_batch_script_and_bad_lines_need_no_slurm(tmp_path, monkeypatch):
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never')\n")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    line = "script -f jax --nodes 2 -n 8 --gpus-per-node 8 --time 30 --hang-after 5 train.py --lr 0.1"
    text = ip.run_line_magic("vgpu_job", line)
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--time=30", f"--chdir={tmp_path}"):
        assert f"#SBATCH {line}\n" in text
    assert f'-m vgpu_magic.batch.slurm jax 0 "$free" "$job" 5.0 {tmp_path / "train.py"} --lr 0.1\n' in text
    for line, said in (
        ("submit --nodes two train.py", "--nodes 'two' is not a whole number"),
        ("submit missing.py", "script 'missing.py' is not a file"),
        ("submit -f mxnet train.py", "framework 'mxnet' is not supported"),
        ("submit --time '1 hour' train.py", "time='1 hour' is not one word"),
        ("status 1 2", "'2' is not understood here"),
        ("logs 99", "job '99' is not one of your jobs (%vgpu_job status lists them)"),
        ("submit --hang-after soon train.py", "--hang-after 'soon'"),
        ("logs 99 --hang-after 5", "logs does not take --hang-after"),
    ):
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("vgpu_job", line)
        assert said in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / ".vgpu_jobs").exists()


def test_a_jobs_slurm_options_are_the_slurm_launchers(tmp_path, monkeypatch):
    """Issue 33: the job backend builds on the ranks' SLURM launcher: its flags and their help, its checks, and
    more #SBATCH lines as it takes them."""
    from IPython.testing.globalipapp import get_ipython

    from vgpu_magic.batch import JobSpec
    from vgpu_magic.ranks.launchers import SlurmLauncher

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never')\n")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    line = "script --partition gpu --account p1 --sbatch=--mem=4G --sbatch='#SBATCH --gres=gpu:1' train.py"
    text = ip.run_line_magic("vgpu_job", line)
    for option in ("--partition=gpu", "--account=p1", "--mem=4G", "--gres=gpu:1"):
        assert f"#SBATCH {option}\n" in text
    with pytest.raises(UsageError, match=r"^sbatch line '--ntasks=8' sets what the launcher sets itself"):
        ip.run_line_magic("vgpu_job", "script --sbatch=--ntasks=8 train.py")
    with pytest.raises(ValueError, match=r"^slurm partition='a b' is not one word; e.g. --partition=gpu$"):
        JobSpec("train.py", partition="a b")
    help_text = " ".join(ip.find_line_magic("vgpu_job").__doc__.split())
    for key in ("time", "partition", "account", "sbatch"):
        assert " ".join(SlurmLauncher.options[key]["help"].split()) in help_text, key
    assert not (tmp_path / ".vgpu_jobs").exists()


def test_a_job_past_its_time_limit_says_so_and_how_long_it_ran(slurm, tmp_path, capsys):
    """Its elapsed time too: SLURM's while it holds the job, then from the job's folder once SLURM forgot it, at
    least the one-minute limit and no longer growing."""
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    (tmp_path / "sleeps.py").write_text(SLEEPER)
    job = vgpu_magic.submit("sleeps.py", time="1")
    started(job)
    shown = subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True, text=True, check=True)
    assert "TimeLimit=00:01:00" in shown.stdout, shown.stdout
    # A minute is SLURM's shortest limit at submission; an administrator's cut of a running job's limit to what
    # it has run is ended by the controller's same time-limit check (and its step's "DUE TO TIME LIMIT"), a
    # minute sooner.
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=0"], check=True, timeout=30)
    assert job.wait(timeout=JOB_TIMEOUT) == "TIMEOUT", job.summary()
    # SLURM's SIGTERM reaches the rank and its wrapper together: the wrapper may outlive the rank and record 143.
    assert job.exit_codes in ([None], [143])
    assert job.summary().startswith(f"{job.job_id} sleeps.py: TIMEOUT")
    assert timedelta(seconds=1) <= job.elapsed < timedelta(seconds=JOB_TIMEOUT)
    # Once SLURM has forgotten the job (MinJobAge), the state is read from what its task left.
    deadline = time.monotonic() + 60
    while slurm_knows(job.job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not slurm_knows(job.job_id) and job.state == "TIMEOUT"
    elapsed = job.elapsed
    assert timedelta(seconds=1) <= elapsed < timedelta(seconds=JOB_TIMEOUT)
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    capsys.readouterr()
    for line in ("status", f"status {job.job_id}"):
        ip.run_line_magic("vgpu_job", line)
        shown = re.search(rf"^{job.job_id} sleeps.py: TIMEOUT, elapsed (\d+):(\d\d):(\d\d), ", capsys.readouterr().out)
        assert shown and timedelta(seconds=int(shown[1]) * 3600 + int(shown[2]) * 60 + int(shown[3])) == elapsed


def slurm_knows(job_id: str) -> bool:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=False)
    return "JobState=" in shown.stdout


def magic_shell():
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    return ip


def test_a_moved_script_leaves_every_job_readable_and_an_ended_job_is_not_cancelled(slurm, tmp_path, capsys):
    """Issue 43 rows 1 and 12: a stored job is a record (its script may have moved); cancelling a job that ended
    says so (``scancel`` itself says nothing)."""
    import vgpu_magic

    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text(f"print('this is {name}')\n")
    first, second = (ended(vgpu_magic.submit(name)) for name in ("a.py", "b.py"))
    (tmp_path / "a.py").rename(tmp_path / "a_old.py")
    assert [job.job_id for job in vgpu_magic.jobs()] == [first.job_id, second.job_id]
    ip = magic_shell()
    capsys.readouterr()
    ip.run_line_magic("vgpu_job", "status")
    ip.run_line_magic("vgpu_job", f"logs {first.job_id}")
    out = capsys.readouterr().out
    assert f"{first.job_id} a.py: COMPLETED" in out and f"{second.job_id} b.py: COMPLETED" in out
    assert "[rank 0] this is a.py" in out
    with pytest.raises(UsageError, match=rf"^job {first.job_id} already ended \(COMPLETED\): there is nothing to"):
        ip.run_line_magic("vgpu_job", f"cancel {first.job_id}")


def test_a_job_submitted_from_a_sub_folder_is_found_there_and_the_line_says_its_layout(slurm, tmp_path, capsys):
    """Issue 43 rows 4 and 13: the job's folder is beside the script, its id in this user's index; the submit
    line echoes the layout and the script's own arguments (``-n 2`` after the script is the script's)."""
    (tmp_path / "train.py").write_text("import sys\nprint('args', sys.argv[1:])\n")
    (tmp_path / "nb").mkdir()
    os.chdir(tmp_path / "nb")
    ip = magic_shell()
    job = ip.run_line_magic("vgpu_job", "submit ../train.py -n 2")
    assert f"submitted job {job.job_id}, 1 node(s) × 1 rank(s): python ../train.py -n 2\n" in capsys.readouterr().out
    ended(job)
    ip.run_line_magic("vgpu_job", f"logs {job.job_id}")
    assert "[rank 0] args ['-n', '2']" in capsys.readouterr().out
    assert (tmp_path / ".vgpu_jobs" / job.job_id).is_dir()
    os.chdir(tmp_path / "data")
    import vgpu_magic

    assert [found.job_id for found in vgpu_magic.jobs()] == [job.job_id]


def test_a_job_slurm_could_never_start_is_refused_and_a_pending_one_says_why(slurm, tmp_path, capsys):
    """Issue 43 row 5: what ``sbatch --test-only`` refuses is refused (more nodes or CPUs than the cluster has);
    a pending job's summary says SLURM's reason, and once cancelled not that reason as why it ended."""
    (tmp_path / "train.py").write_text("print('never')\n")
    ip = magic_shell()
    for line in ("submit --nodes 5 train.py", f"submit -n {slurm.cpus * 4} train.py"):
        with pytest.raises(UsageError, match=r"^SLURM refused the job: Requested node configuration is not"):
            ip.run_line_magic("vgpu_job", line)
    assert slurm.squeue() == [] and not (tmp_path / ".vgpu_jobs").exists()
    job = ip.run_line_magic("vgpu_job", "submit --sbatch=--begin=now+1hour train.py")
    assert job.summary().endswith("\n  PENDING: BeginTime"), job.summary()
    ip.run_line_magic("vgpu_job", f"cancel {job.job_id}")
    assert job.wait(timeout=60) == "CANCELLED" and "BeginTime" not in job.summary()


def test_stopping_a_follow_stops_the_cell_and_says_the_job_goes_on(slurm, tmp_path, capsys, monkeypatch):
    """Issue 43 row 7: KeyboardInterrupt again after the line, so a notebook's Run All stops there."""
    from types import SimpleNamespace

    from vgpu_magic.batch import magics

    def stop(seconds):
        raise KeyboardInterrupt

    (tmp_path / "sleeps.py").write_text(SLEEPER)
    ip = magic_shell()
    job = ip.run_line_magic("vgpu_job", "submit sleeps.py")
    started(job)
    monkeypatch.setattr(magics, "time", SimpleNamespace(sleep=stop))
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        ip.run_line_magic("vgpu_job", f"logs {job.job_id} --follow")
    assert f"stopped following job {job.job_id}; the job goes on (RUNNING)\n" in capsys.readouterr().out
    assert job.state == "RUNNING"
    job.cancel()
    assert job.wait(timeout=60) == "CANCELLED"


def test_rank_0s_port_is_free_on_its_node_whatever_the_job_id(slurm, tmp_path):
    """Issue 43 row 8: another process (another SLURM's job 1) holding the port a job id would give is no matter:
    the batch script takes a port free on the first node, as ``torchrun --standalone`` does."""
    import socket

    import vgpu_magic

    (tmp_path / "joins.py").write_text(
        "import torch.distributed as dist\ndist.init_process_group('gloo')\ndist.barrier()\n"
        "print('joined', dist.get_rank(), flush=True)\ndist.destroy_process_group()\n"
    )
    (tmp_path / "first.py").write_text("print('first')\n")
    last = int(ended(vgpu_magic.submit("first.py")).job_id)
    held = []
    for job_id in range(last + 1, last + 4):  # the next ids, without and with sbatch --test-only's
        sock = socket.socket()
        sock.bind(("", 15000 + job_id % 10000))
        sock.listen()
        held.append(sock)
    try:
        job = again_after_torchs_exit_abort(
            lambda: ended(vgpu_magic.submit("joins.py", ranks_per_node=2)), str, tmp_path, []
        )
    finally:
        for sock in held:
            sock.close()
    assert "[rank 0] joined 0" in job.logs() and "[rank 1] joined 1" in job.logs()


def test_a_killed_rank_is_named_and_torchs_record_writes_its_error_file(slurm, tmp_path):
    """Issue 43 nits: exit 137 is SIGKILL in the summary; TORCHELASTIC_ERROR_FILE is each task's own, so torch's
    ``@record`` writes what torchrun's Root Cause block reads."""
    import vgpu_magic

    (tmp_path / "killed.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    (tmp_path / "records.py").write_text(
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n"
        "@record\ndef main():\n    raise ValueError('bad config')\n\nmain()\n"
    )
    killed, records = vgpu_magic.submit("killed.py"), vgpu_magic.submit("records.py", ranks_per_node=2)
    assert "\n  rank 0 exited with status 137 (SIGKILL):" in ended(killed, "FAILED").summary()
    ended(records, "FAILED")
    written = [records.folder / f"rank-{rank}.error.json" for rank in range(2)]
    assert any(path.exists() for path in written), records.logs()
    for path in filter(Path.exists, written):
        assert "ValueError: bad config" in json.loads(path.read_text())["message"]["message"]


def recorded_job(folder: Path, state: str, codes: list, monkeypatch, **said) -> Path:
    """A job's folder as a submit left it (its script since gone), listed in the index, SLURM's state patched in."""
    from vgpu_magic.batch import index_file
    from vgpu_magic.batch.slurm import SlurmJobs

    job = folder / ".vgpu_jobs" / "7"
    job.mkdir(parents=True)
    record = {"job_id": "7", "script": str(folder / "gone.py"), "args": [], "ranks_per_node": len(codes), **said}
    (job / "job.json").write_text(json.dumps(record))
    for rank, code in enumerate(codes):
        (job / f"rank-{rank}.exit").write_text(f"{code}\n")
        (job / f"rank-{rank}.log").write_text("INFO:tensorflow:Enabled multi-worker collective ops\nstep 1\n")
    index_file().parent.mkdir(parents=True)
    index_file().write_text(f"{job}\n")
    monkeypatch.setattr(SlurmJobs, "state", lambda self, job_id, folder: (state, "", timedelta(seconds=3)))
    return job


def test_a_cancelled_jobs_ranks_did_not_fail_and_a_killed_one_is_named(tmp_path, monkeypatch):
    """Issue 43 nits, no SLURM needed: SLURM's SIGTERM or SIGKILL of a cancel is not a rank's failure; where the
    job failed, a status above 128 names its signal."""
    from vgpu_magic.batch import Job
    from vgpu_magic.batch.slurm import SlurmJobs

    job = Job(recorded_job(tmp_path, "CANCELLED", [143, 137], monkeypatch))
    assert (
        job.summary() == "7 gone.py: CANCELLED, elapsed 00:00:03, 1 node(s) × 2 rank(s), exit codes by rank [143, 137]"
    )
    monkeypatch.setattr(SlurmJobs, "state", lambda *_: ("FAILED", "NonZeroExitCode", timedelta(seconds=3)))
    shown = job.summary()
    assert (
        "\n  rank 0 exited with status 143 (SIGTERM):\n" in shown
        and "\n  rank 1 exited with status 137 (SIGKILL):\n" in shown
    )
    assert shown.endswith("\n    step 1\n  FAILED: NonZeroExitCode")


def test_status_and_submit_show_their_lines_once_and_a_jobs_chatter_is_held_back(tmp_path, monkeypatch, capsys):
    """Issue 43 nits: no ``Out[]`` repeating what the magic printed (the value still comes back); TensorFlow's
    start-up lines held back from ``logs`` as from a rehearsal's ranks, kept in the rank's log file."""
    import vgpu_magic

    recorded_job(tmp_path, "COMPLETED", [0], monkeypatch, framework="tensorflow")
    monkeypatch.chdir(tmp_path)
    ip = magic_shell()
    capsys.readouterr()
    ip.run_cell("%vgpu_job status", store_history=True)
    out = capsys.readouterr().out
    # A terminal writes its prompt first; a kernel sends no result where nothing is to be shown.
    assert out.count("7 gone.py: COMPLETED") == 1 and not re.search(r"Out\[\d+\]: \S", out), out
    ip.run_cell("found = %vgpu_job status\nfound[0].job_id", store_history=True)
    assert re.search(r"Out\[\d+\]: '7'", capsys.readouterr().out)
    ip.run_cell("found", store_history=True)
    assert capsys.readouterr().out.count("7 gone.py: COMPLETED") == 1
    assert vgpu_magic.jobs()[0].logs() == "[rank 0] step 1\n"
    assert "INFO:tensorflow" in (tmp_path / ".vgpu_jobs" / "7" / "rank-0.log").read_text()


def test_each_action_takes_only_its_own_options_and_jobs_lines_only_their_own(tmp_path, monkeypatch):
    """Issue 43 row 6 and nits, no SLURM needed: ``--sbatch`` lines that set what the job's options or wiring set,
    a time limit in seconds (SLURM's is in minutes), an option of another action, a logs without an id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('never')\n")
    ip = magic_shell()
    for line, said in (
        ("script --sbatch=--ntasks-per-node=2 train.py", "sets what the job's own options or wiring set: use ranks"),
        ("script --sbatch=--chdir=/tmp train.py", "'#SBATCH --chdir=/tmp' sets what the job's own options"),
        ("script '--sbatch=#SBATCH -N 2' train.py", "use nodes= (--nodes)"),
        ("script --sbatch=-N2 train.py", "use nodes= (--nodes)"),
        ("script --sbatch=--distribution=cyclic train.py", "the job sets it itself"),
        ("script --time 00:00:20 train.py", "time='00:00:20' has seconds, which SLURM rounds up to a minute"),
        ("script --time 1-0:0:30 train.py", "time='1-0:0:30' has seconds"),
        ("status --rank 3", "status does not take --rank; it takes no options"),
        ("cancel 3 --follow", "cancel does not take --follow"),
        ("submit --rank 1 train.py", "submit does not take --rank"),
        ("logs", "say which job, e.g. %vgpu_job logs 12"),
    ):
        with pytest.raises(UsageError) as info:
            ip.run_line_magic("vgpu_job", line)
        assert said in str(info.value) and "\n" not in str(info.value), (line, str(info.value))
    for time_limit in ("30", "1:00", "01:00:00", "1-12", "2-0:30:00"):
        assert f"#SBATCH --time={time_limit}\n" in ip.run_line_magic("vgpu_job", f"script --time {time_limit} train.py")
    assert not (tmp_path / ".vgpu_jobs").exists()


def test_a_tasks_thread_answers_an_ask_in_the_jobs_folder_and_an_exited_rank_is_named(tmp_path):
    """The ask/answer files without SLURM: this process is rank 0 of 2 (its thread answers), rank 1 has exited."""
    from vgpu_magic.batch.stacks import ASK, Answering, look

    Answering(tmp_path, 0, 2, 0)
    (tmp_path / "rank-1.exit").write_text("3\n")
    said, lines, answered = look(tmp_path, 2, 1.0)
    assert said is None and answered == 1
    assert re.fullmatch(r"rank 0: (idle, )?at tests/test_jobs\.py:\d+: said, lines, answered = look\(.*", lines[0])
    assert lines[1] == "rank 1: exited with status 3"
    assert json.loads((tmp_path / "rank-0.state.json").read_text())["token"] == (tmp_path / ASK).read_text()


HANGS = """import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(16)
dist.all_reduce(t)
print("started", dist.get_rank(), __name__, sys.argv, sys.path[0] == os.path.dirname(__file__), flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(t)
while True:
    time.sleep(0.1)
"""


def test_a_hung_jobs_log_and_stacks_say_which_rank_waits_where(slurm, tmp_path, capsys):
    """Issue 42 in a batch job: rank 1 skips an all_reduce. After --hang-after the job's log has the hang doctor's
    report; ``%vgpu_job stacks`` shows it again; cancelled, nothing is left; an ended job's stacks are refused."""
    from IPython.testing.globalipapp import get_ipython

    (tmp_path / "hangs.py").write_text(HANGS)
    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    job = ip.run_line_magic("vgpu_job", "submit -n 2 --hang-after 3 hangs.py")
    assert job.spec.hang_after == 3
    started(job)
    assert f"[rank 1] started 1 __main__ ['{tmp_path / 'hangs.py'}'] True" in job.logs()
    deadline = time.monotonic() + 60
    while "a hang" not in job.logs() and time.monotonic() < deadline:
        time.sleep(0.5)
    said = "rank 1 never called all_reduce #2 that rank 0 waits in (hangs.py:9); rank 1 is at hangs.py:11, idle"
    assert "vgpu_magic: a hang, " in job.logs() and said in job.logs(), job.logs()
    assert job.logs().count("vgpu_magic: a hang") == 1
    capsys.readouterr()
    ip.run_line_magic("vgpu_job", f"stacks {job.job_id}")
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == f"job {job.job_id}, attempt 1: {said}"
    assert re.fullmatch(
        r"  rank 0: waiting in all_reduce #2 \(\[16\] float32\) for \d+ s, at hangs.py:9: dist.all_reduce\(t\)",
        shown[1],
    )
    assert shown[2] == "  rank 1: idle, at hangs.py:11: time.sleep(0.1)"
    job.cancel()
    assert job.wait(timeout=60) == "CANCELLED"
    deadline = time.monotonic() + 30
    while (slurm.squeue() or processes_running(tmp_path / "hangs.py")) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert slurm.squeue() == [] and processes_running(tmp_path / "hangs.py") == []
    for line, error in (
        (f"stacks {job.job_id}", f"job {job.job_id} is CANCELLED: its tasks are not running; %vgpu_job logs"),
        ("stacks 99999", "job '99999' is not one of your jobs"),
        ("stacks", "say which job, e.g. %vgpu_job stacks 12"),
        (f"stacks {job.job_id} --rank 1", "stacks does not take --rank"),
    ):
        with pytest.raises(UsageError, match=re.escape(error)) as info:
            ip.run_line_magic("vgpu_job", line)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"--hang-after -1 is not a number of seconds"):
        import vgpu_magic

        vgpu_magic.submit("hangs.py", hang_after=-1)
