"""The picture of a :class:`~vgpu_magic.monitor.trace.MemoryTrace`: one
matplotlib figure (Agg, no pyplot), built once and updated in place.

What it shows: one solid line per series (current bytes, held as a step until
the next sample, so nothing is invented between samples) with its running peak
as a faint step line of the same colour; each capped series' cap dashed in its
colour (equal caps interleave their dashes, so every colour shows, and one label
names them); epoch starts as dotted verticals; the y axis in MiB or GiB, never
below 1 MiB, and "nothing allocated" written on it when every figure is zero;
and a side panel with the exact variable bytes per replica, whose axis and bar
labels use one unit.

Live frames are kept cheap by blitting: axes, ticks, caps, epoch marks and
the variables panel are drawn once into a cached background, and a frame only
restores it and draws the lines on top (drawing text is what costs: a legend
takes ~10 ms, a line ~0.3 ms). The background is redrawn only when what it
shows changes: the axes must grow (limits grow in large steps, so that is
rare), an epoch starts or a peak in the legend rises; the variables panel has a
cached bitmap of its own, redrawn only when the variables change.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..units import GIB, MIB, format_bytes
from .display import encode_png
from .trace import MemoryTrace, short_name

__all__ = [
    "MemoryPlot",
    "PlotLayout",
    "save_trace_figure",
    "title_text",
    "PLOT_INSTALL_HINT",
    "require_matplotlib",
]

#: At most this many points per line in a frame (bucket maxima beyond it, so
#: no spike disappears from the picture).
MAX_POINTS = 1500

#: What to install for the plot; the live view and ``savefig`` say the same.
PLOT_INSTALL_HINT = "pip install 'vgpu_magic[plot]'"

#: Pixels per inch. With the font sizes below, the smallest text (tick labels,
#: 8.5 pt) is 12 px high, readable on HiDPI screens too.
DPI = 100
_TICK_PT, _LABEL_PT, _TITLE_PT, _NOTE_PT = 8.5, 9.5, 10.5, 8.0


def require_matplotlib(purpose: str) -> None:
    """Raise an :class:`ImportError` with the install hint when matplotlib
    (or Pillow, which encodes the frames) is missing."""
    try:
        import matplotlib  # noqa: F401
        import PIL  # noqa: F401
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "matplotlib").split(".")[0]
        raise ImportError(f"{missing} is not installed, so {purpose}; {PLOT_INSTALL_HINT}") from None


def title_text(trace: MemoryTrace, final: bool) -> str:
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


def _legend_texts(trace: MemoryTrace, final: bool) -> tuple[str, ...]:
    """The legend. Peaks are named in the final frame only: a live legend that
    changed whenever a peak (or RSS) rose would redraw the whole background
    at almost every frame; live, the faint lines show the peaks."""
    texts = []
    for i, s in enumerate(trace.series):
        cap = f" / cap {format_bytes(s.cap)}" if s.cap else ""
        texts.append(f"{s.label} · {trace.peak_text(i)}{cap}" if final else f"{s.label}{cap}")
    return (*texts, "running peak (faint lines)")


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


def _unit(top: float) -> tuple[str, int]:
    """The unit a panel whose largest value is ``top`` bytes is labelled in."""
    for name, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if top >= scale:
            return name, scale
    return "B", 1


def _cap_groups(caps: tuple[int | None, ...]) -> dict[int, list[int]]:
    """Cap in bytes -> the indices of the series with that cap."""
    groups: dict[int, list[int]] = {}
    for i, cap in enumerate(caps):
        if cap:
            groups.setdefault(cap, []).append(i)
    return groups


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
    empty: bool


class MemoryPlot:
    """A matplotlib figure of a trace, built once and updated in place.

    Parameters
    ----------
    series_count
        How many series the traces drawn will have.
    live
        Blit live frames (see the module docstring). ``False`` draws every
        frame whole, for files.
    """

    def __init__(self, series_count: int, live: bool = True, dpi: int = DPI, width: float = 9.0):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        self.live = live
        # The legend sits under the axes (it would hide lines inside them);
        # the figure grows with its rows so the axes keep their size.
        entries = series_count + 1
        ncol = 1 if entries <= 2 else 2
        rows = math.ceil(entries / ncol)
        axes_h, top_h, xlabel_h, legend_h = 2.4, 0.4, 0.55, 0.24 * rows + 0.12
        height = top_h + axes_h + xlabel_h + legend_h
        bottom = (legend_h + xlabel_h) / height
        self.fig = Figure(figsize=(width, height), dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        self.ax = self.fig.add_axes((0.085, bottom, 0.59, axes_h / height))
        self.vax = self.fig.add_axes((0.80, bottom, 0.17, axes_h / height))
        self.lines = [
            self.ax.plot([], [], color=f"C{i % 10}", lw=1.5, drawstyle="steps-post")[0] for i in range(series_count)
        ]
        # The running peak, faint: it shows the transient memory inside steps
        # that "current", read between steps, never sees.
        self.peak_lines = [
            self.ax.plot([], [], color=f"C{i % 10}", lw=1.0, alpha=0.45, drawstyle="steps-post")[0]
            for i in range(series_count)
        ]
        peak_handle = Line2D([], [], color="0.4", lw=1.0, alpha=0.45)
        self.legend = self.ax.legend(
            [*self.lines, peak_handle],
            [" "] * entries,
            loc="upper left",
            bbox_to_anchor=(0.0, -xlabel_h / axes_h),
            ncol=ncol,
            fontsize=_TICK_PT,
            frameon=False,
            borderaxespad=0.0,
        )
        self.title = self.ax.set_title(" ", fontsize=_TITLE_PT, loc="left")
        self.ax.set_xlabel("time (s)", fontsize=_LABEL_PT)
        self.ax.tick_params(labelsize=_TICK_PT)
        self.ax.grid(True, lw=0.4, alpha=0.4)
        self.vax.tick_params(labelsize=_TICK_PT)
        for line in self._data_lines:
            line.set_animated(live)
        self._decorations: list[Any] = []
        self._variables_key: tuple | None = None
        self._panel_background = None
        self._applied: PlotLayout | None = None  # what the artists show now
        self._layout: PlotLayout | None = None  # what the cached background shows
        self._background = None
        self._labels: tuple[str, ...] = ()
        self._xmax = 10.0
        self._ytop = 0.0
        self.full_draws = 0

    @property
    def _data_lines(self) -> list[Any]:
        return [*self.peak_lines, *self.lines]

    # -- layout -----------------------------------------------------------------
    def _limits(self, trace: MemoryTrace, t_end: float, top: float, final: bool) -> tuple[float, float]:
        caps = [s.cap for s in trace.series if s.cap]
        # Never an axis below 1 MiB: an allocator reporting a few bytes (or
        # none) is drawn near zero on a readable scale.
        need = max([top * 1.08, *(c * 1.04 for c in caps), MIB])
        if final:
            return max(t_end, 1e-3), need
        # Live limits grow in big, round steps so the background is rarely redrawn.
        if t_end > self._xmax:
            self._xmax = max(2 * self._xmax, 1.25 * t_end)
        if need > self._ytop:
            if caps and top * 1.08 <= max(caps):
                self._ytop = need
            else:
                self._ytop = _nice_ceiling(need * 1.25 / MIB) * MIB
        return self._xmax, self._ytop

    def _layout_for(self, trace: MemoryTrace, top: float, t_end: float, final: bool) -> PlotLayout:
        xmax, ytop = self._limits(trace, t_end, top, final)
        first = trace.epoch_starts[0][1] if trace.epoch_starts else 0
        self._labels = tuple(short_name(s.label) for s in trace.series)
        return PlotLayout(
            xmax=xmax,
            ytop=ytop,
            unit=("GiB", GIB) if ytop >= GIB else ("MiB", MIB),
            caps=tuple(s.cap for s in trace.series),
            marks=tuple((t, e) for t, e in trace.epoch_starts if e != first),
            title=title_text(trace, final),
            legend=_legend_texts(trace, final),
            empty=bool(len(trace)) and all(trace.all_zero(i) for i in range(len(trace.series))),
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
        ax.set_ylabel(f"memory ({name})", fontsize=_LABEL_PT)
        for cap, members in _cap_groups(layout.caps).items():
            # Equal caps would hide each other: interleave their dashes.
            dash, gap = 5.0, 5.0 * (len(members) - 1)
            for k, i in enumerate(members):
                style = (k * dash, (dash, gap)) if gap else (0, (dash, 3.0))
                line = ax.axhline(cap / scale, color=f"C{i % 10}", lw=1.2, alpha=0.9, linestyle=style)
                self._decorations.append(line)
            names = ", ".join(self._labels[i] for i in members)
            self._decorations.append(
                ax.text(
                    0.995, cap / scale, f"cap {format_bytes(cap)} ({names}) ", transform=ax.get_yaxis_transform(),
                    ha="right", va="top", fontsize=_NOTE_PT, color="0.3",
                )
            )
        for t, epoch in layout.marks:
            self._decorations.append(ax.axvline(t, color="0.45", ls=":", lw=0.9))
            self._decorations.append(
                ax.text(t, 0.02, f" e{epoch + 1}", transform=ax.get_xaxis_transform(), fontsize=_NOTE_PT, color="0.35")
            )
        if layout.empty:
            self._decorations.append(
                ax.text(0.5, 0.5, "nothing allocated (every reading is 0 B)", transform=ax.transAxes,
                        ha="center", va="center", fontsize=_LABEL_PT, color="0.35")
            )
        for text, value in zip(self.legend.get_texts(), layout.legend):
            text.set_text(value)
        self.title.set_text(layout.title)
        self._applied = layout

    def _draw_variables(self, trace: MemoryTrace) -> None:
        vax = self.vax
        vax.clear()
        vax.tick_params(labelsize=_TICK_PT)
        vax.set_title("variables per replica", fontsize=_LABEL_PT, loc="left")
        if not trace.variable_bytes:
            vax.set_axis_off()
            vax.text(0.0, 0.5, "no model known\n(MemoryMonitor(model=...))", fontsize=_NOTE_PT, transform=vax.transAxes)
            return
        vax.set_axis_on()
        names = [short_name(d) for d in trace.variable_bytes]
        values = list(trace.variable_bytes.values())
        unit, scale = _unit(max(values))
        ys = list(range(len(names)))[::-1]
        vax.barh(ys, [v / scale for v in values], color="0.55", height=0.6)
        vax.set_yticks(ys, names)
        vax.set_xlim(0, max(max(values) / scale, 1) * 1.9)
        vax.set_xlabel(unit, fontsize=_LABEL_PT)
        for y, v in zip(ys, values):
            shown = f"{v / scale:.1f} {unit}" if scale > 1 else f"{v} B"
            vax.text(v / scale, y, " " + shown, va="center", fontsize=_NOTE_PT)

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
        import numpy as np

        width, height = self.canvas.get_width_height()
        pixels = np.asarray(self.canvas.buffer_rgba())
        return encode_png(pixels[:, :, :3], compress_level)

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


def save_trace_figure(trace: MemoryTrace, path: str, dpi: int = DPI) -> str:
    """Write a static figure of ``trace`` to ``path`` (format from its suffix).

    Raises :class:`ImportError` with the install hint without matplotlib.
    """
    require_matplotlib("the plot cannot be saved")
    plot = MemoryPlot(len(trace.series), live=False, dpi=dpi)
    plot.draw(trace, final=True)
    plot.fig.savefig(path, dpi=dpi)
    return path
