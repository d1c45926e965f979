"""The memory trace: plain data, no framework, no matplotlib.

A :class:`MemoryTrace` holds one monitored run (a ``fit``, ``evaluate``,
``predict`` or a custom loop): which memory series were read
(:class:`SeriesInfo`), and for every sample its time, step, epoch, phase and
the current and peak bytes of every series. It is stored column-wise in
:mod:`array` arrays.

Bounded memory
--------------
A custom loop may sample millions of times, so a trace keeps at most
``3 * recent`` rows (``recent`` = 8192 by default, about 1.5 MB for two
series):

* the latest samples at full resolution (between ``recent`` and
  ``2 * recent`` of them);
* older samples as a min/max envelope: each bucket of consecutive samples
  becomes two rows, the first with every series' minimum (current and peak) at
  the bucket's first time, the second with every series' maximum at its last
  time. When the envelope grows past ``recent`` rows, adjacent buckets merge
  and every later bucket covers twice as many samples, so the whole envelope
  always has one resolution.

So a plot of the whole run keeps every spike (as the envelope's top) and
every dip, while what the envelope cannot say, the exact sample at a given
moment long ago, is gone. :attr:`MemoryTrace.decimated` tells how many samples
one envelope bucket covers (1 while nothing was merged). The run's peak and
maximum current bytes are kept apart from the rows and are always exact.

Interrupts
----------
A ``KeyboardInterrupt`` can land between any two bytecodes of
:meth:`MemoryTrace.append`. The readings are converted first (a failing
conversion records nothing); a row is then written to every column and only
then counted, by one assignment. A row written to some columns but not counted
is invisible to every reader and overwritten by the next append; compaction
builds new columns aside and swaps them in with one assignment. A sample is
recorded whole or not at all.
"""

from __future__ import annotations

import csv
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..units import format_bytes, joined_alike

__all__ = ["SeriesInfo", "MemorySample", "MemoryTrace", "short_name", "RECENT_SAMPLES"]

#: Samples kept at full resolution (at least; see the module docstring).
RECENT_SAMPLES = 8192


@dataclass(frozen=True)
class SeriesInfo:
    """One memory series: what one allocator (or the process) reports.

    Parameters
    ----------
    key
        The ``device`` value of this series' rows: a logical device name such
        as ``"/device:GPU:1"``, ``"host"`` for a host allocator that all
        logical CPUs share, or ``"process"`` for the process' resident memory.
    label
        What the plot and the summaries call it.
    devices
        The logical devices whose memory this series is. More than one only
        when they share an allocator; none for the process series.
    cap
        The device's memory cap in bytes, ``None`` when it has none (CPUs, or
        a GPU used whole).
    panel
        Where the view draws it: ``"device"`` for an allocator's bytes,
        ``"process"`` for a process' resident memory, which on CPU dwarfs
        every allocator and so gets a panel (and a scale) of its own.
    """

    key: str
    label: str
    devices: tuple[str, ...]
    cap: int | None = None
    panel: str = "device"

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


class _Columns:
    """The rows of a trace: ``n`` counted rows in parallel arrays, the first
    ``envelope`` of them min/max rows (see the module docstring)."""

    __slots__ = ("time", "step", "epoch", "phase", "current", "peak", "n", "envelope", "bucket")

    def __init__(self, series_count: int) -> None:
        self.time = array("d")
        self.step = array("q")
        self.epoch = array("q")
        self.phase = array("b")
        self.current = [array("q") for _ in range(series_count)]
        self.peak = [array("q") for _ in range(series_count)]
        self.n = 0
        self.envelope = 0
        #: Samples per envelope bucket (each bucket is two rows).
        self.bucket = 1

    def all(self) -> list[array]:
        return [self.time, self.step, self.epoch, self.phase, *self.current, *self.peak]


@dataclass(eq=False)
class MemoryTrace:
    """Samples of every memory series during one run.

    Parameters
    ----------
    series
        The series, in plot order.
    kind
        What was run: ``"fit"``, ``"evaluate"``, ``"predict"`` or ``"custom"``.
    baseline_peak
        Each series' peak when the run started. An allocator keeps its peak
        since the process started (nothing here resets it, so other code's
        measurements stay intact); a peak that never rises above this baseline
        was reached before the run.
    recent
        Samples kept at full resolution before older ones are merged into the
        min/max envelope (see the module docstring).

    Notes
    -----
    ``time`` is seconds since the run started; ``step`` the training step
    (``fit``) or batch (``evaluate``/``predict``) at the sample; ``epoch`` the
    epoch (0-based, 0 outside ``fit``); ``phase`` what ran at the sample
    (``"fit"``, ``"validate"`` for a ``fit``'s validation, ``"evaluate"``,
    ``"predict"`` or ``"custom"``). Two traces are equal when they describe the
    same run: same series and settings and the same rows.
    """

    series: tuple[SeriesInfo, ...]
    kind: str = "custom"
    baseline_peak: tuple[int, ...] = ()
    epochs_total: int | None = None
    steps_total: int | None = None
    #: (time, epoch) at each epoch's start.
    epoch_starts: list[tuple[float, int]] = field(default_factory=list)
    #: Bytes of variables on each logical device (exact, from the variables'
    #: per-device components); empty when no model was known.
    variable_bytes: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    finished: bool = False
    duration: float = 0.0
    recent: int = RECENT_SAMPLES
    #: What a custom loop watches, in its framework's words (``"JAX · 8 devices"``).
    subject: str = ""

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

    # -- recording ------------------------------------------------------------
    def append(self, time: float, step: int, epoch: int, phase: str, readings: Sequence[tuple[int, int]]) -> None:
        """Add one sample: ``readings`` holds ``(current, peak)`` per series.

        The sample is recorded whole or not at all, also when interrupted.
        """
        if len(readings) != len(self.series):
            raise ValueError(f"{len(readings)} readings for {len(self.series)} series")
        values = [(int(cur), int(pk)) for cur, pk in readings]
        row = (float(time), int(step), int(epoch))
        try:
            code = self._phases.index(phase)
        except ValueError:
            self._phases.append(phase)
            code = len(self._phases) - 1
        cols = self._cols
        n = cols.n
        if len(cols.time) != n:  # a row an interrupt left half-written: never counted, drop it
            for column in cols.all():
                del column[n:]
        cols.time.append(row[0])
        cols.step.append(row[1])
        cols.epoch.append(row[2])
        cols.phase.append(code)
        for i, (cur, pk) in enumerate(values):
            cols.current[i].append(cur)
            cols.peak[i].append(pk)
        cols.n = n + 1  # the commit: one assignment
        for i, (cur, pk) in enumerate(values):
            if cur > self._max_current[i]:
                self._max_current[i] = cur
            if pk > self._max_peak[i]:
                self._max_peak[i] = pk
        if cols.n - cols.envelope >= 2 * self.recent:
            self._cols = _compacted(cols, self.recent)

    def add_series(self, series: Sequence[SeriesInfo], baseline_peak: Sequence[int]) -> None:
        """Use ``series`` from now on, which hold every series so far (by key)
        and some that joined the run (a runtime started): those read 0 B in
        the rows before, when their allocator did not exist yet."""
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

    def mark_epoch(self, time: float, epoch: int) -> None:
        """Record that ``epoch`` started at ``time``."""
        self.epoch_starts.append((time, epoch))

    # -- reading --------------------------------------------------------------
    def __len__(self) -> int:
        """The number of rows kept (each has one value per series)."""
        return self._cols.n

    @property
    def decimated(self) -> int:
        """Samples per envelope bucket of older rows; 1 while every sample is kept."""
        return self._cols.bucket

    @property
    def time(self) -> array:
        """Seconds since the run started, per row."""
        return self._column(self._cols.time)

    @property
    def step(self) -> array:
        return self._column(self._cols.step)

    @property
    def epoch(self) -> array:
        return self._column(self._cols.epoch)

    @property
    def current(self) -> list[array]:
        """Per series, current bytes per row."""
        return [self._column(c) for c in self._cols.current]

    @property
    def peak(self) -> list[array]:
        """Per series, peak bytes per row."""
        return [self._column(c) for c in self._cols.peak]

    def _column(self, column: array) -> array:
        n = self._cols.n
        return column if len(column) == n else column[:n]

    def phase(self, index: int) -> str:
        """The phase of row ``index``."""
        return self._phases[self._column(self._cols.phase)[index]]

    def rows(self) -> Iterator[MemorySample]:
        """Every row, sample by sample, series by series."""
        cols = self._cols
        for k in range(cols.n):
            phase = self._phases[cols.phase[k]]
            for i, s in enumerate(self.series):
                yield MemorySample(
                    cols.time[k], cols.step[k], cols.epoch[k], phase, s.key, cols.current[i][k], cols.peak[i][k]
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
        cols = self._cols
        if not cols.n:
            return None
        return cols.current[index][cols.n - 1], cols.peak[index][cols.n - 1]

    def run_peak(self, index: int) -> int | None:
        """The peak reached during this run (exact, whatever was merged), or
        ``None`` when the peak did not rise above its value at the start."""
        if not self._cols.n:
            return None
        top = self._max_peak[index]
        # Current memory that reached the old peak pins the run's peak to it.
        if top > self.baseline_peak[index] or self._max_current[index] >= self.baseline_peak[index]:
            return top
        return None

    def all_zero(self, index: int) -> bool:
        """True when series ``index`` never reported a byte (e.g. a host
        allocator that keeps no statistics): "nothing allocated"."""
        return bool(self._cols.n) and self._max_current[index] == 0 and self._max_peak[index] == 0

    def max_reading(self, index: int) -> int:
        """The largest current or peak bytes series ``index`` read in this run."""
        return max(self._max_current[index], self._max_peak[index])

    def peak_text(self, index: int, unit: str | None = None) -> str:
        """``'peak 1.20 GiB'`` (in ``unit``, e.g. an axis', when given), or an
        honest bound when the peak predates the run."""
        if self.all_zero(index):
            return "nothing allocated"
        peak = self.run_peak(index)
        if peak is not None:
            return f"peak {format_bytes(peak, unit)}"
        if not self._cols.n:
            return "no samples"
        return f"peak ≤ {format_bytes(self.baseline_peak[index], unit)} (reached before this run)"

    def variables_text(self) -> str:
        """``'variables per replica: CPU:0 20.1 MiB, CPU:1 20.1 MiB'``, or ``''``."""
        if not self.variable_bytes:
            return ""
        parts = [(short_name(d), format_bytes(b)) for d, b in self.variable_bytes.items()]
        return "variables per replica: " + ", ".join(joined_alike(parts, " "))

    def _key(self) -> tuple:
        fields = (
            self.series,
            self.kind,
            self.baseline_peak,
            self.epochs_total,
            self.steps_total,
            self.epoch_starts,
            self.variable_bytes,
            self.interrupted,
            self.finished,
            self.duration,
            self.decimated,
        )
        return fields, list(self.rows())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryTrace):
            return NotImplemented
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable: it grows while recording

    def __repr__(self) -> str:
        names = ", ".join(s.label for s in self.series)
        return f"<MemoryTrace {self.kind}: {len(self)} samples of {names}>"


class _Pair(NamedTuple):
    """One envelope bucket: its first and last sample's time, step, epoch and
    phase code, and every series' minimum and maximum current and peak."""

    first: tuple[float, int, int, int]
    last: tuple[float, int, int, int]
    low: tuple[tuple[int, int], ...]
    high: tuple[tuple[int, int], ...]


def _pairs_of_envelope(cols: _Columns) -> list[_Pair]:
    series = range(len(cols.current))
    pairs = []
    for k in range(0, cols.envelope, 2):
        pairs.append(
            _Pair(
                (cols.time[k], cols.step[k], cols.epoch[k], cols.phase[k]),
                (cols.time[k + 1], cols.step[k + 1], cols.epoch[k + 1], cols.phase[k + 1]),
                tuple((cols.current[i][k], cols.peak[i][k]) for i in series),
                tuple((cols.current[i][k + 1], cols.peak[i][k + 1]) for i in series),
            )
        )
    return pairs


def _pair_of_rows(cols: _Columns, first: int, stop: int) -> _Pair:
    last = stop - 1
    low, high = [], []
    for cur, pk in zip(cols.current, cols.peak):
        cur, pk = cur[first:stop], pk[first:stop]
        low.append((min(cur), min(pk)))
        high.append((max(cur), max(pk)))
    return _Pair(
        (cols.time[first], cols.step[first], cols.epoch[first], cols.phase[first]),
        (cols.time[last], cols.step[last], cols.epoch[last], cols.phase[last]),
        tuple(low),
        tuple(high),
    )


def _merged(a: _Pair, b: _Pair) -> _Pair:
    return _Pair(
        a.first,
        b.last,
        tuple((min(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a.low, b.low)),
        tuple((max(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a.high, b.high)),
    )


def _compacted(cols: _Columns, recent: int) -> _Columns:
    """New columns where the oldest ``recent`` full-resolution rows joined the
    envelope, whose adjacent buckets merge while it has more than ``recent``
    rows. The old columns are left untouched (see "Interrupts")."""
    bucket = max(cols.bucket, 4)  # 4 samples -> 2 rows: the first halving
    pairs = _pairs_of_envelope(cols)
    aged_stop = cols.envelope + recent
    pairs += [_pair_of_rows(cols, k, min(k + bucket, aged_stop)) for k in range(cols.envelope, aged_stop, bucket)]
    while 2 * len(pairs) > recent:
        pairs = [_merged(*pairs[j : j + 2]) if j + 1 < len(pairs) else pairs[j] for j in range(0, len(pairs), 2)]
        bucket *= 2
    out = _Columns(len(cols.current))
    out.bucket = bucket
    for pair in pairs:
        for (t, step, epoch, phase), values in ((pair.first, pair.low), (pair.last, pair.high)):
            out.time.append(t)
            out.step.append(step)
            out.epoch.append(epoch)
            out.phase.append(phase)
            for i, (cur, pk) in enumerate(values):
                out.current[i].append(cur)
                out.peak[i].append(pk)
    out.envelope = len(out.time)
    for new, old in zip(out.all(), cols.all()):
        new.extend(old[aged_stop : cols.n])
    out.n = len(out.time)
    return out


def short_name(device: str) -> str:
    """``'/job:localhost/replica:0/task:0/device:GPU:1'`` -> ``'GPU:1'``."""
    return device.rsplit("device:", 1)[-1]
