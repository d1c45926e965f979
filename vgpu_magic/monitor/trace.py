"""The memory trace: plain data, no TensorFlow, no matplotlib.

A :class:`MemoryTrace` holds one monitored run (a ``fit``, ``evaluate``,
``predict`` or a custom loop): which memory series were read
(:class:`SeriesInfo`), and for every sample its time, step, epoch, phase and
the current and peak bytes of every series. It is stored column-wise in
:mod:`array` arrays, so an hour at 20 samples a second stays a few MB.
"""

from __future__ import annotations

import csv
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..units import format_bytes

__all__ = ["SeriesInfo", "MemorySample", "MemoryTrace"]


@dataclass(frozen=True)
class SeriesInfo:
    """One memory series: what one allocator reports.

    Parameters
    ----------
    key
        The ``device`` value of this series' rows: a logical device name such
        as ``"/device:GPU:1"``, or ``"host"`` for the host allocator that all
        logical CPUs share.
    label
        What the plot and the summaries call it.
    devices
        The logical devices whose memory this series is. More than one only
        when they share an allocator (logical CPUs).
    cap
        The device's memory cap in bytes, ``None`` when it has none (CPUs, or
        a GPU used whole).
    """

    key: str
    label: str
    devices: tuple[str, ...]
    cap: int | None = None

    @property
    def shared(self) -> bool:
        """True when several logical devices share this one allocator."""
        return len(self.devices) > 1


class MemorySample(NamedTuple):
    """One row of a trace: one series at one sample."""

    time: float
    step: int
    epoch: int
    phase: str
    device: str
    current: int
    peak: int


#: CSV / row column order.
COLUMNS = MemorySample._fields


@dataclass
class MemoryTrace:
    """Samples of every memory series during one run.

    Parameters
    ----------
    series
        The series, in plot order.
    kind
        What was run: ``"fit"``, ``"evaluate"``, ``"predict"`` or ``"custom"``.
    baseline_peak
        Each series' allocator peak when the run started. The allocator keeps
        its peak since the process started (nothing here resets it, so other
        code's measurements stay intact); a peak that never rises above this
        baseline was reached before the run.

    Notes
    -----
    ``time`` is seconds since the run started; ``step`` the training step
    (``fit``) or batch (``evaluate``/``predict``) at the sample; ``epoch`` the
    epoch (0-based, 0 outside ``fit``); ``phase`` what ran at the sample
    (``"fit"``, ``"validate"`` for a ``fit``'s validation, ``"evaluate"``,
    ``"predict"`` or ``"custom"``).
    """

    series: tuple[SeriesInfo, ...]
    kind: str = "custom"
    baseline_peak: tuple[int, ...] = ()
    epochs_total: int | None = None
    steps_total: int | None = None
    #: (time, epoch) at each epoch's start.
    epoch_starts: list[tuple[float, int]] = field(default_factory=list)
    #: Bytes of variables on each logical device (exact, from the variables'
    #: per-replica components); empty when no model was known.
    variable_bytes: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    finished: bool = False
    duration: float = 0.0

    def __post_init__(self) -> None:
        self.series = tuple(self.series)
        if not self.baseline_peak:
            self.baseline_peak = (0,) * len(self.series)
        self.time = array("d")
        self.step = array("q")
        self.epoch = array("q")
        self._phase_codes = array("b")
        self._phases: list[str] = []
        self.current = [array("q") for _ in self.series]
        self.peak = [array("q") for _ in self.series]

    # -- recording ------------------------------------------------------------
    def append(self, time: float, step: int, epoch: int, phase: str, readings: Sequence[tuple[int, int]]) -> None:
        """Add one sample: ``readings`` holds ``(current, peak)`` per series."""
        if len(readings) != len(self.series):
            raise ValueError(f"{len(readings)} readings for {len(self.series)} series")
        try:
            code = self._phases.index(phase)
        except ValueError:
            self._phases.append(phase)
            code = len(self._phases) - 1
        self.time.append(time)
        self.step.append(step)
        self.epoch.append(epoch)
        self._phase_codes.append(code)
        for i, (cur, pk) in enumerate(readings):
            self.current[i].append(int(cur))
            self.peak[i].append(int(pk))

    def mark_epoch(self, time: float, epoch: int) -> None:
        self.epoch_starts.append((time, epoch))

    # -- reading --------------------------------------------------------------
    def __len__(self) -> int:
        """The number of samples (each has one row per series)."""
        return len(self.time)

    def phase(self, index: int) -> str:
        return self._phases[self._phase_codes[index]]

    def rows(self) -> Iterator[MemorySample]:
        """Every row, sample by sample, series by series."""
        for k in range(len(self.time)):
            phase = self._phases[self._phase_codes[k]]
            for i, s in enumerate(self.series):
                yield MemorySample(
                    self.time[k], self.step[k], self.epoch[k], phase, s.key, self.current[i][k], self.peak[i][k]
                )

    def to_records(self) -> list[dict[str, Any]]:
        """The rows as dictionaries (``pandas.DataFrame(trace.to_records())`` works)."""
        return [row._asdict() for row in self.rows()]

    def to_csv(self, path: str | os.PathLike) -> str:
        """Write the rows to ``path`` as CSV (bytes as integers); return the path."""
        path = os.fspath(path)
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(COLUMNS)
            for row in self.rows():
                writer.writerow((f"{row.time:.6f}", *row[1:]))
        return path

    def latest(self, index: int) -> tuple[int, int] | None:
        """The last ``(current, peak)`` of series ``index``; ``None`` before any sample."""
        if not self.time:
            return None
        return self.current[index][-1], self.peak[index][-1]

    def run_peak(self, index: int) -> int | None:
        """The allocator peak reached during this run, or ``None`` when the
        allocator's peak did not rise above its value at the start (the run's
        own peak is then somewhere between :meth:`max_current` and that value)."""
        if not self.time:
            return None
        top = max(self.peak[index])
        # Current memory that reached the old peak pins the run's peak to it.
        if top > self.baseline_peak[index] or max(self.current[index]) >= self.baseline_peak[index]:
            return top
        return None

    def max_current(self, index: int) -> int | None:
        return max(self.current[index]) if self.time else None

    def peak_text(self, index: int) -> str:
        """``'peak 1.20 GiB'``, or an honest bound when the peak predates the run."""
        peak = self.run_peak(index)
        if peak is not None:
            return f"peak {format_bytes(peak)}"
        if not self.time:
            return "no samples"
        return f"peak ≤ {format_bytes(self.baseline_peak[index])} (reached before this run)"

    def variables_text(self) -> str:
        """``'variables per replica: CPU:0 20.1 MiB, CPU:1 20.1 MiB'``, or ``''``."""
        if not self.variable_bytes:
            return ""
        parts = [f"{short_name(d)} {format_bytes(b)}" for d, b in self.variable_bytes.items()]
        return "variables per replica: " + ", ".join(parts)

    def __repr__(self) -> str:
        names = ", ".join(s.label for s in self.series)
        return f"<MemoryTrace {self.kind}: {len(self)} samples of {names}>"


def short_name(device: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:GPU:1'`` -> ``'GPU:1'``."""
    return device.rsplit("device:", 1)[-1]
