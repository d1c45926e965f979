"""A script run is a launch: ``%vgpu_run FILE ARGS`` starts new rank processes every time, as ``torchrun`` /
``srun`` / ``mpirun`` do.

The engine on each host is the launcher's agent (torchrun's design): :func:`run_rank` starts the script as the
engine's child, in the kernel's folder, with the rank's plan and ``sys.argv = [FILE, *ARGS]``; streams its
output; and reports a non-zero end as a launcher does (``exited with status 3``, ``was killed by SIGSEGV``) with
the last lines of its stderr. Interrupted, it stops the child (SIGTERM, SIGKILL after :data:`TERM_GRACE` s); the
child dies with its engine. Each engine keeps a *spare*: a child started in the background with the framework
imported and nothing of the user's, waiting for its launch (:func:`child`); one started with another environment
than the launch's (outside the plan's per-run ports and ids) is not used.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ProcessExited", "TERM_GRACE", "child", "launch_request", "run_rank", "warm"]

#: Seconds a launched process has after SIGTERM before SIGKILL (below the fault policy's grace for its engine).
TERM_GRACE = 1.5
#: Seconds to wait for the rest of the output once the process exited (a grandchild may hold its pipes).
DRAIN = 1.0
#: Lines of stderr a failure report quotes.
TAIL_LINES = 20
#: What a spare runs (``python -c``: nothing of the user's folder on ``sys.path``, ``sys.flags`` as plain ``python``).
_CHILD = "from vgpu_magic.ranks.launch import child; child()"


class ProcessExited(RuntimeError):
    """The rank's process ended with a non-zero status: how (first line), then the last of its stderr."""


def launch_request(
    plan: Any, path: str, args: list[str], cwd: str, preload: list[str], spare: bool = True
) -> dict[str, Any]:
    """What :func:`run_rank` needs to launch one rank with its :class:`~vgpu_magic.frameworks.base.RankPlan`
    (plain data, sent to its engine); ``preload``: the modules a spare imports; ``spare``: keep one for the
    next launch. The script makes its own call to join the others, as under its launcher."""
    return {
        "spare": spare,
        "plan_env": dict(plan.env),
        "setup": plan.setup,
        "setup_args": list(plan.args),
        "argv": [path, *args],
        "cwd": cwd,
        "preload": list(preload),
    }


# -- on the engine: the per-host agent ----------------------------------------------


@dataclass
class _Process:
    """A started child: a spare waiting for its launch, or the launched process."""

    popen: subprocess.Popen
    control: socket.socket
    #: Its environment outside the rank's plan (whose ports and ids change every run, read when the script joins).
    base: dict[str, str]


_spare: _Process | None = None


def _spare_for(plan_env: dict[str, str], preload: list[str]) -> _Process:
    """The waiting spare, if it lives and was started with this environment; else a new child."""
    global _spare
    proc, _spare = _spare, None
    if proc is not None and proc.popen.poll() is None and proc.base == _base(plan_env):
        return proc
    if proc is not None:
        proc.control.close()
        proc.popen.kill()
        proc.popen.communicate()
    return _start(plan_env, preload)


def _base(plan_env: dict[str, str]) -> dict[str, str]:
    """The engine's environment outside the plan, without ipyparallel's own variables (its key among them)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("IPP_") and k not in plan_env}


def _start(plan_env: dict[str, str], preload: list[str]) -> _Process:
    """Start a child that imports ``preload`` and waits for its launch on a socket."""
    ours, theirs = socket.socketpair()
    base = _base(plan_env)
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
    return _Process(popen, ours, base)


def warm(plan_env: dict[str, str], preload: list[str], wait: float = 0.0) -> None:
    """Run on an engine: make sure a spare waits, started with the rank's plan ``plan_env``;
    wait up to ``wait`` seconds for it to have imported ``preload``."""
    global _spare
    _spare = _spare_for(plan_env, preload)
    _spare.control.settimeout(wait)
    with contextlib.suppress(OSError):
        # The spare says b"R" once its imports are done; peeked at, never read.
        _spare.control.recv(1, socket.MSG_PEEK)
    _spare.control.settimeout(None)


def run_rank(request: dict[str, Any]) -> int:
    """Run on an engine: launch the script ``request`` describes (:func:`launch_request`) as this engine's
    child, stream its output, and wait for its end: its PID, or :class:`ProcessExited`."""
    global _spare
    plan_env, path, cwd = request["plan_env"], request["argv"][0], request["cwd"]
    for what, where, ok in (("folder", cwd, os.path.isdir), ("script", path, os.path.isfile)):
        if not ok(where):
            raise ProcessExited(f"could not start: the {what} {where} does not exist on {socket.gethostname()}")
    proc = _spare_for(plan_env, request["preload"])
    # The engine takes SIGINT only inside a cell's code (run.interrupt_only_the_cell); a launch is
    # interrupted as a cell is, so the fault policy can stop it.
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch = {k: request[k] for k in ("setup", "setup_args", "argv", "cwd")}
        proc.control.sendall(json.dumps({**launch, "env": {**proc.base, **plan_env}}).encode())
        proc.control.shutdown(socket.SHUT_WR)
        code, tail = _follow(proc.popen)
    finally:
        signal.signal(signal.SIGINT, outside)
        proc.control.close()
        _spare = _start(plan_env, request["preload"]) if request["spare"] else None
    if code == 0:
        return proc.popen.pid
    # No PID in the first line: ranks that ended alike are reported together.
    raise ProcessExited("\n".join([how_it_ended(code), *tail]))


def how_it_ended(code: int) -> str:
    """An exit status as a launcher says it: ``exited with status 3``, ``was killed by SIGSEGV``."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


def _follow(popen: subprocess.Popen) -> tuple[int, list[str]]:
    """Copy the child's stdout and stderr to this process' own until it exits: its exit status and the last
    lines of its stderr. Interrupted, stop the child first."""
    from .run import as_terminal_shows

    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES + 1)
    selector = selectors.DefaultSelector()
    for pipe, out in ((popen.stdout, sys.stdout), (popen.stderr, sys.stderr)):
        selector.register(pipe, selectors.EVENT_READ, (out, codecs.getincrementaldecoder("utf-8")("replace")))

    def copy(timeout: float | None) -> None:
        for key, _ in selector.select(timeout):
            out, decoder = key.data
            data = os.read(key.fd, 65536)
            if not data:
                selector.unregister(key.fileobj)
            text = decoder.decode(data, final=not data)
            if text:
                # Not flushed: the engine sends what gathered at its own pace, not one message per read.
                out.write(text)
            if text and out is sys.stderr:
                lines = ((tail.pop() if tail else "") + text).split("\n")
                tail.extend(lines)

    try:
        while popen.poll() is None:
            if selector.get_map():
                copy(0.2)
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(0.2)
    except KeyboardInterrupt:
        if popen.poll() is None:
            popen.terminate()
            try:
                popen.wait(TERM_GRACE)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        # A process that ended on its own as the interrupt came is reported as it ended.
        if popen.returncode in (-signal.SIGTERM, -signal.SIGKILL):
            raise
    finally:
        # What is still in the pipes, then stop: a grandchild that kept them open is not waited for.
        deadline = time.monotonic() + DRAIN
        while selector.get_map() and time.monotonic() < deadline:
            copy(max(0.0, deadline - time.monotonic()))
        selector.close()
        for pipe in (popen.stdout, popen.stderr):
            pipe.close()
    lines = [as_terminal_shows(line) for line in tail if line.strip()]
    return popen.wait(), lines[-TAIL_LINES:]


# -- in the launched process --------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its engine) ends, however that ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    else:
        import psutil

        from . import lifetime

        lifetime.watch_owner(f"{socket.gethostname()}:{parent}:{psutil.Process(parent).create_time():.3f}")
    if os.getppid() != parent:
        os._exit(1)


def child() -> None:
    """A spare (``python -c ... PARENT FD MODULE...``): import the modules, say so on the socket ``FD``, wait
    for the launch there, then become the script's process as ``python FILE ARGS`` would be."""
    import builtins
    import importlib
    import importlib.machinery
    import io
    import types

    parent, fd, preload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    _die_with_parent(parent)
    control = socket.socket(fileno=fd)
    for module in preload:
        # The script's own import of it will say what is wrong, as it would under its launcher.
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    control.sendall(b"R")
    received = b""
    while chunk := control.recv(65536):
        received += chunk
    control.close()
    if not received:
        os._exit(0)
    launch = json.loads(received)
    os.chdir(launch["cwd"])
    os.environ.clear()
    os.environ.update(launch["env"])
    path = launch["argv"][0]
    sys.argv = list(launch["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    if launch["setup"]:
        from .hosts import prepare_rank

        prepare_rank({}, launch["setup"], tuple(launch["setup_args"]))
    # As on a terminal: each line reaches the notebook when printed.
    sys.stdout.reconfigure(line_buffering=True)
    main = types.ModuleType("__main__")
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __loader__=loader)
    sys.modules["__main__"] = main
    try:
        with io.open_code(path) as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except Exception as exc:  # noqa: BLE001 - whatever the script raises ends it, as an uncaught exception does
        # Python's own report of an uncaught exception, from the script's first frame on.
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        # torch.distributed's hook (which labels each line with the rank) reads the exception's own traceback.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)
