"""Live memory of every logical device while a model trains.

User guide
==========

In a notebook::

    In [1]: %load_ext vgpu_magic
    In [2]: %vgpu_split 4
    ...
    In [5]: model.fit(ds, epochs=3, callbacks=[vgpu_magic.MemoryMonitor()])

A memory view appears under the cell and follows ``fit`` live, several times
a second: a widget the browser draws (it takes the colours of JupyterLab's and
Notebook 7's light and dark themes), fed only the samples added since its
last update. Device memory and the process' resident memory (RSS) have panels
of their own, each in one unit for the whole run: one line per logical device
with its cap dashed in the same colour and its running peak faint, epoch
starts as dotted lines, the legend above the panels, and the bytes of
variables each replica holds. The view has its own output above the cell's
printed output, so Keras' progress bar (``verbose=1``) keeps updating below
it. When the cell ends, also after an interrupt, a static image of the whole
run (exact peaks, "done" or "interrupted"; transparent, with colours that read
on light and dark backgrounds) takes the view's place and stays in the
notebook, so saved notebooks, nbviewer and nbval keep it.

Or, without touching the code::

    In [6]: %vgpu_monitor on        # every later fit/evaluate/predict is monitored
    In [7]: %vgpu_monitor status
    In [8]: %vgpu_monitor off       # keras.Model is exactly as before

On logical CPUs the view always shows the kernel process' resident memory
("process RSS"), which is true whatever the framework counts. Where the
framework's logical CPUs share one host allocator (TensorFlow), it reports the
same numbers for each: the view shows that allocator ONCE ("host allocator
(shared by N logical CPUs)"), and says "nothing allocated" where it reports
0 B; where it keeps no statistics at all, the monitor says so once and shows
the process' memory. What does differ per replica, the bytes of its own copy
of the variables, is counted exactly from each variable's per-device parts.

Outside a Jupyter kernel (terminal IPython, a script) the monitor prints one
compact line per epoch and one at the end instead; without anywidget
(``pip install 'vgpu_magic[widgets]'``) too.

Custom training loops, in any framework (the monitor imports neither Keras nor
TensorFlow: in a JAX or PyTorch kernel it reads the framework that runs, and
before any does, the process' memory alone)::

    with vgpu_magic.MemoryMonitor(model=model) as mon:
        for epoch in range(epochs):
            mon.begin_epoch(epoch)                      # optional: epoch marks
            for step, batch in enumerate(dist_dataset):
                strategy.run(train_step, args=(batch,))
                mon.sample(step=step)
            mon.end_epoch(epoch)                        # optional: the text line

A run samples when it starts and when it ends, so even a short ``with`` block
has a trace (``mon.to_csv`` works). Options: ``MemoryMonitor(devices=["GPU:0",
"GPU:1"])`` watches only those, ``interval=`` sets the seconds between samples
(0.05 by default; it applies to ``sample()`` too, so calling it at every step
is cheap), ``display="text"`` or ``"none"`` forces the text summary or
records only.

The monitor reads memory through the framework seam
(:mod:`vgpu_magic.frameworks`): Keras' backend when Keras is imported and
vgpu_magic knows it, otherwise the framework
:func:`vgpu_magic.frameworks.select` picks. ``%%vgpu_run`` feeds the same
trace and view with each rank's memory (:mod:`vgpu_magic.ranks.memory`).

The data
========

``monitor.trace`` is a :class:`MemoryTrace`: per sample the time (seconds
since the run started), step, epoch, phase, and per series (a logical device,
``"host"`` for a shared host allocator, ``"process"`` for RSS) the current and
peak bytes. ``monitor.to_csv(path)`` writes it, ``monitor.savefig(path)``
saves the plot, ``trace.to_records()`` gives a list of dicts for pandas.
``monitor.traces`` keeps the latest 10 finished runs.

Memory stays bounded however long a run is: a trace keeps the latest
samples at full resolution and older ones as a min/max envelope (every spike
and dip stays visible; see :mod:`vgpu_magic.monitor.trace`), and peaks stay
exact.

Peaks come from the allocator itself, which records its peak on every
allocation, so nothing is lost between samples (the RSS peak is the
process' high-water mark from ``getrusage``). Nothing resets that peak
(``reset_memory_stats`` is process-wide); a run whose peak never rose above
the peak before it says so ("peak ≤ X, reached before this run").

Cost
====

Steps are counted in Keras' ``on_*_batch_begin`` hooks (no logs, no sync);
memory is read at most every ``interval`` seconds (0.05 by default), once per
logical GPU or once for all shared logical CPUs (RSS at most every 0.5 s).
A live update sends the new rows as one comm message, five a second, and the
next waits at least 200 × the last update's cost, so the view stays under
0.5 % of the time; the final image, drawn with matplotlib,
waits for the end of the cell (see :mod:`vgpu_magic.monitor.live`).
``benchmarks/monitor_overhead.py`` measures all of it in a real kernel. View
errors are reported once and never stop training. Nothing here starts a
framework's runtime, and importing this package imports no framework, no
widget library and no matplotlib.

Modules: :mod:`.trace` (the data), :mod:`.sampler` (reading memory through
the framework), :mod:`.recorder` (sampling into the trace, feeding a view), :mod:`.session` (the
Keras-free monitor session), :mod:`.views` (the view contract, the text
view), :mod:`.live` and ``live.js`` (the live widget), :mod:`.plot` (the
static image), :mod:`.display` (the notebook output), :mod:`.callback` (the
Keras face), :mod:`.auto` and :mod:`.magics` (``%vgpu_monitor on/off``).
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
