"""The memory trace as data: equality, a sample recorded whole or not at all
(an interrupt can land anywhere), bounded memory with exact peaks, and the
recorder's interval applied to ``sample()``. No framework, no display."""

from __future__ import annotations

import io
import re

import pytest

from vgpu_magic.monitor.recorder import MemoryRecorder
from vgpu_magic.monitor.sampler import DeviceSampler, build_series
from vgpu_magic.monitor.session import MonitorSession
from vgpu_magic.monitor.trace import MemoryTrace

MIB = 1024 * 1024
CPUS = [f"/device:CPU:{i}" for i in range(2)]


def two_series_trace(recent: int = 8192) -> MemoryTrace:
    return MemoryTrace(build_series(CPUS, process=True), kind="custom", recent=recent)


def filled(values: list[int]) -> MemoryTrace:
    trace = two_series_trace()
    for k, v in enumerate(values):
        trace.append(k * 0.1, k, 0, "custom", [(v, v), (10 * MIB, 10 * MIB)])
    return trace


def test_traces_with_different_samples_are_not_equal_and_equal_ones_are():
    a, b, c = filled([1, 2, 3]), filled([1, 2, 4]), filled([1, 2, 3])
    assert a != b  # same series, kind and length: only a sample differs
    assert a == c and a is not c
    assert filled([1, 2]) != a
    with pytest.raises(TypeError):
        hash(a)


class InterruptingInt:
    """A reading whose conversion is interrupted, as a KeyboardInterrupt
    landing inside ``append`` would be."""

    def __int__(self) -> int:
        raise KeyboardInterrupt


def test_an_interrupted_append_records_nothing_and_the_trace_stays_readable(tmp_path):
    trace = filled([5, 6])
    with pytest.raises(KeyboardInterrupt):
        trace.append(0.3, 2, 0, "custom", [(7, InterruptingInt()), (1, 1)])
    assert len(trace) == 2
    lines = (tmp_path / "t.csv").read_text().splitlines() if trace.to_csv(tmp_path / "t.csv") else []
    assert len(lines) == 1 + 2 * 2
    assert len(trace.to_records()) == 4
    trace.append(0.3, 2, 0, "custom", [(7, 7), (1, 1)])
    assert list(trace.current[0]) == [5, 6, 7] and list(trace.step) == [0, 1, 2]


def test_a_row_half_written_when_interrupted_is_never_counted_and_is_replaced():
    # Where the interrupt lands after some columns were appended: the row was
    # not committed, readers do not see it, the next append overwrites it.
    trace = filled([5, 6])
    cols = trace._cols
    cols.time.append(9.9)
    cols.step.append(99)
    assert len(trace) == 2 and list(trace.time) == [0.0, 0.1]
    assert [r.step for r in trace.rows()] == [0, 0, 1, 1]
    trace.append(0.2, 2, 0, "custom", [(7, 7), (1, 1)])
    assert list(trace.time) == [0.0, 0.1, 0.2] and list(trace.step) == [0, 1, 2]


def test_memory_is_bounded_recent_samples_stay_whole_and_older_ones_keep_their_extremes():
    recent = 64
    trace = two_series_trace(recent=recent)
    n = 20_000
    for k in range(n):
        value = 1000 + (k % 10)
        if k == 5_000:
            value = 10**9  # one spike long ago
        if k == 7_000:
            value = 3  # one dip long ago
        trace.append(k * 0.01, k, k // 1000, "custom", [(value, max(value, 1009)), (k, k)])
    assert len(trace) <= 3 * recent
    assert trace.decimated > 1
    # Exact run peak and the spike and dip are still in the picture.
    assert trace.run_peak(0) == 10**9 and max(trace.current[0]) == 10**9
    assert min(trace.current[0]) == 3
    assert trace.run_peak(1) == n - 1
    # The latest samples are at full resolution, times never go back, the run is covered.
    assert list(trace.step)[-recent:] == list(range(n - recent, n))
    times = list(trace.time)
    assert times == sorted(times) and times[0] == 0.0 and times[-1] == pytest.approx((n - 1) * 0.01)
    assert len(list(trace.rows())) == 2 * len(trace)


class FakeClock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_sample_respects_the_interval():
    clock = FakeClock()
    calls = []

    def reader(names):
        calls.append(names)
        return [(1, 2)]

    recorder = MemoryRecorder(
        lambda: DeviceSampler(build_series(CPUS), reader),
        None,
        interval=0.05,
        clock=clock,
    )
    recorder.start("custom")
    for step in range(1000):  # a custom loop calling sample() at every 1 ms step
        clock.now += 0.001
        recorder.sample(step=step)
    recorder.end_epoch(0)  # epoch ends and the run's end always sample
    trace = recorder.finish()
    # baseline read, the start, one every 50 ms, the epoch end and the end
    assert 1 + 1 + 19 + 2 <= len(calls) <= 1 + 1 + 21 + 2
    assert len(trace) == len(calls) - 1
    assert trace.step[-1] == 999


def test_interval_takes_any_real_number_but_not_bools_infinities_or_huge_values():
    np = pytest.importorskip("numpy")
    for good in (np.float32(0.25), np.int64(2), 0.001):
        assert MonitorSession(interval=good, display="none")._recorder.interval == pytest.approx(float(good))
    for bad, words in [
        (True, "interval=True is not a number of seconds; use e.g. interval=0.05"),
        ("0.1", "interval='0.1' is not a number of seconds"),
        (float("inf"), "interval=inf is out of range; use 0.001 to 3600 seconds"),
        (1e308, "is out of range"),
        (float("nan"), "is out of range"),
        (0, "interval=0 is out of range"),
        (-1, "is out of range"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            MonitorSession(interval=bad)


def test_text_summary_of_an_allocator_that_reports_nothing_says_so():
    from vgpu_magic.monitor.views import TextSummaryView

    trace = MemoryTrace(build_series(CPUS, process=True), kind="fit")
    for k in range(3):
        trace.append(k * 0.1, k, 0, "fit", [(0, 0), (300 * MIB, 310 * MIB)])
    trace.duration = 0.3
    out = io.StringIO()
    TextSummaryView(out).finish(trace)
    line = out.getvalue()
    assert "host allocator (shared by 2 logical CPUs): nothing allocated" in line
    assert "process RSS (all memory of this Python process): now 300.0 MiB, peak 310.0 MiB" in line


def test_three_or_more_alike_in_a_row_read_as_one():
    from vgpu_magic.units import joined_alike

    parts = [("CPU:0", "1020 B"), *[(f"CPU:{i}", "988 B") for i in range(1, 8)], ("RSS", "988 B")]
    assert joined_alike(parts, ": ") == ["CPU:0: 1020 B", "CPU:1…RSS, each: 988 B"]
    # Only within a group (a panel): the process' RSS is not one of the devices.
    grouped = [(*part, "process" if part[0] == "RSS" else "device") for part in parts]
    assert joined_alike(grouped, ": ") == ["CPU:0: 1020 B", "CPU:1…CPU:7, each: 988 B", "RSS: 988 B"]
    assert joined_alike(parts[:3], " ") == ["CPU:0 1020 B", "CPU:1 988 B", "CPU:2 988 B"]  # two alike stay two
    assert joined_alike([], ": ") == []
