"""What the recorder feeds: views of a :class:`~vgpu_magic.monitor.trace.MemoryTrace`.

The contract is :class:`View`: four calls, each given the trace, none of
which may stop the training (the recorder switches off a view that raises and
says so once). A view decides itself what to show and when.

* :class:`LivePlotView`: the live plot in a notebook (a
  :class:`~vgpu_magic.monitor.plot.MemoryPlot` shown through one
  :class:`~vgpu_magic.monitor.display.DisplaySurface`).
* :class:`TextSummaryView`: one line per epoch and one at the end.
* :class:`NullView`: records only.

Redraw throttle
---------------
Drawing runs on the training thread, so every millisecond drawn is a
millisecond of training lost. :class:`RedrawThrottle` allows the next frame
when ``now - last_start >= max(min_interval, budget_factor * last_cost)``,
with ``min_interval = 0.4 s`` and ``budget_factor = 100``. A frame costing
``c`` is thus followed by at least ``99 c`` of training, so drawing takes at
most ``c / 100c = 1 %`` of the time whatever ``c`` is (the whole monitor's
goal is 2 %). Frames can only be drawn at a sample (at a batch start, at most
every 50 ms), so they land a little after the time allowed. A live frame
(blit, PNG encode, publish) costs 3-5 ms on a quiet machine, so the plot
refreshes about twice a second; where frames cost more (a loaded machine),
it refreshes less often rather than slowing the training.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ..units import format_bytes
from .display import DisplaySurface, MemoryFrame
from .trace import MemoryTrace

__all__ = ["View", "RedrawThrottle", "LivePlotView", "TextSummaryView", "NullView", "summary_line"]


class View:
    """The view contract; every method does nothing here.

    ``start(trace)`` when the run's trace opens, ``sampled(trace, now)`` after
    every sample (``now`` on the recorder's clock), ``epoch_end(trace, epoch)``
    and ``finish(trace)`` once the run ended (``trace.finished`` is set).
    """

    def start(self, trace: MemoryTrace) -> None:
        pass

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        pass

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        pass

    def finish(self, trace: MemoryTrace) -> None:
        pass


class NullView(View):
    """Records only; draws and prints nothing."""


def summary_line(trace: MemoryTrace) -> str:
    """``'host allocator (shared by 4 logical CPUs): now 72.5 MiB, peak 121.8 MiB'``
    and the same for each further series, ``'; '``-separated."""
    parts = []
    for i, s in enumerate(trace.series):
        latest = trace.latest(i)
        if latest is None:
            parts.append(f"{s.label}: no samples")
            continue
        if trace.all_zero(i):
            parts.append(f"{s.label}: nothing allocated")
            continue
        cap = f" of cap {format_bytes(s.cap)}" if s.cap else ""
        parts.append(f"{s.label}: now {format_bytes(latest[0])}, {trace.peak_text(i)}{cap}")
    return "; ".join(parts)


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
        state = "interrupted" if trace.interrupted else "done"
        line = f"memory · {trace.kind} {state} in {trace.duration:.1f} s, {len(trace)} samples"
        line += f" · {summary_line(trace)}"
        if trace.variable_bytes:
            line += f" · {trace.variables_text()}"
        self._print(line)


class RedrawThrottle:
    """Allows a redraw when ``now - last_start >= max(min_interval, budget_factor * last_cost)``.

    See the module docstring for why this keeps drawing at or under
    ``1 / budget_factor`` of the time. Start it with :meth:`reset` at the run
    start: the first frame then comes ``min_interval`` into the run, not at
    its very first step.
    """

    def __init__(self, min_interval: float = 0.4, budget_factor: float = 100.0) -> None:
        self.min_interval = min_interval
        self.budget_factor = budget_factor
        self.last_start = -math.inf
        self.last_cost = 0.0

    def reset(self, now: float) -> None:
        self.last_start = now
        self.last_cost = 0.0

    def next_allowed(self) -> float:
        return self.last_start + max(self.min_interval, self.budget_factor * self.last_cost)

    def ready(self, now: float) -> bool:
        return now >= self.next_allowed()

    def record(self, start: float, cost: float) -> None:
        self.last_start = start
        self.last_cost = cost


class LivePlotView(View):
    """The live plot: one :class:`~vgpu_magic.monitor.plot.MemoryPlot`, one
    :class:`~vgpu_magic.monitor.display.DisplaySurface`, frames allowed by a
    :class:`RedrawThrottle` on their measured cost.

    The surface opens with a text placeholder when the run starts (see
    :mod:`vgpu_magic.monitor.display` for why). The final frame (tight
    limits, exact peaks, "done") is drawn whole, which costs a few times a live
    frame; ``defer`` (``defer(draw)``) may postpone it to when the training is
    over, e.g. to the end of the notebook cell, so it does not count against
    the run. Without ``defer`` it is drawn at once.

    ``draw_costs`` keeps every frame's cost (seconds: drawing, encoding and
    publishing), ``draw_kinds`` whether it was a ``"blit"``, a ``"full"``
    redraw or the ``"final"`` frame, ``setup_cost`` the one-time cost of
    importing matplotlib and building the figure, for the benchmark and for
    the curious.
    """

    def __init__(
        self,
        surface: DisplaySurface | None = None,
        throttle: RedrawThrottle | None = None,
        clock: Callable[[], float] = time.perf_counter,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.surface = surface if surface is not None else DisplaySurface()
        self._defer = defer
        self.throttle = throttle or RedrawThrottle()
        self.clock = clock
        self.plot: Any = None
        self.setup_cost = 0.0
        self.draw_costs: list[float] = []
        self.draw_times: list[float] = []
        self.draw_kinds: list[str] = []

    def start(self, trace: MemoryTrace) -> None:
        self.throttle.reset(self.clock())
        self.surface.show(MemoryFrame(None, f"memory · {trace.kind} · the plot appears after the first steps"))

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        if self.throttle.ready(now):
            self._frame(trace, final=False)

    def _frame(self, trace: MemoryTrace, final: bool) -> None:
        from .plot import MemoryPlot, title_text

        if self.plot is None:
            # Importing matplotlib and building the figure happen once (per
            # kernel, or per run shape): counted in setup_cost, not as the cost
            # of a frame, or the throttle would hold the second frame back for
            # fifty times an import.
            begin = self.clock()
            self.plot = MemoryPlot.reuse(len(trace.series))
            self.setup_cost += self.clock() - begin
        start = self.clock()
        full_before = self.plot.full_draws
        png = self.plot.render(trace, final=final)
        self.surface.show(MemoryFrame(png, title_text(trace, final) + "\n" + summary_line(trace)))
        cost = self.clock() - start
        self.throttle.record(start, cost)
        self.draw_costs.append(cost)
        self.draw_times.append(start)
        self.draw_kinds.append("final" if final else "full" if self.plot.full_draws > full_before else "blit")

    def finish(self, trace: MemoryTrace) -> None:
        if not len(trace):
            self._release()
        elif self._defer is None:
            self._final(trace)
        else:
            self._defer(lambda: self._final(trace))

    def _final(self, trace: MemoryTrace) -> None:
        try:
            self._frame(trace, final=True)
        finally:
            self._release()

    def _release(self) -> None:
        if self.plot is not None:
            self.plot.release()
            self.plot = None
