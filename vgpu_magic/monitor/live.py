"""The live view: an anywidget the browser draws (``live.js``), fed only the rows added since the last update (not
bqplot, whose ``Lines`` re-send every point), shown above Keras' progress bar; the final image replaces it."""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..devices import simulated_line
from ..units import format_bytes, unit_for
from .trace import MemoryTrace
from .views import DARK_PALETTE, PALETTE, RedrawThrottle, View, labelled_groups, panel_top, summary_line, title_text

#: A live panel keeps its unit while its largest figure reads in four digits in it ("3121 KiB"), not rescaled.
KEPT_UNIT_DIGITS = 4
#: Seconds of the run the live title's step rate is measured over (Keras' and tqdm's bars average theirs too).
RATE_WINDOW_S = 5.0


@functools.cache
def _widget_class() -> type:
    import anywidget
    import traitlets

    class MemoryWidget(anywidget.AnyWidget):
        """The browser side of :class:`LiveMemoryView` (``live.js``)."""

        _esm = Path(__file__).with_name("live.js")
        #: Where the browser keeps this widget's rows (see live.js).
        key = traitlets.Unicode().tag(sync=True)
        series = traitlets.List().tag(sync=True)
        #: The lines drawn (:func:`~vgpu_magic.monitor.views.labelled_groups`).
        groups = traitlets.List().tag(sync=True)
        units = traitlets.Dict().tag(sync=True)
        marks = traitlets.List().tag(sync=True)
        title = traitlets.Unicode().tag(sync=True)
        note = traitlets.Unicode().tag(sync=True)

        def __repr__(self) -> str:
            return self.title  # the live output's text form (front ends without widgets, nbval)

    return MemoryWidget


def memory_widget(**traits: Any) -> Any:
    import uuid

    return _widget_class()(key=uuid.uuid4().hex, **traits)


def _progress(trace: MemoryTrace) -> str:
    """``'step 340 · 85.0 steps/s'``, the rate over :data:`RATE_WINDOW_S`; nothing where the run counts no steps."""
    if not len(trace) or not (trace.epochs_total or trace.step[-1]):
        return ""
    times, steps = trace.time, trace.step
    k = bisect.bisect_left(times, times[-1] - RATE_WINDOW_S)
    seconds, done = times[-1] - times[k], steps[-1] - steps[k]
    if seconds <= 0 or done <= 0:
        return f"step {steps[-1] + 1}"
    rate = done / seconds
    return f"step {steps[-1] + 1} · " + (f"{rate:.1f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")


def _series(trace: MemoryTrace) -> list[dict[str, Any]]:
    return [
        {
            "label": s.label,
            "panel": s.panel,
            "cap": s.cap,
            "cap_text": format_bytes(s.cap) if s.cap else "",
            "color": PALETTE[i % len(PALETTE)],
            "dark": DARK_PALETTE[i % len(PALETTE)],
        }
        for i, s in enumerate(trace.series)
    ]


class LiveMemoryView(View):
    """Feeds a ``MemoryWidget`` (``widget(**traits)``) in one output of ``display`` (shown once, then updated in
    place); the final image replaces it as ``defer`` says."""

    def __init__(
        self,
        display: Callable[..., Any] | None = None,
        widget: Callable[..., Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        if display is None:
            from IPython.display import display
        self._display = display
        self._handle: Any = None
        self.throttle = RedrawThrottle()
        self._make_widget = widget or memory_widget
        self.clock = clock
        self._defer = defer or (lambda draw: draw())
        self.widget: Any = None
        self._sent, self._bucket, self._marks = 0, 1, 0
        self._units: dict[str, list] = {}

    def start(self, trace: MemoryTrace) -> None:
        begin = self.clock()
        self._units = {}
        self.widget = self._make_widget(series=_series(trace), **self._traits(trace))
        self._show(self.widget)
        self.throttle.reset(begin)
        self._sent, self._bucket, self._marks = 0, trace.decimated, 0

    def _show(self, obj: Any) -> None:
        if self._handle is None:
            self._handle = self._display(obj, display_id=True)
        else:
            self._handle.update(obj)

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        if now >= self.throttle.next_allowed():
            self._update(trace)

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        self._update(trace)

    def series_changed(self, trace: MemoryTrace) -> None:
        if self.widget is not None:
            self.widget.series = _series(trace)
            self._bucket = 0  # a reset: the rows have new columns
            self._update(trace)

    def _traits(self, trace: MemoryTrace) -> dict[str, Any]:
        """The traits that change during a run (the series change only when devices join)."""
        title = " · ".join(filter(None, (title_text(trace), _progress(trace), "live")))
        units, note = self._kept_units(trace), trace.caption()
        return {"groups": labelled_groups(trace), "title": title, "units": units, "note": note}

    def _kept_units(self, trace: MemoryTrace) -> dict[str, list]:
        """Each panel's unit, kept while its :func:`panel_top` reads in :data:`KEPT_UNIT_DIGITS` digits in it."""
        for panel in ("device", "process"):
            top, kept = panel_top(trace, panel), self._units.get(panel)
            if kept is None or top >= 10**KEPT_UNIT_DIGITS * kept[1]:
                self._units[panel] = list(unit_for(top, smallest="KiB"))
        return dict(self._units)

    def _update(self, trace: MemoryTrace) -> None:
        """Send the rows added since the last update (all, as a reset, where the envelope or columns changed)."""
        if self.widget is None:
            return
        start, cpu = self.clock(), time.thread_time()
        reset = trace.decimated != self._bucket or len(trace) < self._sent
        first = 0 if reset else self._sent
        n = len(trace)
        if n > first:
            time_, current, peak = trace.time, trace.current, trace.peak
            columns = [column for pair in zip(current, peak) for column in pair]  # each series' current, then peak
            rows = [[round(time_[k], 3), *(column[k] for column in columns)] for k in range(first, n)]
            self.widget.send({"rows": rows, "reset": reset})
        self._sent, self._bucket = n, trace.decimated
        if len(trace.epoch_starts) != self._marks:
            self._marks = len(trace.epoch_starts)
            first_epoch = trace.epoch[0] if len(trace) else 0  # the epoch the run began in: no mark
            self.widget.marks = [[round(t, 3), e] for t, e in trace.epoch_starts if e != first_epoch]
        for name, value in self._traits(trace).items():
            if getattr(self.widget, name) != value:
                setattr(self.widget, name, value)
        # This thread's CPU time: a busy machine's wall clock counts other processes' time and starves the view.
        self.throttle.record(start, time.thread_time() - cpu)

    def finish(self, trace: MemoryTrace) -> None:
        self._update(trace)
        self._defer(lambda: self._final(trace))

    def _final(self, trace: MemoryTrace) -> None:
        from .display import MemoryFrame

        try:
            self._show(MemoryFrame(*static_image(trace)))
        finally:
            if self.widget is not None:
                self.widget.close()


def static_image(trace: MemoryTrace) -> tuple[bytes | None, str]:
    """The final frame: the static figure as a transparent PNG (``None`` without matplotlib) and its text."""
    from .plot import MemoryFigure, require_matplotlib

    said = simulated_line(trace.simulated)
    text = title_text(trace, final=True) + "\n" + summary_line(trace) + f"\n{said}" * bool(said)
    try:
        require_matplotlib("the final memory plot is text only")
    except ImportError:
        return None, text
    return MemoryFigure(trace).png(), text
