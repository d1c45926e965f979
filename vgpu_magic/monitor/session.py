"""The monitor's session, with no framework in it: :class:`MonitorSession` drives a
:class:`~vgpu_magic.monitor.recorder.MemoryRecorder` and picks its view (the live widget in a notebook, text
elsewhere); the Keras callback (:class:`~vgpu_magic.monitor.callback.MemoryMonitor`) only maps Keras' events onto it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..units import parse_seconds
from .display import DISPLAY_MODES, detect_frontend, interrupts_deferred, running_shell
from .plot import save_trace_figure
from .recorder import MemoryRecorder
from .sampler import DeviceSampler, MemorySampler, build_series, model_variables, variable_bytes
from .trace import MemoryTrace
from .views import TextSummaryView

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python 3.11+

__all__ = ["MonitorSession", "process_sampler", "KEPT_TRACES"]

#: Finished runs :attr:`MonitorSession.traces` keeps (the latest ones).
KEPT_TRACES = 10

#: The seconds between samples that ``interval=`` and ``--interval`` accept.
MIN_INTERVAL, MAX_INTERVAL = 0.001, 3600.0

#: Reports about this process' devices already made (by any monitor).
_SAID: set[str] = set()


def process_sampler(joinable: Callable[[], bool] | None = None) -> DeviceSampler:
    """A sampler of this process' resident memory alone (provisional, given ``joinable``)."""
    return DeviceSampler(build_series([], process=True), lambda names: [], joinable=joinable)


class MonitorSession:
    """Watch the memory of every logical device while a block of code runs: a custom training loop in
    JAX, PyTorch or TensorFlow, or (through :class:`~vgpu_magic.monitor.callback.MemoryMonitor`) Keras'
    ``fit``. Memory is read through the framework whose runtime runs, and until one does, the process'
    alone (the devices join once a runtime starts). A run samples when it starts and when it ends.

    Parameters
    ----------
    devices
        Logical devices to watch, e.g. ``["GPU:0", "GPU:1"]``; by default every
        replica device of the split, plus the model's strategy's devices.
    model
        The model whose variables to count per replica (Keras passes its own).
    strategy
        A ``tf.distribute`` strategy whose devices to watch as well.
    interval
        Seconds between samples, 0.001 to 3600 (allocators keep their own peaks in between).
    display
        ``"auto"``, ``"rich"``, ``"text"`` or ``"none"`` (see :data:`DISPLAY_MODES`).
    view
        A view object to use instead (see :class:`vgpu_magic.monitor.views.View`).
    sampler
        What to read instead of the framework's devices, for one run: the ranks' memory
        (:class:`~vgpu_magic.ranks.memory.RankMemorySampler`); closed when that run ends.

    Examples are in docs/live-view.md."""

    def __init__(
        self,
        devices: Iterable[str] | None = None,
        *,
        model: Any = None,
        strategy: Any = None,
        interval: float = 0.05,
        display: str = "auto",
        view: Any = None,
        sampler: MemorySampler | None = None,
    ) -> None:
        if display not in DISPLAY_MODES:
            raise ValueError(f"display={display!r} is not a display mode; use one of {', '.join(DISPLAY_MODES)}")
        # The one check of --interval's and interval='s seconds.
        seconds = parse_seconds(interval, minimum=MIN_INTERVAL, maximum=MAX_INTERVAL, option="interval=")
        if isinstance(devices, str):
            devices = [d for d in devices.split(",") if d.strip()]
        self._devices = None if devices is None else list(devices)
        self._model_hint, self._strategy = model, strategy
        self.display = display
        self._view = view
        self._sampler = sampler
        self.traces: list[MemoryTrace] = []
        self._joining = False
        self._recorder = MemoryRecorder(
            self._make_sampler, None, interval=seconds, variables=self._variables, background=True
        )
        self._depth = self._epoch_base = self._next_step = 0
        self._fresh = False
        self._shell_watched: Any = None
        self._pending: list[Any] = []

    def _current_model(self) -> Any:
        return self._model_hint

    def _preferred_framework(self) -> str | None:
        """The framework to read when several could be (Keras' backend in the adapter)."""
        return None

    def _make_sampler(self) -> MemorySampler:
        """The sampler given, else the devices of the framework whose runtime runs (the preferred first); until one
        runs, the process' RSS (provisionally)."""
        from .. import frameworks

        if self._sampler is not None:
            return self._sampler
        watched, preferred = frameworks.all_frameworks(), self._preferred_framework()
        found = sorted((fw for fw in watched if fw.imported()), key=lambda fw: fw.name != preferred)
        framework = next((fw for fw in found if fw.runtime_started()), None)
        if framework is None:
            if self._devices is not None:
                self._report("no framework's runtime runs yet, so only the process' memory is read until one starts")
            self._joining = True
            # Asked before each sample: lookups only, no import and no scan of the user's namespace.
            return process_sampler(joinable=lambda: any(fw.runtime_started() for fw in watched))
        try:
            sampler = DeviceSampler.for_framework(
                framework,
                self._devices,
                model=self._current_model(),
                strategy=self._strategy,
                process=self._joining or None,
            )
            sampler.read()
        except Exception as exc:  # noqa: BLE001 - any framework's error; a monitor never stops training
            # e.g. TensorFlow's host allocator without statistics; every later run would read the same.
            self._report_once_per_process(
                f"device memory cannot be read ({exc}); the memory view shows the process' memory"
            )
            sampler = process_sampler()
            sampler.framework = framework  # its variables per replica are still exact
        return sampler

    def _variables(self, sampler: DeviceSampler) -> dict[str, int] | None:
        model = self._current_model()
        if model is None or sampler.framework is None:
            return None
        return variable_bytes(sampler.framework, model_variables(model), sampler.devices)

    def _report(self, message: str) -> None:
        self._recorder.report_once(message, message)

    def _report_once_per_process(self, message: str) -> None:
        """Report what every later run of any monitor would find the same, once."""
        if message not in _SAID:
            _SAID.add(message)
            self._report(message)

    def _make_view(self) -> Any:
        if self._view is not None:
            return self._view
        if self._sampler is not None and not self._sampler.series:  # e.g. every rank on another host
            return None
        mode = detect_frontend() if self.display == "auto" else self.display
        if mode == "rich":
            if importlib.util.find_spec("anywidget") is None:
                self._report_once_per_process(
                    "anywidget is not installed, so memory is summarised as text; pip install 'vgpu_magic[widgets]'"
                )
                return TextSummaryView()
            from .live import LiveMemoryView

            return LiveMemoryView(defer=self._defer_to_cell_end)
        return TextSummaryView() if mode == "text" else None

    def _begin(self, kind: str, epochs: int | None = None) -> None:
        fresh, self._fresh = self._fresh, False
        if self._depth and not fresh:
            # fit's validation runs evaluate through the same callback list
            self._depth += 1
            self._recorder.phase = "validate" if kind == "evaluate" else kind
            return
        if self._recorder.active:
            self._close(interrupted=True)
        self._run_pending()
        self._depth = 1
        self._epoch_base = self._next_step = 0
        # The cell hook first: an interrupt after the view appeared still closes the run and draws its image.
        self._watch_cell()
        self._recorder.view = self._make_view()
        self._joining = False
        self._recorder.start(kind, epochs=epochs)

    def _end(self) -> None:
        if self._depth > 1:
            self._depth -= 1
            self._recorder.phase = self._recorder.kind
        elif self._depth == 1:
            self._close()

    def _close(self, interrupted: bool = False) -> None:
        self._depth = 0
        trace = self._recorder.finish(interrupted=interrupted)
        if trace is not None and not any(t is trace for t in self.traces):
            self.traces = [*self.traces[-(KEPT_TRACES - 1) :], trace]
        if not self._pending:
            self._unwatch_cell()

    def _watch_cell(self) -> None:
        """End the run with its cell at the latest, and draw the final images there, after the training."""
        shell = running_shell()
        if shell is None or self._shell_watched is shell:
            return
        self._unwatch_cell()
        shell.events.register("post_run_cell", self._cell_finished)
        self._shell_watched = shell

    def _unwatch_cell(self) -> None:
        if self._shell_watched is not None:
            with contextlib.suppress(ValueError):  # already unregistered
                self._shell_watched.events.unregister("post_run_cell", self._cell_finished)
            self._shell_watched = None

    def _defer_to_cell_end(self, draw) -> None:
        if self._shell_watched is None:
            draw()
        else:
            self._pending.append(draw)

    def _run_pending(self) -> None:
        pending, self._pending = self._pending, []
        for draw in pending:
            try:
                draw()
            except Exception as exc:  # noqa: BLE001 - one failed image must not stop the others or lose the trace
                self._report(f"the memory view's final image failed ({type(exc).__name__}: {exc}); the trace is kept")

    def _cell_finished(self, result: Any = None) -> None:
        # Unhook first, so nothing below can leave the hook registered; then draw with interrupts held back.
        self._unwatch_cell()
        with interrupts_deferred():
            if self._recorder.active:
                self._close(interrupted=getattr(result, "error_in_exec", None) is not None)
            self._run_pending()

    def start(self, kind: str = "custom") -> Self:
        """Begin a run by hand; it ends with :meth:`finish` or, in IPython, with the cell at the latest."""
        self._fresh = True
        self._begin(kind)
        return self

    def sample(self, step: int | None = None, epoch: int | None = None) -> None:
        """Say which step (and epoch: a new one is marked) the loop is at; starts a run if none is active."""
        if not self._recorder.active:
            self.start()
        self._recorder.sample(step=step, epoch=epoch)

    def begin_epoch(self, epoch: int) -> None:
        """Mark an epoch start in a custom loop."""
        if not self._recorder.active:
            self.start()
        self._recorder.begin_epoch(epoch)

    def end_epoch(self, epoch: int) -> None:
        """Mark an epoch end in a custom loop (the text view prints its line)."""
        self._recorder.end_epoch(epoch)

    def finish(self, interrupted: bool = False, ending: str = "") -> MemoryTrace | None:
        """End the current run; return its trace (in IPython the final image is drawn when the cell ends).
        ``ending``: how an interrupted run ended, where the caller knows more (``"rank 1 failed"``)."""
        if self._recorder.active:
            self._recorder.trace.ending = ending
            self._close(interrupted=interrupted)
        return self.trace

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(interrupted=exc_type is not None)

    # What the recorder knows of the current (or last) run, read-only.
    trace = property(lambda self: self._recorder.trace, doc="Its :class:`MemoryTrace`; ``None`` before the first.")
    view = property(lambda self: self._recorder.view, doc="Its view; ``None`` with none or after it failed.")
    active = property(lambda self: self._recorder.active, doc="Whether a run is being recorded now.")

    def _require_trace(self) -> MemoryTrace:
        if self.trace is None or not len(self.trace):
            raise ValueError("nothing recorded yet; pass the monitor to fit/evaluate/predict or call sample() first")
        return self.trace

    def to_csv(self, path: str | os.PathLike) -> str:
        """Write the trace (time, step, epoch, phase, device, current, peak) as CSV."""
        return self._require_trace().to_csv(path)

    def savefig(self, path: str | os.PathLike, dpi: int = 100) -> str:
        """Save the plot of the trace (PNG, SVG, PDF... from the suffix)."""
        return save_trace_figure(self._require_trace(), os.fspath(path), dpi=dpi)

    def __repr__(self) -> str:
        state = "recording" if self.active else "idle"
        return f"<{type(self).__name__} {state}, {len(self.traces)} finished run(s)>"
