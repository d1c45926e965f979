"""A host's spare: a process that waits, with the framework imported, for its engine's launches (:mod:`.launch`) and
forks each one's process (:func:`.launched.child`), as PyTorch's DataLoader forks its workers: a launch pays neither for
the interpreter nor for the import, also in a loop of launches."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from . import launched

__all__ = ["Forked", "KernelEnviron", "Spare", "give_back", "kernel_environ", "take", "warm"]

#: What a spare runs (``python -c``: nothing of the user's folder on ``sys.path``, ``sys.flags`` as plain ``python``).
_CHILD = "from vgpu_magic.ranks.launched import child; child()"


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


@dataclass
class Spare:
    """A started spare and what it was started with."""

    popen: subprocess.Popen
    #: Launches go out on it; each launch's PID, then its exit status, come back.
    control: socket.socket
    #: Its environment outside the rank's plan (whose ports and ids change every run, read when the script joins).
    base: dict[str, str]
    #: What else it was made with: its imports and the installed packages (:func:`_made`).
    made: tuple
    #: What its imports wrote (stdout, stderr), shown at each launch's start as a new process's imports write it.
    said: tuple[bytes, bytes] = (b"", b"")

    def fork(self, launch: dict) -> tuple[Forked, socket.socket] | None:
        """Send ``launch`` with a new process's output pipes and control socket; the spare forks it: the process and
        its control socket, ``None`` where the spare died. Meanwhile what the imports write is kept and shown first."""
        pipes, (ours, theirs) = [os.pipe(), os.pipe()], socket.socketpair()
        body = json.dumps(launch).encode()
        try:
            socket.send_fds(self.control, [launched.SIZE.pack(len(body))], [pipes[0][1], pipes[1][1], theirs.fileno()])
            self.control.sendall(body)
        except OSError:
            pass  # a spare that died says so below
        finally:
            for _, write in pipes:
                os.close(write)
            theirs.close()
        said = list(self.said)
        with selectors.DefaultSelector() as selector:
            selector.register(self.control, selectors.EVENT_READ)
            for index, pipe in enumerate((self.popen.stdout, self.popen.stderr)):
                selector.register(pipe, selectors.EVENT_READ, index)
            # Its imports may write more than a pipe holds before they end: read them while waiting for the PID; they
            # wrote all before it came (the spare flushes first), so once it came, what the pipes hold is read too.
            forked = False
            while True:
                ready = [key for key, _ in selector.select(0 if forked else None)]
                outputs = [key for key in ready if key.fileobj is not self.control]
                forked = forked or len(outputs) < len(ready)
                if forked and not outputs:
                    break
                for key in outputs:
                    data = os.read(key.fd, 65536)
                    said[key.data] += data
                    if not data:
                        selector.unregister(key.fileobj)
        self.said = (said[0], said[1])
        pid = self.control.recv(launched.SIZE.size, socket.MSG_WAITALL)
        if not pid:
            ours.close()
            return None
        for out, text in zip((sys.stdout, sys.stderr), self.said):
            out.write(text.decode(errors="replace"))
        return Forked(self, launched.SIZE.unpack(pid)[0], pipes[0][0], pipes[1][0]), ours

    def end(self) -> None:
        self.control.close()
        self.popen.kill()
        self.popen.communicate()


class Forked:
    """A launch's process, its spare's child: ``subprocess.Popen``'s face (:mod:`.launch` follows it)."""

    def __init__(self, spare: Spare, pid: int, stdout: int, stderr: int) -> None:
        self.spare, self.pid, self.returncode = spare, pid, None
        # Closed by the launch once read to the end.
        self.stdout = open(stdout, "rb", buffering=0)  # noqa: SIM115
        self.stderr = open(stderr, "rb", buffering=0)  # noqa: SIM115

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            with selectors.DefaultSelector() as selector:
                selector.register(self.spare.control, selectors.EVENT_READ)
                if not selector.select(timeout):
                    raise subprocess.TimeoutExpired(str(self.pid), timeout)
            status = self.spare.control.recv(launched.SIZE.size, socket.MSG_WAITALL)
            # No status: the spare died, which kills its launch (PR_SET_PDEATHSIG).
            self.returncode = launched.SIZE.unpack(status)[0] if status else -signal.SIGKILL
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _made(preload: list[str]) -> tuple:
    """A spare's imports and the packages' folders' mtimes: an install since (``pip install -e``) is not on its path."""
    import site

    folders = sorted({*site.getsitepackages(), site.getusersitepackages()})
    return (tuple(preload), tuple(os.stat(f).st_mtime_ns for f in folders if os.path.isdir(f)))


#: The engine's spare, waiting for its next launch.
_waiting: Spare | None = None


def take(plan_env: dict[str, str], preload: list[str], environ: KernelEnviron | None) -> Spare:
    """The waiting spare, if it lives and was started with this environment; else a new one. ``environ``: the
    kernel's (:func:`kernel_environ`), or ``None``: the engine's own."""
    global _waiting
    spare, _waiting = _waiting, None
    fits = spare is not None and (spare.base, spare.made) == (_base(plan_env, environ), _made(preload))
    if fits and spare.popen.poll() is None:
        return spare
    if spare is not None:
        spare.end()
    return _start(plan_env, preload, environ)


def give_back(spare: Spare, forked: bool, keep: bool, plan_env: dict, preload: list[str], environ) -> None:
    """After a launch: the spare waits for the next one where one is to be ``keep``-t and it lives and ``forked`` this
    one (else it may be stuck importing); otherwise it ends, and a new one starts where one is kept."""
    global _waiting
    if keep and forked and spare.popen.poll() is None:
        _waiting = spare
        return
    spare.end()
    _waiting = _start(plan_env, preload, environ) if keep else None


def _base(plan_env: dict[str, str], environ: KernelEnviron | None) -> dict[str, str]:
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


def _start(plan_env: dict[str, str], preload: list[str], environ: KernelEnviron | None) -> Spare:
    """Start a spare that imports ``preload`` and waits for launches on a socket."""
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
    return Spare(popen, ours, base, made)


def warm(plan_env: dict[str, str], preload: list[str], environ: KernelEnviron | None = None) -> None:
    """Run on an engine: make sure a spare waits, started with ``plan_env`` over ``environ``, importing ``preload``."""
    global _waiting
    _waiting = take(plan_env, preload, environ)
