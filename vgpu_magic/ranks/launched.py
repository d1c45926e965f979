"""The launched process (:mod:`.launch`): a spare that waits with the framework imported, then becomes the script's
process as ``python FILE ARGS`` (or ``python -m MODULE ARGS``) would be, and dies with its engine."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import socket
import struct
import sys

__all__ = ["ENDED", "child", "run_main"]

#: What a launched process sends on its control socket once its script (and the script's own ``atexit`` handlers)
#: ended, as the interpreter finalizes: a fatal signal after it came as it exited (torch's exit-time abort).
ENDED = "\nvgpu_magic: the script ended\n"


def _die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its engine) ends, however that ends."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:
        import psutil

        from . import lifetime

        lifetime.watch_owner(f"{socket.gethostname()}:{parent}:{psutil.Process(parent).create_time():.3f}")
    if os.getppid() != parent:
        os._exit(1)


def child() -> None:
    """A spare (``python -c ... PARENT FD MODULE...``): import the modules, then, for each launch sent on the socket
    ``FD`` (with its output's and control's descriptors), fork the script's process, which becomes it as ``python
    FILE ARGS`` (or ``python -m MODULE ARGS``) would be, and answer its PID, then how it exited. Forked, a launch in a
    loop waits for no import, as PyTorch's DataLoader workers fork theirs."""
    import importlib

    parent, fd, preload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    _die_with_parent(parent)
    commands = socket.socket(fileno=fd)
    for module in preload:
        # The script's own import of it will say what is wrong, as it would under its launcher.
        with contextlib.suppress(Exception):
            importlib.import_module(module)
    # What the imports wrote goes to the engine now, which shows it at the start of every launch, as each import's.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Only the engine's launch ends the spare (its engine's interrupts go to the launched process, by PID).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        head, fds, _, _ = socket.recv_fds(commands, SIZE.size, 3)
        if not head:
            os._exit(0)
        received = commands.recv(SIZE.unpack(head)[0], socket.MSG_WAITALL)
        pid = os.fork()
        if pid == 0:
            commands.close()
            _launched(json.loads(received), fds, parent=os.getppid())
        for each in fds:
            os.close(each)
        commands.sendall(SIZE.pack(pid))
        commands.sendall(SIZE.pack(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))


#: How the engine and its spare frame a size, a PID or an exit status on the spare's socket (each read whole:
#: ``MSG_WAITALL``; fewer bytes: it closed).
SIZE = struct.Struct("!q")


def _launched(launch: dict, fds: list[int], parent: int) -> None:
    """In the forked process: output to ``fds``' pipes, the control socket the third, then the script; never
    returns."""
    import faulthandler

    for fd, std in zip(fds, (1, 2)):
        os.dup2(fd, std)
        os.close(fd)
    control = socket.socket(fileno=fds[2])
    _die_with_parent(parent)
    # The dispositions torchrun's workers get, whatever the kernel was started with (a background shell ignores SIGINT
    # and SIGQUIT, nohup SIGHUP): its agent handles these four, so each is back at its default after exec; and
    # Python's KeyboardInterrupt handler, as in a process started with SIGINT at its default.
    for each in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(each, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "numpy" in sys.modules:
        # numpy seeds its global generator at import from the OS: a fork's must differ from every other launch's.
        sys.modules["numpy"].random.seed()
    # A fatal signal's Python stack (faulthandler's) goes back to the engine on the socket, which shows it as the
    # rank's traceback; unblocked, a dump larger than its buffer is cut rather than waited on.
    control.setblocking(False)
    faulthandler.enable(control)
    os.chdir(launch["cwd"])
    os.environ.clear()
    os.environ.update(launch["env"])
    path = launch["argv"][0]
    sys.argv = list(launch["argv"])
    # As python puts it first on the import path: the current folder under -m, else the script's (links resolved).
    sys.path[0] = os.getcwd() if launch["module"] else os.path.dirname(os.path.realpath(path))
    if launch["setup"] or launch["devices"]:
        from ..plans import SplitRequest
        from .hosts import prepare_rank

        devices = SplitRequest(**launch["devices"]) if launch["devices"] else None
        after = launch["framework"]
        prepare_rank({}, launch["setup"], tuple(launch["setup_args"]), devices=devices, after_import=after)
    # As on a terminal: each line reaches the notebook when printed, in one write, even under PYTHONUNBUFFERED (whose
    # write-through lets C++ output like "[Gloo] Rank 0 is connected" land mid-line); ``flush=True`` sends a part line.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=False)
    if launch["doctor"]:
        from .rank_state import serve

        serve(launch["doctor"])
    # First registered, so run last: after the script's own handlers, as the interpreter finalizes.
    atexit.register(_ended, control)
    try:
        run_main(path, launch["module"])
    finally:
        # Ended: a late interrupt must not end it by SIGINT as Python finalizes (a KeyboardInterrupt still does).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Out of the spare's loop: the interpreter ends as after ``python FILE``, its atexit handlers run.
    sys.exit(0)


def run_main(path: str, module: bool = False) -> None:
    """Run ``path`` as ``python PATH`` (``python -m PATH``) runs it, in this process (``sys.argv``, ``sys.path`` and
    the environment set); an exception it raises ends the process as it would end ``python``'s, status 1."""
    # A KeyboardInterrupt is left to the interpreter, which ends the process by SIGINT after its atexit handlers, as
    # after ``python FILE``: its hook shows it from the script's first frame on too (the script may set its own).
    hook = sys.excepthook
    sys.excepthook = lambda kind, exc, tb: hook(kind, exc.with_traceback(_from_the_script(tb)), exc.__traceback__)
    try:
        if module:
            # As python -m runs it: sys.argv[0] becomes the module's file, its module is __main__.
            runpy.run_module(path, {"__annotations__": {}}, "__main__", alter_sys=True)
        else:
            _run_script(path)
    except Exception as exc:  # noqa: BLE001 - whatever the script raises ends it, as an uncaught exception does
        # Python's own report of an uncaught exception, from the script's first frame on.
        tb = _from_the_script(exc.__traceback__)
        if tb is None and module:
            # Not found, or its package failed before its code ran: python -m's one line.
            print(f"{sys.executable}: {exc}", file=sys.stderr)
            sys.exit(1)
        # torch.distributed's hook (which labels each line with the rank) reads the exception's own traceback.
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(1)


def _from_the_script(tb):
    """``tb`` from the script's first frame on: without the launch's (``python -c``'s, this module's, runpy's)."""
    launching = ("<string>", __file__, runpy.run_module.__code__.co_filename, "<frozen importlib")
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(launching):
        tb = tb.tb_next
    return tb


def _ended(control: socket.socket) -> None:
    """Tell the engine the script ended (:data:`ENDED`), where it still listens."""
    with contextlib.suppress(OSError):
        control.send(ENDED.encode())


def _run_script(path: str) -> None:
    """Run the script at ``path`` as ``python PATH`` does: in a new ``__main__`` module, ``__file__`` absolute (as
    Python 3.9 made it), ``__package__`` and ``__spec__`` None; the code's file name is ``__file__``."""
    import builtins
    import importlib.machinery
    import types

    file = os.path.abspath(path)
    main = types.ModuleType("__main__")
    loader = importlib.machinery.SourceFileLoader("__main__", file)
    main.__dict__.update(__file__=file, __cached__=None, __loader__=loader, __builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    # As python compiles it: read by io.open_code, compiled with dont_inherit.
    exec(loader.source_to_code(loader.get_data(file), file), main.__dict__)
