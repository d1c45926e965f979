"""The recorder: samples a :class:`~vgpu_magic.monitor.sampler.MemorySampler` into a :class:`MemoryTrace` and feeds a
view; knows nothing of Keras. With ``background=True`` its thread samples every ``interval``, as training does not
call back at a steady pace; the training thread's hooks say the step and epoch, and sample the run's start, each
epoch's end and the run's end (a ``training_thread_only`` sampler, JAX's live arrays: every sample, at most every
``interval``). Devices join: a provisional sampler reads the process alone until ``joinable()`` says a runtime
started; the next sample asks for a sampler again. A failing view or sampler is reported once and switched off."""

from __future__ import annotations

import contextvars
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .trace import MemoryTrace

if TYPE_CHECKING:
    from .sampler import MemorySampler

__all__ = ["MemoryRecorder"]


def print_report(message: str) -> None:
    print(f"vgpu_magic: {message}", file=sys.stderr, flush=True)


class MemoryRecorder:
    """Records one run at a time from ``sampler_factory()``'s sampler (asked again once it is ``joinable()``)."""

    def __init__(
        self,
        sampler_factory: Callable[[], MemorySampler],
        view: Any,
        *,
        interval: float = 0.05,
        variables: Callable[[Any], dict[str, int] | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        report: Callable[[str], None] = print_report,
        background: bool = False,
    ) -> None:
        self._sampler_factory, self._variables = sampler_factory, variables
        self._sampler: MemorySampler | None = None
        self.view, self.interval, self.clock = view, interval, clock
        self._report, self._reported, self._background = report, set(), background
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.RLock()
        self.trace: MemoryTrace | None = None
        self.active = False
        self.kind = self.phase = "custom"
        self.epoch = self.step = 0
        self._t0 = 0.0
        self._last = -math.inf

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

    def _failed(self, exc: BaseException) -> None:
        self.active = False
        self.report_once("sampler", f"memory cannot be read, monitoring is off ({type(exc).__name__}: {exc})")

    def start(self, kind: str = "custom", epochs: int | None = None) -> None:
        """Begin a run: a new trace, sampled from now on."""
        self._stop_thread()
        self._close_sampler()
        self.kind = self.phase = kind
        self.epoch = self.step = 0
        self.trace = None
        self._t0 = self.clock()
        self._last = -math.inf
        try:
            self._sampler = self._sampler_factory()
            baseline = tuple(peak for _, peak in self._sampler.read())
        except Exception as exc:  # noqa: BLE001 - any framework's read error; a monitor never stops training
            self._failed(exc)
            return
        sampler = self._sampler
        self.trace = MemoryTrace(
            sampler.series, kind, baseline, epochs_total=epochs, subject=sampler.subject, simulated=sampler.simulated
        )
        self.active = True
        self.refresh_variables()
        self._view_call("start", self.trace)
        self._sample_at(self._t0)
        if self._background and self.active and not self._on_training_thread_only():
            self._stop = threading.Event()
            # The cell's context: what the thread prints or sends belongs to the cell that runs.
            run = contextvars.copy_context().run
            self._thread = threading.Thread(
                target=run, args=(self._sample_in_background,), daemon=True, name="vgpu_magic memory sampler"
            )
            self._thread.start()

    def _sample_in_background(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            with self._lock:
                # Not read here (a join to such a sampler, or a failed run): the hooks sample, or nothing does.
                if not self.active or self._on_training_thread_only():
                    return
                now = self.clock()
                if now - self._last >= self.interval:
                    self._sample_at(now)
                wait = self._last + self.interval - now

    def _stop_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def tick(self, step: int | None = None) -> None:
        """At every step: note it, let devices join, and sample when ``interval`` passed and no thread samples."""
        if step is not None:
            self.step = step
        now = self.clock()
        due = now - self._last >= self.interval and (self._thread is None or self._on_training_thread_only())
        if self._maybe_join() or due:  # devices that joined are read at once
            self._sample_at(now)

    def _on_training_thread_only(self) -> bool:
        return self._sampler is not None and self._sampler.training_thread_only

    def sample(self, step: int | None = None, epoch: int | None = None) -> None:
        """Like :meth:`tick`; a new ``epoch`` is marked as an epoch start."""
        if epoch is not None and epoch != self.epoch:
            self.begin_epoch(epoch)
        self.tick(step)

    def _sample_at(self, now: float) -> None:
        with self._lock:
            self._last = now
            if not self.active:
                return
            try:
                self.trace.append(now - self._t0, self.step, self.epoch, self.phase, self._sampler.read())
            except Exception as exc:  # noqa: BLE001 - any framework's read error; a monitor never stops training
                self._failed(exc)
                return
            self._view_call("sampled", self.trace, now)

    def _maybe_join(self) -> bool:
        """Add the devices of a runtime started since (0 B before); whether they joined. Training thread only."""
        joinable = self._sampler.joinable if self._sampler is not None else None
        if not (self.active and joinable is not None and joinable()):
            return False
        try:
            sampler = self._sampler_factory()
            if sampler.joinable is not None:
                sampler.close()
                return False
            sampler.read()
        except Exception as exc:  # noqa: BLE001 - any framework's read error; the process is still read
            self.report_once("join", f"device memory cannot be read ({type(exc).__name__}: {exc})")
            self._sampler.joinable = None
            return False
        with self._lock:
            self._sampler.close()
            self._sampler = sampler
            # Their allocators did not exist when the run started: every byte they hold came in this run.
            self.trace.add_series(sampler.series, [0] * len(sampler.series))
            self.trace.subject, self.trace.simulated = sampler.subject, sampler.simulated
            self.refresh_variables()
            self._view_call("series_changed", self.trace)
        return True

    def begin_epoch(self, epoch: int) -> None:
        with self._lock:
            self.epoch = epoch
            if self.trace is not None:
                self.trace.epoch_starts.append((self.clock() - self._t0, epoch))

    def end_epoch(self, epoch: int) -> None:
        with self._lock:
            self._maybe_join()
            self._sample_at(self.clock())
            self.refresh_variables()
            if self.trace is not None:
                self._view_call("epoch_end", self.trace, epoch)

    def refresh_variables(self) -> None:
        """Recount the variables' bytes per device."""
        if self.trace is None or self._variables is None:
            return
        try:
            found = self._variables(self._sampler)
            if found is not None:
                self.trace.variable_bytes = found
        except Exception as exc:  # noqa: BLE001 - any framework's variables; a monitor never stops training
            self.report_once("variables", f"variable sizes cannot be read ({type(exc).__name__}: {exc})")

    def finish(self, interrupted: bool = False) -> MemoryTrace | None:
        """End the run: a last sample, the final image or summary; the sampler closed."""
        self._stop_thread()
        try:
            if not self.active:
                return self.trace
            self._maybe_join()
            self._sample_at(self.clock())
            self.active, trace = False, self.trace
            trace.duration, trace.interrupted, trace.finished = self.clock() - self._t0, interrupted, True
            self.refresh_variables()
            self._view_call("finish", trace)
            return trace
        finally:
            self._close_sampler()

    def _close_sampler(self) -> None:
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.close()
