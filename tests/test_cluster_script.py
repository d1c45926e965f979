"""A script run (``%vgpu_run FILE``) from a real Jupyter kernel against what ``torchrun`` gives the same
script: its output whole and in order, its signals, its environment, its ``sys.argv``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from support import (
    kernel_errors,
    kernel_run,
    kernel_stdout,
    kernel_stream,
    machine_loaded,
    started_kernel,
    started_torch_ranks,
)
from vgpu_magic.ranks.shown import as_terminal_shows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def kernel():
    """A fresh kernel running 2 torch ranks (the live memory view on, as by default): ``(manager, client)``.
    At the end none of the ranks' processes may be left. It starts with SIGHUP and SIGQUIT ignored, as under ``nohup``
    in a background shell: a launched rank gets torchrun's dispositions all the same."""
    with started_kernel(graceful=True, ignoring=(signal.SIGHUP, signal.SIGQUIT)) as (km, kc):
        pids = started_torch_ranks(kc)
        yield km, kc
        kernel_run(kc, "%vgpu_cluster stop")
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p], timeout=15)
    assert alive == []


def _process(pid: int) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid)
    return None


def test_every_line_a_rank_prints_arrives_in_order(kernel, tmp_path):
    """Issue 37, row 25: 500,000 lines per rank with the live view on delivered 513,558 of 1,000,002 lines,
    neither rank's last, and the run said it succeeded (the run waited 5 s for output still on its way)."""
    _, kc = kernel
    script = tmp_path / "lines.py"
    script.write_text("for i in range(500_000):\n    print(f'line {i}')\nprint('END')\n")
    reply = kernel_run(kc, f"%vgpu_run {script}", timeout=500)
    assert not kernel_errors(reply), kernel_errors(reply)
    assert kernel_stream(reply, "stderr") == ""
    lines = kernel_stdout(reply).splitlines()
    for rank in (0, 1):
        label = f"[rank {rank}] "
        mine = [line[len(label) :] for line in lines if line.startswith(label)]
        assert mine == [f"line {i}" for i in range(500_000)] + ["END"]


def _own_lines(text: str, rank: int) -> list[str]:
    """The lines of ``text`` labelled with ``rank``, without the label."""
    label = f"[rank {rank}] "
    return [line[len(label) :] for line in text.splitlines() if line.startswith(label)]


def test_a_printed_line_arrives_whole_on_its_own_stream_while_the_framework_logs(kernel, tmp_path):
    """Issue 45: ``print("process", i, "of", n)`` reached the notebook as ``[rank 0] process[Gloo] Rank 0 is
    connected ...``: under ``PYTHONUNBUFFERED`` (this machine's, CI's, the suite's) each piece of a print left on
    its own, and Gloo's C++ wrote its line to the same stdout between two. And a rank's stderr reached the notebook's
    stdout. Every line arrives whole, labelled, in order, on the stream it was written to, whatever a framework
    writes at C level meanwhile (here a thread's ``os.write`` to fd 1 and fd 2)."""
    _, kc = kernel
    script = tmp_path / "both.py"
    script.write_text(
        "import os, threading\n"
        "def log():\n"
        "    for i in range(1000):\n"
        "        os.write(1, f'framework line {i}\\n'.encode())\n"
        "        os.write(2, f'framework warning {i}\\n'.encode())\n"
        "logger = threading.Thread(target=log)\n"
        "logger.start()\n"
        "for i in range(1000):\n"
        "    print('a', i, 'b')\n"
        "logger.join()\n"
    )
    reply = kernel_run(kc, f"%env PYTHONUNBUFFERED=1\n%vgpu_run --no-plot {script}")
    assert not kernel_errors(reply), kernel_errors(reply)
    out, err = kernel_stdout(reply), kernel_stream(reply, "stderr")
    for rank in (0, 1):
        theirs = [line for line in _own_lines(out, rank) if line.startswith("framework")]
        assert [line for line in _own_lines(out, rank) if line not in theirs] == [f"a {i} b" for i in range(1000)]
        assert theirs == [f"framework line {i}" for i in range(1000)]
        assert _own_lines(err, rank) == [f"framework warning {i}" for i in range(1000)]


def test_a_cells_stderr_reaches_the_notebooks_stderr(kernel):
    """Issue 43, row 11: a rank's warnings reached the notebook on its stdout stream."""
    _, kc = kernel
    cell = "%%vgpu_run --no-plot\nimport sys, warnings\nprint('out')\nwarnings.warn('careful')\n"
    cell += "print('err', file=sys.stderr)"
    reply = kernel_run(kc, cell)
    assert not kernel_errors(reply), kernel_errors(reply)
    out, err = kernel_stdout(reply), kernel_stream(reply, "stderr")
    for rank in (0, 1):
        assert _own_lines(out, rank) == ["out"]
        assert _own_lines(err, rank)[-1] == "err"
        assert any("UserWarning: careful" in line for line in _own_lines(err, rank))


def interrupt_once_both_train(km) -> Callable[[dict], None]:
    """An ``on_message`` for :func:`kernel_run` that interrupts the kernel (as the notebook's stop button does)
    once both ranks printed ``training``, and only once."""
    started: list[str] = []

    def interrupt(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            started.extend(line for line in msg["content"]["text"].splitlines() if line.endswith("training"))
            if len(started) == 2:
                started.append("sent")
                km.interrupt_kernel()

    return interrupt


def test_ctrl_c_reaches_the_script_on_every_rank_and_says_so_in_one_line(kernel, tmp_path):
    """Issue 37, rows 1 and 3: the launched process started with SIGINT ignored (the spare's engine's) and was
    stopped with SIGTERM, so its ``except KeyboardInterrupt`` never ran; the interrupt printed a 65-135 line
    traceback through the kernel's internals."""
    km, kc = kernel
    script = tmp_path / "train.py"
    script.write_text(
        "import os, time\n"
        "try:\n"
        "    print('training', flush=True)\n"
        "    time.sleep(120)\n"
        "except KeyboardInterrupt:\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'saved-' + os.environ['RANK']), 'w').close()\n"
        "    print('saved', flush=True)\n"
    )
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}", on_message=interrupt_once_both_train(km))
    [error] = [m["content"] for m in reply if m["msg_type"] == "error"]
    # Issue 42 (43, row 3): where each rank was, by the hang doctor.
    [said] = error["traceback"]
    where = r"(idle, )?at train.py:4: time.sleep\(120\)"
    assert re.fullmatch(rf"KeyboardInterrupt: interrupted ranks 0, 1 \(rank 0 was {where}; rank 1 was {where}\)", said)
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]
    assert sorted(line for line in kernel_stdout(reply).splitlines() if "saved" in line) == [
        "[rank 0] saved",
        "[rank 1] saved",
    ]
    # The cluster came through: the next launch runs.
    reply = kernel_run(kc, f"%vgpu_run --no-plot {tmp_path / 'lines.py'}")
    assert not kernel_errors(reply), kernel_errors(reply)


def test_argv_is_as_typed_and_the_kernels_environment_is_the_launchs(kernel, tmp_path):
    """Issue 37, rows 4 and 14: ``%env`` and ``os.environ`` after the start did not reach a script (``!torchrun``
    passes them); ``sys.argv[0]`` was made absolute (torchrun keeps it as typed)."""
    _, kc = kernel
    (tmp_path / "show.py").write_text(
        "import os, sys\nprint(sys.argv, os.environ.get('FOO'), os.environ.get('BAR'), os.environ['RANK'])\n"
    )
    cell = f"%cd {tmp_path}\n%env FOO=from-env\nimport os\nos.environ['BAR'] = 'set'\n%vgpu_run --no-plot show.py x"
    reply = kernel_run(kc, cell)
    assert not kernel_errors(reply), kernel_errors(reply)
    shown = sorted(line for line in kernel_stdout(reply).splitlines() if line.startswith("[rank"))
    assert shown == [f"[rank {r}] ['show.py', 'x'] from-env set {r}" for r in (0, 1)]
    reply = kernel_run(kc, "del os.environ['BAR']\n%env FOO=\n%cd -")
    assert not kernel_errors(reply), kernel_errors(reply)


def test_a_script_that_configures_torch_through_the_environment_gets_its_settings(kernel, tmp_path):
    """Issue 37, row 17: the warm spare had imported torch already, so a script's ``OMP_NUM_THREADS`` set before its
    ``import torch`` was ignored (threads 1 under %vgpu_run, 2 under plain python)."""
    _, kc = kernel
    script = tmp_path / "threads.py"
    script.write_text("import os\nos.environ['OMP_NUM_THREADS'] = '2'\nimport torch\nprint(torch.get_num_threads())\n")
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
    assert not kernel_errors(reply), kernel_errors(reply)
    assert sorted(x for x in kernel_stdout(reply).splitlines() if x.startswith("[rank")) == ["[rank 0] 2", "[rank 1] 2"]


def test_a_package_installed_after_the_start_is_importable_at_the_first_run(kernel, tmp_path):
    """Issue 37, row 29: the first %vgpu_run after ``pip install -e mypkg`` raised ModuleNotFoundError (the spare
    had read the import path before the install). What the install adds is a ``.pth`` file in site-packages."""
    import site
    import uuid

    _, kc = kernel
    name = f"vgpu_test_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / "src" / name).mkdir(parents=True)
    (tmp_path / "src" / name / "__init__.py").write_text("WHO = 'installed'\n")
    (tmp_path / "use.py").write_text(f"import {name}\nprint({name}.WHO)\n")
    pth = next(p for p in map(Path, site.getsitepackages()) if p.is_dir()) / f"__editable__{name}.pth"
    pth.write_text(f"{tmp_path / 'src'}\n")
    try:
        reply = kernel_run(kc, f"%vgpu_run --no-plot {tmp_path / 'use.py'}")
    finally:
        pth.unlink()
    assert not kernel_errors(reply), kernel_errors(reply)
    assert sorted(x for x in kernel_stdout(reply).splitlines() if x.startswith("[rank")) == [
        "[rank 0] installed",
        "[rank 1] installed",
    ]


def test_launches_in_a_loop_are_forked_by_one_spare_and_differ_as_new_processes(kernel, tmp_path):
    """Issue 44: five launches in a loop (a sweep) waited, each but the first, for a new spare to import torch (1.3 s
    of 2.5 s). Now one spare per engine forks every launch: each launch's parent is that same spare, not its engine;
    each is still a new process, with numpy's global generator seeded anew, as a new import seeds it."""
    _, kc = kernel
    (tmp_path / "who.py").write_text(
        "import os, numpy, torch\nprint(os.getppid(), os.getpid(), numpy.random.randint(1 << 30), os.environ['RANK'])\n"
    )
    cell = f"import vgpu_magic\nfor _ in range(3):\n    %vgpu_run --no-plot {tmp_path / 'who.py'}\n"
    reply = kernel_run(kc, cell + "print('engines', *vgpu_magic.cluster().pids)")
    assert not kernel_errors(reply), kernel_errors(reply)
    out = kernel_stdout(reply).splitlines()
    engines = next(line for line in out if line.startswith("engines")).split()[1:]
    runs = [line.split()[2:] for line in out if line.startswith("[rank")]
    for rank, engine in enumerate(engines):
        parents, pids, drawn = zip(*[run[:3] for run in runs if run[3] == str(rank)])
        assert len(set(parents)) == 1 and parents[0] != engine, (parents, engine)
        assert len(set(pids)) == 3 and len(set(drawn)) == 3, (pids, drawn)
        assert psutil.Process(int(parents[0])).ppid() == int(engine)


#: A script that writes what its process was given: environment, argv, signal dispositions (Python's and the
#: kernel's masks), to ``ARGV[1]-RANK.json``.
DUMP = """
import json, os, signal, sys
handlers = {s.name: str(signal.getsignal(s)) for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)}
status = open("/proc/self/status").read().splitlines()
masks = dict(line.split(":\\t") for line in status if line[:6] in ("SigBlk", "SigIgn"))
given = {"env": dict(os.environ), "argv": sys.argv, "handlers": handlers, "masks": masks}
json.dump(given, open(f"{sys.argv[1]}-{os.environ['RANK']}.json", "w"))
"""

#: What a rank is given otherwise than under torchrun, and why.
INTENDED = {
    # torchrun's agent's own bookkeeping (its run id, restarts, its error file), which no script reads.
    "TORCHELASTIC_RUN_ID": "the elastic agent's",
    "TORCHELASTIC_RESTART_COUNT": "the elastic agent's",
    "TORCHELASTIC_MAX_RESTARTS": "the elastic agent's",
    "TORCHELASTIC_USE_AGENT_STORE": "the elastic agent's",
    "TORCHELASTIC_ERROR_FILE": "the elastic agent's",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "the elastic agent's",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "the elastic agent's",
    "MASTER_PORT": "a free port each run, chosen by each launcher",
    # The hang doctor reads each rank's collectives from torch's Flight Recorder (docs/hangs.md).
    "TORCH_FR_BUFFER_SIZE": "the hang doctor's",
    # Rank 0's reachable address, never localhost (torchrun --standalone's), so that other hosts reach it too.
    "MASTER_ADDR": "rank 0's reachable address",
    # Set by the shell that ran torchrun (the command it ran last).
    "_": "the shell's",
    # The cluster's own: its processes' owner (a stop or a dead kernel ends them) and its token.
    "VGPU_MAGIC_OWNER": "the cluster's processes' owner",
    "VGPU_MAGIC_CLUSTER": "the cluster's token",
}


def test_a_launched_rank_is_given_what_torchrun_gives_it(kernel, tmp_path):
    """Issue 37, row 4: a rank's environment and signal dispositions, variable by variable, against
    ``torchrun``'s for the same script from the same kernel; only those :data:`INTENDED` differ."""
    _, kc = kernel
    (tmp_path / "dump.py").write_text(DUMP)
    cell = (
        f"%cd {tmp_path}\n%env FOO=1\n"
        "!{sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 dump.py torchrun\n"
        "%vgpu_run --no-plot dump.py ours\n%cd -"
    )
    reply = kernel_run(kc, "import sys\n" + cell)
    assert not kernel_errors(reply), kernel_errors(reply)
    for rank in (0, 1):
        ours, theirs = (json.loads((tmp_path / f"{who}-{rank}.json").read_text()) for who in ("ours", "torchrun"))
        assert ours["env"]["FOO"] == "1"
        differ = {
            name: (ours["env"].get(name), theirs["env"].get(name))
            for name in {*ours["env"], *theirs["env"]}
            if ours["env"].get(name) != theirs["env"].get(name) and name not in INTENDED
        }
        assert differ == {}
        assert (ours["handlers"], ours["masks"]) == (theirs["handlers"], theirs["masks"])
        assert ours["argv"] == ["dump.py", "ours"] and theirs["argv"] == ["dump.py", "torchrun"]


#: A script (or module) that writes what Python gave it as ``__main__`` to ``seen-ARGV[1]-RANK.json``.
SEEN = """
import json, os, sys
seen = {
    "file": __file__, "package": __package__, "spec": __spec__ and __spec__.name, "argv": sys.argv[1:],
    "argv0": sys.argv[0], "path0": sys.path[0], "main": sys.modules["__main__"].__dict__ is globals(),
    "globals": sorted(globals()), "cached": __cached__, "folder": os.path.dirname(__file__),
}
json.dump(seen, open(f"seen-{sys.argv[1]}-{os.environ.get('RANK', 0)}.json", "w"))
"""


@pytest.mark.parametrize("form", ["show.py", "-m pkg.show"])
def test_a_script_or_module_is_main_as_python_makes_it(kernel, tmp_path, form):
    """Issue 43, rows 11 and 14, issue 46: ``__file__`` was the path as typed (``os.path.dirname(__file__)`` then
    ``""``), ``__package__`` ``''``, not Python's; ``-m pkg.train`` (torchrun's module form) was refused. Both now
    against plain ``python show.py`` / ``python -m pkg.show`` from the same folder."""
    _, kc = kernel
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    for where in (tmp_path / "show.py", tmp_path / "pkg" / "show.py"):
        where.write_text(SEEN)
    cell = f"import sys\n%cd {tmp_path}\n!{{sys.executable}} {form} python\n%vgpu_run --no-plot {form} ours\n%cd -"
    reply = kernel_run(kc, cell)
    assert not kernel_errors(reply), kernel_errors(reply)
    python = json.loads((tmp_path / "seen-python-0.json").read_text())
    for rank in (0, 1):
        ours = json.loads((tmp_path / f"seen-ours-{rank}.json").read_text())
        assert {**ours, "argv": ["python"]} == python
    assert python["folder"] == str(tmp_path / ("pkg" if "-m" in form else ""))
    assert (python["package"], python["argv0"]) == (
        ("pkg", str(tmp_path / "pkg" / "show.py")) if "-m" in form else (None, "show.py")
    )


def test_a_progress_bar_on_stderr_is_live_and_not_an_error(kernel, tmp_path):
    """Issue 37, row 5: a plain ``from tqdm import tqdm`` bar did not move for the whole run, then both finished
    bars arrived at the end in the notebook's stderr. Issue 45: the bar is on stderr, where tqdm writes it and
    Jupyter shows any cell's, and moves there."""
    _, kc = kernel
    script = tmp_path / "bar.py"
    script.write_text("import time\nfrom tqdm import tqdm\nfor step in tqdm(range(40)):\n    time.sleep(0.05)\n")
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
    assert not kernel_errors(reply), kernel_errors(reply)
    assert "%|" not in kernel_stdout(reply)
    for rank in (0, 1):
        # The bar came in pieces as it moved, each over the last.
        updates = [m["content"]["text"] for m in reply if m["msg_type"] == "stream" and "%|" in m["content"]["text"]]
        assert len([text for text in updates if f"[rank {rank}]" in text]) >= 2 and "\r" in "".join(updates)
    shown = [as_terminal_shows(line) for line in kernel_stream(reply, "stderr").split("\n")]
    assert sorted(line.split("|")[0] for line in shown if "40/40" in line) == ["[rank 0] 100%", "[rank 1] 100%"]


def _run_rank_1_failing(kernel, tmp_path) -> tuple[list[dict], dict, str]:
    """``%vgpu_run`` of a gloo script whose rank 1 raises ``ValueError: bad batch`` at step 5: the reply, its one
    error, and everything it showed (stdout, stderr, the error's lines)."""
    _, kc = kernel
    script = tmp_path / "ddp.py"
    script.write_text(
        "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\nt = torch.ones(1)\n"
        "for step in range(100):\n    if step == 5 and dist.get_rank() == 1:\n"
        "        raise ValueError('bad batch')\n    dist.all_reduce(t)\n"
    )
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
    [error] = [m["content"] for m in reply if m["msg_type"] == "error"]
    return reply, error, kernel_stdout(reply) + kernel_stream(reply, "stderr") + "\n".join(error["traceback"])


def test_a_failing_ranks_traceback_is_shown_once_under_its_own_label(kernel, tmp_path):
    """Issue 37, row 6: a failing rank's traceback streamed live, then again above the RankRunError; torch's own
    label doubled ours (``[rank 1] [rank1]:``)."""
    reply, error, everything = _run_rank_1_failing(kernel, tmp_path)
    # Rank 1 exits with status 1, or gloo aborts it on its way out (SIGABRT); the error says how, in one line.
    [line] = error["traceback"]
    assert line.startswith(("RankRunError: rank 1 ", "RankRunError: ranks 0, 1 ")), line
    assert everything.count("ValueError: bad batch") == 1
    assert "[rank 1] ValueError: bad batch" in kernel_stream(reply, "stderr")
    assert "[rank1]:" not in everything and "[rank0]:" not in everything


# -- the fault policy's words and the interrupt's grace (issue 37, rows 2, 6, 7) --------------------------------


def test_the_ranks_a_failure_took_down_are_said_in_one_line_each(kernel, tmp_path):
    """Issue 37, row 6: when rank 1 raised, rank 0's consequential gloo traceback (``Connection closed by peer``,
    ~15 lines) streamed in full. Now it is one line, in the live output and in the RankRunError, whose per-rank
    data keeps the whole text."""
    _, kc = kernel
    reply, error, everything = _run_rank_1_failing(kernel, tmp_path)
    assert everything.count("ValueError: bad batch") == 1
    said = "rank 0 stopped: its peer closed the connection (rank 1 failed first)"
    assert f"[{said.replace(' stopped', '] stopped')}" in kernel_stream(reply, "stderr").splitlines()
    [line] = error["traceback"]
    assert line.startswith("RankRunError: rank 1 ") and f"; {said}; the cluster is still usable" in line, line
    assert "Connection closed by peer" not in everything and "[rank 0] Traceback" not in everything
    # The whole text is kept with the rank's failure.
    reply = kernel_run(kc, "import sys\nprint('\\n'.join(sys.last_value.failures[-1].traceback))")
    assert "Connection closed by peer" in kernel_stdout(reply)


@pytest.mark.load
def test_an_interrupted_launch_that_is_still_saving_under_load_is_not_killed(kernel, tmp_path):
    """Issue 37, row 2: an interrupted launch had a fixed grace (30 s, then SIGKILL; the engines 3 s more), so a
    script whose ``except KeyboardInterrupt`` was still at work, slowed by a loaded machine, lost its save and
    the cluster had to be restarted. The grace lasts while the process makes progress (CPU time, I/O, output)."""
    km, kc = kernel
    script = tmp_path / "save.py"
    script.write_text(
        "import os, time\n"
        "try:\n"
        "    print('training', flush=True)\n"
        "    time.sleep(300)\n"
        "except KeyboardInterrupt:\n"
        "    for part in range(40):\n"
        "        print(f'saving part {part}', flush=True)\n"
        "        time.sleep(1)\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'saved-' + os.environ['RANK']), 'w').close()\n"
    )
    with machine_loaded():
        reply = kernel_run(kc, f"%vgpu_run --no-plot {script}", timeout=400, on_message=interrupt_once_both_train(km))
    [error] = [m["content"] for m in reply if m["msg_type"] == "error"]
    assert error["traceback"][0].startswith("KeyboardInterrupt: interrupted ranks 0, 1 (rank 0 was "), error
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]
    (tmp_path / "again.py").write_text("print('again')\n")
    reply = kernel_run(kc, f"%vgpu_run --no-plot {tmp_path / 'again.py'}")
    assert not kernel_errors(reply), kernel_errors(reply)


def spares_ready(kc, within: float = 180.0) -> None:
    """Wait until each engine's spare has imported its framework (used under a CPU share of a core for a second),
    so that a launch's ``--timeout`` counts the script's time, not the spares' imports on a loaded machine."""
    import time

    reply = kernel_run(kc, "import vgpu_magic\nprint(*vgpu_magic.cluster().pids)")
    engines = [psutil.Process(int(pid)) for pid in kernel_stdout(reply).split()]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            spares = [c for e in engines for c in e.children() if "launched import child" in " ".join(c.cmdline())]
            before = [sum(spare.cpu_times()[:2]) for spare in spares]
            time.sleep(1.0)
            if len(spares) == len(engines) and all(sum(s.cpu_times()[:2]) - b < 0.05 for s, b in zip(spares, before)):
                return
    raise AssertionError(f"the spares were still busy after {within:g} s")


@pytest.mark.load
def test_a_timeout_on_ranks_blocked_in_a_collective_kills_them_once_stuck_and_says_so(kernel, tmp_path):
    """Issue 43, rows 2 and 3: ``--timeout 10`` on ranks blocked in a collective returned after 26-133 s: their
    runtimes' threads' CPU time crept (0.01 s every few seconds), which the grace after SIGINT took for progress
    up to its 120 s cap; then the killed ranks were reported ``interrupted``. A process using less than a twentieth
    of a core (and no I/O, no output) for 10 s after SIGINT is stuck: killed, and said so."""
    _, kc = kernel
    script = tmp_path / "skip.py"
    script.write_text(
        "import torch\nimport torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(4)\n"
        "for step in range(4):\n"
        "    if dist.get_rank() == 1 and step == 2:\n"
        "        continue\n"
        "    print('step', step, flush=True)\n"
        "    dist.all_reduce(t)\n"
        "dist.barrier()\n"
    )
    (tmp_path / "warm.py").write_text("print('warm')\n")
    with machine_loaded(2):
        kernel_run(kc, f"%vgpu_run --no-plot {tmp_path / 'warm.py'}")
        spares_ready(kc)
        reply = kernel_run(kc, f"%vgpu_run --no-plot --timeout 10 {script}", timeout=400)
    # Both reached the hang: rank 0's last all_reduce against rank 1's barrier.
    shown = kernel_stdout(reply).splitlines()
    assert "[rank 0] step 3" in shown and "[rank 1] step 3" in shown, shown
    [error] = kernel_errors(reply)
    assert "did not finish within --timeout 10 s" in error and "the cluster is still usable" in error, error
    outcomes = "sys.last_value.result.outcomes.items()"
    reply = kernel_run(kc, f"import json, sys\nprint(json.dumps({{r: o.killed for r, o in {outcomes}}}))")
    killed = json.loads(kernel_stdout(reply))
    # Killed as stuck, not at the cap; one killed may take its peer down with it, which then ends of itself.
    stuck = "made no progress for 10 s after SIGINT"
    assert set(killed.values()) - {""} == {stuck}, killed
    assert "killed rank" in error and f"({stuck})" in error, error
    reply = kernel_run(kc, f"%vgpu_run --no-plot {tmp_path / 'warm.py'}")
    assert not kernel_errors(reply), kernel_errors(reply)


@pytest.mark.load
def test_every_rank_exiting_at_once_is_named_with_its_own_status_under_load(kernel, tmp_path):
    """Issue 43, row 10: with every rank raising ``SystemExit`` at once, 3 runs in 8 (under load) said ``rank 1
    exited with status 1; interrupted rank 0`` though rank 0 had printed its message and exited 1 itself: the
    fault policy's interrupt came while its exit was on its way (once Python restored SIGINT's default action to
    finalize, it ended the process by SIGINT, silently), and the engine reported any interrupted process as
    interrupted. A rank that printed its message is named with its own status."""
    _, kc = kernel
    script = tmp_path / "sysexit.py"
    script.write_text("raise SystemExit('bad config')\n")
    with machine_loaded(2):
        for run in range(8):
            reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
            printed = {line.split("]")[0] for line in kernel_stdout(reply).splitlines() if line.endswith("bad config")}
            [error] = kernel_errors(reply)
            if printed == {"[rank 0", "[rank 1"}:
                assert error == "RankRunError: ranks 0, 1 exited with status 1; the cluster is still usable", run


def test_a_rank_whose_exit_is_on_its_way_as_the_others_fail_is_named_with_its_own_status(kernel, tmp_path):
    """Issue 43, row 10, without the race: rank 0's exit takes long (an ``atexit`` handler), so the fault policy's
    interrupt reaches it after it raised, as a loaded machine's slow exit did."""
    _, kc = kernel
    script = tmp_path / "slow_exit.py"
    script.write_text(
        "import atexit, os, time\n"
        "if os.environ['RANK'] == '0':\n"
        "    atexit.register(time.sleep, 5)\n"
        "raise SystemExit('bad config')\n"
    )
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
    assert kernel_errors(reply) == ["RankRunError: ranks 0, 1 exited with status 1; the cluster is still usable"]


def test_a_signal_after_the_script_ended_is_said_to_have_come_as_it_exited(kernel, tmp_path):
    """torch's exit-time abort (pytorch/pytorch#190489) ends a rank by SIGABRT once its work is done: the error says
    so, where one during the script says only the signal (here both come from the script's own objects)."""
    _, kc = kernel
    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        os.kill(os.getpid(), signal.SIGABRT)\n"
        "if os.environ['RANK'] == '1':\n"
        "    late = Late()  # freed as the interpreter finalizes\n"
        "    if sys.argv[1:] == ['now']:\n"
        "        del late\n"
        "else:\n"
        "    time.sleep(60)  # interrupted by the fault policy\n"
    )
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script}")
    assert kernel_errors(reply) == [
        "RankRunError: rank 1 was killed by SIGABRT as it exited, after its script ended; interrupted rank 0; "
        "the cluster is still usable"
    ]
    reply = kernel_run(kc, f"%vgpu_run --no-plot {script} now")
    said = "RankRunError: rank 1 was killed by SIGABRT; interrupted rank 0; the cluster is still usable"
    assert kernel_errors(reply) == [said]


def test_a_rank_that_dies_mid_run_keeps_the_processes_log(kernel, tmp_path):
    """Issue 37, row 7: what the engines log goes to a log file of the cluster's, kept only when something failed;
    the log of a rank killed by a signal during ``%vgpu_run`` was removed with it (ipyparallel removes the log of
    a process that ended, and the restart the rest)."""
    _, kc = kernel
    script = tmp_path / "die.py"
    # Rank 1 kills its engine, whose PID it is given.
    script.write_text(
        "import os, signal, sys, time\nif os.environ['RANK'] == '1':\n    os.kill(int(sys.argv[1]), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    reply = kernel_run(kc, f"import vgpu_magic\n%vgpu_run --no-plot {script} {{vgpu_magic.cluster().pids[1]}}")
    [error] = [m["content"] for m in reply if m["msg_type"] == "error"]
    said = re.fullmatch(r"rank 1 was killed by SIGKILL \(pid \d+\); the processes' log: (.+?); .*", error["evalue"])
    assert said and "the cluster must be restarted" in error["evalue"], error["evalue"]
    path = said.group(1)
    reply = kernel_run(kc, "%vgpu_cluster restart")
    assert not kernel_errors(reply), kernel_errors(reply)
    kept = Path(path).read_text()
    os.remove(path)
    # Every engine's log, the dead one's too, and the controller's.
    assert kept.count("==> ipengine-") == 2 and "==> ipcontroller-" in kept, kept[:2000]
