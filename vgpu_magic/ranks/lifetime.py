"""Nothing a cluster starts outlives its kernel, which can die without ``atexit`` (SIGKILL, the OOM killer, XLA's
``abort()``): each process watches its owner (:data:`OWNER_ENV`, :func:`watch_owner`), then SIGKILLs itself and all
below it (a rank blocked in a collective never gets back to Python). The controller and engines
(:func:`watched_command`) are watched from a process forked beside them, which a rank holding the GIL cannot starve.
Every process carries its cluster's :data:`CLUSTER_ENV` token (:func:`processes_of`). For processes on other hosts a
watched local process runs the launcher's own stop (``--then 'scancel JOBID'``) when the kernel dies."""

from __future__ import annotations

import contextlib
import os
import runpy
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["OWNER_ENV", "CLUSTER_ENV", "WATCHER_NAME", "watch_owner", "run_when_this_process_dies", "processes_of"]

#: ``"host:pid:start-time"`` of the process whose death ends this one (the start time tells it from a later
#: process reusing the PID; the host keeps a process on another machine from taking a local PID for its owner).
OWNER_ENV = "VGPU_MAGIC_OWNER"
#: A token shared by every process of one cluster (:func:`processes_of`).
CLUSTER_ENV = "VGPU_MAGIC_CLUSTER"
#: Seconds between looks at the owner where ``pidfd_open`` is missing.
POLL = 0.5

_watching: dict[str, str] = {}


def owner_of_this_process() -> str:
    """The :data:`OWNER_ENV` value naming this process (the kernel) as owner."""
    import psutil

    return f"{socket.gethostname()}:{os.getpid()}:{psutil.Process().create_time():.3f}"


def process_alive(pid: int, created: float | None = None) -> bool:
    """Is ``pid`` running (a zombie, dead but not yet reaped, is not), started at ``created`` if given (not reused)?"""
    import psutil

    try:
        proc = psutil.Process(pid)
        return (created is None or abs(proc.create_time() - created) < 0.01) and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_exit(pid: int, created: float) -> None:
    """Return once the owner has exited (or never existed)."""
    fd = None
    with contextlib.suppress(AttributeError, OSError):
        fd = os.pidfd_open(pid)
    try:
        # Checked after opening the pidfd: a PID reused since is not our owner.
        while process_alive(pid, created):
            if fd is not None:
                select.select([fd], [], [])
            else:
                time.sleep(POLL)
    finally:
        if fd is not None:
            os.close(fd)


def _end_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` (this process, unless its watcher's) and everything below it, but the caller."""
    import psutil

    below = []
    with contextlib.suppress(psutil.Error):
        below = psutil.Process(pid).children(recursive=True)
    for proc in below:
        if proc.pid != os.getpid():
            with contextlib.suppress(psutil.Error):
                proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


#: The name a watcher beside a process goes by (``ps -o comm``, ``psutil.Process.name()``).
WATCHER_NAME = "vgpu-watch"


def _watch_from_beside(pid: int, created: float) -> None:
    """Fork a watcher of this process (named :data:`WATCHER_NAME`) that goes with it (``PR_SET_PDEATHSIG``)."""
    watched = os.getpid()
    if os.fork():
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: go with the watched process
        libc.prctl(15, WATCHER_NAME.encode())  # PR_SET_NAME
        # Nobody waits for this process's output: the watched one's pipes are not held open.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        if os.getppid() == watched:  # else it is gone already
            _wait_for_exit(pid, created)
            _end_process_tree(watched)
    finally:
        os._exit(0)


def watch_owner(owner: str | None = None, then: str | None = None, beside: bool = False) -> bool:
    """When ``owner`` exits, run ``then`` and SIGKILL this process and descendants; whether a watch runs."""
    owner = owner or os.environ.get(OWNER_ENV)
    if not owner:
        return False
    host, pid_text, created_text = owner.rsplit(":", 2)
    pid, created = int(pid_text), float(created_text)
    if host != socket.gethostname():
        return False

    def watch() -> None:
        _wait_for_exit(pid, created)
        if then:
            subprocess.run(shlex.split(then), check=False, timeout=60)
        _end_process_tree(os.getpid())

    if beside and sys.platform.startswith("linux"):
        _watch_from_beside(pid, created)
    else:
        threading.Thread(target=watch, name=f"vgpu_magic-owner-watch({pid})", daemon=True).start()
    # A forked child watches the owner itself (without ``then``); set after the watcher's fork, which must not watch.
    _watching["owner"] = owner
    return True


# Threads do not survive fork; a forked child watches for itself.
os.register_at_fork(after_in_child=lambda: _watching and watch_owner(_watching["owner"]))


def watched_command(module: str) -> list[str]:
    """``python -m MODULE`` run under the watch: ``[python, -m, vgpu_magic.ranks.lifetime, MODULE]``."""
    return [sys.executable, "-m", __name__, module]


def run_when_this_process_dies(command: str, token: str = "") -> subprocess.Popen:
    """Start a watcher running ``command`` when this process dies; ``token``: the cluster's stop ends it."""
    env = {**os.environ, OWNER_ENV: owner_of_this_process(), **({CLUSTER_ENV: token} if token else {})}
    return subprocess.Popen(
        [sys.executable, "-m", __name__, "--then", command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def processes_of(token: str, since: float = 0.0) -> list:
    """Every process of this user carrying ``CLUSTER_ENV=token`` (started at or after ``since``)."""
    import psutil

    me = psutil.Process().username()
    found = []
    for proc in psutil.process_iter(["username", "create_time"]):
        with contextlib.suppress(psutil.Error):
            mine = proc.info["username"] == me and proc.info["create_time"] >= since - 1 and proc.pid != os.getpid()
            if mine and proc.environ().get(CLUSTER_ENV) == token:
                found.append(proc)
    return found


def main(argv: list[str] | None = None) -> None:
    """``MODULE ARGS...``: ``MODULE`` as ``__main__``, watched; ``--then CMD``: ``CMD`` once the owner is gone."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--then"] and len(argv) == 2:
        if not watch_owner(then=argv[1]):
            sys.exit(f"{OWNER_ENV} names no owner on this host; nothing to watch")
        threading.Event().wait()
    if not argv:
        sys.exit("usage: python -m vgpu_magic.ranks.lifetime MODULE [ARGS...] | --then COMMAND")
    watch_owner(beside=True)
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
