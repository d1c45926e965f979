"""Live memory of every logical device while a model trains.

In a notebook::

    In [2]: %vgpu_split 4
    In [5]: model.fit(ds, epochs=3, callbacks=[vgpu_magic.MemoryMonitor()])
    In [6]: %vgpu_monitor on        # or: every later fit/evaluate/predict, without code changes

A memory view appears under the cell, above Keras' progress bar, and follows
the run several times a second: a widget the browser draws in the colours of
the front end's theme, fed only the new samples. Device memory and the
process' resident memory (RSS) have panels of their own; series that read the
same all run long are one line, labelled as such. When the cell ends a
static, transparent image of the whole run takes its place and stays in the
notebook. Outside a Jupyter kernel (or without anywidget) it prints one line
per epoch and one at the end.

Custom loops, in any framework (the monitor imports none)::

    with vgpu_magic.MemoryMonitor(model=model) as mon:
        for epoch in range(epochs):
            for step, batch in enumerate(dataset):
                train_step(batch)
                mon.sample(step=step, epoch=epoch)     # a new epoch is marked

A thread of the monitor samples every ``interval`` (0.05 s by default), also
while the training thread is held in a long step; ``sample()`` only says
which step and epoch it is. A run started before any framework's runtime
reads the process alone, and the devices join once a runtime starts.

``monitor.trace`` is a :class:`MemoryTrace` (plain data: time, step, epoch,
phase and per series the current and peak bytes; bounded however long the
run, peaks exact); ``to_csv`` and ``savefig`` write it, ``traces`` keeps the
latest 10 runs. Peaks come from the allocators themselves, which nothing
here resets. ``%%vgpu_run`` shows each rank's memory in the same view.

Cost: a sample reads each allocator once (RSS at most every 0.5 s); a live
update is one comm message, five a second, each followed by at least 200
times its cost of training, so the view stays under 0.5 % of the kernel's
time (``benchmarks/monitor_overhead.py``). A failing view or sampler is
reported once and never stops training.

Modules: :mod:`.trace` (the data), :mod:`.sampler` (reading memory),
:mod:`.recorder` (sampling into the trace, feeding a view), :mod:`.session`
(the Keras-free monitor), :mod:`.views` (the view contract, the text view),
:mod:`.live` and ``live.js`` (the live widget), :mod:`.plot` (the static
image), :mod:`.display` (the notebook output), :mod:`.callback` (the Keras
face), :mod:`.auto` and :mod:`.magics` (``%vgpu_monitor``).
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "MemoryMonitor": "callback",
    "MonitorSession": "session",
    "MemoryTrace": "trace",
    "MemorySample": "trace",
    "SeriesInfo": "trace",
    "MemoryRecorder": "recorder",
    "DeviceSampler": "sampler",
    "AutoMonitoring": "auto",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'vgpu_magic.monitor' has no attribute {name!r}")
