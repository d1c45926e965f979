"""Live memory of every logical device while a model trains.

User guide
==========

In a notebook::

    In [1]: %load_ext vgpu_magic
    In [2]: %vgpu_split 4
    ...
    In [5]: model.fit(ds, epochs=3, callbacks=[vgpu_magic.MemoryMonitor()])

A plot appears under the cell and is updated in place while ``fit`` runs
(about twice a second): one line per logical GPU with its cap as a dashed line
of the same colour and its peak in the legend, each line's running peak as a
faint line, epoch starts as dotted lines, the memory axis in MiB or GiB, and a
side panel with the bytes of variables each replica holds. The plot has its
own output above the cell's printed output, so Keras' progress bar
(``verbose=1``) keeps updating below it. When the cell ends, also after an
interrupt, the final frame (whole run, exact peaks, "done" or "interrupted")
replaces the live one and stays in the notebook as a plain PNG, so it
survives saving.

Or, without touching the code::

    In [6]: %vgpu_monitor on        # every later fit/evaluate/predict is monitored
    In [7]: %vgpu_monitor status
    In [8]: %vgpu_monitor off       # keras.Model is exactly as before

On logical CPUs the plot always shows the kernel process' resident memory
("process RSS"), which is true whatever the framework counts. Where the
framework's logical CPUs share one host allocator (TensorFlow), it reports the
same numbers for each: the plot shows that allocator ONCE ("host allocator
(shared by N logical CPUs)"), and says "nothing allocated" where it reports
0 B (TensorFlow's host allocator keeps no statistics unless asked to). The
side panel shows what does differ per replica, the bytes of its own copy of
the variables (exact, from each variable's per-device parts).

Outside a Jupyter kernel (terminal IPython, a script) the monitor prints one
compact line per epoch and one at the end instead of plotting.

Custom training loops::

    with vgpu_magic.MemoryMonitor(model=model) as mon:
        for epoch in range(epochs):
            mon.begin_epoch(epoch)                      # optional: epoch marks
            for step, batch in enumerate(dist_dataset):
                strategy.run(train_step, args=(batch,))
                mon.sample(step=step)
            mon.end_epoch(epoch)                        # optional: the text line

Options: ``MemoryMonitor(devices=["GPU:0", "GPU:1"])`` watches only those,
``interval=`` sets the seconds between samples (0.05 by default; it applies
to ``sample()`` too, so calling it at every step is cheap), ``display="text"``
or ``"none"`` forces the text summary or records only.

The monitor reads memory through the framework seam
(:mod:`vgpu_magic.frameworks`): Keras' backend when vgpu_magic knows it,
otherwise the framework :func:`vgpu_magic.frameworks.select` picks.

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
logical GPU or once for all shared logical CPUs (RSS at most every 0.5 s);
redraws wait ``max(0.4 s, 100 × the last frame's cost)``, so drawing stays
under 1 % of the time, and live frames only blit the lines onto a cached
background and encode a plain PNG (~4 ms);
the final frame, drawn whole, waits for the end of the cell (see
:mod:`vgpu_magic.monitor.views`). ``benchmarks/monitor_overhead.py`` measures
all of it in a real kernel. Plotting errors are reported once and never stop
training. Nothing here starts a framework's runtime, and importing this
package imports no framework and no matplotlib.

Modules: :mod:`.trace` (the data), :mod:`.sampler` (reading memory through
the framework), :mod:`.recorder` (the engine), :mod:`.views` (the view
contract, the live plot and text views), :mod:`.plot` (the figure),
:mod:`.display` (the notebook output), :mod:`.callback` (the Keras face),
:mod:`.auto` and :mod:`.magics` (``%vgpu_monitor on/off``).
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
