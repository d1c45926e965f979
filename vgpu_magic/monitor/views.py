"""What the recorder feeds: the :class:`View` contract, the text and null views, and what the live view and the
static image share (colours, units, title, series read the same, the updates' rhythm)."""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

from ..units import format_bytes, joined_alike
from .trace import MemoryTrace

__all__ = ["View", "RedrawThrottle", "TextSummaryView", "summary_line", "panel_top"]
__all__ += ["panel_groups", "labelled_groups", "group_label", "title_text", "PALETTE", "DARK_PALETTE"]

#: Series colours. On a light background each has at least 4.5:1 contrast (WCAG's minimum for text, so also for the
#: lines and legend swatches); the live view draws with :data:`DARK_PALETTE` on a dark theme, the same hues lighter.
PALETTE = ("#1f77b4", "#b35f0b", "#258625", "#d62728", "#8f60ba", "#168084", "#c14495", "#757575", "#797913", "#976c46")
DARK_PALETTE = (
    "#2283c5",
    "#d9730d",
    "#2ca02c",
    "#de4849",
    "#976bbf",
    "#1a9a9e",
    "#c6549d",
    "#7f7f7f",
    "#8f8f17",
    "#a3744c",
)


def panel_top(trace: MemoryTrace, panel: str) -> int:
    """The largest cap, baseline or reading so far of one panel (``"device"`` or ``"process"``), in bytes."""
    series = enumerate(zip(trace.series, trace.baseline_peak))
    return max((max(s.cap or 0, base, trace.max_reading(i)) for i, (s, base) in series if s.panel == panel), default=0)


def panel_groups(trace: MemoryTrace) -> list[list[int]]:
    """Series indices grouped where every reading and cap are the same all run, panel by panel (the device panel's
    first): ONE line each group, in the live view and the final image."""
    current, peak, groups = trace.current, trace.peak, []
    for panel in ("device", "process"):
        found: list[list[int]] = []
        for i in (i for i, s in enumerate(trace.series) if s.panel == panel):
            for group in found:
                j = group[0]
                if trace.series[i].cap == trace.series[j].cap and current[i] == current[j] and peak[i] == peak[j]:
                    group.append(i)
                    break
            else:
                found.append([i])
        groups += found
    return groups


def group_label(trace: MemoryTrace, group: list[int]) -> str:
    """``'CPU:1…CPU:7, same'`` for series read the same; the label alone for one."""
    labels = [trace.series[i].label for i in group]
    if len(labels) == 1:
        return labels[0]
    consecutive = group == list(range(group[0], group[-1] + 1))
    return (f"{labels[0]}…{labels[-1]}" if consecutive and len(labels) > 2 else ", ".join(labels)) + ", same"


def labelled_groups(trace: MemoryTrace) -> list[list[Any]]:
    """``[label, [series...]]`` per line of the live view: :func:`panel_groups`, :func:`group_label`."""
    return [[group_label(trace, group), group] for group in panel_groups(trace)]


def title_text(trace: MemoryTrace, final: bool = False) -> str:
    """``'memory · fit · epoch 4/5'``, as Keras' progress bar counts; once final, the steps, duration and ending."""
    parts = [trace.subject if trace.kind == "custom" and trace.subject else trace.kind]
    epoch = trace.epoch_starts[-1][1] if trace.epoch_starts else (trace.epoch[-1] if len(trace) else 0)
    if trace.epochs_total or trace.epoch_starts:
        parts.append(f"epoch {epoch + 1}" + (f"/{trace.epochs_total}" if trace.epochs_total else ""))
    if final:
        if len(trace) and (trace.epochs_total or trace.step[-1]):
            parts.append(f"{trace.step[-1] + 1} steps")
        parts += [f"{trace.duration:.1f} s", (trace.ending or "interrupted") if trace.interrupted else "done"]
    return "memory · " + " · ".join(parts)


class View:
    """The view contract (no-ops here): ``sampled`` each sample, ``series_changed`` when devices joined, ``finish``."""

    def start(self, trace: MemoryTrace) -> None:
        pass

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        pass

    def series_changed(self, trace: MemoryTrace) -> None:
        pass

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        pass

    def finish(self, trace: MemoryTrace) -> None:
        pass


def summary_line(trace: MemoryTrace) -> str:
    """``'host allocator (shared by 4 logical CPUs): now 72.5 MiB, peak 121.8 MiB'`` per series, ``'; '``-separated."""
    parts = []
    for i, s in enumerate(trace.series):
        latest, cap = trace.latest(i), f" of cap {format_bytes(s.cap)}" if s.cap else ""
        if latest is None or trace.all_zero(i):
            said = "no samples" if latest is None else "nothing allocated"
        else:
            said = f"now {format_bytes(latest[0])}, {trace.peak_text(i)}{cap}"
        parts.append((s.label, said, s.panel))
    return "; ".join(joined_alike(parts, ": "))


class TextSummaryView(View):
    """Compact text for terminals and scripts: one line per epoch, one at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def _print(self, text: str) -> None:
        print(text, file=self._stream if self._stream is not None else sys.stdout, flush=True)

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        total = f"/{trace.epochs_total}" if trace.epochs_total else ""
        self._print(f"memory · epoch {epoch + 1}{total} · {summary_line(trace)}")

    def finish(self, trace: MemoryTrace) -> None:
        state = (trace.ending or "interrupted") if trace.interrupted else "done"
        line = f"memory · {trace.kind} {state} in {trace.duration:.1f} s, {len(trace)} samples · {summary_line(trace)}"
        if trace.variable_bytes:
            line += f" · {trace.variables_text()}"
        self._print(line)


class RedrawThrottle:
    """Allows an update at the next due time of a ``min_interval`` rhythm (counted from the last due time: no drift),
    and no sooner than ``budget_factor * last_cost`` after the last started; :meth:`reset` at the run start."""

    def __init__(self, min_interval: float = 0.2, budget_factor: float = 200.0) -> None:
        self.min_interval, self.budget_factor = min_interval, budget_factor
        self.due = self.last_start = -math.inf
        self.last_cost = 0.0

    def reset(self, now: float) -> None:
        self.due, self.last_start, self.last_cost = now + self.min_interval, now, 0.0

    def next_allowed(self) -> float:
        return max(self.due, self.last_start + self.budget_factor * self.last_cost)

    def record(self, start: float, cost: float) -> None:
        """An update started at ``start`` and took ``cost`` seconds."""
        late = start - self.due
        if late < 0:  # an update before it was due (an epoch's end): the rhythm stays
            self.due = max(self.due, start + self.min_interval / 2)
        elif late < self.min_interval / 2:  # a little late, as updates come at samples: keep the rhythm
            self.due += self.min_interval
        else:  # a slow step or a pause: a new rhythm from here
            self.due = start + self.min_interval
        self.last_start = start
        self.last_cost = cost
