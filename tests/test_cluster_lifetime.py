"""Nothing a cluster starts outlives its kernel (issue 16, defects 1 and 7): a
real kernel killed by SIGKILL or ``os.abort()`` (no atexit runs) takes the
controller, its children, the engines and their nannies with it; a controller
killed first leaves nothing after stop; and the watch itself, on plain
processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from support import CHILD_ENV, ROOT, as_a_user, kernel_errors, kernel_run, kernel_stdout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie nobody reaps is dead)."""
    from vgpu_magic.ranks.lifetime import process_alive

    return [pid for pid in pids if process_alive(pid)]


def gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.2)
    return alive(pids)


#: As JupyterLab's cluster panel does, in the Jupyter server's process: ipyparallel's ClusterManager reloading the
#: profile's clusters, logging to the server's terminal at the server's level; each poll's running clusters on stdout.
PANEL = """
import asyncio, json, logging, sys
from ipyparallel.cluster.cluster import ClusterManager
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
manager = ClusterManager(log=logging.getLogger("ServerApp"))
async def main():
    while True:
        clusters = manager.load_clusters(init_default_clusters=True).values()
        print(json.dumps(sorted(c.cluster_id for c in clusters if c.cluster_id)), flush=True)
        await asyncio.sleep(0.2)
asyncio.run(main())
"""


@pytest.mark.parametrize("death", ["SIGKILL", "os.abort()"])
def test_a_kernel_that_dies_without_atexit_takes_every_cluster_process_with_it(death):
    from jupyter_client.manager import start_new_kernel

    env = {**CHILD_ENV, "PYTHONPATH": str(ROOT)}
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    # Issue 37, row 16: JupyterLab's cluster panel, whose copy of the cluster wrote its file again as it died.
    panel = subprocess.Popen([sys.executable, "-c", PANEL], env=env, stdout=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        reply = kernel_run(kc, "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework torch")
        assert not [m for m in reply if m["msg_type"] == "error"]
        family = "[os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]"
        reply = kernel_run(kc, f"import json, os, psutil\nprint(json.dumps({family}))")
        kernel, *pids = json.loads(kernel_stdout(reply).strip().splitlines()[-1])
        # Issue 22, defect 10: the cluster's file (which ipyparallel's tools list) and its logs go with it too.
        reply = kernel_run(
            kc,
            "import glob, vgpu_magic\nc = vgpu_magic.cluster()\nprint(json.dumps("
            "[c.cluster.cluster_file, *glob.glob(f'{c.cluster.profile_dir}/log/*{c.cluster_id}*')]))",
        )
        files = json.loads(kernel_stdout(reply).strip().splitlines()[-1])
        assert len(files) >= 3 and all(os.path.exists(f) for f in files)
        # The controller (main and children), 2 engines and their 2 nannies.
        assert len(pids) >= 5
        if death == "SIGKILL":
            os.kill(kernel, signal.SIGKILL)
        else:
            kc.execute("import os; os.abort()")
        assert gone_within([kernel], 30) == []
        assert gone_within(pids, 15) == []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f) for f in files):
            time.sleep(0.2)
        assert [f for f in files if os.path.exists(f)] == []
        time.sleep(2)  # the panel polls every 0.2 s
        assert [f for f in files if os.path.exists(f)] == []
    finally:
        panel.kill()
        panel.wait()
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


def test_stop_after_the_controller_was_killed_leaves_nothing():
    from vgpu_magic.ranks import RankCluster, lifetime

    # Processes of this test's own (other tests' session fixtures, such as SLURM daemons, are not the cluster's).
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ranks = RankCluster(1, "tensorflow", gpus=[]).start()
    try:
        controller = psutil.Process(ranks.cluster.controller.pid)
        # Its watcher (beside it) goes with it; the children it forked stay.
        children = [p.pid for p in controller.children(recursive=True) if p.name() != lifetime.WATCHER_NAME]
        everything = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert len(children) >= 4
        controller.kill()
        assert gone_within([controller.pid], 10) == []
        # Its children were re-parented: no longer below this process, still running.
        assert alive(children) == children
    finally:
        ranks.stop()
    assert alive(everything) == []


WATCHED = """
import json, os, sys, time
from vgpu_magic.ranks import lifetime
assert lifetime.watch_owner(sys.argv[1])
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(json.dumps([os.getpid(), child]), flush=True)
time.sleep(600)
"""


def test_a_watched_process_and_what_it_forked_end_with_their_owner():
    from vgpu_magic.ranks import lifetime

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        created = psutil.Process(owner.pid).create_time()
        name = f"{lifetime.socket.gethostname()}:{owner.pid}:{created:.3f}"
        watched = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WATCHED), name],
            stdout=subprocess.PIPE,
            text=True,
            env={**CHILD_ENV, "PYTHONPATH": str(ROOT)},
        )
        pids = json.loads(watched.stdout.readline())
        assert alive(pids) == pids
        owner.kill()
        assert gone_within(pids, 15) == []
        assert watched.wait(5) == -signal.SIGKILL
    finally:
        owner.kill()
        owner.wait()


def test_an_owner_on_another_host_or_none_is_not_watched(monkeypatch):
    from vgpu_magic.ranks import lifetime

    monkeypatch.delenv(lifetime.OWNER_ENV, raising=False)
    assert lifetime.watch_owner() is False
    assert lifetime.watch_owner(f"elsewhere.example:{os.getpid()}:0.000") is False


def test_then_runs_its_command_when_the_owner_dies(tmp_path):
    """How a launcher whose processes live on other hosts (SLURM, ssh) ends them: a local watcher runs
    `scancel JOBID` (here: touch a file) when the kernel dies."""
    from vgpu_magic.ranks import lifetime

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    marker = tmp_path / "cancelled"
    try:
        name = f"{lifetime.socket.gethostname()}:{owner.pid}:{psutil.Process(owner.pid).create_time():.3f}"
        watcher = subprocess.Popen(
            [sys.executable, "-m", "vgpu_magic.ranks.lifetime", "--then", f"touch {marker}"],
            env={**CHILD_ENV, "PYTHONPATH": str(ROOT), lifetime.OWNER_ENV: name},
        )
        time.sleep(1.0)
        assert watcher.poll() is None and not marker.exists()
        owner.kill()
        assert watcher.wait(15) == -signal.SIGKILL
        assert marker.exists()
    finally:
        owner.kill()
        owner.wait()


def test_a_rank_busy_in_c_code_holding_the_gil_goes_with_its_kernel(tmp_path):
    """Issue 25, row 3: the watch was a thread inside the engine, so a rank in C code that never lets go
    of the GIL (a regular expression backtracking for hours) outlived its SIGKILLed kernel for as long
    as the call ran. The watch now lives beside each engine, in a process of its own."""
    from support import started_kernel

    pids: list[int] = []
    try:
        with started_kernel() as (_km, kc):
            reply = kernel_run(kc, "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework tensorflow")
            assert not [m for m in reply if m["msg_type"] == "error"], kernel_stdout(reply)
            family = "[os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]"
            reply = kernel_run(kc, f"import json, os, psutil\nprint(json.dumps({family}))")
            kernel, *pids = json.loads(kernel_stdout(reply).strip().splitlines()[-1])
            # Each rank leaves a file as it is about to match, then holds the GIL in re's C code (2**40 steps).
            # (A file, not a print: the engine sends its output from a thread that the GIL then starves.)
            kc.execute(
                f"%%vgpu_run --no-plot\nimport os, re\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w')"
                ".close()\nre.match(r'(a+)+$', 'a' * 40 + 'b')"
            )
            deadline = time.monotonic() + 120
            while len(matching := [int(p.name) for p in tmp_path.iterdir()]) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(matching) == 2 and set(matching) <= set(pids), (matching, pids)
            time.sleep(0.5)
            os.kill(kernel, signal.SIGKILL)
            assert gone_within([kernel], 30) == []
            assert gone_within(pids, 15) == []
    finally:
        for pid in alive(pids):
            os.kill(pid, signal.SIGKILL)


def files_in(profile: Path) -> list[str]:
    """The files in ``profile``, but IPython's own history (which the kernel writes as it runs cells)."""
    return sorted(str(p) for p in profile.rglob("*") if p.is_file() and not p.name.startswith("history.sqlite"))


def test_a_clean_start_run_and_stop_write_nothing_to_the_servers_terminal_and_leave_no_file(tmp_path):
    """Issue 37, rows 7 and 15: each clean stop wrote 43-102 lines per process into the Jupyter server's terminal
    (the cluster panel's copy of the cluster logged every process's log file as a failure), left the controller's
    ``engines<id>.json`` in the profile, and a zombie child of the kernel. The server's terminal is the kernel's
    stdout and stderr and the panel's stderr here."""
    from jupyter_client.manager import start_new_kernel

    env = {**CHILD_ENV, "PYTHONPATH": str(ROOT), "IPYTHONDIR": str(tmp_path / "ipython"), **as_a_user()}
    env = {k: v for k, v in env.items() if v is not None}
    profile = tmp_path / "ipython" / "profile_default"
    (tmp_path / "s.py").write_text("print('ran')\n")
    terminal, panel_log, seen = (tmp_path / name for name in ("terminal", "panel-stderr", "panel-stdout"))
    with terminal.open("w") as out:
        km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path), stdout=out, stderr=out)
    try:
        assert not kernel_errors(kernel_run(kc, "%load_ext vgpu_magic\nimport json, psutil, vgpu_magic"))
        files_before, said_before = files_in(profile), terminal.read_text()
        with panel_log.open("w") as err, seen.open("w") as polls:
            panel = subprocess.Popen([sys.executable, "-c", PANEL], env=env, stdout=polls, stderr=err)
        try:
            reply = kernel_run(kc, "%vgpu_cluster start 2 --framework torch\nc = vgpu_magic.cluster()")
            assert not kernel_errors(reply), kernel_stdout(reply)
            cluster_id = json.loads(kernel_stdout(kernel_run(kc, "print(json.dumps(c.cluster_id))")).split()[-1])
            reply = kernel_run(kc, "%vgpu_run --no-plot s.py")
            assert not kernel_errors(reply) and kernel_stdout(reply).count("] ran") == 2
            deadline = time.monotonic() + 30
            while cluster_id not in seen.read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cluster_id in seen.read_text()  # the panel had the cluster before its stop
            assert not kernel_errors(kernel_run(kc, "%vgpu_cluster stop"))
            polls = len(seen.read_text().splitlines())
            while len(seen.read_text().splitlines()) < polls + 10:
                time.sleep(0.2)
            # The panel's copy noticed the stop and left the panel.
            assert cluster_id not in seen.read_text().splitlines()[-1]
        finally:
            panel.kill()
            panel.wait()
        # No child, zombie or not, once those that ipyparallel's own threads reap (its engines, its controller) had
        # a few seconds on a loaded machine; a zombie nobody waits for (row 15) stays for good.
        children = (
            "import time\nfor _ in range(100):\n    kids = [(p.pid, p.status()) for p in psutil.Process().children()]\n"
            "    if not kids: break\n    time.sleep(0.1)\nprint(kids)"
        )
        assert kernel_stdout(kernel_run(kc, children)).strip() == "[]"
        assert terminal.read_text() == said_before
        assert panel_log.read_text() == ""
        assert files_in(profile) == files_before
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
