"""The memory trace: plain data, no framework, no matplotlib. A :class:`MemoryTrace` holds one run: its series
(:class:`SeriesInfo`) and, per sample, the time, step, epoch, phase and every series' current and peak bytes,
column-wise in :mod:`array` arrays. At most ``3 * recent`` rows: older samples become a min/max envelope (two rows per
bucket, minima at its first time, maxima at its last; :attr:`MemoryTrace.decimated`), so every spike and dip stays
visible; the run's peaks are kept apart, exact. A ``KeyboardInterrupt`` in :meth:`MemoryTrace.append` records a sample
whole or not at all: a row is counted, and new columns swapped in, by one assignment each."""

from __future__ import annotations

import csv
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from ..devices import simulated_line
from ..units import format_bytes, joined_alike

__all__ = ["SeriesInfo", "MemorySample", "MemoryTrace", "short_name", "RECENT_SAMPLES"]

#: Samples kept at full resolution (at least; see the module docstring).
RECENT_SAMPLES = 8192


@dataclass(frozen=True)
class SeriesInfo:
    """One memory series: what one allocator (or the process) reports. ``key``: the rows' ``device``; ``devices``:
    the logical devices it covers; ``cap``: bytes or ``None``; ``panel``: where drawn (RSS dwarfs the allocators)."""

    key: str
    label: str
    devices: tuple[str, ...]
    cap: int | None = None
    panel: str = "device"


class MemorySample(NamedTuple):
    """One row of a trace: one series at one sample."""

    time: float
    step: int
    epoch: int
    phase: str
    device: str
    current: int
    peak: int


class _Columns:
    """``n`` counted rows in parallel arrays, the first ``envelope`` of them min/max rows."""

    __slots__ = ("time", "step", "epoch", "phase", "current", "peak", "n", "envelope", "bucket")

    def __init__(self, series_count: int) -> None:
        self.time, self.step, self.epoch, self.phase = array("d"), array("q"), array("q"), array("b")
        self.current = [array("q") for _ in range(series_count)]
        self.peak = [array("q") for _ in range(series_count)]
        self.n = self.envelope = 0
        self.bucket = 1  # samples per envelope bucket (two rows)

    def all(self) -> list[array]:
        return [self.time, self.step, self.epoch, self.phase, *self.current, *self.peak]


@dataclass(eq=False)
class MemoryTrace:
    """Samples of every memory series during one run: ``kind`` (``"fit"``...), each series' ``baseline_peak`` at the
    start, ``recent`` samples at full resolution; per row time, step, epoch and phase. Equal: the same run."""

    series: tuple[SeriesInfo, ...]
    kind: str = "custom"
    baseline_peak: tuple[int, ...] = ()
    epochs_total: int | None = None
    #: (time, epoch) at each epoch's start.
    epoch_starts: list[tuple[float, int]] = field(default_factory=list)
    #: Bytes of variables on each logical device; empty when no model was known.
    variable_bytes: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    #: How an interrupted run ended, where more is known (``"rank 1 failed"``).
    ending: str = ""
    finished: bool = False
    duration: float = 0.0
    recent: int = RECENT_SAMPLES
    #: What a custom loop watches, in its framework's words (``"JAX · 8 devices"``).
    subject: str = ""
    #: What its devices only simulate (:func:`~vgpu_magic.devices.split_simulates`), for the caption.
    simulated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.series = tuple(self.series)
        if not self.baseline_peak:
            self.baseline_peak = (0,) * len(self.series)
        if self.recent < 4 or self.recent % 2:
            raise ValueError(f"recent={self.recent!r} must be an even number of samples, at least 4")
        self._cols = _Columns(len(self.series))
        self._phases: list[str] = []
        self._max_current = [0] * len(self.series)
        self._max_peak = [0] * len(self.series)

    def append(self, time: float, step: int, epoch: int, phase: str, readings: Sequence[tuple[int, int]]) -> None:
        """Add one sample, whole or not at all: ``readings`` holds ``(current, peak)`` per series."""
        if len(readings) != len(self.series):
            raise ValueError(f"{len(readings)} readings for {len(self.series)} series")
        values = [(int(cur), int(pk)) for cur, pk in readings]
        if phase not in self._phases:
            self._phases.append(phase)
        code, cols = self._phases.index(phase), self._cols
        row = (float(time), int(step), int(epoch), code, *(c for c, _ in values), *(p for _, p in values))
        n = cols.n
        if len(cols.time) != n:  # a row an interrupt left half-written: never counted, drop it
            for column in cols.all():
                del column[n:]
        for column, value in zip(cols.all(), row):
            column.append(value)
        cols.n = n + 1  # the commit: one assignment
        for i, (cur, pk) in enumerate(values):
            self._max_current[i] = max(self._max_current[i], cur)
            self._max_peak[i] = max(self._max_peak[i], pk)
        if cols.n - cols.envelope >= 2 * self.recent:
            self._cols = _compacted(cols, self.recent)

    def add_series(self, series: Sequence[SeriesInfo], baseline_peak: Sequence[int]) -> None:
        """Use ``series`` from now on: those so far (by key) and new ones, which read 0 B in the rows before."""
        cols, old = self._cols, {s.key: i for i, s in enumerate(self.series)}
        if not set(old) <= {s.key for s in series}:
            raise ValueError(f"{[s.key for s in series]} leaves out some of {list(old)}")
        n = cols.n
        out = _Columns(len(series))
        out.time, out.step, out.epoch, out.phase = cols.time[:n], cols.step[:n], cols.epoch[:n], cols.phase[:n]
        out.n, out.envelope, out.bucket = n, cols.envelope, cols.bucket
        place = [old.get(s.key) for s in series]
        for j, i in enumerate(place):
            out.current[j] = array("q", bytes(8 * n)) if i is None else cols.current[i][:n]
            out.peak[j] = array("q", bytes(8 * n)) if i is None else cols.peak[i][:n]
        pick = lambda values, new: tuple(new[j] if i is None else values[i] for j, i in enumerate(place))  # noqa: E731
        self.baseline_peak = pick(self.baseline_peak, list(baseline_peak))
        self._max_current = list(pick(self._max_current, [0] * len(series)))
        self._max_peak = list(pick(self._max_peak, [0] * len(series)))
        self.series = tuple(series)
        self._cols = out

    def __len__(self) -> int:
        return self._cols.n

    @property
    def decimated(self) -> int:
        """Samples per envelope bucket of older rows; 1 while every sample is kept."""
        return self._cols.bucket

    time = property(lambda self: self._column(self._cols.time), doc="Per row, seconds since the run's start.")
    step = property(lambda self: self._column(self._cols.step), doc="Per row, the training step.")
    epoch = property(lambda self: self._column(self._cols.epoch), doc="Per row, the epoch (0-based).")

    @property
    def current(self) -> list[array]:
        """Per series, current bytes per row (``peak``: peak bytes)."""
        return [self._column(c) for c in self._cols.current]

    @property
    def peak(self) -> list[array]:
        return [self._column(c) for c in self._cols.peak]

    def _column(self, column: array) -> array:
        n = self._cols.n
        return column if len(column) == n else column[:n]

    def phase(self, index: int) -> str:
        return self._phases[self._column(self._cols.phase)[index]]

    def rows(self) -> Iterator[MemorySample]:
        cols = self._cols
        for k in range(cols.n):
            phase = self._phases[cols.phase[k]]
            for i, s in enumerate(self.series):
                yield MemorySample(
                    cols.time[k], cols.step[k], cols.epoch[k], phase, s.key, cols.current[i][k], cols.peak[i][k]
                )

    def to_records(self) -> list[dict[str, Any]]:
        """The rows as dictionaries (for ``pandas.DataFrame``)."""
        return [row._asdict() for row in self.rows()]

    def to_csv(self, path: str | os.PathLike) -> str:
        """Write the rows to ``path`` as CSV; return the path."""
        path = os.fspath(path)
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(MemorySample._fields)
            for row in self.rows():
                writer.writerow((f"{row.time:.6f}", *row[1:]))
        return path

    def latest(self, index: int) -> tuple[int, int] | None:
        """The last ``(current, peak)`` of series ``index``; ``None`` before any sample."""
        cols, last = self._cols, self._cols.n - 1
        return (cols.current[index][last], cols.peak[index][last]) if cols.n else None

    def run_peak(self, index: int) -> int | None:
        """The peak reached during this run (exact), or ``None`` where it did not rise above the start's."""
        if not self._cols.n:
            return None
        top = self._max_peak[index]
        # Current memory that reached the old peak pins the run's peak to it.
        if top > self.baseline_peak[index] or self._max_current[index] >= self.baseline_peak[index]:
            return top
        return None

    def all_zero(self, index: int) -> bool:
        """True when series ``index`` never reported a byte: "nothing allocated"."""
        return bool(self._cols.n) and self._max_current[index] == 0 and self._max_peak[index] == 0

    def max_reading(self, index: int) -> int:
        return max(self._max_current[index], self._max_peak[index])

    def peak_text(self, index: int, unit: str | None = None) -> str:
        """``'peak 1.20 GiB'`` (in ``unit`` when given), or a bound when the peak predates the run."""
        if self.all_zero(index):
            return "nothing allocated"
        peak = self.run_peak(index)
        if peak is not None:
            return f"peak {format_bytes(peak, unit)}"
        if not self._cols.n:
            return "no samples"
        return f"peak ≤ {format_bytes(self.baseline_peak[index], unit)} (reached before this run)"

    def device_label(self, device: str) -> str:
        """The series' name of ``device`` (JAX's ``"cpu:3"``), else its short name: variables read as the legend."""
        short = short_name(device)
        return next((s.label for s in self.series if len(s.devices) == 1 and short_name(s.devices[0]) == short), short)

    def caption(self) -> str:
        """The lines under the plot: what is simulated (:func:`~vgpu_magic.devices.simulated_line`), the variables."""
        return "\n".join(line for line in (simulated_line(self.simulated), self.variables_text()) if line)

    def variables_text(self) -> str:
        """``'variables per replica: CPU:0 20.1 MiB, CPU:1 20.1 MiB'``, or ``''``."""
        if not self.variable_bytes:
            return ""
        parts = [(self.device_label(d), format_bytes(b)) for d, b in self.variable_bytes.items()]
        return "variables per replica: " + ", ".join(joined_alike(parts, " "))

    def _key(self) -> tuple:
        return [getattr(self, f.name) for f in fields(self)], self.decimated, list(self.rows())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryTrace):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable: it grows while recording

    def __repr__(self) -> str:
        names = ", ".join(s.label for s in self.series)
        return f"<MemoryTrace {self.kind}: {len(self)} samples of {names}>"


def _compacted(cols: _Columns, recent: int) -> _Columns:
    """New columns where the oldest ``recent`` rows joined the envelope, its buckets merged to at most ``recent``."""
    bucket = max(cols.bucket, 4)  # 4 samples -> 2 rows: the first halving
    aged = cols.envelope + recent
    spans = [(k, k + 2) for k in range(0, cols.envelope, 2)]
    spans += [(k, min(k + bucket, aged)) for k in range(cols.envelope, aged, bucket)]
    while 2 * len(spans) > recent:
        spans = [(spans[j][0], spans[min(j + 1, len(spans) - 1)][1]) for j in range(0, len(spans), 2)]
        bucket *= 2
    out = _Columns(len(cols.current))
    out.bucket = bucket
    for first, stop in spans:
        for row, pick in ((first, min), (stop - 1, max)):
            for new, old in zip(out.all()[:4], cols.all()[:4]):  # time, step, epoch, phase
                new.append(old[row])
            for new, old in zip((*out.current, *out.peak), (*cols.current, *cols.peak)):
                new.append(pick(old[first:stop]))
    out.envelope = len(out.time)
    for new, old in zip(out.all(), cols.all()):
        new.extend(old[aged : cols.n])
    out.n = len(out.time)
    return out


def short_name(device: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:GPU:1'`` -> ``'GPU:1'``."""
    return device.rsplit("device:", 1)[-1]
