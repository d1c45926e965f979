"""What of a rank's output reaches the notebook: each rank gets its framework's quiet log settings where the
user set none (:func:`rank_env`); the start-up lines no setting silences (the framework's ``chatter``) are held
back per rank (:class:`HeldBack`; ``%vgpu_cluster log RANK``, and a failing rank's with its traceback);
``verbose`` shows everything. A rank's traceback names the notebook's cell (:func:`notebook_traceback`).
"""

from __future__ import annotations

import os
import re
import signal
from collections import deque
from collections.abc import Mapping

__all__ = ["HELD_LINES", "HeldBack", "rank_env", "notebook_traceback", "as_terminal_shows", "how_it_ended"]

#: Lines held back per rank (the oldest go first).
HELD_LINES = 2000


def rank_env(fw, verbose: bool = False, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The log settings a rank of ``fw`` gets: the framework's quiet values (defaults with ``verbose``) where
    the kernel's ``environ`` has none the user set (a value the extension set there is not the user's)."""
    from .. import _quieted

    ours = _quieted()
    return {
        name: default if verbose else quiet
        for name, (quiet, default) in fw.log_settings.items()
        if name not in environ or environ[name] == ours.get(name)
    }


class HeldBack:
    """Each rank's held-back start-up lines: those matching ``patterns`` (whole-line regular expressions),
    none with ``verbose``."""

    def __init__(self, patterns: tuple[str, ...] = (), verbose: bool = False) -> None:
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns and not verbose else None
        self.held: dict[int, deque[str]] = {}
        #: What each rank held back in the current run (:meth:`mark`).
        self.this_run: dict[int, list[str]] = {}

    def shown(self, rank: int, line: str) -> bool:
        """Is ``line`` of ``rank`` shown? If not, it is held back."""
        if self.pattern is None or not self.pattern.fullmatch(line.rstrip()):
            return True
        self.held.setdefault(rank, deque(maxlen=HELD_LINES)).append(line)
        self.this_run.setdefault(rank, []).append(line)
        return False

    def mark(self) -> None:
        """A run starts."""
        self.this_run = {}

    def lines(self, rank: int | None = None) -> list[str]:
        """What ``%vgpu_cluster log [RANK]`` prints: the held-back lines, labelled."""
        ranks = sorted(self.held) if rank is None else [rank]
        return [f"[rank {r}] {line}" for r in ranks for line in self.held.get(r, ())]


_COUNT = re.compile(r"(Cell(?:\x1b\[[0-9;]*m|\s)*)In\[\d+\]")


def notebook_traceback(text: str, count: int | None) -> list[str]:
    """A rank's traceback with the notebook cell's ``In[count]`` (or none) for the rank's own "Cell In[k]"."""

    def shown(found: re.Match) -> str:
        cell = found.group(1)
        return f"{cell}In[{count}]" if count is not None else re.sub(r"\s", "", cell)

    return _COUNT.sub(shown, text).splitlines()


def as_terminal_shows(line: str) -> str:
    """The text a terminal shows for ``line``: each ``\\r`` returns to the start,
    and what follows overwrites what was there (``'10/30\\r20/30'`` -> ``'20/30'``)."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part) :]
    return shown


def how_it_ended(code: int) -> str:
    """An exit status as a launcher says it: ``exited with status 3``, ``was killed by SIGSEGV``."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
