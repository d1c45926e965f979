"""Each rank's memory, sampled from the kernel so the ranks run unchanged: RSS (psutil) and GPU memory (NVML per PID;
where NVML lists processes but none of the ranks' PIDs, a container, each rank reports its own allocator's figures),
read by a :class:`~vgpu_magic.monitor.session.MonitorSession`: the same trace and views as a monitored ``fit``."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..monitor.trace import SeriesInfo

#: Seconds between a rank's reports of its allocator's figures, as files: ipyparallel's ``publish_data`` after the
#: cell returned did not reach an idle engine's client (ipyparallel 9.2), and goes to the engine's next request.
REPORT_EVERY = 0.2


def report_allocator(path: str) -> None:
    """On a rank: a thread writing ``"current peak"`` GPU bytes to ``path`` until its folder is removed."""
    import threading

    from ..frameworks import cuda_context_holders

    def report() -> None:
        while os.path.isdir(os.path.dirname(path)):
            try:
                figures = [f for f in (fw.gpu_allocator_bytes() for fw in cuda_context_holders()) if f]
            except Exception:  # noqa: BLE001 - a framework that cannot tell reports nothing
                figures = []
            with contextlib.suppress(OSError):
                with open(path + ".new", "w") as out:
                    out.write(f"{sum(f[0] for f in figures)} {sum(f[1] for f in figures)}")
                os.replace(path + ".new", path)
            time.sleep(REPORT_EVERY)

    threading.Thread(target=report, name="vgpu_magic-allocator", daemon=True).start()


class RankMemorySampler:
    """A :class:`~vgpu_magic.monitor.sampler.MemorySampler` of the ranks on this host: RSS and GPU memory (with
    ``launched``, of their launched processes); ``ended``: the ranks whose run came back, set by the run."""

    subject = ""
    simulated: tuple[str, ...] = ()
    joinable = None
    training_thread_only = False

    def __init__(
        self, pids: list[int | None], gpu: bool, launched: bool = False, engine: Callable[[int], Any] | None = None
    ) -> None:
        import psutil

        self.launched = launched
        self.ranks = [rank for rank, pid in enumerate(pids) if pid is not None]
        self.ended: set[int] = set()
        self._procs: list[Any] = []
        for rank in self.ranks:
            try:
                self._procs.append(psutil.Process(pids[rank]))
            except psutil.Error:
                self._procs.append(None)
        from ..inventory import open_nvml

        nvml = self._nvml = open_nvml() if gpu and self.ranks else None
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())] if nvml else []
        #: The folder the ranks report their allocators' figures in, when NVML cannot tell their processes.
        self._reports: str | None = None
        if engine is not None and self._nvml is not None and not self._nvml_knows_the_ranks(self._nvml_used()):
            self._reports = tempfile.mkdtemp(prefix="vgpu_magic-allocators-")
            for rank in self.ranks:
                engine(rank).apply_async(report_allocator, os.path.join(self._reports, str(rank)))
        of = "GPU (allocator)" if self._reports else "GPU"
        gpu_series = [SeriesInfo(f"rank{r}:gpu", f"rank {r} {of}", (), None) for r in self.ranks] if self._nvml else []
        rss_series = [SeriesInfo(f"rank{r}:rss", f"rank {r} RSS", (), None, panel="process") for r in self.ranks]
        self.series = (*gpu_series, *rss_series)
        self.devices: tuple[str, ...] = ()
        self._peaks = [0] * len(self.series)

    def _family(self, proc: Any) -> list[Any]:
        """The rank's process and, for a launch, what it started: what its spare forked (:mod:`.launch`), not the spare,
        whose pages the launch shares."""
        import psutil

        try:
            spares = proc.children() if self.launched else ()
            return [proc, *(launch for spare in spares for launch in spare.children(recursive=True))]
        except psutil.Error:
            return [proc]

    def rss(self) -> list[int | None]:
        import psutil

        values: list[int | None] = []
        for proc in self._live():
            try:
                values.append(None if proc is None else proc.memory_info().rss)
            except psutil.Error:  # the rank died or its /proc entry went away between two samples
                values.append(None)
            for child in self._family(proc)[1:] if values[-1] is not None else ():
                with contextlib.suppress(psutil.Error):
                    values[-1] += child.memory_info().rss
        return values

    def _nvml_used(self) -> dict[int, int]:
        """GPU bytes per PID (NVML's PID namespace), summed over GPUs."""
        used: dict[int, int] = {}
        for handle in self._handles:
            try:
                for info in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used[info.pid] = used.get(info.pid, 0) + int(info.usedGpuMemory or 0)
            except self._nvml.NVMLError:
                continue
        return used

    def _nvml_knows_the_ranks(self, used: dict[int, int]) -> bool:
        """False when NVML lists processes (``used``) but none of the ranks' PIDs: its PIDs are another namespace's."""
        return not used or any(p is not None and p.pid in used for p in self._procs)

    def gpu(self) -> list[int | None]:
        """GPU bytes per rank from NVML's per-process accounting; ``None`` where NVML cannot tell."""
        used = self._nvml_used() if self._nvml is not None else {}
        if self._nvml is None or not self._nvml_knows_the_ranks(used):
            return [None] * len(self._procs)
        return [sum(used.get(q.pid, 0) for q in self._family(p)) if p is not None else None for p in self._live()]

    def _live(self) -> list[Any]:
        return [None if self.launched and r in self.ended else p for r, p in zip(self.ranks, self._procs)]

    def read(self) -> list[tuple[int, int]]:
        """``(current, peak)`` per series: GPU per rank (else its allocators' reports, 0 before one), then RSS."""
        gpu: list[Any] = self.gpu() if self._nvml is not None and not self._reports else []
        for rank in self.ranks if self._reports else ():
            try:
                with open(os.path.join(self._reports, str(rank))) as report:
                    current, peak = (int(v) for v in report.read().split())
            except (OSError, ValueError):
                current = peak = 0
            gpu.append((current, peak))
        values = [*gpu, *self.rss()]
        found = []
        for i, value in enumerate(values):
            current, peak = value if isinstance(value, tuple) else (value or 0, 0)
            self._peaks[i] = max(self._peaks[i], current, peak)
            found.append((current, self._peaks[i]))
        return found

    def close(self) -> None:
        if self._reports is not None:  # the ranks' reporting threads end with their folder
            # A report written as the folder is emptied keeps it: empty it again until it is gone.
            for _ in range(100):
                shutil.rmtree(self._reports, ignore_errors=True)
                if not os.path.isdir(self._reports):
                    break
                time.sleep(0.01)
            self._reports = None
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._nvml = None


def run_ending(failed: Sequence[int], timed_out: bool) -> str:
    """How a run ended, for its memory view's title: ``"ranks 0, 1 failed"``, ``"timed out"`` or ``""``."""
    if failed:
        return f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} failed"
    return "timed out" if timed_out else ""
