"""The ranks: N local ipyparallel engines, wired as a framework's launcher wires
its processes.

:class:`RankCluster` does the work behind ``%vgpu_cluster`` and
``%%vgpu_run``; it needs no shell. ipyparallel's :class:`~ipyparallel.Cluster`
starts, signals and stops the processes; this class adds the ranks' hosts and
their order (:mod:`.hosts`), the framework's wiring (each framework's
``plan_ranks`` in :mod:`vgpu_magic.frameworks`), the fault policy (:mod:`.run`) and a stop
that leaves nothing behind: ipyparallel sends SIGTERM and only later SIGKILL
(TensorFlow workers were measured still alive 5 s after SIGTERM), so
:meth:`RankCluster.stop` escalates itself and checks with psutil that every
process it started is gone. A kernel that dies without a stop takes them all
with it (:mod:`.lifetime`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .. import frameworks
from ..frameworks.base import RankPlan
from ..inventory import GPUInfo, NVMLReadError
from ..units import MIB
from . import lifetime
from .hosts import HostReport, RankLayout, layout_ranks, prepare_rank, report_host, visible_gpus
from .launchers import LAUNCHERS, LauncherPlan, plan_launcher
from .names import UnsendableName, names_to_send, names_written, pack_names, script_code, split_last_expression
from .run import RankRun, RankRunError, process_alive

__all__ = ["LAUNCHERS", "ClusterStartError", "RankCluster", "RankInfo", "current", "free_ports"]

#: Seconds processes get after SIGTERM before SIGKILL when the cluster stops.
STOP_GRACE = 2.0
#: Seconds the engines may take to register with the controller.
ENGINE_TIMEOUT = 120.0
#: Seconds the wiring (process group / coordinator rendezvous) may take.
SETUP_TIMEOUT = 120.0
#: Seconds a cancelled batch job may take to leave the queue, and remote engines to exit.
REMOTE_STOP_TIMEOUT = 30.0
#: The controller's heartbeat. The hub accepts a registering engine only once its heart has answered a ping, so
#: ipyparallel's default 3 s period made every start wait 3-6 s for nothing (``benchmarks/cluster.py``). Beating
#: every 200 ms costs the idle cluster under 1 % of one core; 150 misses keep ipyparallel's 30 s before a silent
#: engine counts as dead.
HEARTBEAT_MS = 200
CONTROLLER_ARGS = (
    f"--HeartMonitor.period={HEARTBEAT_MS}",
    f"--HeartMonitor.max_heartmonitor_misses={30_000 // HEARTBEAT_MS}",
)

_current: RankCluster | None = None
_lock = threading.Lock()


class ClusterStartError(RuntimeError):
    """The cluster could not start or be wired; nothing it started is left running."""


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


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, chosen by the OS (bind to port 0)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


#: Run on an SSH host at stop: wait for the engines (PIDs there) to exit, SIGKILL what
#: survived, remove the cluster's folder, and say which PIDs are left.
_REMOTE_CLEANUP = (
    "pids='{pids}'; for i in $(seq 40); do alive=''; "
    "for p in $pids; do kill -0 $p 2>/dev/null && alive=\"$alive $p\"; done; "
    '[ -z "$alive" ] && break; sleep 0.25; done; [ -n "$alive" ] && kill -9 $alive 2>/dev/null && sleep 0.5; '
    "still=''; for p in $pids; do kill -0 $p 2>/dev/null && still=\"$still $p\"; done; "
    "rm -rf '{folder}'; echo left:$still"
)


def _ssh(location: str, args: tuple[str, ...], command: str) -> str | None:
    """Run ``command`` on ``location`` over ssh; its stdout, or None if ssh failed."""
    try:
        proc = subprocess.run(
            ["ssh", *args, location, command],
            capture_output=True,
            text=True,
            timeout=REMOTE_STOP_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None
    return proc.stdout if proc.returncode == 0 else None


def _wait_job_gone(job: str, timeout: float) -> bool:
    """Has SLURM job ``job`` left ``squeue`` within ``timeout`` seconds?"""
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True, timeout=30, check=False
        )
        # squeue exits non-zero for a job id it no longer knows: gone as well.
        if proc.returncode != 0 or not proc.stdout.strip():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def current() -> RankCluster | None:
    """The running cluster started by ``%vgpu_cluster start`` / :meth:`RankCluster.start`, or ``None``."""
    return _current


class RankCluster:
    """N ranks of one framework on local ipyparallel engines.

    Parameters
    ----------
    n:
        Number of ranks (1..64).
    framework:
        A name in :data:`vgpu_magic.frameworks.REGISTRY` (or an alias):
        ``"torch"``, ``"tensorflow"`` (``"tf"``), ``"jax"``.
    split:
        TensorFlow: logical GPUs per worker (GPU only); JAX: CPU devices per process.
    memory:
        Per-rank GPU memory cap in bytes (default: an even share of what the GPU can give).
    port:
        The coordinator port (torch's ``MASTER_PORT``, JAX's coordinator, the
        first TensorFlow worker); default: ports the OS gives on the hosts that bind them.
    gpus:
        The GPUs every host is planned with, ``[(cuda_index, total_bytes), ...]``;
        default: what each engine reports it sees.
    launcher:
        How ipyparallel starts the engines: ``"local"`` (processes of this
        kernel), ``"mpi"`` (one ``mpiexec`` job; needs ``mpiexec`` and
        ``mpi4py``), ``"slurm"`` (one ``sbatch`` job running ``srun
        ipengine``) or ``"ssh"`` (engines started on other hosts over SSH).
        The ranks are wired from the hosts the engines report, in the
        launcher's order (``SLURM_PROCID``, the MPI rank).
    launcher_options:
        What the launcher needs (see :mod:`.launchers`): SLURM ``partition``,
        ``account``, ``time``, extra ``sbatch`` lines and ``srun`` arguments;
        SSH ``hosts``, ``ssh_args``, ``python``; ``controller_address``.
    join:
        Also make the call a script makes to join the others
        (``init_process_group``, ``jax.distributed.initialize``) on each rank
        at start. By default a rank gets only what its real launcher gives a
        process, and the user's code makes that call, as under ``torchrun``.

    Raises
    ------
    ValueError
        For a request that cannot work, before anything starts.

    Examples
    --------
    >>> ranks = RankCluster(2, "torch", join=True).start()  # doctest: +SKIP
    >>> ranks.run("import torch.distributed as dist; dist.get_rank()", output=True)  # doctest: +SKIP
    [0, 1]
    >>> ranks.stop()                                      # doctest: +SKIP
    """

    def __init__(
        self,
        n: int,
        framework: str,
        split: int | None = None,
        memory: int | None = None,
        port: int | None = None,
        gpus: list[tuple[int, int]] | None = None,
        launcher: str = "local",
        launcher_options: dict[str, Any] | None = None,
        join: bool = False,
    ) -> None:
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise ValueError(f"rank count {n!r} is out of range; use 1..64")
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"--port {port} is not a TCP port; use 1..65535, or leave it out for a free one")
        self.fw = frameworks.get(framework)
        self.cluster_id = f"vgpu-{uuid.uuid4().hex[:8]}"
        self.launcher_plan: LauncherPlan = plan_launcher(launcher, n, launcher_options, self.cluster_id)
        self.launcher = launcher
        self.launcher_options = dict(launcher_options or {})
        self.join = bool(join)
        missing = [m for m in ("ipyparallel", "psutil", "cloudpickle") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"the ranks need {', '.join(missing)}: pip install 'vgpu_magic[cluster]'")
        if importlib.util.find_spec(self.fw.module) is None:
            raise ValueError(f"{self.label} is not installed in this kernel; {self.fw.capabilities.install_hint}")
        #: The GPUs the caller planned for (every host then plans with them), or ``None``: each engine's own.
        self.given_gpus = (
            None
            if gpus is None
            else tuple(GPUInfo(index, total_mib=total // MIB, nvml_index=index) for index, total in gpus)
        )
        memory_mib = None if memory is None else memory // MIB
        # Planned once on this host's view of the ranks, so a request that cannot work fails before anything starts;
        # start() plans again from what the engines report.
        self.fw.plan_ranks(self._predicted_layout(n), split, memory_mib, port)
        self.n = n
        self.split = split
        self.memory = memory
        self.memory_mib = memory_mib
        self.port = port
        self.hosts: list[HostReport] = []
        self.layout: RankLayout | None = None
        self.plans: list[RankPlan] = []
        self.cluster: Any = None
        self.client: Any = None
        self.view: Any = None
        self.engine_ids: list[int] = []
        self.pids: list[int] = []
        self.must_restart: str | None = None
        #: Names cells run on the ranks assigned: rank state, never overwritten from the notebook.
        self.rank_names: set[str] = set()
        self._owned: set[int] = set()
        #: Engine launchers by PID, kept after ipyparallel forgets a stopped one (for exit statuses).
        self._launchers: dict[int, Any] = {}
        #: Carried by every process of this cluster (:func:`.lifetime.processes_of`).
        self._token = ""
        self._started_at = 0.0

    @property
    def framework(self) -> str:
        return self.fw.name

    @property
    def label(self) -> str:
        return self.fw.label

    @property
    def running(self) -> bool:
        return self.cluster is not None

    def same_request(self, other: RankCluster) -> bool:
        """Does ``other`` ask for the same ranks and wiring as this cluster?"""

        def request(c: RankCluster) -> tuple:
            return (c.n, c.framework, c.split, c.memory, c.port, c.given_gpus, c.launcher, c.launcher_options, c.join)

        return request(self) == request(other)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> RankCluster:
        """Start the engines, wire them, and make this the current cluster.

        Raises :class:`ClusterStartError` (with the failing rank's traceback) if
        starting or wiring fails; nothing started is left running then.
        """
        global _current
        import ipyparallel as ipp

        if self.running:
            return self
        with _lock:
            previous, _current = _current, self
        if previous is not None and previous is not self:
            previous.stop()
        self._token, self._started_at = uuid.uuid4().hex, time.time()
        try:
            _check_memory_fits(self.n, self.fw)
            if self.port is not None:
                _check_port_free(self.port)
            self.cluster = self._new_cluster(ipp)
            self.cluster.start_cluster_sync(n=self.n)
            # Remembered at once, so that even engines that never register are stopped.
            self._remember_processes()
            self._watch_remote()
            self.client = self.cluster.connect_client_sync()
            # interactive=False: no progress bar in the cell (the start summary says what started).
            self.client.wait_for_engines(self.n, timeout=ENGINE_TIMEOUT, block=True, interactive=False)
            self.hosts = self._read_hosts(sorted(self.client.ids)[: self.n])
            self.layout = self._layout(self.hosts)
            # Rank order: the launcher's ranks, else the engines', grouped by host.
            self.engine_ids = [place.engine_id for place in self.layout.places]
            self.pids = [place.pid for place in self.layout.places]
            if not self.launcher_plan.remote:
                # Local and mpiexec engines are this host's processes; a SLURM job's tasks and SSH
                # engines are ended through their launcher (stop), a PID elsewhere names nothing here.
                self._owned.update(self.pids)
            self.view = self.client[self.engine_ids]
            self.view.block = True
            self.plans = self.fw.plan_ranks(self.layout, self.split, self.memory_mib, self.port)
            self._wire()
        except BaseException as exc:
            self.stop()
            if isinstance(exc, RankRunError):
                raise ClusterStartError(
                    f"wiring {self.label} failed: {exc.headline(state=False)}; nothing was left running"
                ) from exc
            if isinstance(exc, Exception) and not isinstance(exc, ClusterStartError):
                raise ClusterStartError(f"the ranks could not start: {type(exc).__name__}: {exc}") from exc
            raise
        atexit.register(self.stop)
        self._activate_px()
        return self

    def _read_hosts(self, engine_ids: list[int]) -> list[HostReport]:
        """Each engine's :class:`~.hosts.HostReport` (hostname, reachable address,
        GPUs, PID, a free port on its host, the launcher's rank variables)."""
        # ipyparallel's controller_location is where engines connect when the controller listens on every interface.
        controller = self.cluster.controller_location or self.cluster.controller_ip or "127.0.0.1"
        pending = [self.client[e].apply_async(report_host, e, controller) for e in engine_ids]
        return [ar.get(timeout=ENGINE_TIMEOUT) for ar in pending]

    def _layout(self, hosts: list[HostReport]) -> RankLayout:
        """The ranks laid out on ``hosts``, planned with the caller's GPUs where given."""
        layout = layout_ranks(hosts)
        return layout if self.given_gpus is None else layout.with_gpus(self.given_gpus)

    def _predicted_layout(self, n: int) -> RankLayout:
        """The layout ``n`` engines started on this host would report (checked before starting)."""
        host = socket.gethostname()
        try:
            gpus = self.given_gpus if self.given_gpus is not None else visible_gpus()
        except NVMLReadError as exc:
            raise ValueError(str(exc)) from None
        return self._layout([HostReport(e, host, "127.0.0.1", 0, gpus, 0) for e in range(n)])

    def _new_cluster(self, ipp: Any) -> Any:
        """ipyparallel's cluster, configured with the launcher plan."""
        import copy

        from traitlets.config import Config

        plan = self.launcher_plan
        kwargs: dict[str, Any] = {}
        if plan.controller_ip:
            kwargs.update(controller_ip=plan.controller_ip, controller_location=plan.controller_location)
        # ERROR: ipyparallel logs an engine's whole log file as a warning when it exits non-zero, which
        # every stop after a killed rank would print into the cell; this class reports failures itself.
        # The controller and the local and mpiexec engines run under lifetime's watch of this kernel.
        config = _watched_config(self._token)
        config.merge(Config(copy.deepcopy(plan.config)))
        cluster = ipp.Cluster(
            n=self.n,
            engines=_engine_launcher(plan.engines),
            cluster_id=self.cluster_id,
            log_level=logging.ERROR,
            controller_args=list(CONTROLLER_ARGS),
            config=config,
            **kwargs,
        )
        if plan.name == "slurm":
            # ipyparallel writes the batch script into the kernel's working folder (the user's notebooks);
            # an absolute name puts it with the engines' log in the profile instead, removed by stop().
            cluster.config.SlurmEngineSetLauncher.batch_file_name = self._batch_file(cluster)
        return cluster

    def _batch_file(self, cluster: Any) -> str:
        import os

        return os.path.join(cluster.profile_dir, "log", f"ipengine-{self.cluster_id}.sbatch")

    def _remember_processes(self) -> None:
        """Every process ipyparallel started for us on this host (controller, local and
        mpiexec engines), for :meth:`stop`. SSH engines' PIDs are PIDs on their hosts,
        and a batch job's tasks belong to SLURM: :meth:`stop` ends those through
        their launcher."""
        from ipyparallel.cluster.launcher import LocalProcessLauncher, SSHLauncher

        launchers = [self.cluster.controller]
        for engine_set in self.cluster.engines.values():
            launchers.extend(getattr(engine_set, "launchers", {}).values() or [engine_set])
        for launcher in launchers:
            if not isinstance(launcher, LocalProcessLauncher) or isinstance(launcher, SSHLauncher):
                continue
            pid = getattr(launcher, "pid", -1)
            if pid and pid > 0:
                self._owned.add(pid)
                self._launchers[pid] = launcher

    def _wire(self) -> None:
        """Set each rank's environment and run its setup, all ranks at once (a rendezvous)."""
        plans = self.plans

        def submit(rank: int) -> Any:
            plan = plans[rank]
            return self.client[self.engine_ids[rank]].apply_async(
                prepare_rank, plan.env, plan.setup, plan.args, self.join
            )

        RankRun(self.pids, submit, self._exit_code, timeout=SETUP_TIMEOUT, stdout=sys.stdout, stderr=sys.stderr).run()

    def _activate_px(self) -> None:
        """``%px`` / ``%%px`` on the ranks, as ipyparallel users expect."""
        # A convenience only: the ranks work without %px, so a shell that cannot take the magics is no error.
        with contextlib.suppress(Exception):
            from IPython import get_ipython

            if get_ipython() is not None:
                self.view.activate()

    def _exit_code(self, rank: int) -> int | None:
        """How rank ``rank``'s process exited (negative: the signal), as the wait that reaped it
        returned it; ``None`` where no such wait is ours (engines started by mpiexec)."""
        launcher = self._launchers.get(self.pids[rank])
        code = getattr(getattr(launcher, "process", None), "exit_code", None)
        return None if code is None else int(code)

    def stop(self) -> None:
        """Stop every process this cluster started and check that none is left.

        SIGTERM, then SIGKILL after :data:`STOP_GRACE` seconds for what is
        still alive; ipyparallel then removes its files. Safe to call twice.
        """
        global _current
        import psutil

        procs: dict[int, Any] = {}
        for pid in sorted(self._owned):
            try:
                proc = psutil.Process(pid)
                procs[pid] = proc
                procs.update((child.pid, child) for child in proc.children(recursive=True))
            except psutil.Error:
                continue
        if self._token:
            # Also those whose parent died first (the controller's children once its main process is gone).
            procs.update((proc.pid, proc) for proc in lifetime.processes_of(self._token, self._started_at))
        procs = list(procs.values())
        if self.client is not None:
            # A client whose controller already died can fail to close; its sockets go with it.
            with contextlib.suppress(Exception):
                self.client.close()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=STOP_GRACE)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _, alive = psutil.wait_procs(alive, timeout=5)
        jobs = [getattr(es, "job_id", "") for es in self.cluster.engines.values()] if self.cluster is not None else []
        ssh_engines = self._ssh_engines()
        if self.cluster is not None:
            # For a batch launcher this is the scancel of the job; for SSH, SIGTERM over ssh. If it fails,
            # local processes are gone (checked above) and remote ones are checked below.
            with contextlib.suppress(Exception):
                self.cluster.stop_cluster_sync()
        left = self._stop_remote([job for job in jobs if job], ssh_engines)
        if self.cluster is not None and self.launcher_plan.name == "slurm":
            import os

            with contextlib.suppress(FileNotFoundError):
                os.remove(self._batch_file(self.cluster))
        self.cluster = self.client = self.view = None
        self.engine_ids, self.pids, self._owned, self._launchers, self._token = [], [], set(), {}, ""
        self.hosts, self.layout = [], None
        self.rank_names = set()
        self.must_restart = None
        atexit.unregister(self.stop)
        with _lock:
            if _current is self:
                _current = None
        if alive:
            raise RuntimeError(f"processes {sorted(p.pid for p in alive)} did not exit after SIGKILL")
        if left:
            raise RuntimeError(f"after stopping, {'; '.join(left)}")

    def _watch_remote(self) -> None:
        """Engines on other hosts (a SLURM job's tasks, SSH engines) cannot watch this kernel's PID,
        so a watched process next to the kernel ends them through their launcher when the kernel dies
        without :meth:`stop` (``python -m vgpu_magic.ranks.lifetime --then COMMAND``). It carries the
        cluster's token, so :meth:`stop` ends it with the rest."""
        import shlex

        jobs = [getattr(es, "job_id", "") for es in self.cluster.engines.values()]
        commands = [shlex.join(["scancel", job]) for job in jobs if job]
        if self.launcher_plan.ssh_hosts:
            remote_dir = self.launcher_plan.config["SSHEngineSetLauncher"]["remote_profile_dir"]
            engines = self._ssh_engines()
            for location, args in self.launcher_plan.ssh_hosts:
                pids = " ".join(str(pid) for where, pid in engines if where == location)
                cleanup = f"kill {pids} 2>/dev/null; " + _REMOTE_CLEANUP.format(pids=pids, folder=remote_dir)
                commands.append(shlex.join(["ssh", *args, location, cleanup]))
        env = {**os.environ, lifetime.OWNER_ENV: lifetime.owner_of_this_process(), lifetime.CLUSTER_ENV: self._token}
        for command in commands:
            subprocess.Popen(
                [sys.executable, "-m", "vgpu_magic.ranks.lifetime", "--then", command],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _ssh_engines(self) -> list[tuple[str, int]]:
        """``(ssh location, PID there)`` of each engine started over SSH, in start order."""
        if self.cluster is None or self.launcher != "ssh":
            return []
        return [
            (launcher.location, launcher.pid)
            for engine_set in self.cluster.engines.values()
            for launcher in getattr(engine_set, "launchers", {}).values()
            if getattr(launcher, "pid", None)
        ]

    def _stop_remote(self, jobs: list[str], ssh_engines: list[tuple[str, int]]) -> list[str]:
        """Make sure nothing is left where the launcher ran engines: the batch job has
        left the queue (``scancel``, then ``scancel -s KILL``), and on each SSH host
        the engines are gone (SIGKILL for what survived SIGTERM) and this cluster's
        folder removed. Returns what is still left, in words."""
        left = []
        for job in jobs:
            if not _wait_job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                subprocess.run(["scancel", "-s", "KILL", job], capture_output=True, timeout=30, check=False)
                if not _wait_job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                    left.append(f"SLURM job {job} is still in squeue")
        if self.launcher_plan.ssh_hosts:
            remote_dir = self.launcher_plan.config["SSHEngineSetLauncher"]["remote_profile_dir"]
            for location, args in self.launcher_plan.ssh_hosts:
                pids = " ".join(str(pid) for where, pid in ssh_engines if where == location)
                out = _ssh(location, args, _REMOTE_CLEANUP.format(pids=pids, folder=remote_dir))
                if out is None or "left:" not in out or out.split("left:")[1].strip():
                    left.append(
                        f"{location}: engines {out.split('left:')[1].strip() if out and 'left:' in out else '?'} left"
                    )
        return left

    def restart(self) -> RankCluster:
        """Stop and start again with the same ranks and wiring."""
        self.stop()
        return self.start()

    # -- using the ranks ----------------------------------------------------------------
    def _require_running(self) -> None:
        if not self.running:
            raise RuntimeError("the cluster is not running; start it with %vgpu_cluster start N --framework NAME")
        if self.must_restart:
            raise RuntimeError(f"the cluster must be restarted ({self.must_restart}): %vgpu_cluster restart")

    def run(
        self,
        code: str,
        namespace: dict[str, Any] | None = None,
        timeout: float | None = None,
        output: bool = False,
        plot: bool = False,
    ) -> list[Any] | None:
        """Run ``code`` on every rank under the fault policy (:mod:`.run`).

        Names ``code`` reads from ``namespace`` are sent by value first,
        except names earlier cells assigned on the ranks (:attr:`rank_names`).
        Returns the value of the last expression on each rank, in rank order,
        when ``output`` is true. Raises :class:`~.names.UnsendableName`,
        :class:`~.run.RankRunError`, or :class:`RuntimeError` if the cluster
        is not usable.
        """
        self._require_running()
        namespace = namespace or {}
        compile(code, "<cell>", "exec")
        names = names_to_send(code, namespace, self.rank_names)
        if names:
            self._send(pack_names(namespace, names), {name: type(namespace[name]).__name__ for name in names})
        if output:
            code = split_last_expression(code, "_vgpu_out")

        def submit(rank: int) -> Any:
            return self.client[self.engine_ids[rank]].execute(code, silent=False, block=False)

        gpu = self.layout is not None and any(p.gpu for p in self.layout.places)
        runner = RankRun(self.pids, submit, self._exit_code, timeout=timeout, plot=plot, gpu=gpu)
        candidates = names_written(code)
        self.last_run = runner
        try:
            results = runner.run()
        except RankRunError as exc:
            if exc.must_restart:
                self.must_restart = exc.headline().split(";")[0]
            else:
                self._settle_rank_names(candidates)
            raise
        except KeyboardInterrupt:
            if runner.killed:
                killed = runner.killed
                ranks = f"rank{'s' if len(killed) > 1 else ''} {', '.join(map(str, killed))}"
                self.must_restart = f"{ranks} {'were' if len(killed) > 1 else 'was'} killed after an interrupt"
            else:
                self._settle_rank_names(candidates)
            raise
        self._settle_rank_names(candidates)
        if output:
            return self._pull_values()
        for rank, ar in enumerate(results):
            shown = (
                (ar.execute_result or {}).get("data", {}).get("text/plain") if hasattr(ar, "execute_result") else None
            )
            if shown is not None:
                print(f"[rank {rank}] Out: {shown}")
        return None

    def _send(self, blobs: dict[str, bytes], kinds: dict[str, str]) -> None:
        """Bind the pickled names on every rank; :class:`~.names.UnsendableName` naming the first
        that a rank cannot unpickle (a module only the kernel can import), with the rank's reason."""
        self.view.push({"_vgpu_names": blobs}, block=True)
        self.view.execute(_UNPACK_NAMES, block=True)
        for rank, failed in enumerate(self.view.pull("_vgpu_failed", block=True)):
            if failed:
                name, reason = failed
                raise UnsendableName(
                    f"cannot send {name!r} ({kinds[name]}) to the ranks: rank {rank} cannot unpickle it "
                    f"({reason}); make it importable on the ranks, or create it inside the cell"
                )

    def _pull_values(self) -> list[Any]:
        """Each rank's ``_vgpu_out``; :class:`~.names.UnsendableName` in one line if one cannot come back."""
        self.view.execute(_CHECK_OUT, block=True)
        for rank, failed in enumerate(self.view.pull("_vgpu_out_failed", block=True)):
            if failed:
                kind, reason = failed
                raise UnsendableName(
                    f"the cell's last value on rank {rank} ({kind}) cannot be sent back to the notebook: {reason}; "
                    "end the cell with plain values (numbers, lists, arrays), e.g. list(...) of a generator"
                )
        return [self.client[e].pull("_vgpu_out", block=True) for e in self.engine_ids]

    def _settle_rank_names(self, candidates: set[str]) -> None:
        """:attr:`rank_names` becomes what exists on the ranks of the names cells may have bound: a
        name deleted there, or whose assignment never ran, is the notebook's again."""
        asked = sorted(self.rank_names | candidates)
        if not asked:
            return
        from ipyparallel.error import IPythonError

        try:
            self.view.execute(f"_vgpu_present = [n for n in {asked!r} if n in globals()]", block=True)
            present = self.view.pull("_vgpu_present", block=True)
        except (IPythonError, OSError, TimeoutError):
            # A rank that cannot answer (it died): keep every candidate as rank state, the safe side.
            self.rank_names |= candidates
            return
        self.rank_names = set().union(*map(set, present))

    def run_script(
        self, path: str, args: list[str] | tuple[str, ...] = (), timeout: float | None = None, plot: bool = False
    ) -> None:
        """Run the script ``path`` with ``args`` on every rank, as ``torchrun ...
        path ARGS`` runs it (:func:`~.names.script_code`), under the same fault
        policy as :meth:`run`.

        Each run is a fresh launch, as each ``torchrun`` is: the ranks get new
        coordinator ports (and torch a new run id) first. A process group the
        previous run destroyed can still hold its TCP store open (measured with
        a DDP model, torch 2.14), and a new ``init_process_group`` on the old
        port would meet that stale store.
        """
        self._require_running()
        self.hosts = self._read_hosts(self.engine_ids)
        self.layout = self._layout(self.hosts)
        self.plans = self.fw.plan_ranks(self.layout, self.split, self.memory_mib, self.port)
        for place, plan in zip(self.layout.places, self.plans):
            self.client[place.engine_id].apply_sync(prepare_rank, plan.env, "", ())
        self.run(script_code(os.path.abspath(path), list(args)), timeout=timeout, plot=plot)

    def status(self) -> list[RankInfo]:
        """Each rank's PID, liveness and memory (RSS, and GPU memory where NVML has it)."""
        from .memory import RankMemorySampler

        if not self.running:
            return []
        places = self.layout.places
        here = socket.gethostname()
        # A PID on another host names nothing here: such ranks are alive while their engine is registered.
        local = [not self.launcher_plan.remote or place.hostname == here for place in places]
        sampler = RankMemorySampler([pid for pid, mine in zip(self.pids, local) if mine], any(p.gpu for p in places))
        local_rss, local_gpu = iter(sampler.rss()), iter(sampler.gpu())
        sampler.close()
        rss = [next(local_rss) if mine else None for mine in local]
        gpu = [next(local_gpu) if mine else None for mine in local]
        registered = set(self.client.ids) if self.client is not None else set()
        alive = [
            process_alive(pid) if mine else engine in registered
            for pid, mine, engine in zip(self.pids, local, self.engine_ids)
        ]
        return [
            RankInfo(
                rank,
                self.engine_ids[rank],
                pid,
                alive[rank],
                rss[rank] if alive[rank] else None,
                gpu[rank],
                places[rank].hostname,
            )
            for rank, pid in enumerate(self.pids)
        ]

    def describe(self) -> list[str]:
        """Lines for ``%vgpu_cluster start`` / ``status``."""
        from ..units import format_bytes

        if not self.running:
            return ["no cluster running"]
        where = self.launcher_plan.describe()
        engine_sets = getattr(self.cluster, "engines", {}).values()
        where += "".join(f", job {es.job_id}" for es in engine_sets if getattr(es, "job_id", ""))
        lines = [f"{self.n} {self.label} rank{'s' if self.n > 1 else ''} on {where}"]
        lines.extend(self.plans[0].notes if self.plans else ())
        join_call = self.fw.join_call
        if join_call and self.join:
            lines.append(f"each rank has joined ({join_call} at start, --join): your code must not call it again")
        elif join_call:
            lines.append(
                f"each rank has its launcher's environment; your code calls {join_call}, as under its launcher"
            )
        infos = self.status()
        # One host needs no naming on every line; ranks on several hosts say where each runs.
        several_hosts = len({info.host for info in infos}) > 1
        for info in infos:
            state = "alive" if info.alive else "dead"
            if info.alive and info.rss is not None:
                state += f", RSS {format_bytes(info.rss)}"
            if info.alive and info.gpu is not None:
                state += f", GPU {format_bytes(info.gpu)}"
            where = f" on {info.host}" if several_hosts else ""
            lines.append(f"  rank {info.rank}: pid {info.pid}{where}, {state}")
        if self.must_restart:
            lines.append(f"must be restarted ({self.must_restart}): %vgpu_cluster restart")
        return lines

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<RankCluster {self.n} × {self.framework}, {state}>"


#: Host memory one rank is assumed to need at most before one is measured (torch on CPU measured ~530 MiB).
RANK_MEMORY_BOUND = 2 * 1024**3
_footprints: dict[str, int] = {}


def rank_footprint(module: str) -> int:
    """Resident bytes of one rank once it has imported ``module`` (an engine's own
    imports too), measured once per kernel in a fresh interpreter."""
    import subprocess

    if module not in _footprints:
        code = f"import psutil, ipyparallel.engine.app, {module}; print(psutil.Process().memory_info().rss)"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
        _footprints[module] = int(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else 0
    return _footprints[module]


def _check_memory_fits(n: int, fw: Any) -> None:
    """:class:`ClusterStartError` in one line if ``n`` ranks would not fit in the host's available
    memory, estimated from one measured rank. Measured only where the bound leaves doubt."""
    import psutil

    from ..units import format_bytes

    available = psutil.virtual_memory().available
    if n * RANK_MEMORY_BOUND <= available:
        return
    one = rank_footprint(fw.module)
    if not one or n * one <= available:
        return
    raise ClusterStartError(
        f"{n} {fw.label} ranks need about {format_bytes(n * one)} of memory (one rank with {fw.module} "
        f"imported: {format_bytes(one)}), but {format_bytes(available)} is available; start at most "
        f"{max(1, available // one)} ranks"
    )


#: Run on the ranks: bind each pushed name, stopping at the first that cannot be unpickled there.
_UNPACK_NAMES = """
import cloudpickle as _vgpu_cp
_vgpu_failed = None
for _vgpu_name, _vgpu_blob in _vgpu_names.items():
    try:
        globals()[_vgpu_name] = _vgpu_cp.loads(_vgpu_blob)
    except Exception as _vgpu_error:
        _vgpu_first = str(_vgpu_error).splitlines()[0] if str(_vgpu_error) else ""
        _vgpu_failed = (_vgpu_name, f"{type(_vgpu_error).__name__}: {_vgpu_first}".rstrip(": "))
        break
del _vgpu_cp, _vgpu_names
"""

#: Run on the ranks: can the cell's last value be pickled back to the kernel?
_CHECK_OUT = """
import pickle as _vgpu_pickle
_vgpu_out_failed = None
try:
    _vgpu_pickle.dumps(_vgpu_out)
except Exception as _vgpu_error:
    _vgpu_out_failed = (type(_vgpu_out).__name__, f"{type(_vgpu_error).__name__}: {_vgpu_error}")
del _vgpu_pickle
"""


def _check_port_free(port: int) -> None:
    """:class:`ClusterStartError` naming ``port`` (and who holds it) if it cannot be bound here.

    Checked before anything starts: otherwise JAX's coordinator only says "rank 0
    died", and TensorFlow starts and then fails in the user's first
    ``MultiWorkerMirroredStrategy()``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", port))
    except OSError as exc:
        holder = ""
        try:
            import psutil

            pids = {c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid}
            if pids:
                holder = f" by pid {', '.join(map(str, sorted(pids)))}"
        except psutil.Error:
            # Naming the holder is a courtesy; where psutil may not list connections, the port alone is said.
            pass
        raise ClusterStartError(
            f"--port {port} is in use on this machine{holder} ({exc.strerror}); "
            "choose another, or leave --port out for a free one"
        ) from None
    finally:
        sock.close()


def _watched_config(token: str) -> Any:
    """ipyparallel configuration that starts the controller and the engines under
    :mod:`.lifetime`'s watch of this kernel, marked with the cluster's ``token``."""
    from traitlets.config import Config

    env = {lifetime.OWNER_ENV: lifetime.owner_of_this_process(), lifetime.CLUSTER_ENV: token}
    config = Config()
    config.LocalControllerLauncher.controller_cmd = lifetime.watched_command("ipyparallel.controller")
    config.LocalControllerLauncher.environment = dict(env)
    for launcher in ("LocalEngineSetLauncher", "MPIEngineSetLauncher"):
        config[launcher].engine_cmd = lifetime.watched_command("ipyparallel.engine")
        config[launcher].environment = dict(env)
    return config


def _engine_launcher(launcher: str) -> Any:
    """The ipyparallel engine launcher for ``launcher``; local engines record how they exit.

    ipyparallel's launcher reaps an engine in a thread and hands its exit status to
    its event loop, which may never run it (the kernel's loop is busy running the cell
    that watches the ranks): without this, a dead rank's status is lost.
    """
    if launcher != "local":
        return launcher
    import psutil
    from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher

    class ExitRecordingProcess(psutil.Process):
        exit_code: int | None = None

        def wait(self, timeout: float | None = None) -> int | None:
            code = super().wait(timeout)
            self.exit_code = code
            return code

    class ExitRecordingEngineLauncher(LocalEngineLauncher):
        def _start_waiting(self) -> None:
            self.process = ExitRecordingProcess(self.process.pid)
            super()._start_waiting()

    class ExitRecordingEngineSetLauncher(LocalEngineSetLauncher):
        launcher_class = ExitRecordingEngineLauncher

    return ExitRecordingEngineSetLauncher
