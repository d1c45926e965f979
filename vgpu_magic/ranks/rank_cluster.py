"""The ranks: N ipyparallel engines wired as a framework's launcher wires its processes. :class:`RankCluster`, the
work behind ``%vgpu_cluster`` and ``%%vgpu_run``, adds to ipyparallel's processes their hosts and order (:mod:`.hosts`),
the wiring, the fault policy (:mod:`.run`) and a stop checked with psutil (ipyparallel's SIGKILL comes late: TensorFlow
workers lived 5 s past SIGTERM). A kernel that dies without a stop takes them along (:mod:`.lifetime`)."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

from .. import frameworks
from ..devices import simulated_line
from ..frameworks.base import RankPlan
from ..inventory import GPUInfo, NVMLReadError, nccl_version, visible_gpus
from ..layout import HostReport, RankLayout, layout_ranks
from ..units import MIB, format_bytes
from . import doctor, launch, lifetime, names, processes, spare
from .hosts import prepare_rank, report_host
from .launchers import LAUNCHERS, MAX_RANKS, Launcher, plan_launcher
from .mps import MPSDaemon, plan_mps
from .processes import ClusterStartError, RankInfo, RankProcesses
from .run import RankRun, RankRunError, RankWork, interrupt_only_the_cell
from .shown import HeldBack, rank_env, record_output
from .spec import RESTART_COUNTS, ClusterNotRunning, ClusterSpec, ClusterState, RunResult, RunState, checked_faults

__all__ = ["LAUNCHERS", "ClusterStartError", "RankCluster", "RankInfo", "current"]

#: Seconds the engines may take to register with the controller.
ENGINE_TIMEOUT = 120.0
#: Seconds the wiring (process group / coordinator rendezvous) may take.
SETUP_TIMEOUT = 120.0
_current: RankCluster | None = None
_lock = threading.Lock()


def current() -> RankCluster | None:
    """The running cluster started by ``%vgpu_cluster start`` / :meth:`RankCluster.start`, or ``None``."""
    return _current


class RankCluster:
    """``n`` ranks of ``framework`` on ipyparallel engines (docs/ranks.md): ``split`` devices per rank; ``memory`` each
    rank's GPU cap in bytes; ``port`` the coordinator's (default: a free one); ``gpus`` ``[(cuda_index, total_bytes)]``
    every host plans with; ``launcher(_options)`` how engines start; ``join``: the script's join call at start;
    ``verbose``: start-up lines shown; ``spares``: a warm spare per rank; ``backend``: the collectives'; ``mps``: an MPS
    daemon of its own (default: where MPS can run). A bad request is a :class:`ValueError` before anything starts."""

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
        verbose: bool = False,
        spares: bool = True,
        backend: str | None = None,
        mps: bool | None = None,
    ) -> None:
        if not isinstance(n, int) or not 1 <= n <= MAX_RANKS:
            raise ValueError(f"rank count {n!r} is out of range; use 1..{MAX_RANKS}")
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"--port {port} is not a TCP port; use 1..65535, or leave it out for a free one")
        self.fw = frameworks.get(framework)
        #: The framework's registry name (``"torch"``) and the name shown to people (``"PyTorch"``).
        self.framework, self.label = self.fw.name, self.fw.label
        self.cluster_id = f"vgpu-{uuid.uuid4().hex[:8]}"
        #: How the engines start, planned; once started, the owner of their processes.
        self.launcher: Launcher = plan_launcher(launcher, n, launcher_options, self.cluster_id)
        missing = [m for m in ("ipyparallel", "psutil", "cloudpickle") if importlib.util.find_spec(m) is None]
        no_framework = importlib.util.find_spec(self.fw.module) is None
        framework_hint = f"{self.label} is not installed in this kernel; {self.fw.capabilities.install_hint}"
        if missing:
            # Everything missing in one message: one install, not one error after another.
            also = f"; {framework_hint}" if no_framework else ""
            raise ValueError(f"the ranks need {', '.join(missing)}: pip install 'vgpu_magic[cluster]'{also}")
        if no_framework:
            raise ValueError(framework_hint)
        #: What was asked for, validated below (a request that cannot work fails before anything starts).
        asked = (split, memory, port, gpus, launcher, launcher_options or {}, join, verbose, spares, backend, mps)
        self.spec = ClusterSpec(n, self.fw.name, *asked)
        self.n, self.join = n, bool(join)
        #: Each rank's held-back start-up lines (:meth:`log`).
        self.held = HeldBack.of(self.fw, bool(verbose))
        #: The GPUs the caller planned for (every host then plans with them), or ``None``: each engine's own.
        self.given_gpus = gpus if gpus is None else tuple(GPUInfo(i, total_mib=t // MIB, nvml_index=i) for i, t in gpus)
        # Planned on what n engines on this host would report; start() plans again from what they report.
        try:
            seen = self.given_gpus if self.given_gpus is not None else visible_gpus()
        except NVMLReadError as exc:
            raise ValueError(str(exc)) from None
        here = [HostReport(e, socket.gethostname(), "127.0.0.1", 0, seen, 0, nccl=nccl_version()) for e in range(n)]
        self.mps: MPSDaemon | None = None
        planned = self._plan_ranks(layout_ranks(here, self.given_gpus))
        self.mps, self.mps_note = plan_mps(any(p.mps for p in planned), mps, not self.launcher.watched, self.cluster_id)
        self.plans: list[RankPlan] = []
        self._started_at = 0.0
        self._forget()

    def _forget(self) -> None:
        self.cluster = self.client = self.view = None
        self.layout: RankLayout | None = None
        self.state, self.reason = ClusterState.STOPPED, ""
        self.rank_names = names.RankNames()
        # _launchers: by PID, kept after ipyparallel forgets a stopped one (exit statuses); _token: on every process
        # of this cluster (:func:`.lifetime.processes_of`); _cleanups: :func:`.processes.clean_up_when_kernel_dies`'s.
        self.engine_ids, self.pids, self._owned, self._launchers, self._token = [], [], set(), {}, ""
        self._cleanups: set[int] = set()
        self.asks: list[str | None] = [None] * self.n
        self._doctor = ""

    @property
    def running(self) -> bool:
        """Started and not stopped (usable, or to be restarted)."""
        return self.state in (ClusterState.RUNNING, ClusterState.MUST_RESTART)

    @property
    def must_restart(self) -> str | None:
        """Why the cluster must be restarted (:attr:`state` ``MUST_RESTART``), or ``None``."""
        return self.reason if self.state is ClusterState.MUST_RESTART else None

    def runs(self, spec: ClusterSpec) -> bool:
        """Is this cluster running ``spec`` and usable? Then a start of ``spec`` ("Run all") keeps its ranks."""
        return self.state is ClusterState.RUNNING and self.spec == spec

    def start(self) -> RankCluster:
        """Start, wire and make this the current cluster; :class:`ClusterStartError` leaves nothing running."""
        try:
            return self._start()
        except ClusterStartError as exc:
            # Rank 0's port, free when its engine asked the OS, was taken (an ephemeral port of another connection)
            # before its store listened: once more, with ports asked for again.
            if "EADDRINUSE" not in str(exc) or self.spec.port is not None:
                raise
        return self._start()

    def _start(self) -> RankCluster:
        global _current
        if self.running:
            return self
        with _lock:
            previous, _current = _current, self
        if previous is not None and previous is not self:
            previous.stop()
        self._token, self._started_at, self.state = uuid.uuid4().hex, time.time(), ClusterState.STARTING
        try:
            #: Whether each rank keeps a warm spare for script runs (asked for, and memory not tight).
            self.spares = processes.check_memory_fits(self.n, self.fw) and self.spec.spares
            if self.spec.port is not None:
                processes.check_port_free(self.spec.port)
            self.cluster = processes.new_ipp_cluster(self.launcher, self.n, self.cluster_id, self._token)
            processes.despite_interrupts(lambda: self.launcher.start(self.n))
            # Remembered at once, so that even engines that never register are stopped.
            launchers = processes.local_launchers(self.launcher)
            self._owned.update(launchers)
            self._launchers.update(launchers)
            self._cleanups = processes.clean_up_when_kernel_dies(self.launcher, self._token)
            if self.mps is not None:
                # Before any rank starts CUDA: a process is MPS's client only if the daemon is there at its start.
                self._cleanups.add(lifetime.run_when_this_process_dies(self.mps.stop_command(), self._token).pid)
                self.mps.start()
            self.client = self.cluster.connect_client_sync()
            record_output(self.client)
            # interactive=False: no progress bar in the cell (the start summary says what started).
            self.client.wait_for_engines(self.n, timeout=ENGINE_TIMEOUT, block=True, interactive=False)
            self.layout = self._lay_out(sorted(self.client.ids)[: self.n])
            # Rank order: the launcher's ranks, else the engines', grouped by host.
            self.engine_ids = [place.engine_id for place in self.layout.places]
            self.pids = [place.pid for place in self.layout.places]
            if self.launcher.watched:
                # Its engines are this host's processes; another host's end through their launcher.
                self._owned.update(self.pids)
            self.view = self.client[self.engine_ids]
            self.view.block = True
            self.plans = self._plan_ranks(self.layout)
            # Each rank's environment and setup, all ranks at once (a rendezvous).
            args = [(p.env, p.setup, p.args, self.join, p.devices) for p in self.plans]
            procs, wiring = self._processes(), RankWork(function=prepare_rank, args=args)
            self._watch(RankRun(procs, wiring, timeout=SETUP_TIMEOUT, held=self.held), set())
            self.view.apply_sync(interrupt_only_the_cell)
            elsewhere = [None if procs.on_this_host(r) else p.address for r, p in enumerate(self.layout.places)]
            self._doctor, self.asks = doctor.serve([procs.engine(r) for r in range(self.n)], elsewhere)
            if self.spares:
                # A spare on every engine, importing as the start returns (a launch before then waits for it).
                preload, environ = self._preload(), spare.kernel_environ(self.launcher.task_variables)
                warm = RankWork(function=spare.warm, args=[(p.env, preload, environ) for p in self.plans])
                for ar in [warm.submit(procs.engine(r), r) for r in range(self.n)]:
                    ar.get(timeout=ENGINE_TIMEOUT)
        except BaseException as exc:
            # The start's own error first, then what the cleanup found, then where the processes' logs are kept.
            kept = processes.keep_logs(self.cluster) if isinstance(exc, Exception) else ""
            try:
                processes.despite_interrupts(self.stop)
                left = "nothing was left running" + kept
            except RuntimeError as cleanup:
                left = str(cleanup) + kept
            if isinstance(exc, RankRunError):
                raise ClusterStartError(f"wiring {self.label} failed: {exc.headline(state=False)}; {left}") from exc
            if isinstance(exc, Exception) and not isinstance(exc, ClusterStartError):
                why = self.launcher.start_failure(exc) or f"{type(exc).__name__}: {exc}"
                raise ClusterStartError(f"the ranks could not start: {why}; {left}") from exc
            raise
        self.state = ClusterState.RUNNING
        atexit.register(self.stop)
        # %px / %%px on the ranks, as ipyparallel users expect: a convenience, no error where a shell cannot take them.
        with contextlib.suppress(Exception):
            from IPython import get_ipython

            if get_ipython() is not None:
                self.view.activate()
        return self

    def _lay_out(self, engine_ids: list[int]) -> RankLayout:
        """The ranks laid out from what ``engine_ids`` report, numbered as their launcher numbered them."""
        # ipyparallel's controller_location is where engines connect when the controller listens on every interface.
        controller = self.cluster.controller_location or self.cluster.controller_ip or "127.0.0.1"
        prefixes = self.launcher.task_variables
        pending = [self.client[e].apply_async(report_host, e, controller, prefixes) for e in engine_ids]
        reports = [ar.get(timeout=ENGINE_TIMEOUT) for ar in pending]
        return layout_ranks(reports, self.given_gpus, self.launcher.launched)

    def _plan_ranks(self, layout: RankLayout) -> list[RankPlan]:
        """The framework's plans for ``layout``, with quiet logs and (where a plan uses it) the MPS daemon."""
        spec, quiet = self.spec, rank_env(self.fw, self.spec.verbose)
        memory_mib = None if spec.memory is None else spec.memory // MIB
        plans = self.fw.plan_ranks(layout, spec.split, memory_mib, spec.port, spec.backend)
        mps = self.mps.env if self.mps is not None else {}
        return [replace(p, env={**quiet, **p.env, **(mps if p.mps else {})}) for p in plans]

    def _processes(self) -> RankProcesses:
        """How the fault policy reaches the ranks: by PID on this host, through their engines elsewhere."""
        hosts = [place.hostname for place in self.layout.places]
        local = [self.launcher.reaches_by_pid(host) for host in hosts]
        return RankProcesses(self.pids, self.client, self.engine_ids, local, hosts, self._launchers, self.cluster)

    def stop(self) -> None:
        """Stop every process this cluster started (SIGTERM, then SIGKILL), checking none is left; idempotent."""
        global _current
        if self.cluster is not None:
            processes.unlist(self.cluster)
        # A client whose controller already died can fail to close; its sockets go with it.
        with contextlib.suppress(Exception):
            self.client.close()
        alive = processes.terminate(self._owned, self._token, self._started_at, spared=self._cleanups)
        left = processes.stop_launched(self.launcher) if self.cluster is not None else []
        if self.mps is not None:
            self.mps.stop()  # once its clients, the ranks, are gone: it waits for them
        # The kernel may be killed while it stops (Jupyter's shutdown waits 5 s): its clean-up watchers go last.
        alive += processes.terminate(self._cleanups)
        if self._doctor:
            shutil.rmtree(self._doctor, ignore_errors=True)
        self._forget()
        atexit.unregister(self.stop)
        with _lock:
            if _current is self:
                _current = None
        if alive:
            raise RuntimeError(f"processes {sorted(p.pid for p in alive)} did not exit after SIGKILL")
        if left:
            raise RuntimeError(f"after stopping, {'; '.join(left)}")

    def restart(self) -> RankCluster:
        self.stop()
        return self.start()

    def _require_running(self) -> None:
        if not self.running:
            raise ClusterNotRunning("the cluster is not running; start it with %vgpu_cluster start N --framework NAME")
        if self.state is ClusterState.MUST_RESTART:
            raise ClusterNotRunning(f"the cluster must be restarted ({self.reason}): %vgpu_cluster restart")

    def run(
        self,
        code: str,
        namespace: dict[str, Any] | None = None,
        timeout: float | None = None,
        output: bool = False,
        plot: bool = False,
        hang_after: float = doctor.HANG_AFTER,
    ) -> list[Any] | None:
        """Run ``code`` on every rank (fault policy: :mod:`.run`), names read sent first; ``output``: last values;
        ``hang_after``: :mod:`.doctor`'s."""
        hang_after = doctor.checked_hang_after(hang_after)
        self._require_running()
        compile(code, "<cell>", "exec")
        self._say_simulated()
        self.rank_names.send(self.view, code, namespace or {})
        if output:
            code = names.split_last_expression(code, "_vgpu_out")
        procs = self._processes()
        watch = doctor.HangDoctor([a and f"{a}-cell" for a in self.asks], hang_after, sys.stderr, procs.memory_pids())
        runner = RankRun(procs, RankWork(code), timeout, plot, self._gpu(), held=self.held, doctor=watch)
        result = self._watch(runner, names.names_written(code))
        if output:
            return names.pull_values(self.view)
        for rank, ar in enumerate(result.replies):
            shown = (getattr(ar, "execute_result", None) or {}).get("data", {}).get("text/plain")
            if shown is not None:
                print(f"[rank {rank}] Out: {shown}")
        return None

    def simulated(self) -> str:
        """What the ranks only simulate, one line (:func:`~vgpu_magic.devices.simulated_line`); ``""``: nothing."""
        return simulated_line(self.plans[0].simulated if self.plans else ())

    def _say_simulated(self) -> None:
        """A run's first line: what it simulates, once for all ranks (nothing where nothing is)."""
        said = self.simulated()
        if said:
            print(said)

    def _gpu(self) -> bool:
        return self.layout is not None and any(p.gpu for p in self.layout.places)

    def _watch(self, runner: RankRun, candidates: set[str], attempt: int = 1, last: bool = True) -> RunResult:
        """Run ``runner`` (the run's ``attempt``), the cluster's state taken from its result (an interrupt's too);
        while the cluster is usable, settle which ``candidates`` are rank state. :class:`RankRunError` where the run
        failed, unless a ``last=False`` attempt failed leaving the cluster usable: then its result, to try again."""
        result = None
        try:
            result = replace(runner.run(), attempts=attempt)
        except KeyboardInterrupt as interrupt:
            result = getattr(interrupt, "result", None)
            raise
        finally:
            if getattr(result, "state", None) is RunState.MUST_RESTART:
                self.state, self.reason = ClusterState.MUST_RESTART, result.reason
            if self.state is ClusterState.RUNNING:
                self.rank_names.settle(self.view, candidates)
        if result.state is RunState.MUST_RESTART or (last and result.state is RunState.FAILED):
            raise RankRunError(result)
        return result

    def run_script(
        self,
        path: str,
        args: list[str] | tuple[str, ...] = (),
        timeout: float | None = None,
        plot: bool = False,
        module: bool = False,
        max_restarts: int = 0,
        fail: list[str] | tuple[str, ...] = (),
        preempt: str | None = None,
        hang_after: float = doctor.HANG_AFTER,
    ) -> RunResult:
        """Launch ``path ARGS`` on every rank as ``torchrun`` does (:mod:`.launch`), all again up to ``max_restarts``
        times when one fails; ``fail``/``preempt`` inject failures into the first launch; ``timeout``: all attempts;
        ``module``: as ``torchrun -m``; ``hang_after``: :mod:`.doctor`'s. Its :class:`RunResult` (or RankRunError)."""
        faults = checked_faults(self.n, max_restarts, fail, preempt)
        hang_after = doctor.checked_hang_after(hang_after)
        self._require_running()
        attempts, start = max_restarts + 1, time.monotonic()
        # Laid out and planned once per run, its ports fresh (rank 0's engine may hold the start's, for --join or a
        # cell's process group) and chosen on the hosts that bind them. Attempts change only the restart count (as
        # torchrun's keep their master port): a lost engine ends the run; the ports were the ended attempt's.
        self.layout = self._lay_out(self.engine_ids)
        self.plans = self._plan_ranks(self.layout)
        self._say_simulated()
        where = (path, list(args), os.getcwd(), self.fw.module, self._preload(), self.spares)
        where += (self.launcher.task_variables, module)
        procs, gpu, asks = self._processes(), self._gpu(), self.asks if hang_after else [None] * self.n
        for attempt in range(1, attempts + 1):
            counts = dict(zip(RESTART_COUNTS, (str(attempt - 1), str(max_restarts))))
            # Where the plan has torchrun's restart counters: this attempt's, of at most max_restarts.
            plans = [replace(p, env={**p.env, **{k: v for k, v in counts.items() if k in p.env}}) for p in self.plans]
            requests = [launch.LaunchRequest(p, *where, faults, doctor.listens_at(a)) for p, a in zip(plans, asks)]
            faults = []  # injected into the first launch only
            work = RankWork(function=launch.run_rank, args=[(request,) for request in requests])
            watch = doctor.HangDoctor(self.asks, hang_after, sys.stderr, procs.memory_pids())
            runner = RankRun(procs, work, timeout, plot, gpu, True, held=self.held, since=start, doctor=watch)
            # The last attempt's failure raises: the loop ends on a success.
            result = self._watch(runner, set(), attempt, last=attempt == attempts)
            if result.state is RunState.SUCCEEDED:
                break
            print(f"attempt {attempt} of {attempts}: {RankRunError(result).headline(state=False)} at ", end="")
            print(f"{time.monotonic() - start:.1f} s; restarting the {self.n} rank{'s' * (self.n > 1)}")
        if attempt > 1:
            print(f"finished on attempt {attempt} of {attempts}")
        return result

    def _preload(self) -> list[str]:
        """What a spare imports before its launch: the framework, and its rank setup's module."""
        setups = {plan.setup.partition(":")[0] for plan in self.plans if plan.setup}
        return [self.fw.module, *sorted(setups)]

    def status(self) -> list[RankInfo]:
        """Each rank's PID, liveness, host and memory (RSS, and GPU where NVML has it; none on another host)."""
        return self._processes().infos(self._gpu()) if self.running else []

    def log(self, rank: int | None = None) -> list[str]:
        """The start-up lines the ranks (or ``rank``) wrote and were not shown (``%vgpu_cluster log [RANK]``)."""
        if rank is not None and not 0 <= rank < self.n:
            raise ValueError(f"rank {rank} is not one of this cluster's ranks 0..{self.n - 1}")
        return self.held.lines(rank)

    def describe(self) -> list[str]:
        """Lines for ``%vgpu_cluster start`` / ``status``: where and how the ranks run, the two modes, each rank."""
        several = "s" if self.n > 1 else ""
        if not self.running:
            return [f"{self.n} {self.label} rank{several} {self.state.value}"]
        lines = [f"{self.n} {self.label} rank{several} on {self.launcher.describe()}"]
        lines.extend(self.plans[0].notes if self.plans else ())
        lines += [line for line in [self.mps_note, self.simulated()] if line]
        call = self.fw.join_call
        joined = f"has joined ({call} at start, --join): cells must not call it again; scripts make their own call"
        own = f"has its launcher's environment; your code calls {call}, as under its launcher"
        lines += [f"each rank {joined if self.join else own}"] * bool(call)
        # Lines a notebook shows whole (a long one wraps mid-word in JupyterLab's output area).
        lines.append("cells (%%vgpu_run): run in these ranks, which keep their state")
        spare = f"no spare: {'memory is tight' if self.spec.spares else 'spares=False'}, each launch starts cold"
        spare = f"a spare waits with {self.fw.module} imported" if self.spares else spare
        lines.append(f"scripts (%vgpu_run FILE): a fresh launch each run{self.launcher.launches} ({spare})")
        infos = self.status()
        several_hosts = len({info.host for info in infos}) > 1
        for info in infos:
            state = "alive" if info.alive else "dead"
            if info.alive and info.rss is not None:
                state += f", RSS {format_bytes(info.rss)}"
            if info.alive and info.gpu is not None:
                state += f", GPU {format_bytes(info.gpu)}"
            where = f" on {info.host}" if several_hosts else ""
            lines.append(f"  rank {info.rank}: pid {info.pid}{where}, {state}")
        if self.state is ClusterState.MUST_RESTART:
            lines.append(f"{self.state.value} ({self.reason}): %vgpu_cluster restart")
        return lines

    def __repr__(self) -> str:
        return f"<RankCluster {self.n} × {self.framework}, {self.state.value}>"
