"""The ranks' processes: checked before they start (memory, port), started by ipyparallel under :mod:`.lifetime`'s
watch of this kernel, and made sure of when they stop (SIGTERM, SIGKILL, then as their launcher says)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import glob
import logging
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ClusterStartError
from ..units import format_bytes
from . import lifetime
from .launchers import Launcher

__all__ = ["CONTROLLER_ARGS", "ClusterStartError", "check_memory_fits", "check_port_free", "new_ipp_cluster"]

#: Seconds processes get after SIGTERM before SIGKILL when the cluster stops.
STOP_GRACE = 2.0
#: The controller's heartbeat: an engine registers after its first ping, so ipyparallel's 3 s made every start
#: wait (``benchmarks/cluster.py``); 150 misses keep its 30 s before a silent engine counts as dead.
HEARTBEAT_MS = 200
CONTROLLER_ARGS = (
    f"--HeartMonitor.period={HEARTBEAT_MS}",
    f"--HeartMonitor.max_heartmonitor_misses={30_000 // HEARTBEAT_MS}",
)
#: Seconds a start or stop under way may take to end after an interrupt, before it is left to itself.
UNINTERRUPTED_LIMIT = 60.0


def despite_interrupts(call: Any) -> Any:
    """``call()`` run to its end despite an interrupt (raised after): a start abandoned half-way would launch on."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vgpu_magic-uninterrupted")
    future = pool.submit(call)
    pool.shutdown(wait=False)
    interrupt, deadline = None, math.inf
    while not future.done() and time.monotonic() < deadline:
        try:
            concurrent.futures.wait([future], timeout=None if interrupt is None else deadline - time.monotonic())
        except KeyboardInterrupt as exc:
            interrupt, deadline = interrupt or exc, min(deadline, time.monotonic() + UNINTERRUPTED_LIMIT)
    if interrupt is not None:
        raise interrupt
    return future.result()


#: Host memory one rank is assumed to need at most before one is measured (torch on CPU measured ~530 MiB).
RANK_MEMORY_BOUND = 2 * 1024**3


@functools.cache
def rank_footprint(module: str) -> int:
    """Resident bytes of a fresh interpreter with ``module`` and an engine's own imports imported (once per kernel)."""
    code = f"import psutil, ipyparallel.engine.app, {module}; print(psutil.Process().memory_info().rss)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    return int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else 0


def check_memory_fits(n: int, fw: Any) -> bool:
    """Do ``n`` ranks fit in memory with a warm spare each? ``False``: only without; else :class:`ClusterStartError`."""
    import psutil

    available = psutil.virtual_memory().available
    if 2 * n * RANK_MEMORY_BOUND <= available:
        return True
    one = rank_footprint(fw.module)
    if not one or 2 * n * one <= available:
        return True
    if n * one <= available:
        return False
    raise ClusterStartError(
        f"{n} {fw.label} ranks need about {format_bytes(n * one)} of memory (one rank with {fw.module} "
        f"imported: {format_bytes(one)}), but {format_bytes(available)} is available; start at most "
        f"{max(1, available // one)} ranks"
    )


def check_port_free(port: int) -> None:
    """:class:`ClusterStartError` naming ``port`` and its holder if it cannot be bound (JAX would say "rank 0 died")."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError as exc:
            import psutil

            pids: set[int] = set()
            # Naming the holder is a courtesy; where psutil may not list connections, the port alone is said.
            with contextlib.suppress(psutil.Error):
                pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid}
            holder = f" by pid {', '.join(map(str, sorted(pids)))}" if pids else ""
            raise ClusterStartError(
                f"--port {port} is in use on this machine{holder} ({exc.strerror}); "
                "choose another, or leave --port out for a free one"
            ) from None


def new_ipp_cluster(launcher: Launcher, n: int, cluster_id: str, token: str) -> Any:
    """ipyparallel's cluster for ``n`` engines, as ``launcher`` planned it, its processes marked with ``token``."""
    from traitlets.config import Config

    from . import upstream as ours

    kwargs: dict[str, Any] = {}
    if launcher.controller_ip:
        kwargs.update(controller_ip=launcher.controller_ip, controller_location=launcher.controller_location)
    # The controller, and the engines the launcher has watched, run under lifetime's watch of this kernel.
    env = {lifetime.OWNER_ENV: lifetime.owner_of_this_process(), lifetime.CLUSTER_ENV: token}
    config = Config(copy.deepcopy(launcher.config))
    config.LocalControllerLauncher.controller_cmd = lifetime.watched_command("ipyparallel.controller")
    config.LocalControllerLauncher.environment = dict(env)
    cluster = ours.RanksCluster(
        n=n,
        engines=launcher.engines,
        cluster_id=cluster_id,
        log=ours.QUIET,
        log_level=logging.ERROR,
        controller_args=list(CONTROLLER_ARGS),
        config=config,
        **kwargs,
    )
    cluster.owner = True
    launcher.configure(cluster, env)
    return cluster


def keep_logs(cluster: Any, launchers: Any = ()) -> str:
    """``"; the processes' log: PATH"``: the processes' logs (which the stop removes) kept in one file, or ``""``."""
    pattern = os.path.join(cluster.profile_dir, "log", f"*{cluster.cluster_id}*.log") if cluster else ""
    texts = {}
    for log in sorted(glob.glob(pattern)):
        with contextlib.suppress(OSError), open(log, errors="replace") as lines:
            texts[os.path.basename(log)] = lines.read()
    for launcher in launchers:
        name = os.path.basename(getattr(launcher, "output_file", "") or "")
        texts[name] = texts.get(name) or (launcher.get_output() if name else "")
    if not any(texts.values()):
        return ""
    path = os.path.join(tempfile.gettempdir(), f"vgpu_magic-{cluster.cluster_id}.log")
    with open(path, "w") as kept:
        kept.writelines(f"==> {name} <==\n{text}\n" for name, text in sorted(texts.items()) if text)
    return f"; the processes' log: {path}"


def local_launchers(launcher: Launcher) -> dict[int, Any]:
    """By PID, ipyparallel's launcher of each process it started here for ``launcher`` (controller, watched engines)."""
    found = [launcher.cluster.controller]
    for engine_set in launcher.cluster.engines.values() if launcher.watched else ():
        found.extend(getattr(engine_set, "launchers", {}).values() or [engine_set])
    return {process.pid: process for process in found if (getattr(process, "pid", None) or -1) > 0}


#: Run when the kernel dies without a stop: remove what matches each argument (a glob).
_REMOVE = "import glob, os, sys; [os.remove(p) for pattern in sys.argv[1:] for p in glob.glob(pattern)]"


def clean_up_when_kernel_dies(launcher: Launcher, token: str) -> set[int]:
    """A stop's work, done by watchers if the kernel dies without one (remote engines ended, files and logs removed).
    Returns their PIDs: a stop ends them last, so a kernel killed while it stops (Jupyter: 5 s) still cleans up."""
    cluster = launcher.cluster
    logs = os.path.join(cluster.profile_dir, "log", f"*{cluster.cluster_id}*")
    commands = [shlex.join([sys.executable, "-c", _REMOVE, cluster.cluster_file, logs, *_connection_files(cluster)])]
    commands += [shlex.join(command) for command in launcher.clean_up_commands()]
    return {lifetime.run_when_this_process_dies(command, token).pid for command in commands}


def _connection_files(cluster: Any) -> list[str]:
    """The controller's connection files, which it removes only when it exits of itself."""
    return list(cluster.controller.connection_files.values()) if getattr(cluster, "controller", None) else []


def terminate(owned: set[int], token: str = "", started_at: float = 0.0, spared: set[int] = frozenset()) -> list[Any]:
    """End ``owned``, their children and ``token``'s processes, but ``spared``: SIGTERM, then SIGKILL; the survivors."""
    import psutil

    procs: dict[int, Any] = {}
    for pid in sorted(owned):
        with contextlib.suppress(psutil.Error):
            procs[pid] = psutil.Process(pid)
            procs.update((child.pid, child) for child in procs[pid].children(recursive=True))
    ended: set[int] = set(spared)
    alive: list[Any] = []
    # Twice where a token marks them: a process forked while the first round ended its parent was not found.
    for _ in range(2 if token else 1):
        if token:
            procs.update((proc.pid, proc) for proc in lifetime.processes_of(token, started_at))
        now = [proc for pid, proc in procs.items() if pid not in ended]
        ended.update(procs)
        for proc in now:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        late = _running_after(now, STOP_GRACE)
        for proc in late:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        alive += _running_after(late, 5.0)
    # Reaped here where nothing else waits for them (watchers; the controller, whose reaping needs an event loop),
    # else each stays a zombie; a PID not our child is none of ours; one just ended may take a moment to be waitable.
    pending = {*owned, *procs} - set(spared) - {proc.pid for proc in alive}
    deadline = time.monotonic() + 2.0
    while pending and time.monotonic() <= deadline:
        for pid in list(pending):
            with contextlib.suppress(ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    continue  # not ended yet
            pending.discard(pid)
        time.sleep(0.05 if pending else 0)
    return alive


def _running_after(procs: list[Any], timeout: float) -> list[Any]:
    """Those of ``procs`` running after ``timeout`` s; a zombie has ended (init may be slow to reap orphans)."""
    import psutil

    def running(proc: Any) -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [proc for proc in procs if running(proc)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@dataclass(frozen=True)
class RankInfo:
    """One rank as ``%vgpu_cluster status`` shows it."""

    rank: int
    engine_id: int
    pid: int
    alive: bool
    rss: int | None
    gpu: int | None
    host: str


@dataclass
class RankProcesses:
    """How the fault policy reaches each rank's process: on this host (``local[rank]``, all by default) by its PID; on
    another through its engine, ``client[engine_ids[rank]]``; ipyparallel's ``launchers`` (by PID) and ``cluster``."""

    pids: list[int]
    client: Any = None
    engine_ids: Sequence[int] = ()
    local: list[bool] | None = None
    hosts: list[str] | None = None
    launchers: Mapping[int, Any] = field(default_factory=dict)
    cluster: Any = None

    def on_this_host(self, rank: int) -> bool:
        return self.local is None or self.local[rank]

    def engine(self, rank: int) -> Any:
        return self.client[self.engine_ids[rank]]

    def alive(self, rank: int) -> bool:
        if self.on_this_host(rank):
            return lifetime.process_alive(self.pids[rank])
        return self.client is not None and self.engine_ids[rank] in self.client.ids

    def signal(self, rank: int, signum: int) -> None:
        if self.on_this_host(rank):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pids[rank], signum)
        else:
            # Through the engine's nanny; an engine already gone is no error.
            with contextlib.suppress(Exception):
                self.client.send_signal(signum, targets=[self.engine_ids[rank]], block=False).get(timeout=5.0)

    def exit_code(self, rank: int) -> int | None:
        """How the rank's process exited, as the wait that reaped it returned it (None where no such wait is ours)."""
        return getattr(getattr(self.launchers.get(self.pids[rank]), "process", None), "exit_code", None)

    def memory_pids(self) -> list[int | None]:
        """The PIDs the kernel can read memory of (``None`` for a rank on another host)."""
        return [pid if self.on_this_host(rank) else None for rank, pid in enumerate(self.pids)]

    def infos(self, gpu: bool) -> list[RankInfo]:
        """Each rank's PID, liveness, host and memory (RSS, and ``gpu``'s where NVML has it; none on another host)."""
        from .memory import RankMemorySampler

        sampler = RankMemorySampler(self.memory_pids(), gpu)
        rss, used = dict(zip(sampler.ranks, sampler.rss())), dict(zip(sampler.ranks, sampler.gpu()))
        sampler.close()
        alive = [self.alive(rank) for rank in range(len(self.pids))]
        return [
            RankInfo(rank, self.engine_ids[rank], pid, up, rss.get(rank) if up else None, used.get(rank), host)
            for rank, (pid, host, up) in enumerate(zip(self.pids, self.hosts, alive))
        ]


def unlist(cluster: Any) -> None:
    """Remove ``cluster``'s file for good before its processes end (else a panel lists a dead cluster)."""
    cluster.remove_cluster_file()
    cluster.cluster_file = ""


def stop_launched(launcher: Launcher) -> list[str]:
    """Stop what ipyparallel launched for ``launcher``, check nothing is left where it ran; what is, in words."""
    cluster = launcher.cluster
    # Read before the stop: ipyparallel forgets the engines it stopped.
    left, connection = launcher.stop_check(), _connection_files(cluster)
    # If this fails, local processes are gone already (the caller checked) and remote ones are checked below.
    with contextlib.suppress(Exception):
        cluster.stop_cluster_sync()
    unlist(cluster)
    # The controller's record of its engines (which it removes only when it exits of itself).
    connection.append(os.path.join(cluster.profile_dir, "log", f"engines{cluster.cluster_id}.json"))
    for path in connection:  # left by a controller that was killed
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    # Stopped here: ipyparallel's own stop at exit (or when the object goes) would only try again, noisily.
    cluster.shutdown_atexit = False
    return left()
