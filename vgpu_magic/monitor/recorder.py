"""The recorder: samples memory into a :class:`MemoryTrace` and feeds a view.

:class:`MemoryRecorder` knows nothing about Keras: the Keras callback, the
context manager for custom loops and the tests all drive the same calls
(``start``, ``tick``/``sample``, ``begin_epoch``/``end_epoch``, ``finish``).

Sampling cost. :meth:`MemoryRecorder.tick` and :meth:`MemoryRecorder.sample`
are meant for every step: they read the clock and sample only when
``interval`` has passed since the last sample (a custom loop calling
``sample()`` a million times costs a million clock reads, not a million
reads of every allocator). The run's first sample, each epoch's end and the
run's end are always sampled.
Sampling reads each allocator's *current* and *peak*; the allocator updates its
peak on every allocation, so no peak between two samples is lost however
sparse the samples are. Nothing resets those peaks
(``tf.config.experimental.reset_memory_stats`` is process-wide and would
silently change what any other code measures); instead the peak at the start
is kept as a baseline, and a peak that never rises above it is reported as
reached before the run.

Failures. A view that raises (a plotting error) is reported once and switched
off; a sampler that raises is reported once and sampling stops. Neither ever
raises into the training loop. ``KeyboardInterrupt`` is not caught: the trace
recorded so far stays, and :meth:`finish` can still be called with
``interrupted=True`` to draw the last frame.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .trace import MemoryTrace

__all__ = ["MemoryRecorder", "RecorderStats", "KEPT_COSTS", "MIN_INTERVAL", "MAX_INTERVAL", "check_interval"]

#: Per-sample costs kept for statistics (the count and the sum cover all).
KEPT_COSTS = 4096

#: Seconds between samples: the bounds ``interval=`` and ``--interval`` accept.
MIN_INTERVAL, MAX_INTERVAL = 0.001, 3600.0


def check_interval(interval: Any) -> float:
    """``interval`` as seconds; :class:`ValueError` unless it is a real number
    (not a bool; ``numpy.float32`` is fine) from :data:`MIN_INTERVAL` to
    :data:`MAX_INTERVAL`."""
    if isinstance(interval, bool) or not isinstance(interval, numbers.Real):
        raise ValueError(f"interval={interval!r} is not a number of seconds; use e.g. interval=0.05")
    seconds = float(interval)
    if not (math.isfinite(seconds) and MIN_INTERVAL <= seconds <= MAX_INTERVAL):
        raise ValueError(
            f"interval={interval!r} is out of range; use {MIN_INTERVAL:g} to {MAX_INTERVAL:g} seconds, "
            "e.g. interval=0.05"
        )
    return seconds


class RecorderStats:
    """What monitoring cost: samples taken and the seconds spent reading them.

    ``costs`` keeps the latest :data:`KEPT_COSTS` reads' seconds (for a
    median); ``samples`` and ``sample_seconds`` count every read.
    """

    def __init__(self) -> None:
        self.costs: deque[float] = deque(maxlen=KEPT_COSTS)
        self.samples = 0
        self.sample_seconds = 0.0
        self.devices = 0

    def add(self, seconds: float) -> None:
        self.costs.append(seconds)
        self.samples += 1
        self.sample_seconds += seconds

    @property
    def sample_cost(self) -> float:
        """Mean seconds per sample (all series)."""
        return self.sample_seconds / self.samples if self.samples else 0.0


def _print_report(message: str) -> None:
    print(f"vgpu_magic: {message}", file=sys.stderr, flush=True)


class MemoryRecorder:
    """Records one run at a time; :meth:`start` begins the next run with a
    fresh trace (set :attr:`view` first to draw it somewhere else).

    Parameters
    ----------
    sampler_factory
        Returns an object with ``series`` (:class:`SeriesInfo` tuple),
        ``devices`` and ``read() -> [(current, peak), ...]``. Called when the
        first sample is due, and only once the framework's runtime runs (see
        ``runtime_started``), so a recorder never starts the runtime itself.
    view
        The view to feed (see :mod:`vgpu_magic.monitor.views`).
    runtime_started
        Whether the framework's runtime already runs (the framework's
        :meth:`~vgpu_magic.frameworks.base.Framework.runtime_started`).
    interval
        Minimum seconds between two samples of :meth:`tick` / :meth:`sample`.
    variables
        Returns the variables whose per-device bytes to show, or ``None``.
    report
        Where one-line problem reports go (stderr by default).
    """

    def __init__(
        self,
        sampler_factory: Callable[[], Any],
        view: Any,
        *,
        runtime_started: Callable[[], bool],
        interval: float = 0.05,
        variables: Callable[[], Iterable[Any] | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        report: Callable[[str], None] = _print_report,
    ) -> None:
        self._sampler_factory = sampler_factory
        self._sampler: Any = None
        self.view = view
        self.interval = interval
        self._variables = variables
        self.clock = clock
        self._runtime_started = runtime_started
        self._report = report
        self._reported: set[str] = set()
        self.stats = RecorderStats()
        self.trace: MemoryTrace | None = None
        self.active = False
        self.kind = "custom"
        self.phase = "custom"
        self.epoch = 0
        self.step = 0
        self._t0 = 0.0
        self._last = -float("inf")
        self._epochs_total: int | None = None
        self._steps_total: int | None = None
        self._pending_epochs: list[tuple[float, int]] = []
        self._sampling_ok = True

    # -- problems -----------------------------------------------------------------
    def report_once(self, key: str, message: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self._report(message)

    def _view_call(self, method: str, *args: Any) -> None:
        if self.view is None:
            return
        try:
            getattr(self.view, method)(*args)
        except Exception as exc:  # noqa: BLE001 - a plotting error must never stop training
            self.view = None
            self.report_once(
                "view",
                f"the memory plot stopped after an error ({type(exc).__name__}: {exc}); "
                "training goes on and the trace is still recorded",
            )

    # -- lifecycle ----------------------------------------------------------------
    def start(self, kind: str = "custom", epochs: int | None = None, steps: int | None = None) -> None:
        """Begin a run: a new trace, sampled from now on."""
        self.kind = self.phase = kind
        self.epoch = 0
        self.step = 0
        self.trace = None
        self._epochs_total = epochs
        self._steps_total = steps
        self._pending_epochs = []
        self._sampler = None
        self._sampling_ok = True
        self.stats = RecorderStats()
        self._t0 = self.clock()
        self._last = -float("inf")
        self.active = True
        self._sample_at(self._t0)

    def _open_trace(self) -> bool:
        """Build the sampler and the trace once the runtime runs."""
        if not self._sampling_ok:
            return False
        try:
            if self._sampler is None and not self._runtime_started():
                return False
            if self._sampler is None:
                self._sampler = self._sampler_factory()
            baseline = tuple(peak for _, peak in self._sampler.read())
        except Exception as exc:  # noqa: BLE001 - any framework's read error; a monitor never stops training
            self._sampling_ok = False
            self.report_once("sampler", f"memory cannot be read, monitoring is off ({type(exc).__name__}: {exc})")
            return False
        self.stats.devices = len(self._sampler.devices)
        self.trace = MemoryTrace(
            series=tuple(self._sampler.series),
            kind=self.kind,
            baseline_peak=baseline,
            epochs_total=self._epochs_total,
            steps_total=self._steps_total,
        )
        self.trace.epoch_starts.extend(self._pending_epochs)
        self._pending_epochs = []
        self.refresh_variables()
        self._view_call("start", self.trace)
        return True

    def tick(self, step: int | None = None) -> None:
        """Call at every step: samples when ``interval`` has passed."""
        if step is not None:
            self.step = step
        now = self.clock()
        if now - self._last >= self.interval:
            self._sample_at(now)

    def sample(self, step: int | None = None, epoch: int | None = None) -> None:
        """Like :meth:`tick`, and sets the epoch too: samples when ``interval``
        has passed since the last sample."""
        if epoch is not None:
            self.epoch = epoch
        self.tick(step)

    def _sample_at(self, now: float) -> None:
        self._last = now
        if not self.active or (self.trace is None and not self._open_trace()):
            return
        try:
            begin = time.perf_counter()
            readings = self._sampler.read()
            self.stats.add(time.perf_counter() - begin)
        except Exception as exc:  # noqa: BLE001 - any framework's read error; a monitor never stops training
            self._sampling_ok = False
            self.active = False
            self.report_once("sampler", f"memory cannot be read, monitoring is off ({type(exc).__name__}: {exc})")
            return
        self.trace.append(now - self._t0, self.step, self.epoch, self.phase, readings)
        self._view_call("sampled", self.trace, now)

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        mark = (self.clock() - self._t0, epoch)
        if self.trace is None:
            self._pending_epochs.append(mark)
        else:
            self.trace.mark_epoch(*mark)

    def end_epoch(self, epoch: int) -> None:
        self._sample_at(self.clock())
        self.refresh_variables()
        if self.trace is not None:
            self._view_call("epoch_end", self.trace, epoch)

    def refresh_variables(self) -> None:
        """Recount the variables' bytes per device."""
        if self.trace is None or self._variables is None:
            return
        try:
            from .sampler import variable_bytes

            found = self._variables()
            if found is not None:
                self.trace.variable_bytes = variable_bytes(found, self._sampler.devices)
        except Exception as exc:  # noqa: BLE001 - any framework's variables; a monitor never stops training
            self.report_once("variables", f"variable sizes cannot be read ({type(exc).__name__}: {exc})")

    def finish(self, interrupted: bool = False) -> MemoryTrace | None:
        """End the run: a last sample, the final image or summary."""
        if not self.active:
            return self.trace
        self._sample_at(self.clock())
        self.active = False
        trace = self.trace
        if trace is not None:
            trace.duration = self.clock() - self._t0
            trace.interrupted = interrupted
            trace.finished = True
            self.refresh_variables()
            self._view_call("finish", trace)
        return trace
