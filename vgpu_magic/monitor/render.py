"""Drawing a :class:`~vgpu_magic.monitor.trace.MemoryTrace`: a live plot in a
notebook, a per-epoch text summary elsewhere.

A *view* is what the recorder feeds: ``start(trace)``, ``sampled(trace, now)``
after every sample, ``epoch_end(trace, epoch)`` and ``finish(trace)``.

* :class:`LivePlotView` draws with :class:`MemoryPlot` (matplotlib, Agg, no
  pyplot) and shows each frame through one :class:`DisplaySurface`: the first
  frame is ``display(..., display_id=True)``, every later one
  ``handle.update(...)`` of that same output, so the notebook never grows a list
  of outputs and never flickers. Frames are PNG, so the last one stays in the
  saved notebook as a static image.
* :class:`TextSummaryView` prints one line per epoch and one at the end.
* :class:`NullView` records only.

Redraw throttle
---------------
Drawing runs on the training thread, so every millisecond drawn is a
millisecond of training lost. :class:`RedrawThrottle` allows the next frame
when ``now - last_start >= max(min_interval, budget_factor * last_cost)``,
with ``min_interval = 0.4 s`` and ``budget_factor = 50``. A frame costing
``c`` is thus followed by at least ``49 c`` of training, so drawing takes at
most ``c / 50c = 2 %`` of the time whatever ``c`` is. Frames can only be drawn
at a sample (at a batch start, at most every 50 ms), so they land a little
after the time allowed; with ``0.4 s`` rather than ``0.5 s`` as the floor the
plot still refreshes at least twice a second whenever a frame costs 8 ms or
less (``1 / max(0.4, 50 c)`` Hz before that lateness; a live frame here costs
4-5 ms).
Live frames are kept that cheap by blitting: axes, ticks, caps, epoch
marks and the variables panel are drawn once into a cached background, and a
frame only restores it and draws the lines on top (drawing text is what costs:
a legend takes ~10 ms, a line ~0.3 ms). The background is redrawn only when
what it shows changes: the axes must grow (limits grow in large steps, so that
is rare), an epoch starts or a peak in the legend rises; the variables panel
has a cached bitmap of its own, redrawn only when the variables change.
"""

from __future__ import annotations

import base64
import io
import math
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, TextIO

from ..units import format_bytes
from .trace import MemoryTrace, short_name

__all__ = [
    "RedrawThrottle",
    "MemoryPlot",
    "MemoryFrame",
    "DisplaySurface",
    "LivePlotView",
    "TextSummaryView",
    "NullView",
    "detect_frontend",
    "summary_line",
]

_MIB = 1024 * 1024
_GIB = 1024 * _MIB

#: At most this many points per line in a frame (bucket maxima beyond it, so
#: no spike disappears from the picture).
MAX_POINTS = 1500


def detect_frontend() -> str:
    """``"rich"`` inside a Jupyter kernel (which can show images), else ``"text"``.

    Terminal IPython, plain scripts and anything without a kernel get text.
    Never imports IPython itself.
    """
    if "IPython" not in sys.modules:
        return "text"
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return "text"
    return "rich"


class RedrawThrottle:
    """Allows a redraw when ``now - last_start >= max(min_interval, budget_factor * last_cost)``.

    See the module docstring for why this keeps drawing at or under
    ``1 / budget_factor`` of the time. Start it with :meth:`reset` at the run
    start: the first frame then comes ``min_interval`` into the run, not at
    its very first step.
    """

    def __init__(self, min_interval: float = 0.4, budget_factor: float = 50.0) -> None:
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


def summary_line(trace: MemoryTrace) -> str:
    """``'host memory (shared by 4 logical CPUs): now 72.5 MiB, peak 121.8 MiB'``
    and the same for each further series, ``'; '``-separated."""
    parts = []
    for i, s in enumerate(trace.series):
        latest = trace.latest(i)
        if latest is None:
            parts.append(f"{s.label}: no samples")
            continue
        cap = f" of cap {format_bytes(s.cap)}" if s.cap else ""
        parts.append(f"{s.label}: now {format_bytes(latest[0])}, {trace.peak_text(i)}{cap}")
    return "; ".join(parts)


def _title(trace: MemoryTrace, final: bool) -> str:
    """The plot title. Live frames name only the epoch (the x axis shows the
    time), so the title changes with the epoch and not with every frame."""
    parts = [trace.kind]
    if trace.epochs_total and len(trace):
        parts.append(f"epoch {trace.epoch[-1] + 1}/{trace.epochs_total}")
    if final:
        if len(trace):
            parts.append(f"{trace.step[-1] + 1} steps")
        parts.append(f"{trace.duration:.1f} s")
        parts.append("interrupted" if trace.interrupted else "done")
    return "memory · " + " · ".join(parts)


def _legend_texts(trace: MemoryTrace) -> tuple[str, ...]:
    texts = []
    for i, s in enumerate(trace.series):
        cap = f" / cap {format_bytes(s.cap)}" if s.cap else ""
        texts.append(f"{s.label} · {trace.peak_text(i)}{cap}")
    return tuple(texts)


def _decimate(times: Any, values: list[Any], limit: int = MAX_POINTS) -> tuple[Any, list[Any]]:
    """At most ``limit`` points: bucket starts and bucket maxima."""
    import numpy as np

    n = len(times)
    if n <= limit:
        return times, values
    k = math.ceil(n / limit)
    m = (n // k) * k
    t = times[:m:k]
    out = []
    for v in values:
        head = v[:m].reshape(-1, k).max(axis=1)
        out.append(np.append(head, v[m:].max()) if m < n else head)
    if m < n:
        t = np.append(t, times[m])
    return t, out


def _nice_ceiling(x: float) -> float:
    """The next 1, 2 or 5 times a power of ten at or above ``x``."""
    if x <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(x))
    for step in (1, 2, 5, 10):
        if step * power >= x:
            return step * power
    return 10 * power


class PlotLayout(NamedTuple):
    """Everything a frame shows except the lines: when it is unchanged, a
    frame only blits the lines onto the cached background."""

    xmax: float
    ytop: float
    unit: tuple[str, int]
    caps: tuple[int | None, ...]
    marks: tuple[tuple[float, int], ...]
    title: str
    legend: tuple[str, ...]


class MemoryPlot:
    """A matplotlib figure of a trace, built once and updated in place.

    One solid line per series (current bytes) with the allocator's running
    peak as a faint step line of the same colour, each capped series' cap as a
    dashed line of the same colour, its peak in the legend, epoch starts as
    dotted verticals, the y axis in MiB or GiB, and a side panel with the exact
    variable bytes per replica.

    Parameters
    ----------
    series_count
        How many series the traces drawn will have (the figure is built for
        them).
    live
        Blit live frames (see the module docstring). ``False`` draws every
        frame whole, for files.
    """

    def __init__(self, series_count: int, live: bool = True, dpi: int = 80, width: float = 8.5):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.live = live
        # The legend sits under the axes (it would hide lines inside them);
        # the figure grows with its rows so the axes keep their size.
        ncol = 1 if series_count <= 2 else 2
        rows = math.ceil(series_count / ncol)
        axes_h, top_h, xlabel_h, legend_h = 2.3, 0.35, 0.5, 0.2 * rows + 0.12
        height = top_h + axes_h + xlabel_h + legend_h
        bottom = (legend_h + xlabel_h) / height
        self.fig = Figure(figsize=(width, height), dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        self.ax = self.fig.add_axes((0.075, bottom, 0.60, axes_h / height))
        self.vax = self.fig.add_axes((0.80, bottom, 0.17, axes_h / height))
        self.lines = [self.ax.plot([], [], color=f"C{i % 10}", lw=1.4)[0] for i in range(series_count)]
        # The allocator's running peak, faint: it shows the transient memory
        # inside steps that "current", read between steps, never sees.
        self.peak_lines = [
            self.ax.plot([], [], color=f"C{i % 10}", lw=0.9, alpha=0.45, drawstyle="steps-post")[0]
            for i in range(series_count)
        ]
        self.legend = self.ax.legend(
            self.lines,
            [" "] * series_count,
            loc="upper left",
            bbox_to_anchor=(0.0, -xlabel_h / axes_h),
            ncol=ncol,
            fontsize=7.5,
            frameon=False,
            borderaxespad=0.0,
        )
        self.title = self.ax.set_title(" ", fontsize=9, loc="left")
        self.ax.set_xlabel("time (s)", fontsize=8)
        self.ax.tick_params(labelsize=7.5)
        self.ax.grid(True, lw=0.4, alpha=0.4)
        self.vax.tick_params(labelsize=7.5)
        for line in self._data_lines:
            line.set_animated(live)
        self._decorations: list[Any] = []
        self._variables_key: tuple | None = None
        self._panel_background = None
        self._applied: PlotLayout | None = None  # what the artists show now
        self._layout: PlotLayout | None = None  # what the cached background shows
        self._background = None
        self._xmax = 10.0
        self._ytop = 0.0
        self.full_draws = 0

    @property
    def _data_lines(self) -> list[Any]:
        return [*self.peak_lines, *self.lines]

    # -- layout -----------------------------------------------------------------
    def _limits(self, trace: MemoryTrace, t_end: float, top: float, final: bool) -> tuple[float, float]:
        caps = [s.cap for s in trace.series if s.cap]
        need = max([top * 1.08, *(c * 1.04 for c in caps), 1.0])
        if final:
            return max(t_end, 1e-3), need
        # Live limits grow in big, round steps so the background is rarely redrawn.
        if t_end > self._xmax:
            self._xmax = max(2 * self._xmax, 1.25 * t_end)
        if need > self._ytop:
            if caps and top * 1.08 <= max(caps):
                self._ytop = need
            else:
                self._ytop = _nice_ceiling(need * 1.25 / _MIB) * _MIB
        return self._xmax, self._ytop

    def _layout_for(self, trace: MemoryTrace, top: float, t_end: float, final: bool) -> PlotLayout:
        xmax, ytop = self._limits(trace, t_end, top, final)
        first = trace.epoch_starts[0][1] if trace.epoch_starts else 0
        return PlotLayout(
            xmax=xmax,
            ytop=ytop,
            unit=("GiB", _GIB) if ytop >= _GIB else ("MiB", _MIB),
            caps=tuple(s.cap for s in trace.series),
            marks=tuple((t, e) for t, e in trace.epoch_starts if e != first),
            title=_title(trace, final),
            legend=_legend_texts(trace),
        )

    def _apply(self, layout: PlotLayout) -> None:
        """Set the artists to ``layout`` (drawing nothing)."""
        for artist in self._decorations:
            artist.remove()
        self._decorations = []
        name, scale = layout.unit
        ax = self.ax
        ax.set_xlim(0, layout.xmax)
        ax.set_ylim(0, layout.ytop / scale)
        ax.set_ylabel(f"memory ({name})", fontsize=8)
        for i, cap in enumerate(layout.caps):
            if cap:
                self._decorations.append(ax.axhline(cap / scale, color=f"C{i % 10}", ls="--", lw=1.0, alpha=0.9))
        for t, epoch in layout.marks:
            self._decorations.append(ax.axvline(t, color="0.45", ls=":", lw=0.9))
            self._decorations.append(
                ax.text(t, 0.02, f" e{epoch + 1}", transform=ax.get_xaxis_transform(), fontsize=7, color="0.35")
            )
        for text, value in zip(self.legend.get_texts(), layout.legend):
            text.set_text(value)
        self.title.set_text(layout.title)
        self._applied = layout

    def _draw_variables(self, trace: MemoryTrace) -> None:
        vax = self.vax
        vax.clear()
        vax.tick_params(labelsize=7.5)
        vax.set_title("variables per replica", fontsize=8, loc="left")
        if not trace.variable_bytes:
            vax.set_axis_off()
            vax.text(0.0, 0.5, "no model known\n(MemoryMonitor(model=...))", fontsize=7.5, transform=vax.transAxes)
            return
        vax.set_axis_on()
        names = [short_name(d) for d in trace.variable_bytes]
        values = list(trace.variable_bytes.values())
        top = max(values) or 1
        scale, unit = (_GIB, "GiB") if top >= _GIB else (_MIB, "MiB")
        ys = list(range(len(names)))[::-1]
        vax.barh(ys, [v / scale for v in values], color="0.55", height=0.6)
        vax.set_yticks(ys, names)
        vax.set_xlim(0, top / scale * 1.9)
        vax.set_xlabel(unit, fontsize=8)
        for y, v in zip(ys, values):
            vax.text(v / scale, y, " " + format_bytes(v), va="center", fontsize=7)

    # -- frames -----------------------------------------------------------------
    def _data(self, trace: MemoryTrace) -> tuple[Any, list[Any]]:
        """Times, then current and peak bytes of each series, decimated."""
        import numpy as np

        times = np.array(trace.time, dtype=float)
        values = [np.array(c, dtype=float) for c in (*trace.current, *trace.peak)]
        return _decimate(times, values)

    def draw(self, trace: MemoryTrace, final: bool = False) -> None:
        """Bring the figure up to date with ``trace``.

        Live frames blit onto the cached background when its layout still
        fits. The final frame is drawn whole with tight limits, and leaves
        the cached background alone: a next run whose first frames look the
        same (same model, same epochs) blits from its very first frame.
        """
        times, values = self._data(trace)
        t_end = trace.duration if final else (float(times[-1]) if len(times) else 0.0)
        top = max((float(v.max()) for v in values if len(v)), default=0.0)
        layout = self._layout_for(trace, top, t_end, final)
        for line, value in zip([*self.lines, *self.peak_lines], values):
            line.set_data(times, value / layout.unit[1] if len(value) else value)
            if final:
                line.set_animated(False)
        variables = tuple(trace.variable_bytes.items())
        if variables != self._variables_key:
            self._variables_key = variables
            self._draw_variables(trace)
            self._panel_background = None
            self._background = None
        if final or not self.live:
            self._apply(layout)
            self._draw_whole()
            return
        if layout != self._layout or self._background is None:
            self._apply(layout)
            self._draw_whole()
            self._layout = layout
            self._background = self.canvas.copy_from_bbox(self.fig.bbox)
        else:
            if self._applied != layout:  # a final frame changed the artists since
                self._apply(layout)
            self.canvas.restore_region(self._background)
        for line in self._data_lines:
            self.ax.draw_artist(line)

    def _draw_whole(self) -> None:
        """Draw everything but the animated lines. Live, the variables panel
        (half of all the text, and it rarely changes) comes from its own cached
        bitmap and only the main axes are drawn."""
        self.full_draws += 1
        if not self.live:
            self.canvas.draw()
            return
        if self._panel_background is None:
            self.ax.set_visible(False)
            self.canvas.draw()
            self.ax.set_visible(True)
            self._panel_background = self.canvas.copy_from_bbox(self.fig.bbox)
        else:
            self.canvas.restore_region(self._panel_background)
        self.ax.draw(self.canvas.get_renderer())

    def png(self, compress_level: int = 1) -> bytes:
        """The canvas as PNG (fast compression for live frames)."""
        from PIL import Image

        width, height = self.canvas.get_width_height()
        image = Image.frombuffer("RGBA", (width, height), self.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        out = io.BytesIO()
        image.convert("RGB").save(out, format="png", compress_level=compress_level)
        return out.getvalue()

    def render(self, trace: MemoryTrace, final: bool = False) -> bytes:
        """Draw and return the frame as PNG."""
        self.draw(trace, final=final)
        return self.png(compress_level=6 if final else 1)

    def reset(self) -> None:
        """Get ready for the next run: empty lines, initial limits. The cached
        background stays; it is used only if the next layout matches it."""
        self._xmax = 10.0
        self._ytop = 0.0
        for line in self._data_lines:
            line.set_data([], [])
            line.set_animated(self.live)

    @classmethod
    def reuse(cls, series_count: int) -> MemoryPlot:
        """A live plot for ``series_count`` series: a released one when there
        is one (building a figure and drawing it the first time costs several
        times a later full frame), else a new one."""
        spare = _SPARE_PLOTS.pop(series_count, None)
        return spare if spare is not None else cls(series_count)

    def release(self) -> None:
        """Done with this plot: keep it for the next run of the same shape."""
        if self.live:
            self.reset()
            _SPARE_PLOTS[len(self.lines)] = self


#: One released live plot per series count, for the next run.
_SPARE_PLOTS: dict[int, MemoryPlot] = {}


def save_trace_figure(trace: MemoryTrace, path: str, dpi: int = 100) -> str:
    """Write a static figure of ``trace`` to ``path`` (format from its suffix)."""
    plot = MemoryPlot(len(trace.series), live=False, dpi=dpi)
    plot.draw(trace, final=True)
    plot.fig.savefig(path, dpi=dpi)
    return path


class MemoryFrame:
    """One frame for a notebook: PNG plus a one-line text form.

    Displays as ``image/png``; terminals and text exports get the summary.
    """

    def __init__(self, png: bytes, text: str) -> None:
        self.png = png
        self.text = text

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"image/png": base64.b64encode(self.png).decode("ascii"), "text/plain": self.text}

    def __repr__(self) -> str:
        return self.text


class DisplaySurface:
    """One output in a notebook, shown once and then updated in place.

    Parameters
    ----------
    display
        ``display(obj, display_id=True) -> handle`` with ``handle.update(obj)``;
        by default :func:`IPython.display.display`. Tests pass a fake.
    """

    def __init__(self, display: Callable[..., Any] | None = None) -> None:
        if display is None:
            from IPython.display import display
        self._display = display
        self.handle: Any = None

    def show(self, obj: Any) -> None:
        if self.handle is None:
            self.handle = self._display(obj, display_id=True)
        else:
            self.handle.update(obj)


class LivePlotView:
    """The live plot: one :class:`MemoryPlot`, one :class:`DisplaySurface`,
    frames allowed by a :class:`RedrawThrottle` on their measured cost.

    The final frame (tight limits, exact peaks, "done") is drawn whole, which
    costs a few times a live frame; ``defer`` (``defer(draw)``) may postpone it
    to when the training is over, e.g. to the end of the notebook cell, so it
    does not count against the run. Without ``defer`` it is drawn at once.

    ``draw_costs`` keeps every frame's cost (seconds: drawing, encoding and
    publishing), ``draw_kinds`` whether it was a ``"blit"``, a ``"full"``
    redraw or the ``"final"`` frame, ``setup_cost`` the one-time cost of importing matplotlib and
    building the figure, for the benchmark and for the curious.
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
        self.plot: MemoryPlot | None = None
        self.setup_cost = 0.0
        self.draw_costs: list[float] = []
        self.draw_times: list[float] = []
        self.draw_kinds: list[str] = []

    def start(self, trace: MemoryTrace) -> None:
        self.throttle.reset(self.clock())

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        if self.throttle.ready(now):
            self._frame(trace, final=False)

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        pass

    def _frame(self, trace: MemoryTrace, final: bool) -> None:
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
        self.surface.show(MemoryFrame(png, _title(trace, final) + "\n" + summary_line(trace)))
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


class TextSummaryView:
    """Compact text for terminals and scripts: one line per epoch, one at the end."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def _print(self, text: str) -> None:
        print(text, file=self._stream if self._stream is not None else sys.stdout, flush=True)

    def start(self, trace: MemoryTrace) -> None:
        pass

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        pass

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        total = f"/{trace.epochs_total}" if trace.epochs_total else ""
        self._print(f"memory · epoch {epoch + 1}{total} · {summary_line(trace)}")

    def finish(self, trace: MemoryTrace) -> None:
        state = "interrupted" if trace.interrupted else "done"
        line = f"memory · {trace.kind} {state} in {trace.duration:.1f} s, {len(trace)} samples · {summary_line(trace)}"
        if trace.variable_bytes:
            line += f" · {trace.variables_text()}"
        self._print(line)


class NullView:
    """Records only; draws and prints nothing."""

    def start(self, trace: MemoryTrace) -> None:
        pass

    def sampled(self, trace: MemoryTrace, now: float) -> None:
        pass

    def epoch_end(self, trace: MemoryTrace, epoch: int) -> None:
        pass

    def finish(self, trace: MemoryTrace) -> None:
        pass
