"""The memory monitor's engine, without TensorFlow: the trace, the series
grouping, the sampler through a fake framework, the update throttle, the live
view on a fake widget and notebook output, the static figure, and the
recorder with fake samplers and failing views.

The data is shaped like what TensorFlow reports (see
``test_monitor_keras.py`` for the same paths under real splits and a real
kernel); clocks are simulated, so nothing here depends on wall-clock time.
"""

from __future__ import annotations

import base64
import io
import itertools
import subprocess
import sys
from collections.abc import Collection
from dataclasses import replace

import pytest

from support import last_json, run_python
from vgpu_magic import frameworks
from vgpu_magic.monitor.display import MemoryFrame, detect_frontend
from vgpu_magic.monitor.live import LiveMemoryView
from vgpu_magic.monitor.plot import MemoryFigure, save_trace_figure
from vgpu_magic.monitor.recorder import MemoryRecorder
from vgpu_magic.monitor.sampler import DeviceSampler, SamplerError, build_series, normalize_device, variable_bytes
from vgpu_magic.monitor.trace import MemoryTrace, SeriesInfo
from vgpu_magic.monitor.views import RedrawThrottle, TextSummaryView, View

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CPUS = [f"/device:CPU:{i}" for i in range(4)]
GPUS = [f"/device:GPU:{i}" for i in range(4)]


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeHandle:
    def __init__(self, log: list) -> None:
        self.log = log

    def update(self, obj) -> None:
        self.log.append(("update", obj))


class FakeDisplay:
    """Records what a notebook would receive: displays and handle updates."""

    def __init__(self) -> None:
        self.log: list = []

    def __call__(self, obj, display_id=None):
        self.log.append(("display", obj, display_id))
        return FakeHandle(self.log)


class FakeWidget:
    """Records what the live view sends to the browser: custom messages and trait values."""

    def __init__(self, **traits) -> None:
        self.sent: list = []
        self.closed = False
        self.series, self.groups, self.units = traits["series"], traits["groups"], traits["units"]
        self.title, self.note = traits["title"], traits["note"]
        self.marks: list = []

    def send(self, content) -> None:
        self.sent.append(content)

    def close(self) -> None:
        self.closed = True


def live_view(display, clock, **kwargs) -> LiveMemoryView:
    widgets: list = []

    def widget(**traits):
        widgets.append(FakeWidget(**traits))
        return widgets[-1]

    view = LiveMemoryView(display, widget=widget, clock=clock, **kwargs)
    view.widgets = widgets
    return view


def fake_reader(values: dict[str, tuple[int, int]], calls: list):
    """A reader shaped like ``tf_memory_reader``: ``GPU:0``-style names, and
    the ValueError TensorFlow raises for a device it does not know."""

    def read(names):
        calls.append(list(names))
        found = []
        for name in names:
            if name not in values:
                raise ValueError(f"No matching devices found for '{name}'")
            found.append(values[name])
        return found

    return read


def png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    assert data.startswith(PNG_SIGNATURE)
    with Image.open(io.BytesIO(data)) as image:
        image.verify()
    with Image.open(io.BytesIO(data)) as image:
        return image.size


def cpu_trace(samples: int = 20) -> MemoryTrace:
    trace = MemoryTrace(build_series(CPUS), kind="fit", baseline_peak=(MIB,), epochs_total=2)
    trace.variable_bytes = dict.fromkeys(CPUS, 3 * MIB)
    for k in range(samples):
        if k in (0, samples // 2):
            trace.epoch_starts.append((k * 0.1, 0 if k == 0 else 1))
        trace.append(k * 0.1, k, 0 if k < samples // 2 else 1, "fit", [(40 * MIB + k * MIB, 60 * MIB + k * MIB)])
    return trace


# -- the trace -------------------------------------------------------------------------
def test_trace_rows_cover_every_sample_and_series_and_round_trip_through_csv(tmp_path):
    series = build_series(GPUS[:2], {GPUS[0]: 2 * GIB, GPUS[1]: GIB})
    trace = MemoryTrace(series, kind="fit", baseline_peak=(0, 0))
    trace.append(0.0, 0, 0, "fit", [(1, 10), (2, 20)])
    trace.append(0.5, 7, 0, "validate", [(3, 30), (4, 40)])
    rows = list(trace.rows())
    assert len(rows) == 2 * len(trace) == 4
    assert [(r.step, r.phase, r.device, r.current, r.peak) for r in rows] == [
        (0, "fit", GPUS[0], 1, 10),
        (0, "fit", GPUS[1], 2, 20),
        (7, "validate", GPUS[0], 3, 30),
        (7, "validate", GPUS[1], 4, 40),
    ]
    text = (tmp_path / "t.csv").read_text() if trace.to_csv(tmp_path / "t.csv") else ""
    lines = text.strip().splitlines()
    assert lines[0] == "time,step,epoch,phase,device,current,peak"
    assert lines[-1] == "0.500000,7,0,validate,/device:GPU:1,4,40"
    assert len(lines) == 5
    with pytest.raises(ValueError, match="1 readings for 2 series"):
        trace.append(1.0, 8, 0, "fit", [(1, 1)])


def test_peak_is_the_run_peak_only_when_it_rose_during_the_run():
    series = build_series(["GPU:0", "GPU:1"])
    trace = MemoryTrace(series, baseline_peak=(100 * MIB, 100 * MIB))
    trace.append(0.0, 0, 0, "fit", [(10 * MIB, 100 * MIB), (10 * MIB, 100 * MIB)])
    trace.append(1.0, 1, 0, "fit", [(20 * MIB, 150 * MIB), (30 * MIB, 100 * MIB)])
    assert trace.run_peak(0) == 150 * MIB
    assert trace.peak_text(0) == "peak 150.0 MiB"
    # Never above the peak before the run: the run's peak is unknown, say so.
    assert trace.run_peak(1) is None
    assert trace.peak_text(1) == "peak ≤ 100.0 MiB (reached before this run)"


# -- series and sampling ------------------------------------------------------------------
def test_logical_cpus_form_one_shared_host_series_and_gpus_one_series_each():
    cpu = build_series(CPUS)
    assert [(s.key, s.devices, s.cap) for s in cpu] == [("host", tuple(CPUS), None)]
    assert cpu[0].label == "host allocator (shared by 4 logical CPUs)"
    assert len(cpu[0].devices) > 1

    gpu = build_series(["GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1"], {GPUS[0]: GIB, GPUS[1]: 2 * GIB})
    assert [(s.key, s.label, s.cap, len(s.devices) > 1) for s in gpu] == [
        (GPUS[0], "GPU:0", GIB, False),
        (GPUS[1], "GPU:1", 2 * GIB, False),
    ]
    mixed = build_series([GPUS[0], CPUS[0]])
    assert [s.key for s in mixed] == [GPUS[0], "host"]
    assert mixed[1].label == "host allocator (CPU:0)"


def test_normalize_device_rejects_what_is_not_a_device():
    assert normalize_device("gpu:3") == "/device:GPU:3"
    with pytest.raises(ValueError, match="'banana' is not a device name"):
        normalize_device("banana")


def test_sampler_reads_the_shared_host_allocator_once_per_sample():
    calls: list = []
    sampler = DeviceSampler(build_series(CPUS), reader=fake_reader({"CPU:0": (5, 9)}, calls))
    assert sampler.read() == [(5, 9)]
    assert calls == [["CPU:0"]]
    assert sampler.devices == tuple(CPUS)


def test_sampler_reads_every_logical_gpu_and_names_a_missing_one():
    calls: list = []
    values = {"GPU:0": (1, 2), "GPU:1": (3, 4)}
    sampler = DeviceSampler(build_series(GPUS[:2]), reader=fake_reader(values, calls))
    assert sampler.read() == [(1, 2), (3, 4)]
    assert calls == [["GPU:0", "GPU:1"]]
    broken = DeviceSampler(build_series(GPUS[:3]), reader=fake_reader(values, calls))
    with pytest.raises(ValueError, match="'GPU:2'"):
        broken.read()
    short = DeviceSampler(build_series(GPUS[:2]), reader=lambda names: [(1, 2)])
    with pytest.raises(SamplerError, match="1 readings for 2 devices"):
        short.read()


class _DType:
    def __init__(self, size: int) -> None:
        self.size = size


class _Component:
    """Shaped like a per-replica component: ``device``, ``shape``, ``dtype.size``."""

    def __init__(self, device: str, shape: tuple[int, ...], size: int = 4) -> None:
        self.device = device
        self.shape = shape
        self.dtype = _DType(size)


class _Mirrored:
    def __init__(self, shape, devices, size=4) -> None:
        self.values = tuple(_Component(f"/job:localhost/replica:0/task:0/device:{d}", shape, size) for d in devices)


def test_variable_bytes_counts_each_replica_component_on_its_device():
    kernel = _Mirrored((32, 64), ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    bias = _Mirrored((64,), ["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    step = _Component("/job:localhost/replica:0/task:0/device:CPU:0", (), size=8)  # a plain variable
    found = variable_bytes(frameworks.get("tensorflow"), [kernel, bias, step, kernel], CPUS)
    per_replica = (32 * 64 + 64) * 4
    assert found == {CPUS[0]: per_replica + 8, CPUS[1]: per_replica, CPUS[2]: per_replica, CPUS[3]: per_replica}


# -- the throttle ---------------------------------------------------------------------------
def test_throttle_waits_two_hundred_times_the_last_cost_and_keeps_a_0_2_s_rhythm():
    throttle = RedrawThrottle()
    throttle.reset(0.0)
    assert 0.19 < throttle.next_allowed() <= 0.2
    throttle.record(0.27, 0.0001)  # a cheap update, 70 ms late: the next is due on the rhythm
    assert throttle.next_allowed() == pytest.approx(0.4)
    throttle.record(1.0, 0.0001)  # 0.6 s late (a pause): a new rhythm from here
    assert throttle.next_allowed() == pytest.approx(1.2)
    throttle.record(1.29, 0.0001)  # 90 ms late: still on the rhythm, but never within 0.1 s
    assert throttle.next_allowed() == pytest.approx(1.4)
    throttle.record(1.4, 0.0001)
    throttle.record(1.7, 0.0001)  # 0.1 s late, half an interval: a new rhythm
    assert throttle.next_allowed() == pytest.approx(1.9)
    throttle.record(2.0, 0.010)  # a 10 ms update: wait 2 s
    assert throttle.next_allowed() == pytest.approx(4.0)


@pytest.mark.parametrize("step", [0.010, 0.050, 0.073, 0.099])
@pytest.mark.parametrize("cost", [0.0001, 0.0005, 0.002, 0.030, 0.200])
def test_throttled_updates_stay_under_half_a_percent_and_come_five_times_a_second_when_cheap(cost, step):
    # Simulated training: an update may only come at a sample, every `step`
    # seconds (73 ms: a Keras step on a loaded 2-core machine), for 120 s;
    # each update costs `cost`.
    throttle = RedrawThrottle()
    now, spent, updates, gaps, last = 0.0, 0.0, 0, [], 0.0
    throttle.reset(now)
    while now < 120.0:
        now += step
        if now >= throttle.next_allowed():
            throttle.record(now, cost)
            gaps.append(now - last)
            last = now
            now += cost
            spent += cost
            updates += 1
    assert spent / now <= 0.005
    assert min(gaps) >= 0.1 - 1e-9
    if cost <= 0.0005:
        assert updates / now >= 4.9


# -- the live view ---------------------------------------------------------------------------
def test_live_view_shows_one_widget_feeds_it_new_rows_only_and_leaves_the_final_image():
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace = cpu_trace(0)
    view.start(trace)
    (widget,) = view.widgets
    for k in range(40):
        clock.now += 0.1
        trace.append(k * 0.1, k, 0, "fit", [(40 * MIB + k * MIB, 80 * MIB)])
        view.sampled(trace, clock.now)
    trace.duration, trace.finished = 4.1, True
    view.finish(trace)

    kinds = [entry[0] for entry in display.log]
    # The widget opens the output at the run start (so it sits above the cell's stream output);
    # the final image replaces it in place.
    assert kinds == ["display", "update"] and display.log[0][1] is widget and display.log[0][2] is True
    assert [s["label"] for s in widget.series] == ["host allocator (shared by 4 logical CPUs)"]
    assert widget.series[0]["panel"] == "device" and widget.units["device"] == ["MiB", MIB]
    # Each update sends only the rows added since the one before: every row exactly once.
    rows = [row for message in widget.sent for row in message["rows"]]
    assert [row[0] for row in rows] == pytest.approx([k * 0.1 for k in range(40)])
    assert rows[-1][1:] == [79 * MIB, 80 * MIB]
    assert not any(message["reset"] for message in widget.sent)
    assert 13 <= len(widget.sent) <= 21  # every 0.2 or 0.3 s (samples come every 0.1 s) of 4 s, and the last
    # Nothing in the view grows per update, however long the fit (a benchmark measures its costs itself).
    grown = [k for k, v in vars(view).items() if isinstance(v, Collection) and not isinstance(v, str) and len(v) > 2]
    assert grown == []
    final = display.log[-1][1]
    assert isinstance(final, MemoryFrame) and widget.closed
    width, height = png_size(final.png)
    assert width > 400 and height > 200
    bundle = final._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"]) == final.png
    assert "done" in bundle["text/plain"] and "shared by 4 logical CPUs" in bundle["text/plain"]


def test_the_live_views_unit_holds_mid_fit_and_its_title_counts_steps_and_their_rate():
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace = MemoryTrace(build_series(CPUS), kind="fit", baseline_peak=(0,), epochs_total=2)
    view.start(trace)
    (widget,) = view.widgets
    units = []
    for k in range(60):  # 57 KiB growing to 3 MiB, 10 steps a second
        clock.now += 0.1
        trace.append(k * 0.1, k, 0, "fit", [(57 * KIB + k * 52 * KIB, 57 * KIB + k * 52 * KIB)])
        view.sampled(trace, clock.now)
        units.append(widget.units["device"])
    assert units[0] == units[-1] == ["KiB", KIB]  # 3.1 MiB reads 3121 KiB: no label rescaled mid-fit
    view.epoch_end(trace, 0)  # an update now, whatever the throttle says
    assert widget.title == "memory · fit · epoch 1/2 · step 60 · 10.0 steps/s · live"
    trace.append(6.0, 60, 0, "fit", [(20 * MIB, 20 * MIB)])  # past four digits in KiB: the next unit
    view.sampled(trace, clock.now + 1)
    assert widget.units["device"] == ["MiB", MIB]


def test_the_final_image_is_transparent():
    import numpy as np
    from PIL import Image

    trace = cpu_trace()
    trace.duration, trace.finished = 2.0, True
    with Image.open(io.BytesIO(MemoryFigure(trace).png())) as image:
        assert image.mode == "RGBA"
        alpha = np.asarray(image)[:, :, 3]
    # The background lets the notebook's own show through: most pixels are fully transparent.
    assert (alpha == 0).mean() > 0.7


def test_a_trace_that_merged_old_rows_is_sent_again_whole():
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace = MemoryTrace(build_series(CPUS), kind="custom", recent=8)
    view.start(trace)
    widget = view.widgets[0]
    for k in range(40):
        clock.now += 0.3
        trace.append(k * 0.3, k, 0, "custom", [(k * MIB, k * MIB)])
        view.sampled(trace, clock.now)
    assert any(m["reset"] for m in widget.sent)
    # What the browser holds after the last reset is the trace as it stands.
    last = max(i for i, m in enumerate(widget.sent) if m["reset"])
    held = [row for m in widget.sent[last:] for row in m["rows"]]
    assert [row[0] for row in held] == pytest.approx(list(trace.time))


def test_epoch_marks_and_the_title_are_traits_set_when_they_change():
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace = cpu_trace(0)
    view.start(trace)
    widget = view.widgets[0]
    trace.epoch_starts.append((0.0, 0))
    trace.append(0.0, 0, 0, "fit", [(MIB, MIB)])
    trace.epoch_starts.append((1.0, 1))
    trace.append(1.0, 1, 1, "fit", [(MIB, MIB)])
    view.epoch_end(trace, 0)
    assert widget.marks == [[1.0, 1]]  # the first epoch's start is the run's start: no mark
    assert widget.title == "memory · fit · epoch 2/2 · step 2 · 1.0 steps/s · live"
    assert widget.note == "variables per replica: CPU:0…CPU:3, each 3.0 MiB"


def test_final_image_can_wait_until_the_training_is_over():
    display, clock, pending = FakeDisplay(), FakeClock(), []
    view = live_view(display, clock, defer=pending.append)
    trace = cpu_trace()
    view.start(trace)
    clock.now += 1.0
    view.sampled(trace, clock.now)
    trace.duration, trace.finished = 2.0, True
    view.finish(trace)
    assert [entry[0] for entry in display.log] == ["display"] and len(pending) == 1
    pending.pop()()
    assert [entry[0] for entry in display.log] == ["display", "update"]
    assert "done" in display.log[-1][1].text and view.widgets[0].closed


def cpu_run(samples: int, base: int) -> MemoryTrace:
    trace = MemoryTrace(build_series(CPUS), kind="fit", baseline_peak=(90 * MIB,), epochs_total=1)
    trace.variable_bytes = dict.fromkeys(CPUS, 3 * MIB)
    trace.epoch_starts.append((0.0, 0))
    for k in range(samples):
        trace.append(k * 0.05, k, 0, "fit", [(base + (k % 7) * MIB, 80 * MIB)])
    return trace


def test_live_updates_wait_for_the_throttle():
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace = cpu_trace(0)
    view.start(trace)
    for k in range(6):  # 0.18 s: before the first update is due
        clock.now += 0.03
        trace.append(k * 0.03, k, 0, "fit", [(MIB, MIB)])
        view.sampled(trace, clock.now)
    assert [entry[0] for entry in display.log] == ["display"] and view.widgets[0].sent == []


def test_cpu_figure_has_one_line_for_the_shared_allocator_and_variables_per_replica():
    trace = cpu_trace()
    trace.duration, trace.finished = 2.0, True
    plot = MemoryFigure(trace)
    assert len(plot.lines) == len(plot.peak_lines) == 1 and list(plot.axes) == ["device"]
    # the running peak, dotted, in the line's colour
    assert plot.peak_lines[0].get_color() == plot.lines[0].get_color()
    assert plot.peak_lines[0].get_linestyle() == ":"
    assert list(plot.peak_lines[0].get_ydata()[[0, -1]]) == [60.0, 79.0]
    assert list(plot.lines[0].get_ydata()[[0, -1]]) == [40.0, 59.0]
    legend = [t.get_text() for t in plot.legend.get_texts()]
    # The dotted running-peak lines have their own legend entry.
    assert legend == ["host allocator (shared by 4 logical CPUs) · peak 79.0 MiB", "running peak (dotted)"]
    assert plot.legend.legend_handles[1].get_linestyle() == ":"
    assert [t.get_text() for t in plot.vax.get_yticklabels()] == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    ax = plot.axes["device"]
    assert ax.get_ylabel() == "device memory (MiB)"
    # Epoch 2 starts at 1.0 s: one marker of dark and light dots.
    assert [line.get_xdata()[0] for line in ax.lines if line.get_label() == "_epoch"] == [1.0, 1.0]


def test_gpu_figure_draws_each_cap_dashed_in_its_line_colour_and_its_legend_reads_in_the_axis_unit():
    caps = {d: (2 + i) * GIB for i, d in enumerate(GPUS)}
    trace = MemoryTrace(build_series(GPUS, caps), kind="fit", baseline_peak=(0,) * 4)
    for k in range(30):
        trace.append(k * 0.1, k, 0, "fit", [((i + 1) * GIB // 2, (i + 1) * GIB // 2 + MIB) for i in range(4)])
    trace.duration = 3.0
    plot = MemoryFigure(trace)
    ax = plot.axes["device"]
    dashed = [line for line in ax.lines if line.get_label() == "_cap"]
    assert [line.get_color() for line in dashed] == [line.get_color() for line in plot.lines]
    assert [line.get_ydata()[0] for line in dashed] == [2, 3, 4, 5]  # GiB
    assert ax.get_ylabel() == "device memory (GiB)"
    assert plot.legend.get_texts()[3].get_text() == "GPU:3 · peak 2.00 GiB / cap 5.00 GiB"
    # A peak under 1 GiB on a GiB axis reads in GiB too, not "513.0 MiB".
    assert plot.legend.get_texts()[0].get_text() == "GPU:0 · peak 0.50 GiB / cap 2.00 GiB"
    # A run that starts in KiB and peaks at 4.9 MiB ends on a MiB axis, which its legend uses.
    grows = MemoryTrace(build_series(GPUS[:1]), kind="fit", baseline_peak=(100 * 1024,))
    for k in range(50):
        grows.append(k * 0.1, k, 0, "fit", [(k * MIB // 10, k * MIB // 10)])
    plot = MemoryFigure(grows)
    assert plot.axes["device"].get_ylabel() == "device memory (MiB)"
    assert plot.legend.get_texts()[0].get_text() == "GPU:0 · peak 4.9 MiB"


def test_epoch_labels_do_not_overprint():
    trace = MemoryTrace(build_series(CPUS), kind="fit", epochs_total=60)
    for epoch in range(60):
        trace.epoch_starts.append((epoch * 0.1, epoch))
        trace.append(epoch * 0.1, epoch, epoch, "fit", [(MIB, MIB)])
    trace.duration = 6.0
    ax = MemoryFigure(trace).axes["device"]
    labels = sorted(t.get_position()[0] for t in ax.texts if t.get_text().strip().startswith("e"))
    assert len([line for line in ax.lines if line.get_label() == "_epoch"]) == 2 * 59  # every mark drawn
    assert 5 <= len(labels) < 59  # ... but only labels with room
    assert min(b - a for a, b in itertools.pairwise(labels)) >= 0.045 * 6.0 - 1e-9


def test_savefig_writes_a_real_png(tmp_path):
    trace = cpu_trace()
    trace.duration = 2.0
    path = save_trace_figure(trace, str(tmp_path / "memory.png"))
    width, height = png_size((tmp_path / "memory.png").read_bytes())
    assert path.endswith("memory.png") and width >= 800 and height >= 300


def test_text_view_prints_one_line_per_epoch_and_one_at_the_end():
    out = io.StringIO()
    view = TextSummaryView(out)
    trace = cpu_trace()
    view.epoch_end(trace, 0)
    trace.duration = 2.0
    view.finish(trace)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0] == ("memory · epoch 1/2 · host allocator (shared by 4 logical CPUs): now 59.0 MiB, peak 79.0 MiB")
    assert lines[1].startswith("memory · fit done in 2.0 s, 20 samples · host allocator")
    assert "variables per replica: CPU:0…CPU:3, each 3.0 MiB" in lines[1]


@pytest.mark.slow
def test_frontend_is_text_outside_a_kernel():
    assert detect_frontend() == "text"
    code = "import vgpu_magic.monitor.display as d; print(d.detect_frontend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "text"


# -- the recorder ---------------------------------------------------------------------------------
def make_recorder(view, clock, reports, calls=None, values=None):
    values = {"CPU:0": (MIB, 2 * MIB)} if values is None else values
    calls = calls if calls is not None else []

    def factory():
        return DeviceSampler(build_series(CPUS), reader=fake_reader(values, calls))

    return MemoryRecorder(factory, view, interval=0.05, clock=clock, report=reports.append)


class ExplodingView(View):
    """A view whose update fails, as a broken front end library would."""

    def __init__(self, clock) -> None:
        self.attempts = 0

    def sampled(self, trace, now) -> None:
        self.attempts += 1
        raise RuntimeError("renderer exploded")


def test_a_failing_view_is_reported_once_and_recording_goes_on():
    clock, reports = FakeClock(), []
    view = ExplodingView(clock)
    recorder = make_recorder(view, clock, reports)
    recorder.start("fit", epochs=1)
    for step in range(100):
        clock.now += 0.01
        recorder.tick(step)
    trace = recorder.finish()
    assert view.attempts == 1
    assert reports == [
        "the memory plot stopped after an error (RuntimeError: renderer exploded); "
        "training goes on and the trace is still recorded"
    ]
    assert len(trace) >= 20  # every 50 ms over 1 s, plus start and end
    assert trace.finished and not trace.interrupted


def test_ticks_sample_at_most_every_interval():
    clock, reports, calls = FakeClock(), [], []
    recorder = make_recorder(None, clock, reports, calls=calls)
    recorder.start("fit")
    for step in range(1000):  # 1 ms steps for 1 s
        clock.now += 0.001
        recorder.tick(step)
    recorder.finish()
    assert 20 <= len(recorder.trace) <= 22
    assert recorder.trace.step[1] >= 49
    assert all(c == ["CPU:0"] for c in calls)  # one read of the shared allocator per sample


def test_a_sampler_that_fails_is_reported_once_and_stops_sampling():
    clock, reports, calls = FakeClock(), [], []
    recorder = make_recorder(None, clock, reports, calls=calls, values={})
    recorder.start("fit")
    for step in range(10):
        clock.now += 0.1
        recorder.tick(step)
    recorder.finish()
    assert reports == ["memory cannot be read, monitoring is off (ValueError: No matching devices found for 'CPU:0')"]
    assert len(calls) == 1


def test_interrupted_run_keeps_its_trace_and_draws_a_final_frame():
    display, clock, reports = FakeDisplay(), FakeClock(), []
    recorder = make_recorder(live_view(display, clock), clock, reports)
    recorder.start("fit", epochs=3)
    for step in range(30):
        clock.now += 0.02
        recorder.tick(step)
    trace = recorder.finish(interrupted=True)
    assert len(trace) > 10 and trace.interrupted
    assert "interrupted" in display.log[-1][1].text
    assert reports == []


# -- the framework seam -----------------------------------------------------------------------------
class FakeFramework:
    """A framework in a few lines: its logical CPUs do NOT share one allocator
    (each reports its own bytes, as JAX's live arrays do), no TensorFlow."""

    def __init__(self, shared: bool = False) -> None:
        from vgpu_magic.frameworks.base import Capabilities, ConfigSnapshot

        self.capabilities = Capabilities(name="fake", label="Fake", cpus_share_allocator=shared)
        self.snapshot = ConfigSnapshot(
            cpu_names=("/physical_device:CPU:0",),
            gpu_names=(),
            logical={"/physical_device:CPU:0": (None, None, None)},
            visible_gpus=(),
            memory_growth=(),
        )
        self.calls: list = []

    def runtime_started(self) -> bool:
        return True

    def read_configuration(self):
        return self.snapshot

    def device_label(self, name):  # its own words for its devices, as JAX's "cpu:3"
        return name.rpartition("/device:")[2].lower()

    def memory_reader(self):
        def read(names):
            self.calls.append(list(names))
            return [(1000 * (int(n.rsplit(":", 1)[1]) + 1), 5000) for n in names]

        return read


def test_a_framework_whose_cpus_have_their_own_memory_gets_one_series_each_plus_rss():
    fw = FakeFramework()
    model = type("Model", (), {})()  # no distribute_strategy: nothing assumed
    sampler = DeviceSampler.for_framework(fw, model=model)
    # Labelled in the framework's words; read by the devices' names.
    assert [(s.key, s.label) for s in sampler.series] == [
        ("/device:CPU:0", "cpu:0"),
        ("/device:CPU:1", "cpu:1"),
        ("/device:CPU:2", "cpu:2"),
        ("process", "process RSS (all memory of this Python process)"),
    ]
    readings = sampler.read()
    assert readings[:3] == [(1000, 5000), (2000, 5000), (3000, 5000)]
    rss, peak = readings[3]
    assert 10 * MIB < rss <= peak  # this interpreter's resident memory
    assert fw.calls == [["CPU:0", "CPU:1", "CPU:2"]]
    shared = DeviceSampler.for_framework(FakeFramework(shared=True))
    assert [s.key for s in shared.series] == ["host", "process"]


def test_the_caption_says_once_what_the_split_devices_simulate():
    """Issue 48: the sampler reads the split from the framework's configuration, the recorder's trace carries it, and
    the live view's caption and the final frame's text say it in one line; one device simulates nothing."""
    from vgpu_magic.monitor.live import static_image

    said = "simulated: 3 logical CPUs share one allocator and the CPU's cores"
    assert DeviceSampler.for_framework(FakeFramework()).simulated == ("3 logical CPUs share the CPU's cores",)
    fw = FakeFramework(shared=True)
    recorder = MemoryRecorder(lambda: DeviceSampler.for_framework(fw), None, interval=0.05, clock=FakeClock())
    recorder.start("fit", epochs=1)
    trace = recorder.finish()
    assert trace.caption() == said
    display, clock = FakeDisplay(), FakeClock()
    view = live_view(display, clock)
    trace.variable_bytes = {"/device:CPU:0": 3 * MIB}
    view.start(trace)
    assert view.widgets[0].note == f"{said}\nvariables per replica: CPU:0 3.0 MiB"
    assert [line for line in static_image(trace)[1].splitlines() if "simulated" in line] == [said]
    fw.snapshot = replace(fw.snapshot, logical={})
    assert not DeviceSampler.for_framework(fw).simulated


def test_jax_names_its_devices_in_its_own_words_and_tensorflow_in_its_own():
    from vgpu_magic import frameworks

    assert frameworks.get("jax").device_label("/device:CPU:3") == "cpu:3"
    assert frameworks.get("jax").device_label("/device:GPU:1") == "cuda:1"
    assert frameworks.get("tensorflow").device_label("/device:GPU:1") == "GPU:1"


def test_process_memory_matches_psutil():
    psutil = pytest.importorskip("psutil")
    from vgpu_magic.monitor.sampler import process_memory_reader

    rss, peak = process_memory_reader()()
    assert abs(rss - psutil.Process().memory_info().rss) < 16 * MIB
    assert peak >= rss


class _Shard:
    def __init__(self, platform: str, index: int, nbytes: int) -> None:
        self.device = type("Device", (), {"platform": platform, "id": index})()
        self.data = type("Data", (), {"nbytes": nbytes})()


def test_variable_bytes_counts_each_shard_of_an_array_placed_on_several_devices():
    value = type("Array", (), {})()
    value.addressable_shards = [_Shard("cpu", i, 400) for i in range(3)]
    variable = type("Variable", (), {"value": value})()
    assert variable_bytes(frameworks.get("jax"), [variable], CPUS[:3]) == {CPUS[0]: 400, CPUS[1]: 400, CPUS[2]: 400}


# -- what the plot shows -------------------------------------------------------------------------------
def test_the_variables_are_named_as_the_legend_names_the_devices():
    """JAX's devices are "cpu:0" in the legend (JAX's words); the variables panel said "CPU:0" (notebook 06)."""
    # As the sampler builds JAX's series: one per device, labelled by the framework.
    series = [SeriesInfo(d, frameworks.get("jax").device_label(d), (d,)) for d in CPUS[:2]]
    trace = MemoryTrace(tuple(series), kind="fit")
    trace.variable_bytes = {"/device:CPU:0": 2048, "/device:CPU:1": 2048}
    for k in range(3):
        trace.append(k * 0.1, k, 0, "fit", [(1024, 1024), (1024, 1024)])
    trace.duration = 0.3
    plot = MemoryFigure(trace)
    assert plot.legend.get_texts()[0].get_text().startswith("cpu:0, cpu:1")
    assert sorted(t.get_text() for t in plot.vax.get_yticklabels()) == ["cpu:0", "cpu:1"]
    assert trace.variables_text() == "variables per replica: cpu:0 2.0 KiB, cpu:1 2.0 KiB"


def test_rss_gets_its_own_panel_so_an_allocator_reporting_nothing_stays_readable():
    series = build_series(CPUS, process=True)
    trace = MemoryTrace(series, kind="fit", baseline_peak=(0, 600 * MIB))
    trace.variable_bytes = {d: 4 * 1024 + 1024 * k for k, d in enumerate(CPUS)}  # a tiny model: KiB
    for k in range(10):
        trace.append(k * 0.1, k, 0, "fit", [(0, 0), (600 * MIB + k * MIB, 620 * MIB)])
    trace.duration = 1.0
    plot = MemoryFigure(trace)
    legend = [t.get_text() for t in plot.legend.get_texts()]
    assert legend[0] == "host allocator (shared by 4 logical CPUs) · nothing allocated"
    assert legend[1].startswith("process RSS (all memory of this Python process) · peak 620.0 MiB")
    device, process = plot.axes["device"], plot.axes["process"]
    assert device.get_ylabel() == "device memory (KiB)" and device.get_ylim()[1] == pytest.approx(1.0)
    assert process.get_ylabel() == "process RSS (MiB)" and process.get_ylim()[1] > 600
    assert plot.lines[1].axes is process
    # The variables panel: one unit on its axis and its bar labels.
    assert plot.vax.get_xlabel() == "KiB"
    assert [t.get_text().strip() for t in plot.vax.texts] == ["4.0 KiB", "5.0 KiB", "6.0 KiB", "7.0 KiB"]

    zero = MemoryTrace(build_series(CPUS), kind="fit")
    for k in range(10):
        zero.append(k * 0.1, k, 0, "fit", [(0, 0)])
    zero.duration = 1.0
    ax = MemoryFigure(zero).axes["device"]
    assert ax.get_ylabel() == "device memory (KiB)" and ax.get_ylim()[1] == pytest.approx(1.0)
    assert "nothing allocated (every reading is 0 B)" in [t.get_text() for t in ax.texts]


def test_equal_caps_on_several_gpus_all_show_and_are_labelled_once():
    caps = dict.fromkeys(GPUS, 2 * GIB)
    trace = MemoryTrace(build_series(GPUS, caps), kind="fit", baseline_peak=(0,) * 4)
    for k in range(10):
        trace.append(k * 0.1, k, 0, "fit", [(GIB // 2 + i, GIB // 2 + i) for i in range(4)])
    trace.duration = 1.0
    plot = MemoryFigure(trace)
    ax = plot.axes["device"]
    capped = [line for line in ax.lines if line.get_ydata()[0] == 2 and line not in plot.lines]
    assert len(capped) == 4
    # Interleaved dashes: each colour gets its own stretch of the same line.
    offsets = {line._unscaled_dash_pattern[0] for line in capped}
    assert len(offsets) == 4
    assert [line.get_color() for line in capped] == [line.get_color() for line in plot.lines]
    labels = [t.get_text() for t in ax.texts if t.get_text().startswith("cap")]
    assert labels == ["cap 2.00 GiB (GPU:0, GPU:1, GPU:2, GPU:3) "]


def test_series_that_read_the_same_are_one_line_at_their_true_value_labelled_as_such():
    """The live view draws the final image's lines: its groups come from the kernel (live.js groups nothing)."""
    # Eight JAX CPU devices: CPU:0 holds more, the seven others 602.1 KiB each all run long.
    series = build_series([f"CPU:{i}" for i in range(8)], shared_cpus=False, process=True)
    trace = MemoryTrace(series, kind="custom", baseline_peak=(0,) * 9)
    for k in range(20):
        trace.append(k * 0.1, k, 0, "custom", [(700 * 1024, 700 * 1024)] + [(616550, 616550)] * 7 + [(GIB, GIB)])
    trace.duration = 2.0
    plot = MemoryFigure(trace)
    assert plot.groups == [[0], list(range(1, 8)), [8]]
    view = live_view(FakeDisplay(), FakeClock())
    view.start(trace)
    (widget,) = view.widgets
    assert widget.groups == [["CPU:0", [0]], ["CPU:1…CPU:7, same", list(range(1, 8))], [series[8].label, [8]]]
    legend = [t.get_text() for t in plot.legend.get_texts()]
    assert legend[:2] == ["CPU:0 · peak 700.0 KiB", "CPU:1…CPU:7, same · peak 602.1 KiB"]
    device = plot.axes["device"]
    assert [line.axes for line in plot.lines[:2]] == [device, device]
    # Drawn where they are, one line of one width: nothing moved or widened apart.
    assert set(plot.lines[1].get_ydata()) == {616550 / 1024}
    assert {line.get_linewidth() for line in plot.lines} == {1.6}
    # Lines that differ somewhere but may overlap elsewhere stay apart by their dashes.
    assert [line.get_linestyle() for line in plot.lines] == ["-", "--", "-"]
    # Apart the moment one differs.
    trace.append(2.0, 20, 0, "custom", [(700 * 1024, 700 * 1024)] + [(616550, 616550)] * 6 + [(0, 616550), (GIB, GIB)])
    assert MemoryFigure(trace).groups == [[0], list(range(1, 7)), [7], [8]]
    view.epoch_end(trace, 0)
    assert [members for _, members in widget.groups] == [[0], list(range(1, 7)), [7], [8]]
    assert widget.groups[1][0] == "CPU:1…CPU:6, same"


def test_text_is_large_enough_for_hidpi_and_lines_hold_between_samples():
    trace = cpu_trace()
    trace.duration = 2.0
    plot = MemoryFigure(trace)
    dpi = plot.fig.dpi
    smallest = min(
        [t.get_fontsize() for t in plot.axes["device"].get_yticklabels() + plot.legend.get_texts()]
        + [plot.title.get_fontsize()]
    )
    assert smallest * dpi / 72 >= 11  # pixels
    # No straight ramp between two samples far apart: the value holds until
    # the next reading.
    assert plot.lines[0].get_drawstyle() == "steps-post"


SAVEFIG_WITHOUT_MATPLOTLIB = """
import sys
sys.modules["matplotlib"] = None  # as if it were not installed
from vgpu_magic.monitor.plot import save_trace_figure, require_matplotlib
from vgpu_magic.monitor.sampler import build_series
from vgpu_magic.monitor.trace import MemoryTrace

trace = MemoryTrace(build_series(["CPU:0"]))
trace.append(0.0, 0, 0, "custom", [(1, 1)])
try:
    require_matplotlib("the final memory plot is text only")
except ImportError as exc:
    print("final:", exc)
try:
    save_trace_figure(trace, "never.png")
except ImportError as exc:
    print("savefig:", type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_savefig_without_matplotlib_gives_the_install_hint_of_the_final_image():
    out = subprocess.run([sys.executable, "-c", SAVEFIG_WITHOUT_MATPLOTLIB], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines == [
        "final: matplotlib is not installed, so the final memory plot is text only; pip install 'vgpu_magic[plot]'",
        "savefig: ImportError matplotlib is not installed, so the plot cannot be saved; pip install 'vgpu_magic[plot]'",
    ]


def test_the_final_image_is_a_png_of_the_canvas_with_a_transparent_background():
    import numpy as np
    from PIL import Image

    plot = MemoryFigure(cpu_run(30, 30 * MIB))
    png = plot.png()
    assert png.startswith(PNG_SIGNATURE)
    with Image.open(io.BytesIO(png)) as image:
        decoded = np.asarray(image.convert("RGBA"))
    assert decoded.shape[:2] == np.asarray(plot.canvas.buffer_rgba()).shape[:2]
    assert decoded[0, 0, 3] == 0 and decoded[..., 3].max() == 255  # see-through around what is drawn


# -- samples that do not wait for the training thread; devices that join; epochs; the title ------------------
class SeriesLog(View):
    """Records what the recorder tells a view."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, trace) -> None:
        self.calls.append(("start", len(trace.series)))

    def series_changed(self, trace) -> None:
        self.calls.append(("series_changed", len(trace.series)))


def test_a_background_recorder_samples_while_the_training_thread_calls_nothing():
    import threading
    import time

    calls: list = []
    recorder = MemoryRecorder(
        lambda: DeviceSampler(build_series(CPUS), reader=fake_reader({"CPU:0": (MIB, MIB)}, calls)),
        None,
        interval=0.001,
        background=True,
    )
    recorder.start("fit")
    threads = threading.active_count()
    deadline = time.monotonic() + 30
    # This thread sleeps, as a training thread blocked in a long step does: the trace still grows.
    while len(recorder.trace) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(recorder.trace) >= 5
    recorder.tick(7)  # a hook only notes the step
    trace = recorder.finish()
    assert threading.active_count() == threads - 1  # the sampling thread ended with the run
    assert list(trace.time) == sorted(trace.time) and trace.step[-1] == 7
    assert len(trace) == len(calls) - 1  # every read a row (the first one is the baseline)


def test_a_reader_that_counts_live_arrays_is_read_on_the_training_thread_only():
    # JAX's CPU reader counts live arrays: read from the sampling thread in the middle of a step, it saw the
    # arrays between a donated buffer's end and its replacement, and the live view dipped to 0 B.
    import threading
    import time

    from vgpu_magic.frameworks.jax.memory import MemoryReader

    readers: list = []

    def reader(names):
        readers.append(threading.current_thread())
        return [(MIB, MIB) for _ in names]

    reader.training_thread_only = MemoryReader.training_thread_only
    recorder = MemoryRecorder(lambda: DeviceSampler(build_series(CPUS), reader=reader), None, interval=0.001,
                              background=True)  # fmt: skip
    recorder.start("fit")
    for step in range(5):
        time.sleep(0.02)  # the sampling thread would have sampled several times meanwhile
        recorder.tick(step)
    trace = recorder.finish()
    assert len(trace) >= 1 and readers
    assert set(readers) == {threading.current_thread()}


def test_no_sampling_thread_waits_on_a_reader_only_the_training_thread_reads():
    # JAX's reader: the hooks sample. A thread left to wait for them woke with no wait at all whenever an
    # interval had passed until the next hook sampled (190,000 times in a 300-step Keras fit on JAX: 1.25x its time).
    import threading

    clock = FakeClock()
    reader = fake_reader({"CPU:0": (MIB, MIB)}, [])
    reader.training_thread_only = True
    threads = threading.active_count()
    recorder = MemoryRecorder(lambda: DeviceSampler(build_series(CPUS), reader=reader), None, interval=2**-7,
                              clock=clock, background=True)  # fmt: skip
    recorder.start("fit")
    assert threading.active_count() == threads
    for step in range(100):  # steps of an eighth of the interval: a sample every 8 steps, on this thread
        clock.now += 2**-10
        recorder.tick(step)
    assert list(recorder.finish().step) == [0, *range(7, 100, 8), 99]


def test_the_sampling_thread_ends_once_devices_join_that_only_the_training_thread_reads():
    import threading

    clock, runtime = FakeClock(), {"started": False}
    reader = fake_reader({"CPU:0": (MIB, MIB)}, [])
    reader.training_thread_only = True

    def factory():
        if runtime["started"]:
            return DeviceSampler(build_series(CPUS, process=True), reader=reader, process=lambda: (GIB, GIB))
        return DeviceSampler(build_series([], process=True), lambda names: [], process=lambda: (GIB, GIB),
                             joinable=lambda: runtime["started"])  # fmt: skip

    recorder = MemoryRecorder(factory, None, interval=0.001, clock=clock, background=True)
    threads = threading.active_count()
    recorder.start("fit")
    thread = recorder._thread
    assert thread.is_alive() and threading.active_count() == threads + 1  # it reads the process' RSS
    runtime["started"] = True
    recorder.tick(0)
    thread.join(timeout=60)  # it looks at its next wake (1 ms)
    assert not thread.is_alive()
    assert [s.key for s in recorder.finish().series] == ["host", "process"]


def test_the_sampling_thread_ends_with_a_run_whose_sampler_failed():
    # It used to wake with no wait until the run's end: JAX's count read from it failed on a donated array
    # ("Array has been deleted") in 3 of 4 fits of the benchmark's model, and the fit took up to 3x as long.
    import threading

    clock, reads = FakeClock(), []

    def reader(names):
        reads.append(threading.current_thread())
        if len(reads) > 2:  # the baseline and the start's sample read, then the thread's first
            raise RuntimeError("Array has been deleted with shape=float32[].")
        return [(MIB, MIB)]

    recorder = MemoryRecorder(lambda: DeviceSampler(build_series(CPUS), reader=reader), None, interval=0.001,
                              clock=clock, background=True, report=lambda message: None)  # fmt: skip
    recorder.start("fit")
    thread = recorder._thread
    clock.now += 1.0  # a sample is due: the thread takes it, and it fails
    thread.join(timeout=60)
    assert not thread.is_alive() and len(reads) == 3 and not recorder.active


def test_devices_join_at_the_first_sample_after_their_runtime_started():
    clock, reports = FakeClock(), []
    runtime = {"started": False}
    values = {"CPU:0": (3 * MIB, 4 * MIB)}
    asked: list[bool] = []

    def started() -> bool:
        asked.append(runtime["started"])
        return runtime["started"]

    def factory():
        if not runtime["started"]:
            return DeviceSampler(
                build_series([], process=True), lambda names: [], process=lambda: (GIB, GIB), joinable=started
            )
        return DeviceSampler(build_series(CPUS, process=True), fake_reader(values, []), process=lambda: (GIB, GIB))

    view = SeriesLog()
    recorder = MemoryRecorder(factory, view, interval=0.05, clock=clock, report=reports.append)
    recorder.start("custom")
    for step in range(10):
        clock.now += 0.1
        recorder.sample(step=step)
    assert [s.key for s in recorder.trace.series] == ["process"] and asked == [False] * 10
    runtime["started"] = True
    clock.now += 0.001  # well within the interval: the sample that joins them reads them all the same
    recorder.sample(step=10)
    assert [s.key for s in recorder.trace.series] == ["host", "process"]
    assert recorder.trace.step[-1] == 10 and recorder.trace.latest(0) == (3 * MIB, 4 * MIB)
    for step in range(11, 20):
        clock.now += 0.1
        recorder.sample(step=step)
    trace = recorder.finish()
    assert len(asked) == 11  # asked no more once they joined
    assert view.calls == [("start", 1), ("series_changed", 2)]
    joined = trace.current[0]
    # Before its runtime started the device had no allocator: 0 B; since then its readings.
    assert joined[0] == 0 and joined[-1] == 3 * MIB and set(joined) == {0, 3 * MIB}
    assert set(trace.current[1]) == {GIB} and reports == []
    assert trace.peak_text(0) == "peak 4.0 MiB"


def test_a_custom_loop_marks_each_new_epoch_it_passes_to_sample():
    clock, reports = FakeClock(), []
    recorder = make_recorder(None, clock, reports)
    recorder.start("custom")
    for step in range(30):
        clock.now += 0.1
        recorder.sample(step=step, epoch=step // 10)
    trace = recorder.finish()
    assert [epoch for _, epoch in trace.epoch_starts] == [1, 2]
    assert [t for t, _ in trace.epoch_starts] == pytest.approx([1.1, 2.1])
    assert [
        round(line.get_xdata()[0], 3)
        for line in MemoryFigure(trace).axes["device"].lines
        if line.get_label() == "_epoch"
    ] == [1.1, 1.1, 2.1, 2.1]


def test_the_title_counts_epochs_as_keras_does_and_names_what_a_custom_loop_watches():
    from vgpu_magic.monitor.views import title_text

    trace = MemoryTrace(build_series(CPUS), kind="fit", epochs_total=5)
    for epoch in range(3):
        trace.epoch_starts.append((epoch * 1.0, epoch))
        trace.append(epoch * 1.0 + 0.5, epoch, epoch, "fit", [(MIB, MIB)])
    trace.epoch_starts.append((3.0, 3))  # Keras printed "Epoch 4/5"; no sample of it yet
    assert title_text(trace) == "memory · fit · epoch 4/5"
    custom = MemoryTrace(build_series(CPUS), subject="JAX · 8 devices")
    assert title_text(custom) == "memory · JAX · 8 devices"
    custom.epoch_starts.append((0.0, 0))
    assert title_text(custom) == "memory · JAX · 8 devices · epoch 1"


# The code, as a notebook runs it, then the CSV's rows. The recorder's clock stands still, so no sample
# is due but those the run takes itself: the devices join at the sample after the start, or not at all.
JOINS = """
import csv, io, json
import numpy as np
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "vgpu_magic")
shell.run_line_magic("vgpu_split", "4 --framework {framework}")
{imports}, vgpu_magic
mon = vgpu_magic.MemoryMonitor(display="none")
mon._recorder.clock = lambda: 0.0
with mon:
    mon.sample(step=0)
    {start}
    mon.sample(step=1)
    joined = [s.key for s in mon.trace.series]
mon.to_csv("memory.csv")
rows = {{}}
for row in csv.DictReader(open("memory.csv")):
    rows.setdefault(row["device"], []).append([int(row["step"]), int(row["current"])])
print(json.dumps({{"joined": joined, "subject": mon.trace.subject, "rows": rows}}))
"""


@pytest.mark.slow
def test_jax_devices_join_a_monitor_entered_before_jax_s_backend_started(tmp_path):
    from support import last_json, run_python

    start = "a = jax.device_put(jnp.ones(2**21, dtype=jnp.float32), jax.devices()[1]); a.block_until_ready()"
    code = JOINS.format(framework="jax", imports="import jax, jax.numpy as jnp", start=start)
    result = last_json(run_python(f"import os; os.chdir({str(tmp_path)!r})\n" + code).stdout)
    devices = [f"/device:CPU:{i}" for i in range(4)]
    assert result["joined"] == [*devices, "process"] and result["subject"] == "JAX · 4 devices"
    rows = result["rows"]
    # The 8 MiB array on device 1 from the sample after it on (0 B before: no backend ran), nothing on device 0.
    assert rows["/device:CPU:1"] == [[0, 0], [1, 8 * MIB], [1, 8 * MIB]]
    assert rows["/device:CPU:0"] == [[0, 0], [1, 0], [1, 0]]


@pytest.mark.slow
def test_tensorflow_s_devices_join_a_monitor_entered_before_its_runtime_started(tmp_path):
    from support import last_json, run_python

    start = "with tf.device('CPU:1'):\n        a = tf.constant(np.ones(2**21, dtype=np.float32))"
    code = JOINS.format(framework="tensorflow", imports="import tensorflow as tf", start=start)
    result = last_json(run_python(f"import os; os.chdir({str(tmp_path)!r})\n" + code).stdout)
    # TensorFlow's four logical CPUs share its host allocator: one series, then the process.
    assert result["joined"] == ["host", "process"] and result["subject"] == "TensorFlow · 4 devices"
    (before, *after) = result["rows"]["host"]
    assert before == [0, 0] and [step for step, _ in after] == [1, 1]
    assert all(current >= 8 * MIB for _, current in after)  # the constant, counted from the sample after it


TORCH_CUDA_STARTS_MID_RUN = """
import json
from unittest import mock
import torch
import vgpu_magic
from vgpu_magic.inventory import GPUInfo

real = torch.cuda.is_available()
mon = vgpu_magic.MemoryMonitor(display="none")
mon._recorder.clock = lambda: 0.0  # no sample is due but the run's own: they join at the next, or not at all
mon.start()
mon.sample(step=0)
before = [s.key for s in mon.trace.series]
if real:
    block = torch.ones(1 << 20, device="cuda")  # 4 MiB: CUDA starts here
else:  # torch.cuda's own functions, as they read once CUDA started on two GPUs
    held = {0: 4 << 20, 1: 0}
    mock.patch.object(torch.cuda, "is_initialized", lambda: True).start()
    mock.patch.object(torch.cuda, "memory_allocated", held.__getitem__).start()
    mock.patch.object(torch.cuda, "max_memory_allocated", lambda i: held[i] + 512).start()
    mock.patch("vgpu_magic.frameworks.torch.visible_gpus", lambda: (GPUInfo(0), GPUInfo(1))).start()
mon.sample(step=1)
steps = list(mon.trace.step)
trace = mon.finish()
print(json.dumps({
    "real": real, "before": before, "labels": [s.label for s in trace.series], "steps": steps,
    "first": [c[0] for c in trace.current], "last": [list(trace.latest(i)) for i in range(len(trace.series))],
}))
"""


@pytest.mark.slow
def test_torch_cuda_devices_join_a_run_when_cuda_starts_in_it():
    pytest.importorskip("torch")
    result = last_json(run_python(TORCH_CUDA_STARTS_MID_RUN, timeout=180).stdout)
    assert result["before"] == ["process"]
    gpus = result["labels"][:-1]
    assert gpus[0] == "cuda:0" and all(label.startswith("cuda:") for label in gpus)
    assert result["labels"][-1].startswith("process RSS")
    assert result["first"][0] == 0  # before CUDA started: no allocator, no bytes
    assert result["steps"] == [0, 1]  # read at the first sample after CUDA started
    current, peak = result["last"][0]
    assert current >= 4 * MIB and peak >= current
    if not result["real"]:
        assert result["last"][:2] == [[4 * MIB, 4 * MIB + 512], [0, 512]]
