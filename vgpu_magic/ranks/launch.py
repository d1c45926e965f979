"""A script run is a launch: ``%vgpu_run FILE ARGS`` starts new rank processes every time, as ``torchrun`` does
(docs/ranks.md, *Cells and scripts*). Each host's engine is the agent: :func:`run_rank` starts the script as its child,
which dies with it, and follows it; :func:`.launched.child` is a spare, waiting with the framework imported."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from . import launched
from .launched import ENDED
from .shown import dumped_traceback, how_it_ended

__all__ = ["INTERRUPT_LIMIT", "ProcessExited", "kernel_environ", "launch_request", "run_rank", "warm"]

#: Seconds a launched process has at most after SIGINT (its ``except KeyboardInterrupt``) while it makes progress.
INTERRUPT_LIMIT = 120.0
#: Seconds without progress (output, I/O, CPU) after which an interrupted process is killed: enough for a handler to
#: wait for another's save (``dist.barrier()``), short of torchrun's fixed 30 s.
STUCK = 10.0
#: A core's share that is progress after SIGINT: one blocked in a collective uses ~0.002, a working handler more.
BUSY = 0.05
#: Seconds to wait for the rest of the output once the process exited (a grandchild may hold its pipes).
DRAIN = 1.0
#: What a spare runs (``python -c``: nothing of the user's folder on ``sys.path``, ``sys.flags`` as plain ``python``).
_CHILD = "from vgpu_magic.ranks.launched import child; child()"


class ProcessExited(RuntimeError):
    """The rank's process ended with a non-zero status: how."""


class ProcessKilled(RuntimeError):
    """The rank's process did not stop after SIGINT and was killed: why (the kernel reports the rank killed)."""


@dataclass(frozen=True)
class KernelEnviron:
    """What a launch's environment starts from: the kernel's host and its environment at the run, and the prefixes
    of the variables that the engines' own launch gave them (their launcher's ``task_variables``: ``SLURM_``)."""

    host: str
    environ: dict[str, str]
    task_variables: tuple[str, ...] = ()


def kernel_environ(task_variables: tuple[str, ...] = ()) -> KernelEnviron:
    """In the kernel: its host and its environment as it is now, which a launch on that host starts from."""
    return KernelEnviron(socket.gethostname(), dict(os.environ), tuple(task_variables))


def launch_request(
    plan: Any,
    path: str,
    args: list[str],
    cwd: str,
    preload: list[str],
    spare: bool = True,
    task_variables: tuple[str, ...] = (),
    module: bool = False,
    faults: tuple = (),
    doctor: str | None = None,
) -> dict:
    """What :func:`run_rank` needs to launch one rank with its ``RankPlan``, as plain data; ``preload``: the modules a
    spare imports; ``spare``: keep one for the next launch; ``task_variables``: :class:`KernelEnviron`'s; ``module``:
    ``path`` names a module, run as ``python -m``; ``faults``: the run's :class:`~.spec.Fault` s (its own injected);
    ``doctor``: where the rank answers the hang doctor (:mod:`.rank_state`), or ``None``."""
    return {
        # On the host's clock: all ranks at once (one preempted alone would fail in a peer's collective first).
        "faults": [
            (time.time() + f.after, f.after, int(f.signum), f.kill_after, f.said)
            for f in faults
            if f.rank in (None, plan.rank)
        ],
        "spare": spare,
        "environ": kernel_environ(task_variables),
        "module": module,
        "plan_env": dict(plan.env),
        "doctor": doctor,
        "setup": plan.setup,
        "setup_args": list(plan.args),
        "devices": None if plan.devices is None else asdict(plan.devices),
        "argv": [path, *args],
        "cwd": cwd,
        "preload": list(preload),
    }


# -- on the engine: the per-host agent ----------------------------------------------

#: :func:`kernel_environ`'s, or ``None`` (the engine's own).
Environ = KernelEnviron | None


@dataclass
class _Process:
    """A started child: a spare waiting for its launch, or the launched process."""

    popen: subprocess.Popen
    control: socket.socket
    #: Its environment outside the rank's plan (whose ports and ids change every run, read when the script joins).
    base: dict[str, str]
    #: What else it was made with: its imports and the installed packages (:func:`_made`).
    made: tuple


def _made(preload: list[str]) -> tuple:
    """A child's imports and the packages' folders' mtimes: an install since (``pip install -e``) is not on its path."""
    import site

    folders = sorted({*site.getsitepackages(), site.getusersitepackages()})
    return (tuple(preload), tuple(os.stat(f).st_mtime_ns for f in folders if os.path.isdir(f)))


#: ``os.environ[...] =``, ``environ.setdefault(`` or ``.update(``, ``putenv(``.
_SETS_ENVIRONMENT = re.compile(rb"environ\s*\[[^]]*\]\s*=[^=]|environ\s*\.\s*(setdefault|update)\s*\(|putenv\s*\(")


def _sets_environment(path: str) -> bool:
    """Does the script set environment variables? Frameworks read theirs at import: it imports its own, as in python."""
    with contextlib.suppress(OSError), open(path, "rb") as source:
        return bool(_SETS_ENVIRONMENT.search(source.read()))
    return False  # the script's own run says what is wrong with it


_spare: _Process | None = None


def _spare_for(plan_env: dict[str, str], preload: list[str], environ: Environ) -> _Process:
    """The waiting spare, if it lives and was started with this environment; else a new child."""
    global _spare
    proc, _spare = _spare, None
    fits = proc is not None and (proc.base, proc.made) == (_base(plan_env, environ), _made(preload))
    if fits and proc.popen.poll() is None:
        return proc
    if proc is not None:
        proc.control.close()
        proc.popen.kill()
        proc.popen.communicate()
    return _start(plan_env, preload, environ)


def _base(plan_env: dict[str, str], environ: Environ) -> dict[str, str]:
    """A launch's environment outside the plan: on the kernel's host the kernel's ``environ`` (a launcher run from the
    notebook inherits it) with what the engine's launch gave it (``srun``'s ``SLURM_*``); on another host the engine's
    own. With :mod:`.lifetime`'s variables, without ipyparallel's (its key)."""
    from . import lifetime

    ours = {k: os.environ[k] for k in (lifetime.OWNER_ENV, lifetime.CLUSTER_ENV) if k in os.environ}
    env = dict(os.environ)
    if environ is not None and environ.host == socket.gethostname():
        theirs = environ.task_variables
        env = {k: v for k, v in environ.environ.items() if not k.startswith(theirs)}
        env.update({k: v for k, v in os.environ.items() if k.startswith(theirs)})
    env.update(ours)
    return {k: v for k, v in env.items() if not k.startswith("IPP_") and k not in plan_env}


def _start(plan_env: dict[str, str], preload: list[str], environ: Environ) -> _Process:
    """Start a child that imports ``preload`` and waits for its launch on a socket."""
    ours, theirs = socket.socketpair()
    base, made = _base(plan_env, environ), _made(preload)
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid()), str(theirs.fileno()), *preload],
            env={**base, **plan_env},
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
        )
    finally:
        theirs.close()
    return _Process(popen, ours, base, made)


def warm(plan_env: dict[str, str], preload: list[str], environ: Environ = None) -> None:
    """Run on an engine: make sure a spare waits, started with ``plan_env`` over ``environ``, importing ``preload``."""
    global _spare
    _spare = _spare_for(plan_env, preload, environ)


def run_rank(request: dict[str, Any]) -> int:
    """On an engine: launch :func:`launch_request`'s script as its child, stream its output, wait: its PID, or
    :class:`ProcessExited`."""
    global _spare
    plan_env, path, cwd = request["plan_env"], request["argv"][0], request["cwd"]
    # A module is found by the launched process (python's "No module named ..." if not); a file it could run is here.
    script = os.path.join(cwd, *path.split(".")) + ".py" if request["module"] else os.path.join(cwd, path)
    for what, where, ok in (("folder", cwd, os.path.isdir), ("script", script, os.path.isfile)):
        if not ok(where) and not (request["module"] and what == "script"):
            raise ProcessExited(f"could not start: the {what} {where} does not exist on {socket.gethostname()}")
    preload = [] if _sets_environment(script) else request["preload"]
    proc = _spare_for(plan_env, preload, request["environ"])
    # The engine takes SIGINT only inside a cell's code (run.interrupt_only_the_cell); a launch is
    # interrupted as a cell is, so the fault policy can stop it.
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch = {
            k: request[k] for k in ("setup", "setup_args", "devices", "argv", "cwd", "preload", "module", "doctor")
        }
        # PWD as a shell that ran the launcher there sets it.
        proc.control.sendall(json.dumps({**launch, "env": {**proc.base, "PWD": cwd, **plan_env}}).encode())
        proc.control.shutdown(socket.SHUT_WR)
        injected, timers = _inject(proc.popen, request["faults"])
        try:
            code = _follow(proc.popen)
        finally:
            for timer in timers:
                timer.cancel()
        dump = ""  # the script's end (ENDED), then faulthandler's dump at a fatal signal (:func:`.launched.child`)
        with contextlib.suppress(OSError):
            dump = proc.control.recv(1 << 20, socket.MSG_DONTWAIT).decode(errors="replace")
            traceback = dumped_traceback(dump.replace(ENDED, ""), (launched.__file__, runpy.__file__, "<string>"))
            sys.stderr.write("".join(f"{line}\n" for line in traceback))
    finally:
        signal.signal(signal.SIGINT, outside)
        proc.control.close()
        _spare = _start(plan_env, preload, request["environ"]) if request["spare"] else None
    if injected:
        # Ended by the fault whatever its status (a preempted script exiting 0 did not finish), quoted as typed.
        raise ProcessExited(f"{how_it_ended(code)} (injected: {'; '.join(injected)})")
    if code == 0:
        return proc.popen.pid
    # No PID: ranks that ended alike are reported together. What it wrote (its traceback) was shown as it wrote it.
    # A signal after the script ended (torch's exit-time abort, pytorch/pytorch#190489) is said so: its work was done.
    raise ProcessExited(
        how_it_ended(code) + (" as it exited, after its script ended" if code < 0 and ENDED in dump else "")
    )


def _inject(popen: subprocess.Popen, faults: list) -> tuple[list[str], list[threading.Timer]]:
    """Timers sending each fault's signal (then a preemption's SIGKILL) to ``popen``: what was sent, and the timers."""
    injected: list[str] = []

    def send(signum: int, said: str) -> None:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signum)
            injected.append(said)

    timers = []
    for at, after, signum, kill_after, said in faults:
        wait = max(0.0, at - time.time())
        timers.append(threading.Timer(wait, send, (signum, f"{said}: {signal.Signals(signum).name} at {after:g} s")))
        if kill_after is not None:
            late = f"{said}: SIGKILL {kill_after:g} s after SIGTERM"
            timers.append(threading.Timer(wait + kill_after, send, (signal.SIGKILL, late)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    return injected, timers


def _follow(popen: subprocess.Popen) -> int:
    """Copy the child's output until it exits: its status; interrupted, :func:`_stop` it (KeyboardInterrupt, killed)."""
    selector = selectors.DefaultSelector()
    for pipe, out in ((popen.stdout, sys.stdout), (popen.stderr, sys.stderr)):
        selector.register(pipe, selectors.EVENT_READ, (out, codecs.getincrementaldecoder("utf-8")("replace")))

    def copy(timeout: float) -> None:
        if not selector.get_map():  # both pipes closed: wait for the exit instead
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout)
            return
        for key, _ in selector.select(timeout):
            out, decoder = key.data
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
            text = decoder.decode(data, final=not data)
            if text:
                # Not flushed: the engine sends what gathered at its own pace, not one message per read.
                out.write(text)

    interrupted, killed = False, ""
    try:
        while popen.poll() is None:
            copy(0.2)
    except KeyboardInterrupt:
        # A process that ended on its own as the interrupt came is reported as it ended.
        interrupted = popen.poll() is None
        if interrupted:
            killed = _stop(popen, copy)
    finally:
        # What is still in the pipes (not waiting on a grandchild holding them); an interrupt now changes nothing.
        with contextlib.suppress(KeyboardInterrupt):
            deadline = time.monotonic() + DRAIN
            while selector.get_map() and time.monotonic() < deadline:
                copy(max(0.0, deadline - time.monotonic()))
        selector.close()
        for pipe in (popen.stdout, popen.stderr):
            pipe.close()
    code = popen.wait()
    if killed:
        raise ProcessKilled(killed)
    # How SIGINT ends a Python process (its handler done, or none); any other status is its own end, reported so.
    if interrupted and code in (0, -signal.SIGINT):
        raise KeyboardInterrupt
    return code


def _stop(popen: subprocess.Popen, copy: Callable[[float], None]) -> str:
    """SIGINT the process and follow it (``copy``: its output) while it progresses: ``""``, or why it was killed."""
    popen.send_signal(signal.SIGINT)
    start = time.monotonic()
    for _ in progressing(popen.pid):
        if popen.poll() is not None:
            return ""
        copy(0.2)  # what its handler prints goes on streaming
    if popen.poll() is not None:
        return ""
    popen.kill()
    if time.monotonic() - start < INTERRUPT_LIMIT:
        return f"made no progress for {STUCK:g} s after SIGINT"
    return f"did not stop within {INTERRUPT_LIMIT:g} s of SIGINT"


def progressing(pid: int) -> Iterator[None]:
    """Yields while ``pid`` progressed (I/O, or :data:`BUSY` of a core) in the last :data:`STUCK` s, at most
    :data:`INTERRUPT_LIMIT` s; the caller waits a moment each time."""
    import psutil

    start = moved = time.monotonic()
    io = used = None
    while (now := time.monotonic()) - start < INTERRUPT_LIMIT and now - moved < STUCK:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            done = _io(proc)
            cpu = sum(proc.cpu_times()[:4])  # its own and its reaped children's, user and system
            if used is None or done != io or cpu - used >= BUSY * STUCK:
                io, used, moved = done, cpu, now
        yield


def _io(proc: Any) -> tuple:
    """What ``proc`` read and wrote that tells progress: its main thread's reads and writes (a save, a print: Linux's
    ``/proc``) and the whole process's storage I/O, not its other threads' socket polls (a store's, a runtime's), which
    go on while the main thread is blocked (rank 0 waiting for a rank that died before it joined polled for 120 s).
    psutil has no io_counters on macOS: there CPU time alone tells progress."""
    storage = tuple(proc.io_counters()[2:4]) if hasattr(proc, "io_counters") else ()  # read_bytes, write_bytes
    with contextlib.suppress(OSError), open(f"/proc/{proc.pid}/task/{proc.pid}/io") as main:
        return (main.read(), *storage)
    return storage
