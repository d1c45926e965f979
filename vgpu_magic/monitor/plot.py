"""The static picture of a :class:`~vgpu_magic.monitor.trace.MemoryTrace` (docs/live-view.md shows what it draws):
one matplotlib figure (Agg, no pyplot), drawn once when a run ends, what stays in the notebook and ``savefig``'s
file. Transparent, so text that must read on light and dark themes sits on a light card (4.5:1 or more)."""

from __future__ import annotations

import io
import math
from typing import Any

from ..units import format_bytes, unit_for
from .trace import MemoryTrace, short_name
from .views import PALETTE, group_label, panel_groups, panel_top, title_text

#: At most this many points per line (bucket maxima beyond it, so no spike disappears).
MAX_POINTS = 1500

#: Pixels per inch. With the font sizes below, the smallest text (8.5 pt) is 12 px high.
DPI = 100
_TICK_PT, _TITLE_PT, _NOTE_PT = 8.5, 10.5, 8.0

#: Axes and titles: a mid grey that reads on white and on JupyterLab's dark background (#111).
TEXT = "#777777"
_GRID = "#8a8a8a"
_LABEL, _NOTE = {"fontsize": 9.5, "color": TEXT}, {"fontsize": _NOTE_PT, "color": TEXT}
#: The legend's card and its text (about 15:1).
_CARD, _CARD_TEXT = "#f7f7f7", "#222222"
_EPOCH = {"fontsize": _NOTE_PT, "color": _CARD_TEXT, "bbox": {"facecolor": _CARD, "edgecolor": "none", "pad": 1.0}}

#: The lines of one panel, in turn (as live.js): overlapping series stay apart by their dashes, never moved.
DASHES = ("-", (0, (7, 3)), (0, (2, 2)), (0, (7, 3, 2, 3)))


def require_matplotlib(purpose: str) -> None:
    """Raise an :class:`ImportError` with the install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or "matplotlib").split(".")[0]
        raise ImportError(f"{missing} is not installed, so {purpose}; pip install 'vgpu_magic[plot]'") from None


def _style(ax: Any) -> None:
    ax.set_facecolor("none")
    ax.tick_params(labelsize=_TICK_PT, colors=TEXT)
    for spine in ax.spines.values():
        spine.set_color(_GRID)
    ax.grid(True, lw=0.4, alpha=0.5, color=_GRID)


class MemoryFigure:
    """The static figure of one trace: ``axes`` per panel, the series ``groups``, their lines, ``legend``, ``vax``."""

    def __init__(self, trace: MemoryTrace, dpi: int = DPI) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        self.trace = trace
        panels = [p for p in ("device", "process") if any(s.panel == p for s in trace.series)]
        self.units = {p: unit_for(panel_top(trace, p), smallest="KiB") for p in panels}
        self.groups = panel_groups(trace)
        entries = len(self.groups) + 1
        ncol = 1 if entries <= 2 else 2
        rows = math.ceil(entries / ncol)
        # title, legend (with room under it for the epoch labels above the top panel), panels
        title_h, legend_h, panel_h, gap_h, bottom_h = 0.36, 0.2 * rows + 0.35, 1.7, 0.5, 0.5
        height = title_h + legend_h + len(panels) * panel_h + (len(panels) - 1) * gap_h + bottom_h
        self.fig = Figure(figsize=(9.0, height), dpi=dpi)
        self.fig.patch.set_alpha(0.0)
        self.canvas = FigureCanvasAgg(self.fig)
        right = 0.67 if trace.variable_bytes else 0.97
        self.axes: dict[str, Any] = {}
        top = height - title_h - legend_h
        for panel in panels:
            bottom = top - panel_h
            self.axes[panel] = self.fig.add_axes((0.085, bottom / height, right - 0.085, panel_h / height))
            top = bottom - gap_h
        self.vax = None
        if trace.variable_bytes:
            first = self.axes[panels[0]].get_position()
            self.vax = self.fig.add_axes((0.80, first.y0, 0.17, first.height))
        self.title = self.fig.text(
            0.085, 1 - 0.24 / height, title_text(trace, final=trace.finished), fontsize=_TITLE_PT, color=TEXT, ha="left"
        )
        self._draw_series()
        handles = [Line2D([], [], color=line.get_color(), lw=2.0, ls=line.get_linestyle()) for line in self.lines]
        peak_handle = Line2D([], [], color=_CARD_TEXT, lw=1.2, ls=":")
        self.legend = self.fig.legend(
            [*handles, peak_handle],
            [*(self._legend_text(g) for g in self.groups), "running peak (dotted)"],
            loc="upper left",
            bbox_to_anchor=(0.075, 1 - title_h / height),
            ncol=ncol,
            fontsize=_TICK_PT,
            frameon=True,
            facecolor=_CARD,
            edgecolor=_CARD,
            framealpha=1.0,
            labelcolor=_CARD_TEXT,
            borderaxespad=0.0,
        )
        self._draw_marks()
        self.axes[panels[-1]].set_xlabel("time (s)", **_LABEL)
        if self.vax is not None:
            self._draw_variables()

    def _legend_text(self, group: list[int]) -> str:
        trace, s = self.trace, self.trace.series[group[0]]
        cap = f" / cap {format_bytes(s.cap)}" if s.cap else ""
        return f"{group_label(trace, group)} · {trace.peak_text(group[0], self.units[s.panel][0])}{cap}"

    def _draw_series(self) -> None:
        import numpy as np

        trace = self.trace
        times = np.array(trace.time, dtype=float)
        values = [np.array(c, dtype=float) for c in (*trace.current, *trace.peak)]
        if len(times) > MAX_POINTS:  # bucket starts and bucket maxima
            starts = np.arange(0, len(times), math.ceil(len(times) / MAX_POINTS))
            times, values = times[starts], [np.maximum.reduceat(v, starts) for v in values]
        count = len(trace.series)
        xmax = max(trace.duration, float(times[-1]) if len(times) else 0.0, 1e-3)
        for panel, ax in self.axes.items():
            _style(ax)
            name, scale = self.units[panel]
            members = [i for i, s in enumerate(trace.series) if s.panel == panel]
            top = max(
                [float(values[j].max()) for i in members for j in (i, i + count) if len(values[j])]
                + [s.cap or 0 for s in trace.series if s.panel == panel]
                + [0.0]
            )
            ax.set_xlim(0, xmax)
            # RSS starts far from 0: the floor is a live process' lowest reading (from 0, growth looks flat).
            low = min([float(v[v > 0].min()) for v in (values[i] for i in members) if (v > 0).any()] or [0.0])
            span = max(top - low, 0.05 * top) if panel == "process" else top
            low = max(0.0, low - 0.15 * span) if panel == "process" else 0.0
            # Never below 1 KiB: an allocator reporting nothing is drawn at zero on a sane scale.
            ax.set_ylim(low / scale, max(top + 0.08 * span, 1024) / scale)
            title = {"device": "device memory", "process": "process RSS"}[panel]
            ax.set_ylabel(f"{title} ({name})", **_LABEL)
            capped = [g for g in self.groups if trace.series[g[0]].panel == panel and trace.series[g[0]].cap]
            for cap in sorted({trace.series[g[0]].cap for g in capped}):
                group = [g[0] for g in capped if trace.series[g[0]].cap == cap]
                # Equal caps would hide each other: interleave their dashes.
                dash, gap = 5.0, 5.0 * (len(group) - 1)
                for k, i in enumerate(group):
                    style = (k * dash, (dash, gap)) if gap else (0, (dash, 3.0))
                    ax.axhline(cap / scale, color=PALETTE[i % len(PALETTE)], lw=1.2, alpha=0.9, ls=style, label="_cap")
                names = ", ".join(short_name(trace.series[i].label) for g in capped if g[0] in group for i in g)
                text = f"cap {format_bytes(cap)} ({names}) "
                ax.text(0.995, cap / scale, text, transform=ax.get_yaxis_transform(), ha="right", va="top", **_NOTE)
            if len(trace) and all(trace.all_zero(i) for i in members):
                text = "nothing allocated (every reading is 0 B)"
                ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", **_LABEL)
        self.lines, self.peak_lines = [], []
        for group in self.groups:
            i = group[0]
            ax, scale = self.axes[trace.series[i].panel], self.units[trace.series[i].panel][1]
            dash = DASHES[len([g for g in self.lines if g.axes is ax]) % len(DASHES)]
            steps = {"color": PALETTE[i % len(PALETTE)], "drawstyle": "steps-post"}
            self.peak_lines.append(ax.plot(times, values[i + count] / scale, lw=1.0, ls=":", **steps)[0])
            self.lines.append(ax.plot(times, values[i] / scale, lw=1.6, ls=dash, **steps)[0])

    def _draw_marks(self) -> None:
        """Epoch starts: dark and light dots in every panel, a label above where it fits."""
        first = self.trace.epoch[0] if len(self.trace) else 0  # the epoch the run began in: no mark
        panels = list(self.axes.values())
        top, above = panels[0], panels[0].get_xaxis_transform()
        last_label = -math.inf
        for t, epoch in ((t, e) for t, e in self.trace.epoch_starts if e != first):
            for ax in panels:
                ax.axvline(t, color=_CARD_TEXT, ls=(0, (1.5, 1.5)), lw=1.0, label="_epoch")
                ax.axvline(t, color=_CARD, ls=(1.5, (1.5, 1.5)), lw=1.0, label="_epoch")
            where = t / top.get_xlim()[1]
            if where - last_label >= 0.045:
                top.text(t, 1.02, f"e{epoch + 1}", transform=above, va="bottom", ha="center", **_EPOCH)
                last_label = where

    def _draw_variables(self) -> None:
        trace, vax = self.trace, self.vax
        _style(vax)
        vax.grid(False)
        vax.set_title("variables per replica", loc="left", **_LABEL)
        names = [trace.device_label(d) for d in trace.variable_bytes]
        values = list(trace.variable_bytes.values())
        unit, scale = unit_for(max(values))
        ys = list(range(len(names)))[::-1]
        vax.barh(ys, [v / scale for v in values], color=TEXT, alpha=0.6, height=0.6)
        vax.set_yticks(ys, names)
        vax.set_xlim(0, max(max(values) / scale, 1) * 1.9)
        vax.set_xlabel(unit, **_LABEL)
        for y, v in zip(ys, values):
            vax.text(v / scale, y, " " + format_bytes(v, unit), va="center", **_NOTE)

    def png(self) -> bytes:
        out = io.BytesIO()
        self.fig.savefig(out, format="png", transparent=True)
        return out.getvalue()


def save_trace_figure(trace: MemoryTrace, path: str, dpi: int = DPI) -> str:
    """Write the static figure of ``trace`` to ``path`` (format from its suffix)."""
    require_matplotlib("the plot cannot be saved")
    MemoryFigure(trace, dpi=dpi).fig.savefig(path, dpi=dpi, transparent=True)
    return path
