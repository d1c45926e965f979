"""A batch job's hang doctor (docs/hangs.md, "In a batch job"): the nodes share only the job's folder, so an ask is a
file there (``stacks.ask``, a fresh token), each task's thread (:class:`Answering`) answers with ``rank-R.state.json``
(:func:`.rank_state.answer` and the token), read by the kernel's own :func:`.doctor.diagnose`."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..ranks import doctor, rank_state

__all__ = ["ASK", "Answering", "look"]

ASK = "stacks.ask"
#: Created by the one task that looks into a hang (its report is the job's, once per attempt).
CLAIM = "stacks.hang"
#: Seconds between a task's looks at the ask file and, with ``--hang-after``, at its own main thread.
POLL = 1.0
#: Seconds every running task has to answer an ask.
WAIT = 15.0


class Answering:
    """Task ``rank`` of ``ranks``' thread: answers each ask in ``folder``; with ``hang_after``, once its main thread has
    idled that long in torch's code (a collective's wait), asks every task and writes a hang's report to its log."""

    def __init__(self, folder: Path, rank: int, ranks: int, hang_after: float) -> None:
        self.folder, self.rank, self.ranks, self.hang_after = folder, rank, ranks, hang_after
        self.main, self.start, self.seen, self.answered = threading.main_thread().ident, time.monotonic(), None, ""
        threading.Thread(target=self._watch, name="vgpu-doctor", daemon=True).start()

    def answer(self) -> None:
        """Answer the ask in the folder if it is a new one (read only when its stat changed)."""
        with contextlib.suppress(FileNotFoundError):
            stat = (self.folder / ASK).stat()
            if (stat.st_ino, stat.st_mtime_ns) != self.seen:
                self.seen, token = (stat.st_ino, stat.st_mtime_ns), (self.folder / ASK).read_text()
                if token != self.answered:
                    said = {**rank_state.answer(), "token": token}
                    _written(self.folder / f"rank-{self.rank}.state.json", json.dumps(said))
                    self.answered = token

    def _watch(self) -> None:
        import psutil

        process, used, since = psutil.Process(), None, None
        while True:
            time.sleep(POLL)
            # OSError: the folder's file system hiccuped (or the folder went): the next look tries again.
            with contextlib.suppress(OSError):
                self.answer()
                frame = sys._current_frames().get(self.main) if self.hang_after else None
                waits = frame is not None and os.sep + "torch" + os.sep in frame.f_code.co_filename
                now = rank_state.main_thread_use(process) if waits else None
                # As the kernel's doctor reads a rank: a loop of small collectives, in torch's code at each look, runs.
                idle = now is not None and used is not None and doctor.idled(used, now, POLL)
                used, since = now, (since or time.monotonic()) if idle else None
                if since is not None and time.monotonic() - since >= self.hang_after:
                    since = None
                    self._report()

    def _report(self) -> None:
        """Claim the job's report (unless another task has), look, and write a hang's report, else give the claim up."""
        try:
            os.close(os.open(self.folder / CLAIM, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        said, lines, _ = look(self.folder, self.ranks, self.hang_after, self.answer)
        if said is None:
            return (self.folder / CLAIM).unlink()
        head = f"vgpu_magic: a hang, {time.monotonic() - self.start:.0f} s into the run: {said}"
        job = os.environ.get("SLURM_JOB_ID", "ID")
        ending = f"the job goes on (a slow rank may still come): %vgpu_job stacks {job} looks again, cancel ends it"
        print(doctor.report(head, [*lines, ending]), end="", file=sys.__stderr__, flush=True)


def look(folder: Path, ranks: int, hang_after: float, tick: Callable[[], None] = lambda: None):
    """Ask every task twice (two answers tell a loop from a wait): the diagnosis (``None``: no hang), a line per
    rank (one that gave no answer: why), and how many answered. ``tick``: the asking task answering itself."""
    answers: dict[int, dict | None] = {}
    for first in (True, False):
        expected = range(ranks) if first else [r for r, answer in answers.items() if answer]
        previous, (answers, codes) = answers, _ask(folder, ranks, expected, tick)
        said, lines = doctor.diagnose(answers, previous, [code is not None for code in codes], hang_after)
    for rank, code in enumerate(codes):
        if answers[rank] is None:
            why = f"did not answer within {WAIT:.0f} s (not started, or C code holding the GIL)"
            lines[rank] = f"rank {rank}: " + (why if code is None else f"exited with status {code}")
    return said, lines, sum(answer is not None for answer in answers.values())


def _ask(folder: Path, ranks: int, expected, tick: Callable[[], None]) -> tuple[dict, list[str | None]]:
    """Each rank's answer to a fresh ask (``None``: none within :data:`WAIT` s from those ``expected``, or exited),
    and each rank's exit status (``None``: running)."""
    token, deadline = secrets.token_hex(8), time.monotonic() + WAIT
    _written(folder / ASK, token)
    while True:
        tick()
        codes = [_read(folder / f"rank-{r}.exit").strip() or None for r in range(ranks)]
        answers = {r: json.loads(_read(folder / f"rank-{r}.state.json") or "{}") for r in range(ranks)}
        answers = {r: answer if answer.get("token") == token else None for r, answer in answers.items()}
        if time.monotonic() > deadline or all(answers[r] or codes[r] for r in expected):
            return answers, codes
        time.sleep(0.1)


def _read(path: Path) -> str:
    with contextlib.suppress(FileNotFoundError):
        return path.read_text()
    return ""


def _written(path: Path, text: str) -> None:
    """Write ``text`` whole or not at all, as a reader on another node sees it (a rename)."""
    part = path.with_name(f".{path.name}.{secrets.token_hex(4)}")  # the asker's, or a task's on another node
    part.write_text(text)
    os.replace(part, path)
