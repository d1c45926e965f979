"""What the live memory view costs a training run, measured in a real kernel.

Run by hand, never by the test suite::

    python benchmarks/monitor_overhead.py [--pairs 15] [--steps 300] [--long 4] [--json]

A fresh Jupyter kernel (jupyter_client) splits the CPU into 4 logical devices
and trains the same MirroredStrategy MLP (about 10 ms a step on 2 cores) for
one epoch of ``--steps`` steps, with and without ``MemoryMonitor()``. The
monitor runs as in a notebook: the live widget in one display output, fed the
trace's new rows by comm messages, then the final image in its place; this
script drains those iopub messages like a front end would and checks there is
one ``display_data`` and one ``update_display_data`` per monitored run.

Wall-clock noise between identical fits on a shared 2-core machine is around
±10 % and, when other processes compete for the cores, whole fits vary by a
factor of 1.5 or more, so runs come in interleaved pairs (the order
alternates, ABBA, so drift cancels), the figure is the median of the per-pair
ratios, and its spread is printed with it (quartiles and extremes). The
kernel's CPU time (all its threads, ``time.process_time``) over the same
interval is reported as a second ratio: it counts the work the monitor adds
and is far less sensitive to other processes taking the cores. Two unreported
warm-up pairs trace the model and import matplotlib and the widget first.

Reported, with the goals from the issue:

* median ratio fit-with-monitor / fit-without (goal <= 1.02), wall clock and
  CPU time, with the spread of the pairs;
* the cost of one memory sample, per sample and per logical device covered
  (on CPU one read of the shared host allocator covers all 4, plus the
  process' RSS at most every 0.5 s; goal <= 5 µs);
* the view's kernel cost: each live update (the new rows as one comm
  message, and the traits that changed), per update and as a share of the
  training time (goal <= 0.5 %), and the final image, which the notebook path
  draws when the cell ends, after the training;
* the live updates per second of training (goal >= 4), from one longer
  monitored run, and the median gap between consecutive updates;
* unpaced fits as users write them (``--unpaced`` pairs, with and without the
  monitor, interleaved: numpy arrays, batch 64, ``--epochs`` epochs, Keras'
  own data adapter, so each epoch
  starts with Keras' own stall of its first step): live updates per second
  from the first callback's ``on_train_begin`` to the last one's
  ``on_train_end``, the longest gap between updates, and the monitor's own
  share of the kernel's time (its samples and its updates, the threads' CPU
  time; goal <= 0.5 %), and the median time ratio with/without;
* the kernel cost of one update of the two widget technologies considered,
  measured in the same kernel: setting a bqplot ``Lines``' arrays (every
  point of 5 series, re-sent each time) at 400 and 4000 rows, and one
  anywidget custom message with the new row (skipped where bqplot is not
  installed).

Times are taken inside the kernel from the first callback's ``on_train_begin``
to the last callback's ``on_train_end``: everything the monitor does (its own
begin and end, every sample and frame, the final frame) is inside, while the
set-up and tear-down of Keras' data iterators, which here stall at random for
one to four seconds with or without a monitor, are not. The ratio of whole
``fit()`` calls is printed too.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import itertools, json, time
import numpy as np
%load_ext vgpu_magic
%vgpu_split 4 --quiet
import keras, tensorflow as tf
import vgpu_magic

STEPS, BATCH = {steps}, 256
with vgpu_magic.strategy().scope():
    model = keras.Sequential([
        keras.Input((128,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS * BATCH, 128)).astype("float32")
y = rng.integers(0, 10, STEPS * BATCH)
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache().prefetch(2)

class Stopwatch(keras.callbacks.Callback):
    # First in the list: starts before every other callback's on_train_begin.
    def on_train_begin(self, logs=None):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

class StopwatchEnd(keras.callbacks.Callback):
    # Last in the list: stops after every other callback's on_train_end.
    def on_train_end(self, logs=None):
        self.end, self.cpu_end = time.perf_counter(), time.process_time()

LAST = None

# What the monitor's parts cost, measured here (the package keeps no figures for a benchmark): each call's
# thread CPU seconds, and when each live update started.
from vgpu_magic.monitor.live import LiveMemoryView
from vgpu_magic.monitor.sampler import DeviceSampler
COSTS = {{"update": [], "update_at": [], "final": [], "sample": []}}

def measure(cls, name, key, clock=time.thread_time):
    original = getattr(cls, name)

    def measured(self, *args):
        begin, start = clock(), time.perf_counter()
        try:
            return original(self, *args)
        finally:
            COSTS[key].append(clock() - begin)
            if key == "update":
                COSTS["update_at"].append(start)

    setattr(cls, name, measured)

measure(LiveMemoryView, "_update", "update")
measure(LiveMemoryView, "_final", "final", clock=time.perf_counter)  # drawn at the cell's end: its wall time
measure(DeviceSampler, "read", "sample")

def reset_costs():
    for costs in COSTS.values():
        costs.clear()

def timed_fit(monitored, data=None):
    global LAST
    reset_costs()
    mon = LAST = vgpu_magic.MemoryMonitor() if monitored else None
    begin, end = Stopwatch(), StopwatchEnd()
    start = time.perf_counter()
    model.fit(data or ds, epochs=1, verbose=0, callbacks=[begin, *([mon] if mon else []), end])
    call = time.perf_counter() - start
    seconds, cpu = end.end - begin.start, end.cpu_end - begin.cpu_start
    out = {{"monitored": monitored, "seconds": seconds, "cpu": cpu, "call": call}}
    if mon is not None:
        series, times = mon.trace.series, COSTS["update_at"]
        out.update(
            samples=len(COSTS["sample"]), sample_seconds=sum(COSTS["sample"]), sample_costs=list(COSTS["sample"]),
            devices=sum(len(s.devices) for s in series), series=[s.label for s in series],
            update_costs=list(COSTS["update"]), update_times=[t - times[0] for t in times],
            duration=mon.trace.duration, rows=len(mon.trace),
        )
    print(json.dumps(out))

XS = rng.normal(size=(150 * 64, 128)).astype("float32")
YS = rng.integers(0, 10, 150 * 64)

def unpaced_fit(epochs, monitored=True):
    # As users write it: arrays, batch 64, several epochs; nothing slows the steps down.
    global LAST
    reset_costs()
    mon = LAST = vgpu_magic.MemoryMonitor() if monitored else None
    begin, end = Stopwatch(), StopwatchEnd()
    model.fit(XS, YS, batch_size=64, epochs=epochs, verbose=0, callbacks=[begin, *([mon] if mon else []), end])
    if mon is None:
        print(json.dumps({{"seconds": end.end - begin.start}}))
        return
    times = COSTS["update_at"]
    print(json.dumps({{
        "seconds": end.end - begin.start, "updates": len(times), "update_seconds": sum(COSTS["update"]),
        "sample_seconds": sum(COSTS["sample"]), "samples": len(COSTS["sample"]),
        "longest_gap": max((b - a for a, b in itertools.pairwise(times)), default=0.0),
    }}))

def final_image():
    # Run in the cell after a monitored fit: its final image was drawn when
    # that cell ended, after the training.
    print(json.dumps({{"cost": COSTS["final"][-1], "closed": LAST.view.widget.comm is None}}))

def widget_costs():
    # One update of each widget technology, in this kernel, shown but not drawn (no front end here).
    from IPython.display import display
    import bqplot as bq
    from vgpu_magic.monitor.live import memory_widget
    out = {{}}
    t, values = np.arange(4000.0), np.random.default_rng(0).random((5, 4000))
    for rows in (400, 4000):
        scale = bq.LinearScale()
        lines = bq.Lines(x=t[:1], y=values[:, :1], scales={{"x": scale, "y": bq.LinearScale()}})
        display(bq.Figure(marks=[lines], axes=[bq.Axis(scale=scale)]))
        costs = []
        for n in range(rows - 100, rows):
            begin = time.perf_counter()
            with lines.hold_sync():
                lines.x, lines.y = t[:n], values[:, :n]
            costs.append(time.perf_counter() - begin)
        out[f"bqplot, {{rows}} rows"] = float(np.median(costs))
    widget = memory_widget(series=[], units={{}}, title="", note="")
    display(widget)
    costs = []
    for n in range(100):
        begin = time.perf_counter()
        widget.send({{"rows": [[float(t[n]), *(int(v * 1e9) for v in values[:, n])]], "reset": False}})
        costs.append(time.perf_counter() - begin)
    out["anywidget, the new row"] = float(np.median(costs))
    widget.close()
    print(json.dumps(out))
"""


def run_cell(kc, code: str, timeout: float = 600) -> tuple[str, list[dict]]:
    """Execute ``code``; return its stdout and its display messages."""
    msg_id = kc.execute(code)
    stdout, shown = [], []
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1.0, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            stdout.append(content["text"])
        elif kind in ("display_data", "update_display_data"):
            shown.append({"type": kind, "id": content.get("transient", {}).get("display_id")})
        elif kind == "comm_msg" and content["data"].get("method") == "custom":
            shown.append({"type": "custom", "id": None})
        elif kind == "error":
            raise RuntimeError(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(stdout), shown


def fit(kc, monitored: bool, data: str = "None") -> dict:
    stdout, shown = run_cell(kc, f"timed_fit({monitored}, {data})")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["displays"] = sum(m["type"] == "display_data" for m in shown)
    result["updates"] = sum(m["type"] == "update_display_data" for m in shown)
    result["messages"] = sum(m["type"] == "custom" for m in shown)
    result["ids"] = len({m["id"] for m in shown if m["type"] != "custom"})
    if monitored:
        final = json.loads(run_cell(kc, "final_image()")[0].strip().splitlines()[-1])
        assert final["closed"], final
        result["final_cost"] = final["cost"]
    return result


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values``: the order statistics
    ``k`` and ``n + 1 - k`` with the largest ``k`` for which the binomial tails
    leave at least ``confidence`` between them."""
    n, ordered = len(values), sorted(values)
    tail = (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n // 2 and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    return (ordered[k - 1], ordered[n - k]) if k else (ordered[0], ordered[-1])


def spread(values: list[float]) -> str:
    """``'95 % interval of the median 0.98..1.05, quartiles 0.99..1.03, pairs 0.91..1.20'``."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    low, high = median_interval(values)
    return (
        f"95 % interval of the median {low:.3f}..{high:.3f}, quartiles {q1:.3f}..{q3:.3f}, "
        f"pairs {min(values):.3f}..{max(values):.3f}"
    )


def median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f} ms" if values else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=15, help="interleaved pairs (default 15, at least 9)")
    parser.add_argument("--steps", type=int, default=300, help="steps per fit (default 300, at least 200)")
    parser.add_argument("--long", type=int, default=4, help="epochs of data in the one long run (default 4)")
    parser.add_argument("--unpaced", type=int, default=4, help="pairs of unpaced multi-epoch fits (default 4)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each unpaced fit (default 4)")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    args = parser.parse_args()
    if args.pairs < 9 or args.steps < 200:
        parser.error("use --pairs >= 9 and --steps >= 200")

    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT)}
    env.pop("VGPU_MAGIC_SPLIT", None)
    env.pop("MPLBACKEND", None)
    began = time.perf_counter()
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    try:
        run_cell(kc, SETUP.format(steps=args.steps))
        for _ in range(2):  # warm-up: tracing, matplotlib import, the figure, the allocators
            fit(kc, False)
            fit(kc, True)
        pairs = []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            runs = {monitored: fit(kc, monitored) for monitored in order}
            pairs.append((runs[False], runs[True]))
            # Progress, so a slow machine shows where it is.
            print(f"pair {i + 1}/{args.pairs}: {runs[True]['seconds'] / runs[False]['seconds']:.3f}", flush=True)
        long = fit(kc, True, f"ds.repeat({args.long})")
        unpaced, unpaced_off = [], []
        for i in range(args.unpaced):  # interleaved with unmonitored ones, the order alternating
            for monitored in (True, False) if i % 2 == 0 else (False, True):
                out = run_cell(kc, f"unpaced_fit({args.epochs}, {monitored})")[0].strip().splitlines()[-1]
                (unpaced if monitored else unpaced_off).append(json.loads(out))
                if monitored:
                    run_cell(kc, "final_image()")
        widgets = None
        if importlib.util.find_spec("bqplot") is not None:
            widgets = json.loads(run_cell(kc, "widget_costs()")[0].strip().splitlines()[-1])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    on = [p[1] for p in pairs]
    off = [p[0] for p in pairs]
    ratios = [b["seconds"] / a["seconds"] for a, b in pairs]
    cpu_ratios = [b["cpu"] / a["cpu"] for a, b in pairs]
    call_ratios = [b["call"] / a["call"] for a, b in pairs]
    monitored_runs = [*on, long]
    samples = sum(r["samples"] for r in monitored_runs)
    per_sample = sum(r["sample_seconds"] for r in monitored_runs) / samples
    median_sample = statistics.median(c for r in monitored_runs for c in r["sample_costs"])
    devices = on[0]["devices"]
    updates = [c for r in monitored_runs for c in r["update_costs"]]
    finals = [r["final_cost"] for r in monitored_runs]
    share = [sum(r["update_costs"]) / r["seconds"] for r in on]
    # Everything the monitor does in the kernel during a run: its samples and its view's updates.
    own = [(r["sample_seconds"] + sum(r["update_costs"])) / r["seconds"] for r in on]
    live_times = long["update_times"]
    gaps = [b - a for a, b in itertools.pairwise(live_times)]
    # One display (the widget, opened at the run start), one update (the final image in its place); the live
    # updates are comm messages, one per update that had new rows.
    one_output = all(
        r["displays"] == 1 and r["updates"] == 1 and r["ids"] == 1 and 0 < r["messages"] <= len(r["update_costs"])
        for r in monitored_runs
    )
    off_median = statistics.median(r["seconds"] for r in off)

    print(
        f"monitor overhead in a Jupyter kernel: {args.pairs} interleaved pairs of {args.steps}-step fits, "
        f"MirroredStrategy over 4 logical CPUs; series: {', '.join(on[0]['series'])}"
    )
    print(
        f"  training without      median {off_median:.2f} s ({1000 * off_median / args.steps:.1f} ms/step; "
        "on_train_begin of the first callback to on_train_end of the last)"
    )
    print(f"  training with         median {statistics.median(r['seconds'] for r in on):.2f} s")
    print(f"  ratio with/without    median {statistics.median(ratios):.3f}  (goal <= 1.02; {spread(ratios)})")
    print(
        f"  CPU time with/without median {statistics.median(cpu_ratios):.3f}  ({spread(cpu_ratios)}; the kernel "
        "process' CPU seconds, all threads: the work the monitor adds)"
    )
    print(
        f"  whole fit() call      median ratio {statistics.median(call_ratios):.3f} (adds Keras/tf.data set-up "
        "and tear-down, which stall at random for seconds here, monitored or not)"
    )
    print(
        f"  memory sample         mean {1e6 * per_sample:.1f} µs, median {1e6 * median_sample:.1f} µs "
        f"(all series, {devices} logical devices covered)"
    )
    print(
        f"  live update           median {1000 * statistics.median(updates):.3f} ms of the kernel's time "
        f"({len(updates)} updates: the new rows as one comm message, and the traits that changed)"
    )
    print(
        f"  view's kernel share   median {100 * statistics.median(share):.3f} % of each paired monitored run, "
        f"{100 * sum(long['update_costs']) / long['seconds']:.3f} % of the long run (goal <= 0.5 %)"
    )
    median_gap = f"{statistics.median(gaps):.2f} s" if gaps else "—"
    print(
        f"  monitor's own share   median {100 * statistics.median(own):.3f} % of each paired monitored run "
        "(its samples and live updates: the ratio a run free of noise would show is 1 + this)"
    )
    print(
        f"  updates per second    {len(live_times) / long['seconds']:.2f} in the long run "
        f"({long['seconds']:.1f} s, {len(live_times)} updates; goal >= 4); median gap {median_gap}"
    )
    if unpaced:
        rates = [r["updates"] / r["seconds"] for r in unpaced]
        shares = [(r["sample_seconds"] + r["update_seconds"]) / r["seconds"] for r in unpaced]
        ratios_unpaced = [a["seconds"] / b["seconds"] for a, b in zip(unpaced, unpaced_off)]
        print(
            f"  unpaced fits          {len(unpaced)} of {args.epochs} epochs (arrays, batch 64, median "
            f"{statistics.median(r['seconds'] for r in unpaced):.1f} s): updates per second median "
            f"{statistics.median(rates):.2f} (min {min(rates):.2f}; goal >= 4), longest gap "
            f"{max(r['longest_gap'] for r in unpaced):.2f} s, monitor's own share median "
            f"{100 * statistics.median(shares):.3f} % (max {100 * max(shares):.3f} %; goal <= 0.5 %); "
            f"time with/without median {statistics.median(ratios_unpaced):.3f} "
            f"(pairs {min(ratios_unpaced):.3f}..{max(ratios_unpaced):.3f})"
        )
    print(f"  final image           {median_ms(finals)}, drawn when the cell ends, after the training")
    print(f"  display               one output per run, the widget then the final image in its place: {one_output}")
    if widgets:
        print("  one update, by widget " + "; ".join(f"{k}: {1000 * v:.3f} ms" for k, v in widgets.items()))
    print(f"  took                  {time.perf_counter() - began:.0f} s")
    if args.json:
        report = {
            "pairs": [[a, b] for a, b in pairs],
            "long": long,
            "ratios": ratios,
            "cpu_ratios": cpu_ratios,
            "unpaced": unpaced,
        }
        print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
