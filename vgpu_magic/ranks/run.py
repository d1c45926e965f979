"""Running one piece of work on every rank under the fault policy docs/ranks.md states (*When a rank fails*):
:class:`RankRun` submits it to each rank (one ipyparallel ``AsyncResult`` each) and watches them from the kernel:
output streams live, labelled ``[rank r]`` (:mod:`.shown`); memory is sampled (:mod:`.memory`). It returns a
:class:`~.spec.RunResult` on success and failure alike; the cluster sets its state from it."""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TextIO

from ..monitor.session import MonitorSession
from ..runtime import running_cell
from .failures import PEER_GONE, how_it_ended, notebook_traceback, taken_down
from .launch import INTERRUPT_LIMIT, STUCK
from .memory import RankMemorySampler, run_ending
from .processes import RankProcesses, keep_logs
from .shown import HeldBack, LineStream, events, show_display
from .spec import RankFailure, RankOutcome, RunResult, RunState

__all__ = ["RankFailure", "RankRunError", "RankRun", "RankWork", "interrupt_only_the_cell"]

#: Seconds the other ranks get, after the first failure, to finish (or fail) on their own.
COLLECT = 1.0
#: Seconds a rank has to come back after SIGINT before it is killed.
GRACE = 3.0
#: Seconds between looks at the ranks (output, completion, liveness).
POLL = 0.05
#: Seconds to wait, at the end of a run, for output still on its way from finished ranks.
OUTPUT_WAIT = 5.0
#: How a run says the cluster is left unusable.
_RESTART = "the cluster must be restarted: %vgpu_cluster restart"


class RankRunError(RuntimeError):
    """A run on the ranks failed (``result``, by rank); IPython shows each failing traceback once, labelled by ranks."""

    def __init__(self, result: RunResult) -> None:
        self.result, self.must_restart = result, result.state is RunState.MUST_RESTART
        self.failures = [outcome.failure for outcome in result.outcomes.values() if outcome.failure is not None]
        self.failure = self.failures[0]
        self.interrupted = [rank for rank, outcome in result.outcomes.items() if outcome.end == "interrupted"]
        self.killed = [rank for rank, outcome in result.outcomes.items() if outcome.killed]
        super().__init__(self.headline())

    def headline(self, state: bool = True) -> str:
        """One line: what failed (like failures together), what was done to the others, (``state``) if usable."""
        parts = [_rank_s(ranks, said) for said, ranks in _by_reason({f.rank: f.summary for f in self.failures}).items()]
        if self.interrupted:
            parts.append(f"interrupted {_rank_s(self.interrupted)}")
        killed = _by_reason({rank: self.result.outcomes[rank].killed for rank in self.killed})
        parts.extend(f"killed {_rank_s(ranks)} ({why})" for why, ranks in killed.items())
        if self.result.attempts > 1:
            parts.append(f"after {self.result.attempts} attempts")
        if state:
            parts.append(_RESTART if self.must_restart else "the cluster is still usable")
        return "; ".join(parts)

    def _render_traceback_(self) -> list[str]:
        lines = [
            f"[{_rank_s(ranks)}] {line}"
            for traceback, ranks in _by_reason({f.rank: f.traceback for f in self.failures if f.kind != "peer"}).items()
            for block in traceback
            for line in block.splitlines()
        ]
        return [*lines, f"RankRunError: {self.headline()}"]


def _by_reason(why: dict[int, Any]) -> dict[Any, list[int]]:
    """``{why: ranks}``, first seen first."""
    ranks: dict[Any, list[int]] = {}
    for rank, said in why.items():
        ranks.setdefault(said, []).append(rank)
    return ranks


def _rank_s(ranks: list[int], said: str = "") -> str:
    """``"rank 0"``, ``"ranks 0, 1"``; then what is ``said`` of them, "was" and "is" agreeing: ``"ranks 1, 2 were
    killed"``."""
    several = len(ranks) > 1
    verb, _, rest = said.partition(" ")
    if several and verb in ("was", "is"):
        said = f"{'were' if verb == 'was' else 'are'} {rest}"
    return f"rank{'s' if several else ''} {', '.join(str(r) for r in sorted(ranks))}{' ' if said else ''}{said}"


def _killed(ranks: list[int], why: str) -> str:
    """``"rank 0 did not stop within 3 s of SIGINT and was killed"`` where ``why`` is ``"did not stop ..."``."""
    were = "were" if len(ranks) > 1 else "was"
    return _rank_s(ranks, f"{why} and {were} killed")


# -- watching the ranks ---------------------------------------------------------------


@dataclass(frozen=True)
class RankWork:
    """What a run submits to every rank: a cell's ``code``, run as the rank's own; else ``function`` applied to the
    rank's ``args[rank]``."""

    code: str = ""
    function: Callable[..., Any] | None = None
    args: Sequence[tuple] = ()

    def submit(self, engine: Any, rank: int) -> Any:
        """Send it to the rank's ``engine`` (an ipyparallel view): the rank's AsyncResult."""
        if self.function is None:
            return engine.execute(self.code, silent=False, block=False)
        return engine.apply_async(self.function, *self.args[rank])


@dataclass
class RankRun:
    """One run of ``work`` on every rank, reached through ``procs``."""

    procs: RankProcesses
    work: RankWork
    timeout: float | None = None
    plot: bool = False
    gpu: bool = False
    #: A script run: each rank's memory is its engine's and the process it launched (:mod:`.launch`).
    launched: bool = False
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)
    #: The ranks' held-back start-up lines (:mod:`.shown`); ``None`` shows every line.
    held: HeldBack | None = None
    #: When the ``timeout`` started (``time.monotonic()``): before this run where it is a restart's, by default now.
    since: float | None = None
    #: The hang doctor (:class:`~.doctor.HangDoctor`) that looks at the ranks while they run, or ``None``.
    doctor: Any = None

    def __post_init__(self) -> None:
        self.trace = None  # the run's MemoryTrace, once it ended
        self._seen: dict[int, int] = {}  # how many of each rank's output events were shown
        #: Seconds a rank has at most to come back after SIGINT: a launch's, while its engine stops its process.
        self.grace = GRACE + (INTERRUPT_LIMIT + STUCK if self.launched else 0.0)
        #: Why a rank whose engine did not come back after SIGINT was killed.
        self.late = f"did not stop within {self.grace:g} s of SIGINT"

    def _emit(self, results: list[Any], streams: list[tuple[LineStream, LineStream]]) -> None:
        for rank, (ar, (out, err)) in enumerate(zip(results, streams)):
            seen = self._seen.get(rank, 0)
            # Read once: the list grows on ipyparallel's thread meanwhile.
            new = events(ar)[seen:]
            self._seen[rank] = seen + len(new)
            for kind, content in new:
                if kind == "display":
                    show_display(rank, content, self.stdout)
                else:
                    (out if kind == "stdout" else err).feed(content)

    def _drain(self, results: list[Any], streams: list[tuple[LineStream, LineStream]]) -> None:
        """Show the rest of each finished, living rank's output, which can trail its reply by seconds (a million
        lines); waited for while more comes within OUTPUT_WAIT."""
        waiting = [rank for rank, ar in enumerate(results) if ar.ready() and self.procs.alive(rank)]
        arrived, since = -1, time.monotonic()
        while waiting and time.monotonic() - since < OUTPUT_WAIT:
            self._emit(results, streams)
            waiting = [rank for rank in waiting if not results[rank].wait_for_output(0)]
            count = sum(len(events(results[rank])) for rank in waiting)
            if count != arrived:
                arrived, since = count, time.monotonic()
            time.sleep(POLL if waiting else 0)
        self._emit(results, streams)
        for rank in waiting:
            self.stderr.write(f"[rank {rank}] the rest of its output did not arrive within {OUTPUT_WAIT:g} s\n")

    def _end(self, streams: list[tuple[LineStream, LineStream]], failures: dict[int, RankFailure], stopped=()) -> None:
        """End each rank's streams. A rank that failed (or was ``stopped``) saying its peer went (:data:`PEER_GONE`)
        while another failed otherwise was taken down by that one: one line says so, in its stream (with where it
        was) and failure."""
        failed = {*stopped, *(r for r, f in failures.items() if f.kind == "error")}
        peers = [r for r in failed if streams[r][1].peer or PEER_GONE.search(getattr(failures.get(r), "summary", ""))]
        first = [r for r in failures if r not in peers]
        for rank, (out, err) in enumerate(streams):
            mine = err.pending_text() or list(getattr(failures.get(rank), "traceback", ()))
            said = taken_down(mine, _rank_s(first[:1])) if first and rank in peers else None
            held = out.end() + err.end(said)
            if said:
                failures[rank] = RankFailure(rank, "peer", said[0], tuple(held) or failures[rank].traceback)

    def _failure(self, rank: int, ar: Any) -> RankFailure:
        exc = _error(ar)
        # A remote error's own traceback, without ipyparallel's "[engine:method]" line (lines are labelled by rank).
        text = getattr(exc, "traceback", None)
        if isinstance(text, str) and text:
            tb: tuple[str, ...] = tuple(notebook_traceback(text, running_cell()))
        else:
            tb = tuple(exc.render_traceback()) if hasattr(exc, "render_traceback") else (str(exc),)
        ename = getattr(exc, "ename", type(exc).__name__)
        evalue = getattr(exc, "evalue", str(exc))
        if ename == "EngineError" or not self.procs.alive(rank):
            return self._death(rank)
        if ename == "ProcessExited":
            # A launched script's process (:mod:`.launch`): how it ended; its traceback was shown as it wrote it.
            return RankFailure(rank, "error", str(evalue))
        # The headline is one line; the whole message is in the traceback.
        first = (str(evalue).strip().splitlines() or [""])[0]
        return RankFailure(rank, "error", f"raised {ename}: {first}".rstrip(": "), tb)

    def _death(self, rank: int) -> RankFailure:
        code, deadline = None, time.monotonic() + (1.0 if self.procs.on_this_host(rank) else 0.0)
        while time.monotonic() < deadline and (code := self.procs.exit_code(rank)) is None:
            time.sleep(POLL)
        how = "died (exit status unknown)" if code is None else how_it_ended(code)
        elsewhere = not self.procs.on_this_host(rank) and self.procs.hosts
        where = f"pid {self.procs.pids[rank]}" + (f" on {self.procs.hosts[rank]}" if elsewhere else "")
        # With what the processes logged, which a restart would remove.
        kept = keep_logs(self.procs.cluster, self.procs.launchers.values())
        return RankFailure(rank, "died", f"{how} ({where}){kept}", (f"rank {rank} {how}",))

    def _stop_others(self, results: list[Any], done: set[int]) -> tuple[list[int], list[int]]:
        """SIGINT every rank still running (not in ``done``, nor :func:`_settled`), kill those still busy after it."""
        running = [r for r, ar in enumerate(results) if r not in done and not _settled(ar) and self.procs.alive(r)]
        for rank in running:
            self.procs.signal(rank, signal.SIGINT)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(not _settled(results[r]) and self.procs.alive(r) for r in running):
            time.sleep(POLL)
        stuck = [r for r in running if not _settled(results[r]) and self.procs.alive(r)]
        for rank in stuck:
            self.procs.signal(rank, signal.SIGKILL)
        # Replies may trail the engines' idle; SIGKILL is delivered asynchronously: report the killed once gone.
        futures.wait([ar for r, ar in enumerate(results) if r not in stuck and _settled(ar)], timeout=COLLECT)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(self.procs.alive(r) for r in stuck):
            time.sleep(POLL)
        return running, stuck

    def _collect(self, results: list[Any], failures: dict[int, RankFailure]) -> None:
        """Add to ``failures`` each rank that raised or died since the last look."""
        for rank, ar in enumerate(results):
            if rank in failures:
                continue
            if ar.ready() and not ar.successful():
                failures[rank] = self._failure(rank, ar)
            elif not ar.ready() and not self.procs.alive(rank):
                failures[rank] = self._death(rank)

    def run(self) -> RunResult:
        """Run to the end: how it ended, with each rank's AsyncResult (``replies``); KeyboardInterrupt, said in one
        line, where the run was interrupted."""
        n = len(self.procs.pids)
        held = self.held or HeldBack()
        held.this_run = {}
        lives: dict[int, dict] = {}

        def stream(r: int, out: TextIO) -> LineStream:
            # Whose unfinished line is drawn is one record per output, which every rank's stream to it shares.
            return LineStream(f"[rank {r}] ", out, partial(held.shown, r), f"[rank{r}]:", lives.setdefault(id(out), {}))

        # Two streams, as Jupyter shows a cell's own: a rank's stdout to stdout, its stderr (warnings, logs) to stderr.
        streams = [(stream(r, self.stdout), stream(r, self.stderr)) for r in range(n)]
        sampler = RankMemorySampler(self.procs.memory_pids(), self.gpu, self.launched, self.procs.engine)
        memory = MonitorSession(sampler=sampler, interval=0.2, display="auto" if self.plot else "none")
        start = time.monotonic() if self.since is None else self.since
        results: list[Any] = []
        failures: dict[int, RankFailure] = {}
        timed_out: RankFailure | None = None
        try:
            memory.start("%vgpu_run" if self.launched else "%%vgpu_run")
            results = [self.work.submit(self.procs.engine(rank), rank) for rank in range(n)]
            collected_by = math.inf
            while True:
                self._emit(results, streams)
                sampler.ended = {rank for rank, ar in enumerate(results) if ar.ready()}
                seen = len(failures)
                # Replies land on ipyparallel's thread any time: end only on what was looked at (and collected).
                looked = [ar.ready() for ar in results]
                self._collect(results, failures)
                if self.doctor is not None:
                    self.doctor.look(looked)
                now = time.monotonic()
                if len(failures) > seen:
                    # The others get COLLECT seconds after each failure to finish, or fail, before any is interrupted.
                    collected_by = now + COLLECT
                elif not failures and not all(looked) and self.timeout is not None and now - start > self.timeout:
                    late = [r for r in range(n) if not looked[r]]
                    said = f"did not finish within --timeout {self.timeout:g} s (still running: {_rank_s(late)})"
                    said += self._where(looked)
                    timed_out = RankFailure(late[0], "timeout", said, (f"timed out after {self.timeout:g} s",))
                if timed_out or now >= collected_by or all(looked[r] or r in failures for r in range(n)):
                    break
                # AsyncResults are futures: wake as soon as one finishes, else look again after POLL.
                futures.wait(
                    [ar for ar in results if not ar.ready()], timeout=POLL, return_when=futures.FIRST_COMPLETED
                )
        except KeyboardInterrupt:
            where = self._where([ar.ready() for ar in results]) if len(results) == n else ""
            running, killed = self._stop_others(results, set(failures))
            self._drain(results, streams)
            self._end(streams, {})
            self.trace = memory.finish(interrupted=True)
            said = [f"interrupted {_rank_s(running)}{where}" if running else "no rank was running"]
            said.extend(_killed(ranks, why) for why, ranks in _by_reason(_gone(results, running)).items())
            if killed:
                said.append(f"{_killed(killed, self.late)}; {_RESTART}")
            interrupt = KeyboardInterrupt("; ".join(said))
            # The cluster's state, as a failed run's result gives it.
            interrupt.result = _ended({}, [], killed, self.late)
            # IPython shows this one line, not the way the interrupt came through the kernel and vgpu_magic.
            interrupt._render_traceback_ = lambda: [f"KeyboardInterrupt: {interrupt}"]
            raise interrupt from None
        finally:
            if self.doctor is not None:
                self.doctor.close()
        # Without a failure or a timeout every rank succeeded: nothing to stop, no error to find.
        stopped, killed = self._stop_others(results, set(failures)) if failures or timed_out else ([], [])
        why = {**_gone(results, stopped), **dict.fromkeys(killed, self.late)}
        for rank, ar in enumerate(results):
            # A rank that came back (from the interrupt, or as it was sent) with an error of its own failed too.
            exc = _error(ar) if rank not in failures and rank not in why else None
            if exc is not None and getattr(exc, "ename", type(exc).__name__) != "KeyboardInterrupt":
                failures[rank] = self._failure(rank, ar)
        self._drain(results, streams)
        self._end(streams, failures, stopped)
        self.trace = memory.finish(bool(failures or timed_out), run_ending(sorted(failures), timed_out is not None))
        if failures or timed_out:
            # Peer-downed ranks last, the timeout first (no later failure hides it) unless its rank failed.
            every = sorted(failures.values(), key=lambda failure: failure.kind == "peer")
            if timed_out and timed_out.rank not in failures:
                every.insert(0, timed_out)
            for failure in every:
                # What a failing rank wrote is part of its failure.
                held_back = held.this_run.get(failure.rank, ())
                self.stderr.write("".join(f"[rank {failure.rank}] {line}\n" for line in held_back))
            fate = {failure.rank: failure for failure in every}
            ended = {r: _outcome(fate.get(r), r in stopped, why.get(r, "")) for r in [*fate, *range(n)]}
            return _ended(ended, every, killed, self.late, results)
        return RunResult(RunState.SUCCEEDED, dict.fromkeys(range(n), RankOutcome("finished")), replies=results)

    def _where(self, done: list[bool]) -> str:
        """``" (rank 0 was waiting in ...; rank 1 was at ...)"``: where the doctor found the ranks not ``done``."""
        where = self.doctor.where(done) if self.doctor is not None else ""
        return f" ({where})" if where else ""


def _ended(outcomes: dict, failures: list[RankFailure], killed: list[int], late: str, replies=()) -> RunResult:
    """A failed run's result: it must restart for its dead ranks and those ``killed`` (``late``), else (errors only)
    the cluster is still usable."""
    died = _by_reason({f.rank: f.summary for f in failures if f.kind == "died"}).items()
    reason = "; ".join([_rank_s(ranks, said) for said, ranks in died] + [_killed(killed, late)] * bool(killed))
    return RunResult(RunState.MUST_RESTART if reason else RunState.FAILED, outcomes, reason, replies=replies)


def _gone(results: list[Any], ranks: list[int]) -> dict[int, str]:
    """``{rank: why}``: each of ``ranks`` whose engine killed its launched process after SIGINT (it lives on)."""
    errors = {rank: _error(results[rank]) for rank in ranks}
    return {r: str(exc.evalue) for r, exc in errors.items() if getattr(exc, "ename", "") == "ProcessKilled"}


def _outcome(failure: RankFailure | None, stopped: bool, killed: str) -> RankOutcome:
    """As the fault policy left the rank, unless it failed of its own (or said its peer went) after the interrupt."""
    if getattr(failure, "kind", "timeout") == "timeout":
        return RankOutcome("interrupted" if stopped else "finished", failure, killed)
    return RankOutcome("peer" if failure.kind == "peer" else "failed", failure, killed)


def _settled(ar: Any) -> bool:
    """Is the rank done: its reply came, its code raised (published before the reply), or its engine went idle (its
    output futures resolved)? A done rank is not interrupted, nor killed for a reply an interrupt lost."""
    from .upstream import message_futures

    children = message_futures(ar)
    return ar.ready() or _error(ar) is not None or (bool(children) and all(c.output.done() for c in children))


def _error(ar: Any) -> BaseException | None:
    """The rank's error: its reply's, or (a reply lost to an interrupt) the one it published as output."""
    if ar.ready():
        return ar.exception(timeout=0)
    metadata = getattr(ar, "metadata", None)
    metadata = metadata[0] if isinstance(metadata, list) and metadata else metadata
    return metadata.get("error") if isinstance(metadata, dict) else None


def interrupt_only_the_cell() -> None:
    """On a rank's engine: SIGINT interrupts a cell's own code only (in ipykernel's whole request it lost replies or
    ended the loop), and a failed cell does not abort the next (ipykernel's abort caught a run sent right after)."""
    from IPython import get_ipython

    from . import upstream

    shell = get_ipython()
    shell.events.register("pre_execute", lambda: signal.signal(signal.SIGINT, signal.default_int_handler))
    shell.events.register("post_execute", lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    upstream.set_handler_hooks(shell.kernel, lambda: None, lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    upstream.no_abort_after_an_error(shell.kernel)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
