"""Each rank's memory, sampled from the kernel side so the ranks run unchanged.

* :class:`RankMemoryTrace`: plain data, one series per rank (process RSS from
  psutil; GPU memory per process from NVML where a GPU exists);
* :class:`RankMemorySampler`: reads those figures for a list of PIDs;
* :class:`RankMemoryPlot`: draws a trace (matplotlib, Agg, no pyplot) and shows
  it through one display handle updated in place, so the last frame stays in
  the notebook as a static image. Redraws are throttled by their measured
  cost: the next frame waits ``max(0.5 s, 20 × last cost)``, so drawing takes
  at most 5 % of the kernel's time while the ranks run.
"""

from __future__ import annotations

import base64
import io
import time
from dataclasses import dataclass, field
from typing import Any

from ..units import format_bytes

__all__ = ["RankMemoryTrace", "RankMemorySampler", "RankMemoryPlot"]


@dataclass
class RankMemoryTrace:
    """Seconds since the run started and, per rank, RSS and GPU bytes (``None`` where unknown)."""

    ranks: int
    times: list[float] = field(default_factory=list)
    rss: list[list[int | None]] = field(default_factory=list)
    gpu: list[list[int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rss = self.rss or [[] for _ in range(self.ranks)]
        self.gpu = self.gpu or [[] for _ in range(self.ranks)]

    def add(self, t: float, rss: list[int | None], gpu: list[int | None]) -> None:
        self.times.append(t)
        for r in range(self.ranks):
            self.rss[r].append(rss[r])
            self.gpu[r].append(gpu[r])

    def peak_rss(self) -> list[int | None]:
        return [max((v for v in series if v is not None), default=None) for series in self.rss]

    def peak_gpu(self) -> list[int | None]:
        return [max((v for v in series if v is not None), default=None) for series in self.gpu]

    def has_gpu(self) -> bool:
        return any(v is not None for series in self.gpu for v in series)

    def summary(self) -> str:
        """``'peak RSS: rank 0 412.0 MiB, rank 1 409.3 MiB'`` (and GPU where known)."""
        text = "peak RSS: " + ", ".join(f"rank {r} {format_bytes(v)}" for r, v in enumerate(self.peak_rss()))
        if self.has_gpu():
            text += "; peak GPU: " + ", ".join(f"rank {r} {format_bytes(v)}" for r, v in enumerate(self.peak_gpu()))
        return text


class RankMemorySampler:
    """Reads each rank's RSS (psutil) and GPU memory (NVML, per PID) from the kernel."""

    def __init__(self, pids: list[int], gpu: bool) -> None:
        import psutil

        self._procs: list[Any] = []
        for pid in pids:
            try:
                self._procs.append(psutil.Process(pid))
            except psutil.Error:
                self._procs.append(None)
        from ..inventory import open_nvml

        self._nvml = open_nvml() if gpu else None
        self._handles = []
        if self._nvml is not None:
            self._handles = [
                self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._nvml.nvmlDeviceGetCount())
            ]

    def rss(self) -> list[int | None]:
        values: list[int | None] = []
        for proc in self._procs:
            try:
                values.append(proc.memory_info().rss if proc is not None else None)
            except Exception:
                values.append(None)
        return values

    def gpu(self) -> list[int | None]:
        """GPU bytes per rank summed over GPUs, from NVML's per-process accounting."""
        if self._nvml is None:
            return [None] * len(self._procs)
        used: dict[int, int] = {}
        for handle in self._handles:
            try:
                for info in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used[info.pid] = used.get(info.pid, 0) + int(info.usedGpuMemory or 0)
            except self._nvml.NVMLError:
                continue
        return [used.get(p.pid, 0) if p is not None else None for p in self._procs]

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None


class RankMemoryPlot:
    """A live per-rank memory plot in one display output, updated in place."""

    MIN_INTERVAL = 0.5
    BUDGET_FACTOR = 20

    def __init__(self, trace: RankMemoryTrace) -> None:
        from matplotlib.figure import Figure

        self.trace = trace
        self.figure = Figure(figsize=(7.0, 2.6), dpi=90)
        self.axes = self.figure.add_subplot(1, 1, 1)
        self.axes.set_xlabel("seconds")
        self.axes.set_ylabel("MiB")
        self.axes.set_title("memory per rank (process RSS)", fontsize=10)
        colours = [f"C{r % 10}" for r in range(trace.ranks)]
        self._rss = [self.axes.plot([], [], color=c, label=f"rank {r}")[0] for r, c in enumerate(colours)]
        self._gpu = [self.axes.plot([], [], color=c, linestyle="--")[0] for c in colours]
        self.axes.legend(loc="upper left", fontsize=8)
        self.figure.tight_layout()
        self._handle = None
        self._last_start = -1e9
        self._last_cost = 0.0

    def _png(self) -> bytes:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        mib = 1024 * 1024
        t = self.trace.times
        top = 1.0
        for r in range(self.trace.ranks):
            rss = [(v or 0) / mib for v in self.trace.rss[r]]
            self._rss[r].set_data(t, rss)
            top = max(top, *rss, 0)
            if self.trace.has_gpu():
                gpu = [(v or 0) / mib for v in self.trace.gpu[r]]
                self._gpu[r].set_data(t, gpu)
                top = max(top, *gpu, 0)
        if self.trace.has_gpu():
            self.axes.set_title("memory per rank (process RSS solid, GPU memory dashed)", fontsize=10)
        for r, line in enumerate(self._rss):
            line.set_label(f"rank {r} (peak {format_bytes(self.trace.peak_rss()[r])})")
        self.axes.legend(loc="upper left", fontsize=8)
        self.axes.set_xlim(0, max(1.0, t[-1] if t else 1.0) * 1.05)
        self.axes.set_ylim(0, top * 1.15)
        buf = io.BytesIO()
        FigureCanvasAgg(self.figure).print_png(buf)
        return buf.getvalue()

    def _bundle(self) -> dict[str, Any]:
        return {"image/png": base64.b64encode(self._png()).decode("ascii"), "text/plain": "<per-rank memory plot>"}

    def show(self) -> None:
        """Display the first frame (so the plot sits above the ranks' output)."""
        from IPython.display import display

        self._handle = display(self._bundle(), raw=True, display_id=True)
        self._last_start = time.perf_counter()

    def refresh(self, final: bool = False) -> None:
        """Draw a new frame if the throttle allows (always when ``final``)."""
        now = time.perf_counter()
        if not final and now - self._last_start < max(self.MIN_INTERVAL, self.BUDGET_FACTOR * self._last_cost):
            return
        self._last_start = now
        bundle = self._bundle()
        self._last_cost = time.perf_counter() - now
        if self._handle is not None:
            self._handle.update(bundle, raw=True)
