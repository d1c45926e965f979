"""Live memory of every logical device while a model trains (docs/live-view.md). ``MemoryMonitor`` is a Keras
callback and, for custom loops in any framework, a context manager whose ``sample(step=, epoch=)`` says where the loop
is; ``%vgpu_monitor on`` monitors every later ``fit``/``evaluate``/``predict``. ``monitor.trace`` is a
:class:`MemoryTrace` (bounded, peaks exact). A failing view or sampler is reported once and never stops training."""
