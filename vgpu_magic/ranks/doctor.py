"""The hang doctor (docs/hangs.md): while a run waits, the kernel asks each rank on this host where it is
(:mod:`.rank_state`, over a Unix socket) and, when a rank has waited in a collective for ``hang_after`` seconds that
another never entered, or ranks entered the same collective differently (torch's Flight Recorder analyzer's rules),
or a JAX process has idled in JAX's code at a line another process is not at, prints one report: each rank's state
and line, and one line of diagnosis. The run goes on waiting."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import threading
import time
from typing import Any, TextIO

from . import rank_state
from .run import _by_reason, _rank_s

__all__ = ["HangDoctor", "checked_hang_after", "diagnose", "idled", "report", "serve"]

#: The default ``--hang-after``: seconds a rank waits in a collective that another never entered before the report.
HANG_AFTER = 30.0
#: Seconds a rank has to answer (one whose main thread holds the GIL cannot).
ANSWER = 2.0
#: A share of a core above which a rank that is not in a collective is running, not waiting (one blocked in a
#: collective or a sleep uses ~0.002; a loop on a loaded machine can get well below a whole core).
BUSY = 0.1
#: Times a second a rank's main thread may be switched out and still idle (its engine's, following a launch: 5).
WAKES = 50
#: Seconds between two answers of a rank at least, to tell a loop from a wait by its CPU time (counted in ticks of
#: 10 ms; an ask holds a rank's GIL while it answers).
APART = 1.0
#: The file ipykernel compiles a cell as (on a rank, where the magic's line is the cell's line 1).
_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")
#: torch's dtype names as Flight Recorder writes them, as people write them.
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64"}


def checked_hang_after(value: Any) -> float:
    """``--hang-after`` in seconds (``0``: no doctor), or ValueError that says what works."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 7 * 24 * 3600:
        raise ValueError(f"--hang-after {value!r} is not a number of seconds; use e.g. --hang-after 30, or 0 for none")
    return float(value)


class HangDoctor:
    """Asks the ranks at ``addresses`` (``None``: not on this host) every third of ``hang_after`` while ``look`` is
    called, and writes a report to ``out`` once per hang; :meth:`where` says where each rank is, for a stop."""

    def __init__(self, addresses: list[str | None], hang_after: float, out: TextIO, pids: list[int | None]) -> None:
        self.addresses, self.hang_after, self.out, self.pids = addresses, hang_after, out, pids
        self.period = max(1.0, hang_after / 3)
        #: Each rank's main threads' CPU seconds and switches at the last look, and when.
        self.cpu: tuple[dict[int, tuple[float, int]], float] = ({}, time.monotonic())
        self.start = time.monotonic()
        self.next = self.start + self.period
        self.answers: dict[int, dict | None] = {}
        #: When the ranks last answered (:data:`APART`).
        self.answered = 0.0
        self.reported: set[str] = set()
        #: The ask on its way, if alive (the kernel's interrupt may come meanwhile: it is waited for).
        self.asking = threading.Thread()

    def look(self, done: list[bool]) -> None:
        """Ask the ranks when it is time to, on a thread of its own (a rank may take :data:`ANSWER` s), and report a
        hang found in their answers; ``hang_after`` 0: never."""
        if self.hang_after and time.monotonic() >= self.next and not self.asking.is_alive():
            self.asking = threading.Thread(target=self._look, args=(list(done),), name="vgpu-doctor", daemon=True)
            self.asking.start()

    def _look(self, done: list[bool]) -> None:
        if not self._idle():
            self.next = time.monotonic() + self.period
            return
        previous, self.answers = self.answers, ask(self.addresses)
        self.next = self.answered = time.monotonic()
        self.next += self.period
        said, lines = diagnose(self.answers, previous, done, self.hang_after)
        if said is not None and any(previous.get(r) is None for r, a in self.answers.items() if a is not None):
            # A rank's first answer: one more, a second later, tells a loop from a wait.
            self.next = time.monotonic() + APART
        elif said is not None and said.split(";")[0] not in self.reported:
            # Once per hang, however its ranks run meanwhile.
            self.reported.add(said.split(";")[0])
            seconds = time.monotonic() - self.start
            ending = "the run goes on waiting (a slow rank may still come): --timeout or the stop button end it"
            self.out.write(report(f"vgpu_magic: a hang, {seconds:.0f} s into the run: {said}", [*lines, ending]))
            self.out.flush()

    def _idle(self) -> bool:
        """Has a rank (its engine's main thread, and the process it launched's) used less than :data:`BUSY` of a core
        and been switched out less than :data:`WAKES` times a second since the last look, or is one's unknown (on
        another host)? Main threads, as the ranks' answers count (:func:`.rank_state.main_thread_cpu`): runtime
        threads spin while a rank waits. Ranks that all run (a loop of small collectives wakes its main thread for
        each) are not asked: an answer takes the GIL from them."""
        import psutil

        seen, now = {}, time.monotonic()
        for rank, pid in enumerate(self.pids):
            with contextlib.suppress(psutil.Error, TypeError):
                processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                uses = [rank_state.main_thread_use(p) for p in processes]
                seen[rank] = (sum(cpu for cpu, _ in uses), sum(wakes for _, wakes in uses))
        (before, then), self.cpu = self.cpu, (seen, now)
        # Not at the first look, before a rank could idle: a first answer imports torch's symbolizer (1.5 s, GIL held).
        idle = [r for r in seen if r in before and idled(before[r], seen[r], now - then)]
        return None in self.pids or bool(idle)

    def where(self, done: list[bool]) -> str:
        """Where each rank not ``done`` is now, for the line of a timeout or an interrupt: ``"rank 0 was at ..."``."""
        if not self.hang_after:
            return ""
        self.close()
        # Not right after the last answers (an ask may just have ended): a loop would read as idle.
        time.sleep(max(0.0, self.answered + APART - time.monotonic()))
        previous, answers = self.answers, ask(self.addresses)
        _, lines = diagnose(answers, previous, done, self.hang_after)
        asked = [r for r, address in enumerate(self.addresses) if address is not None and not done[r]]
        return "; ".join(lines[r].replace(": ", " was ", 1) for r in asked)

    def close(self) -> None:
        """Wait for an ask on its way (its report comes before the run's end)."""
        if self.asking.is_alive():
            self.asking.join()


def idled(before: tuple[float, int], now: tuple[float, int], seconds: float) -> bool:
    """Did main threads whose CPU seconds and switches (:func:`.rank_state.main_thread_use`) went from ``before`` to
    ``now`` in ``seconds`` idle: less than :data:`BUSY` of a core, switched out less than :data:`WAKES` times a
    second?"""
    return now[0] - before[0] < BUSY * seconds and now[1] - before[1] < WAKES * seconds


def serve(engines: list[Any], hosts: list[str | None]) -> tuple[str, list[str]]:
    """At a cluster's start: a folder of its own for the ranks' sockets and each rank's address: on this host (its
    ``hosts`` entry ``None``) a Unix socket there, its engine answering beside it (``-cell``) for cells, a launch at
    the address; on another host ``tcp:HOST:PORT:NAME``, its engine's :func:`~.rank_state.relay`."""
    folder = tempfile.mkdtemp(prefix="vgpu-doctor-")
    addresses = []
    for rank, (engine, host) in enumerate(zip(engines, hosts)):
        if host is None:
            addresses.append(os.path.join(folder, str(rank)))
            engine.apply_sync(rank_state.serve, f"{addresses[-1]}-cell")
        else:
            name = f"{os.path.basename(folder)}-{rank}"
            addresses.append(f"tcp:{host}:{engine.apply_sync(rank_state.relay, name)}:{name}")
    return folder, addresses


def listens_at(address: str | None) -> str | None:
    """Where a launched rank listens for an ask to ``address``: the Unix socket, or the abstract one its engine
    relays to."""
    return f"\0{address.rpartition(':')[2]}" if address and address.startswith("tcp:") else address


def ask(addresses: list[str | None]) -> dict[int, dict | None]:
    """Each rank's answer (:func:`.rank_state.answer`), ``None`` where it gave none within :data:`ANSWER` s."""
    asked: dict[int, socket.socket] = {}
    for rank, address in enumerate(addresses):
        with contextlib.suppress(OSError):  # not listening yet, or gone: its answer is None
            if address is not None and address.startswith("tcp:"):
                host, port, name = address[4:].rsplit(":", 2)
                asked[rank] = socket.create_connection((host, int(port)), timeout=ANSWER)
                asked[rank].sendall(f"{name}\n".encode())
            elif address is not None:
                asked[rank] = socket.socket(socket.AF_UNIX)
                asked[rank].settimeout(ANSWER)
                asked[rank].connect(address)
    deadline, answers = time.monotonic() + ANSWER, dict.fromkeys(range(len(addresses)))
    for rank, connection in asked.items():
        with connection, contextlib.suppress(OSError, ValueError):
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            answers[rank] = json.loads(b"".join(iter(lambda c=connection: c.recv(65536), b"")))
    return answers


def diagnose(
    answers: dict[int, dict | None], previous: dict[int, dict | None], done: list[bool], hang_after: float
) -> tuple[str | None, list[str]]:
    """The diagnosis (``None``: no hang) and a line per rank, from each rank's answer and the one before it."""
    ranks = {r: _Rank(r, a, previous.get(r), done[r]) for r, a in answers.items()}
    lines = [rank.line() for rank in ranks.values()]
    waiting = [r for r in ranks.values() if r.waiting is not None]
    mismatch = next(filter(None, (_mismatch(rank, ranks.values()) for rank in waiting)), None)
    if mismatch is not None:
        return mismatch, lines
    for rank in sorted(waiting, key=lambda r: -r.waited):
        entry = rank.waiting
        if rank.waited < hang_after:
            continue
        pg, seq = entry["process_group"][0], entry["collective_seq_id"]
        missing = [r for r in ranks.values() if r.answer is not None or r.done]
        missing = [r for r in missing if r is not rank and r.entered(pg) < seq]
        if not missing:
            continue
        waiters = [r.rank for r in waiting if r.waiting["collective_seq_id"] == seq and r.entered(pg) == seq]
        return _hang(missing, "never called", f"{_op(entry)} #{seq}", waiters, entry["frames"]), lines
    # JAX records no collectives: a process idle in JAX's code at one line that another process is not at.
    for rank in sorted((r for r in ranks.values() if r.since is not None), key=lambda r: -r.waited):
        others = [r for r in ranks.values() if r.done or (r.answer is not None and r.spot() != rank.spot())]
        if rank.waited < hang_after or not others:
            continue
        waiters = [r.rank for r in ranks.values() if r.since is not None and r.spot() == rank.spot()]
        return _hang(others, "never reached", "the JAX call", waiters, rank.answer["stack"][-1:]), lines
    return None, lines


def _hang(absent: list[_Rank], never: str, call: str, waiters: list[int], frames: list) -> str:
    """The diagnosis: ``"ranks 1, 3 never called all_reduce #2 that ranks 0, 2 wait in (train.py:10)"``, then where
    each ``absent`` rank is, those at one place together: ``"ranks 1, 3 are at train.py:8, idle"``."""
    verb = "wait" if len(waiters) > 1 else "waits"
    said = [f"{_rank_s([r.rank for r in absent], never)} {call} that {_rank_s(waiters)} {verb} in ({_where(frames)})"]
    return "; ".join(said + [_rank_s(n, at) for at, n in _by_reason({r.rank: r.at() for r in absent}).items()])


def report(head: str, lines: list[str]) -> str:
    """The report's text: ``head`` (the diagnosis), then each of ``lines`` (a rank's, then what goes on) indented."""
    return f"{head}\n" + "".join(f"  {line}\n" for line in lines)


class _Rank:
    """One rank's answer, read: the collective it waits in (``waiting``, for ``waited`` s), where it is."""

    def __init__(self, rank: int, answer: dict | None, previous: dict | None, done: bool) -> None:
        self.rank, self.answer, self.previous, self.done = rank, answer, previous, done
        entries = (answer or {}).get("entries", [])
        self.collectives = [e for e in entries if not e.get("is_p2p")]
        open_ = [e for e in self.collectives if not e["retired"]]
        # Waiting: its main thread in torch's code (a collective's wait, a backward whose reducer waits).
        self.waiting = open_[-1] if open_ and answer["in_torch"] else None
        self.waited = answer["at"] - self.waiting["time_created_ns"] / 1e9 if self.waiting else 0.0
        # Waiting in JAX: its main thread in JAX's code, idle at the same line since an earlier answer; ``since``, when
        # it was first seen so, is kept in the answer for the next look's.
        self.since = None if self.waiting or not (answer or {}).get("in_jax") else self._since()
        if self.since is not None:
            self.waited = answer["at"] - self.since

    def _since(self) -> float | None:
        """When it was first seen idle in JAX's code at its line of the script (none: a process past the script's end
        waits in JAX's shutdown for the others), or ``None``."""
        previous, line = self.previous, self.answer["stack"][-1:]
        if not line or self.how() != "idle" or not previous.get("in_jax") or previous["stack"][-1:] != line:
            return None
        self.answer["since"] = previous.get("since", previous["at"])
        return self.answer["since"]

    def spot(self) -> list:
        """Its innermost line of the user's code (``[]``: none)."""
        return [frame[:2] for frame in self.answer["stack"][-1:]] if self.answer else []

    def entered(self, pg: str) -> int:
        """The last collective number it entered on process group ``pg`` (``0``: none); exited: none more."""
        seqs = [e["collective_seq_id"] for e in self.collectives if e["process_group"][0] == pg]
        return max([(self.answer or {}).get("entered", {}).get(pg, 0), *seqs])

    def how(self) -> str:
        """Running ``"in a loop"`` (busy in one function between two looks), ``"running"`` or ``"idle"``; ``""``: not
        known (one look)."""
        if not self.previous or self.answer is None or self.previous["pid"] != self.answer["pid"]:
            return ""
        share = (self.answer["cpu"] - self.previous["cpu"]) / max(1e-3, self.answer["at"] - self.previous["at"])
        if share < BUSY:
            return "idle"
        now, before = self.answer["stack"], self.previous["stack"]
        return "in a loop" if now and before and now[-1][:3:2] == before[-1][:3:2] else "running"

    def at(self) -> str:
        """Where its code is and how it runs there, for the diagnosis: ``"is at train.py:8, in a loop"``."""
        if self.done:
            return "exited"
        if self.answer is None:
            return "not answering (C code holding the GIL)"
        how = self.how()
        return f"is at {_where(self.answer['stack'][-1:])}" + (f", {how}" if how else "")

    def line(self) -> str:
        """Its line of the report: its state, its line of code and the source there."""
        if self.done or self.answer is None:
            return f"rank {self.rank}: {self.at()}"
        user = self.answer["stack"]
        source = f"at {_where(user[-1:])}" + (f": {user[-1][3]}" if user and user[-1][3] else "")
        if self.waiting is not None:
            entry = self.waiting
            what = f"{_op(entry)} #{entry['collective_seq_id']}" + (f" ({_tensors(entry)})" if _tensors(entry) else "")
            return f"rank {self.rank}: waiting in {what} for {self.waited:.0f} s, {source}"
        if self.since is not None:
            return f"rank {self.rank}: waiting in a JAX call for {self.waited:.0f} s, {source}"
        return f"rank {self.rank}: {self.how() + ', ' if self.how() else ''}{source}"


def _where(frames: list) -> str:
    """``train.py:10`` for the first of ``frames`` (a Flight Recorder entry's, or a stack's): its file from the
    current folder, or its name."""
    if not frames:
        return "no line of the script"
    frame = frames[0]
    path, line = (frame["filename"], frame["line"]) if isinstance(frame, dict) else frame[:2]
    if _CELL.search(path):
        return f"the cell's line {line}"
    relative = os.path.relpath(path)
    return f"{os.path.basename(path) if relative.startswith('..') else relative}:{line}"


def _op(entry: dict) -> str:
    return entry["profiling_name"].partition(":")[2] or entry["profiling_name"]


def _tensors(entry: dict) -> str:
    """``[16] float32`` for each of the entry's input tensors."""
    pairs = zip(entry.get("input_sizes", []), entry.get("input_dtypes", []))
    return ", ".join(f"{list(size)} {_DTYPES.get(dtype, dtype.lower())}" for size, dtype in pairs)


def _mismatch(rank: _Rank, ranks: Any) -> str | None:
    """How another rank entered ``rank``'s collective differently (op, sizes or dtypes), or ``None``."""
    entry = rank.waiting
    pg, seq = entry["process_group"][0], entry["collective_seq_id"]
    for other in ranks:
        theirs = [e for e in other.collectives if e["process_group"][0] == pg and e["collective_seq_id"] == seq]
        if other is rank or not theirs or not _differ(entry, theirs[0], pg, len(ranks)):
            continue
        (a, first), (b, second) = sorted([(rank.rank, entry), (other.rank, theirs[0])], key=lambda pair: pair[0])
        said = [f"{_op(e)}({_tensors(e)}) ({_where(e['frames'])})" for e in (first, second)]
        return f"at collective #{seq} rank {a} called {said[0]} and rank {b} {said[1]}"
    return None


def _differ(mine: dict, theirs: dict, pg: str, n: int) -> bool:
    """Do two ranks' entries of one collective differ, by torch's Flight Recorder analyzer (``fr_trace``)'s rules?"""
    keys = ("profiling_name", "input_sizes", "output_sizes", "input_dtypes", "output_dtypes")
    if all(mine.get(k) == theirs.get(k) for k in keys):
        return False
    try:
        from torch.distributed.flight_recorder.components.types import MatchState
        from torch.distributed.flight_recorder.components.utils import match_one_event
    except ImportError:  # a torch without the analyzer: any difference is one
        return True
    state = match_one_event(mine, theirs, {pg: set(range(n))}, pg).state
    return state not in (MatchState.FULLY_MATCHED, MatchState.COLLECTIVE_STATE_MISMATCH, MatchState.UNDECIDED)
