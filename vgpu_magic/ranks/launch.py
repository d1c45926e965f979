"""A script run is a launch: ``%vgpu_run FILE ARGS`` starts new rank processes every time, as ``torchrun`` does
(docs/ranks.md, *Cells and scripts*). Each host's engine is the agent: :func:`run_rank` starts the script as its child,
which dies with it, and follows it; :func:`.launched.child` is a spare, waiting with the framework imported."""

from __future__ import annotations

import codecs
import contextlib
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
from dataclasses import asdict, dataclass, field
from typing import Any

from . import launched, spare
from .failures import dumped_traceback, how_it_ended
from .launched import ENDED
from .spare import KernelEnviron, kernel_environ

__all__ = ["INTERRUPT_LIMIT", "LaunchRequest", "ProcessExited", "run_rank"]

#: Seconds a launched process has at most after SIGINT (its ``except KeyboardInterrupt``) while it makes progress.
INTERRUPT_LIMIT = 120.0
#: Seconds without progress (output, I/O, CPU) after which an interrupted process is killed: enough for a handler to
#: wait for another's save (``dist.barrier()``), short of torchrun's fixed 30 s.
STUCK = 10.0
#: A core's share that is progress after SIGINT: one blocked in a collective uses ~0.002, a working handler more.
BUSY = 0.05
#: Seconds to wait for the rest of the output once the process exited (a grandchild may hold its pipes).
DRAIN = 1.0


class ProcessExited(RuntimeError):
    """The rank's process ended with a non-zero status: how."""


class ProcessKilled(RuntimeError):
    """The rank's process did not stop after SIGINT and was killed: why (the kernel reports the rank killed)."""


@dataclass(frozen=True)
class LaunchRequest:
    """One rank's launch, made in the kernel, as :func:`run_rank` takes it: the rank's ``RankPlan``, the script
    (``path ARGS`` in ``cwd``; ``module``: ``path`` names a module, as ``python -m``), the ``framework``'s module (its
    setup runs after its import), what a spare imports (``preload``) and whether one is kept (``spare``), the run's
    injected :class:`~.spec.Fault` s (the rank's own act), and where the rank answers the hang doctor
    (:mod:`.rank_state`), or ``None``."""

    plan: Any
    path: str
    args: list[str]
    cwd: str
    framework: str
    preload: list[str]
    spare: bool = True
    #: The prefixes of the variables that the engines' own launch gave them (:class:`KernelEnviron`'s).
    task_variables: tuple[str, ...] = ()
    module: bool = False
    faults: tuple = ()
    doctor: str | None = None
    #: What the launch's environment starts from: the kernel's, as it is when the request is made.
    environ: KernelEnviron | None = None
    #: ``time.time()`` at the run's start: the faults come after it on every host at once (one rank preempted alone
    #: would fail in a peer's collective first).
    start: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "environ", self.environ or kernel_environ(self.task_variables))
        object.__setattr__(self, "start", time.time())


# -- on the engine: the per-host agent ----------------------------------------------

#: A script that sets environment variables (``os.environ[...] =``, ``environ.setdefault(`` or ``.update(``,
#: ``putenv(``) imports the framework itself, which reads its variables at import, as in python.
_SETS_ENVIRONMENT = re.compile(rb"environ\s*\[[^]]*\]\s*=[^=]|environ\s*\.\s*(setdefault|update)\s*\(|putenv\s*\(")


def run_rank(request: LaunchRequest) -> int:
    """On an engine: launch the request's script (its spare forks it), stream its output, wait: its PID, or
    :class:`ProcessExited`."""
    plan, path, cwd = request.plan, request.path, request.cwd
    # A module is found by the launched process (python's "No module named ..." if not); a file it could run is here.
    script = os.path.join(cwd, *path.split(".")) + ".py" if request.module else os.path.join(cwd, path)
    for what, where, ok in (("folder", cwd, os.path.isdir), ("script", script, os.path.isfile)):
        if not ok(where) and not (request.module and what == "script"):
            raise ProcessExited(f"could not start: the {what} {where} does not exist on {socket.gethostname()}")
    preload = list(request.preload)
    with contextlib.suppress(OSError), open(script, "rb") as source:  # unreadable: its own run says why
        preload = [] if _SETS_ENVIRONMENT.search(source.read()) else preload
    proc = spare.take(plan.env, preload, request.environ)
    # Interrupted as a cell is (run.interrupt_only_the_cell, the engine's SIGINT), so the fault policy can stop it.
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    forked = None
    try:
        devices = None if plan.devices is None else asdict(plan.devices)
        # What the launched process reads (:func:`.launched.child`); PWD as a shell that ran the launcher there sets it.
        launch = {"setup": plan.setup, "setup_args": list(plan.args), "devices": devices, "doctor": request.doctor}
        launch.update(argv=[path, *request.args], cwd=cwd, framework=request.framework, module=request.module)
        forked = proc.fork({**launch, "env": {**proc.base, "PWD": cwd, **plan.env}})
        if forked is None:
            raise ProcessExited(f"could not start: its spare process {how_it_ended(proc.popen.wait())}")
        injected, timers = _inject(forked[0], request)
        try:
            code = _follow(forked[0])
        finally:
            for timer in timers:
                timer.cancel()
        dump = ""  # the script's end (ENDED), then faulthandler's dump at a fatal signal (:func:`.launched.child`)
        with contextlib.suppress(OSError):
            dump = forked[1].recv(1 << 20, socket.MSG_DONTWAIT).decode(errors="replace")
            traceback = dumped_traceback(dump.replace(ENDED, ""), (launched.__file__, runpy.__file__, "<string>"))
            sys.stderr.write("".join(f"{line}\n" for line in traceback))
    finally:
        signal.signal(signal.SIGINT, outside)
        if forked is not None:
            forked[1].close()
        spare.give_back(proc, forked is not None, request.spare, plan.env, preload, request.environ)
    if injected:
        # Ended by the fault whatever its status (a preempted script exiting 0 did not finish), quoted as typed.
        raise ProcessExited(f"{how_it_ended(code)} (injected: {'; '.join(injected)})")
    if code == 0:
        return forked[0].pid
    # No PID: ranks that ended alike are reported together. What it wrote (its traceback) was shown as it wrote it.
    # A signal after the script ended (torch's exit-time abort, pytorch/pytorch#190489) is said so: its work was done.
    raise ProcessExited(
        how_it_ended(code) + (" as it exited, after its script ended" if code < 0 and ENDED in dump else "")
    )


def _inject(popen: Any, request: LaunchRequest) -> tuple[list[str], list[threading.Timer]]:
    """Timers sending each of the request's faults for its rank (then a preemption's SIGKILL) to ``popen``: what was
    sent, and the timers."""
    injected: list[str] = []

    def send(signum: int, said: str) -> None:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signum)
            injected.append(said)

    timers = []
    for fault in request.faults:
        if fault.rank not in (None, request.plan.rank):
            continue
        wait, said = max(0.0, request.start + fault.after - time.time()), fault.said
        timers.append(threading.Timer(wait, send, (fault.signum, f"{said}: {fault.signum.name} at {fault.after:g} s")))
        if fault.kill_after is not None:
            late = f"{said}: SIGKILL {fault.kill_after:g} s after SIGTERM"
            timers.append(threading.Timer(wait + fault.kill_after, send, (signal.SIGKILL, late)))
    for timer in timers:
        timer.daemon = True
        timer.start()
    return injected, timers


def _follow(popen: Any) -> int:
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


def _stop(popen: Any, copy: Callable[[float], None]) -> str:
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
            # I/O that tells progress: the main thread's reads and writes (a save, a print: Linux's /proc) and the
            # process's storage I/O, not its other threads' socket polls (a store's, a runtime's), which go on while
            # the main thread is blocked. psutil has no io_counters on macOS: there CPU time alone tells progress.
            done = tuple(proc.io_counters()[2:4]) if hasattr(proc, "io_counters") else ()  # read_bytes, write_bytes
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/io") as main:
                done = (main.read(), *done)
            cpu = sum(proc.cpu_times()[:4])  # its own and its reaped children's, user and system
            if used is None or done != io or cpu - used >= BUSY * STUCK:
                io, used, moved = done, cpu, now
        yield
