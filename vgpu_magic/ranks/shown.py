"""What of a rank's output reaches the notebook: quiet log settings where the user set none (:func:`rank_env`), the
start-up lines no setting silences held back (:class:`HeldBack`) unless ``verbose``, its output recorded as it arrives
(:func:`record_output`), shown in labelled whole lines (:class:`LineStream`) and displays (:func:`show_display`)."""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from .failures import PEER_GONE

__all__ = ["HELD_LINES", "HeldBack", "LineStream", "as_terminal_shows", "events", "rank_env", "record_output"]
__all__ += ["show_display"]

#: Lines held back per rank (the oldest go first).
HELD_LINES = 2000


def rank_env(fw, verbose: bool = False, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A rank's log settings: ``fw``'s quiet values (``verbose``: defaults) where the user set none in ``environ``."""
    from .. import _quieted

    ours = _quieted()
    return {
        name: default if verbose else quiet
        for name, (quiet, default) in fw.log_settings.items()
        if name not in environ or environ[name] == ours.get(name)
    }


class HeldBack:
    """Each rank's held-back start-up lines: those matching ``patterns`` (whole lines), none with ``verbose``. A held
    line holding ``end`` k times held k lines that threads wrote at once: the k - 1 lines after it that are empty or a
    number (what followed ``end`` in them) are theirs."""

    def __init__(self, patterns: tuple[str, ...] = (), verbose: bool = False, end: str = "") -> None:
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns and not verbose else None
        self.end = end
        self.held: dict[int, deque[str]] = {}
        #: What each rank held back in the current run (emptied as one starts).
        self.this_run: dict[int, list[str]] = {}
        #: Per rank, the lines after a held line that still belong to it (its newlines and digits came after another's).
        self.owed: dict[int, int] = {}

    @classmethod
    def of(cls, fw, verbose: bool = False) -> HeldBack:
        """Framework ``fw``'s chatter held back."""
        return cls(fw.chatter, verbose, fw.chatter_end)

    def shown(self, rank: int, line: str) -> bool:
        """Is ``line`` of ``rank`` shown? If not, it is held back."""
        owed = self.owed.pop(rank, 0)
        if owed and (line.strip().isdigit() or not line.strip()):
            self.owed[rank] = owed - 1
        elif self.pattern is None or not self.pattern.fullmatch(line.rstrip()):
            return True
        elif (ends := line.count(self.end) if self.end else 0) > 1:
            self.owed[rank] = ends - 1
        self.held.setdefault(rank, deque(maxlen=HELD_LINES)).append(line)
        self.this_run.setdefault(rank, []).append(line)
        return False

    def lines(self, rank: int | None = None) -> list[str]:
        """What ``%vgpu_cluster log [RANK]`` prints: the held-back lines, labelled."""
        ranks = sorted(self.held) if rank is None else [rank]
        return [f"[rank {r}] {line}" for r in ranks for line in self.held.get(r, ())]


@dataclass(eq=False)
class LineStream:
    """One rank's stream as a terminal shows it: whole lines, labelled; a ``\r`` line drawn as it goes (``live``: whose
    line is unfinished); ``theirs``: the framework's own label, left out. A traceback waits for its last line; one
    saying a peer went (:data:`PEER_GONE`: ``peer``) waits for :meth:`end`."""

    label: str
    out: TextIO
    shown: Callable[[str], bool] = lambda line: True
    theirs: str = ""
    live: dict = field(default_factory=dict)
    tail: str = field(default="", init=False)
    #: The lines of a traceback that has not ended yet (not yet known to be shown).
    pending: list[str] | None = field(default=None, init=False)
    peer: bool = field(default=False, init=False)

    def feed(self, text: str) -> None:
        """The next of what the rank wrote."""
        *lines, self.tail = (self.tail + text).split("\n")
        shown = [f"{self.label}{self._text(line)}\n" for line in self._now(lines) if self.shown(line)]
        self._write(shown)
        if "\r" in self.tail and self.pending is None:
            self._write([f"{self.label}{self._text(self.tail)}"])
            self.live["by"] = self

    def _now(self, lines: list[str]) -> list[str]:
        """Those of ``lines`` shown now, the others pending."""
        shown = []
        for line in lines:
            text = self._text(line)
            if self.pending is None and not text.startswith("Traceback (most recent call last)"):
                shown.append(line)
                continue
            self.pending = [*(self.pending or []), line]
            if not self.peer and text[:1].strip() and not text.startswith("Traceback"):
                self.peer = bool(PEER_GONE.search(text))
                if not self.peer:
                    shown, self.pending = shown + self.pending, None
        return shown

    def pending_text(self) -> list[str]:
        """The pending lines (a traceback), as shown."""
        return [self._text(line) for line in self.pending or ()]

    def end(self, said: list[str] | None = None) -> list[str]:
        """The rank is done: what was pending (or the lines ``said`` in its place), its last line even unfinished."""
        pending, self.pending, self.peer = self.pending or [], None, False
        if pending and self.tail:
            pending, self.tail = [*pending, self.tail], ""
        shown = said if said is not None else [line for line in pending if self.shown(line)]
        shown, self.tail = shown + ([self.tail] if self.tail else []), ""
        self._write([f"{self.label}{self._text(line)}\n" for line in shown])
        return [self._text(line) for line in pending]

    def _text(self, line: str) -> str:
        line = as_terminal_shows(line)
        return line.removeprefix(f"{self.theirs} ").removeprefix(self.theirs) if self.theirs else line

    def _write(self, lines: list[str]) -> None:
        """Write ``lines`` over the unfinished line drawn last, if any; where nothing is written, that line stays."""
        if lines:
            self.out.write(("\r" if self.live.pop("by", None) is not None else "") + "".join(lines))
            self.out.flush()


def as_terminal_shows(line: str) -> str:
    """The text a terminal shows for ``line``: ``\\r`` returns to the start (``'10/30\\r20/30'`` -> ``'20/30'``)."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part) :]
    return shown


def show_display(rank: int, content: dict[str, Any], out: TextIO) -> None:
    """What ``rank`` displayed: in a notebook a ``[rank r]`` line and the output itself, in a terminal its text."""
    from IPython import get_ipython

    data = content.get("data") or {}
    shell = get_ipython()
    if getattr(shell, "kernel", None) is None or set(data) <= {"text/plain"}:
        lines = str(data.get("text/plain", "")).splitlines() or [""]
        out.write("".join(f"[rank {rank}] {as_terminal_shows(line)}\n" for line in lines))
        out.flush()
        return
    out.write(f"[rank {rank}]\n")
    out.flush()
    shell.display_pub.publish(data=data, metadata={**(content.get("metadata") or {}), "rank": rank})


def events(ar: Any) -> list[tuple[str, Any]]:
    """What the rank of ``ar`` sent so far, in order (:func:`record_output`)."""
    from .upstream import message_futures

    return getattr((message_futures(ar) or [ar])[0], "output_events", [])


def record_output(client: Any) -> None:
    """Make ``client`` keep each request's output in order as ``output_events`` from before it is sent (ipyparallel
    keeps displays apart and copies each stream whole at each message: a million lines fell seconds behind)."""
    from .upstream import watch_requests

    def record_request(msg_id: str, future: Any) -> Callable[[dict], None]:
        events: list[tuple[str, Any]] = []
        metadata = client.metadata[msg_id]

        def record(msg: dict) -> None:
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                events.append((content["name"], content["text"]))
                metadata[content["name"]] = ""
            elif kind == "display_data":
                events.append(("display", content))

        future.output_events = events
        return record

    watch_requests(client, record_request)
