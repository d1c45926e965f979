"""What the live memory plot costs a training run, measured in a real kernel.

Run by hand, never by the test suite::

    python benchmarks/monitor_overhead.py [--pairs 15] [--steps 300] [--long 4] [--json]

A fresh Jupyter kernel (jupyter_client) splits the CPU into 4 logical devices
and trains the same MirroredStrategy MLP (about 10 ms a step on 2 cores) for
one epoch of ``--steps`` steps, with and without ``MemoryMonitor()``. The
monitor runs as in a notebook: the rich path, one display handle updated with
PNG frames, redraws on; this script drains those iopub messages like a
frontend would and checks there is one ``display_data`` per monitored run.

Wall-clock noise between identical fits on a shared 2-core machine is around
±10 % and, when other processes compete for the cores, whole fits vary by a
factor of 1.5 or more, so runs come in interleaved pairs (the order
alternates, ABBA, so drift cancels), the figure is the median of the per-pair
ratios, and its spread is printed with it (quartiles and extremes). The
kernel's CPU time (all its threads, ``time.process_time``) over the same
interval is reported as a second ratio: it counts the work the monitor adds
and is far less sensitive to other processes taking the cores. Two unreported
warm-up pairs trace the model and import matplotlib first.

Reported, with the goals from the issue:

* median ratio fit-with-monitor / fit-without (goal <= 1.02), wall clock and
  CPU time, with the spread of the pairs;
* the cost of one memory sample, per sample and per logical device covered
  (on CPU one read of the shared host allocator covers all 4, plus the
  process' RSS at most every 0.5 s; goal <= 5 µs);
* the cost of a redraw: live frames (blits onto the cached background, and
  full redraws), and the final frame, which the notebook path draws when the
  cell ends, after the training (it is fetched from the kernel afterwards);
* the achieved refresh rate, from one longer monitored run: live frames per
  second of training, and the median gap between consecutive frames.

Times are taken inside the kernel from the first callback's ``on_train_begin``
to the last callback's ``on_train_end``: everything the monitor does (its own
begin and end, every sample and frame, the final frame) is inside, while the
set-up and tear-down of Keras' data iterators, which here stall at random for
one to four seconds with or without a monitor, are not. The ratio of whole
``fit()`` calls is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import json, time
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

def timed_fit(monitored, data=None):
    global LAST
    mon = LAST = vgpu_magic.MemoryMonitor() if monitored else None
    begin, end = Stopwatch(), StopwatchEnd()
    start = time.perf_counter()
    model.fit(data or ds, epochs=1, verbose=0, callbacks=[begin, *([mon] if mon else []), end])
    call = time.perf_counter() - start
    out = {{"monitored": monitored, "seconds": end.end - begin.start, "cpu": end.cpu_end - begin.cpu_start, "call": call}}
    if mon is not None:
        view, stats = mon.view, mon.stats
        out.update(
            samples=stats.samples, sample_seconds=stats.sample_seconds, sample_costs=list(stats.costs), devices=stats.devices,
            series=[s.label for s in mon.trace.series], draw_costs=view.draw_costs,
            draw_times=[t - view.draw_times[0] for t in view.draw_times], setup=view.setup_cost,
            kinds=view.draw_kinds, duration=mon.trace.duration, rows=len(mon.trace),
        )
    print(json.dumps(out))

def final_frame():
    # Run in the cell after a monitored fit: its final frame was drawn when
    # that cell ended, after the training.
    view = LAST.view
    print(json.dumps({{"kind": view.draw_kinds[-1], "cost": view.draw_costs[-1], "frames": len(view.draw_costs)}}))
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
        elif kind == "error":
            raise RuntimeError(f"{content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(stdout), shown


def fit(kc, monitored: bool, data: str = "None") -> dict:
    stdout, shown = run_cell(kc, f"timed_fit({monitored}, {data})")
    result = json.loads(stdout.strip().splitlines()[-1])
    result["displays"] = sum(m["type"] == "display_data" for m in shown)
    result["updates"] = sum(m["type"] == "update_display_data" for m in shown)
    result["ids"] = len({m["id"] for m in shown})
    if monitored:
        final = json.loads(run_cell(kc, "final_frame()")[0].strip().splitlines()[-1])
        assert final["kind"] == "final" and final["frames"] == len(result["draw_costs"]) + 1, final
        result["final_cost"] = final["cost"]
    return result


def spread(values: list[float]) -> str:
    """``'quartiles 0.99..1.03, pairs 0.91..1.20'``."""
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"quartiles {q1:.3f}..{q3:.3f}, pairs {min(values):.3f}..{max(values):.3f}"


def median_ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f} ms" if values else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=15, help="interleaved pairs (default 15, at least 9)")
    parser.add_argument("--steps", type=int, default=300, help="steps per fit (default 300, at least 200)")
    parser.add_argument("--long", type=int, default=4, help="epochs of data in the one long run (default 4)")
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
        long = fit(kc, True, f"ds.repeat({args.long})")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    on = [p[1] for p in pairs]
    off = [p[0] for p in pairs]
    ratios = [b["seconds"] / a["seconds"] for a, b in pairs]
    cpu_ratios = [b["cpu"] / a["cpu"] for a, b in pairs]
    call_ratios = [b["call"] / a["call"] for a, b in pairs]
    samples = sum(r["samples"] for r in on + [long])
    per_sample = sum(r["sample_seconds"] for r in on + [long]) / samples
    median_sample = statistics.median(c for r in on + [long] for c in r["sample_costs"])
    devices = on[0]["devices"]
    frames = [(c, k) for r in on + [long] for c, k in zip(r["draw_costs"], r["kinds"])]
    finals = [r["final_cost"] for r in on + [long]]
    share = [sum(r["draw_costs"]) / r["seconds"] for r in on]
    live_times = long["draw_times"]
    gaps = [b - a for a, b in zip(live_times[:-1], live_times[1:])]
    # One display (the placeholder opened at the run start), then one update
    # per live frame and one for the final frame.
    one_handle = all(
        r["displays"] == 1 and r["ids"] == 1 and r["updates"] == len(r["draw_costs"]) + 1 for r in on + [long]
    )
    off_median = statistics.median(r["seconds"] for r in off)

    print(f"monitor overhead in a Jupyter kernel: {args.pairs} interleaved pairs of {args.steps}-step fits, "
          f"MirroredStrategy over {devices} logical CPUs ({on[0]['series'][0]})")
    print(f"  training without      median {off_median:.2f} s ({1000 * off_median / args.steps:.1f} ms/step; "
          "on_train_begin of the first callback to on_train_end of the last)")
    print(f"  training with         median {statistics.median(r['seconds'] for r in on):.2f} s")
    print(f"  ratio with/without    median {statistics.median(ratios):.3f}  (goal <= 1.02; {spread(ratios)})")
    print(f"  CPU time with/without median {statistics.median(cpu_ratios):.3f}  ({spread(cpu_ratios)}; the kernel "
          "process' CPU seconds, all threads: the work the monitor adds)")
    print(f"  whole fit() call      median ratio {statistics.median(call_ratios):.3f} (adds Keras/tf.data set-up "
          "and tear-down, which stall at random for seconds here, monitored or not)")
    print(f"  memory sample         mean {1e6 * per_sample:.1f} µs = {1e6 * per_sample / devices:.2f} µs per logical "
          f"device, median {1e6 * median_sample:.1f} µs = {1e6 * median_sample / devices:.2f} µs per device "
          f"(goal <= 5; one read of the shared host allocator covers all {devices})")
    print(f"  redraw                live frames: blit {median_ms([c for c, k in frames if k == 'blit'])} "
          f"({sum(k == 'blit' for _, k in frames)}), full {median_ms([c for c, k in frames if k == 'full'])} "
          f"({sum(k == 'full' for _, k in frames)}); medians incl. PNG encode and publish")
    print(f"  final frame           {median_ms(finals)}, drawn when the cell ends, after the training")
    print(f"  drawing share         median {100 * statistics.median(share):.2f} % of each paired monitored run, "
          f"{100 * sum(long['draw_costs']) / long['seconds']:.2f} % of the long run (bound: 1 %)")
    print(f"  refresh (long run)    {long['seconds']:.1f} s, {len(live_times)} live frames = "
          f"{len(live_times) / long['seconds']:.2f} per second; median gap "
          + (f"{statistics.median(gaps):.2f} s" if gaps else "—"))
    print(f"  display               one display_data per run, then only updates of that handle: {one_handle}")
    print(f"  took                  {time.perf_counter() - began:.0f} s")
    if args.json:
        print(json.dumps({"pairs": [[a, b] for a, b in pairs], "long": long, "ratios": ratios, "cpu_ratios": cpu_ratios}))


if __name__ == "__main__":
    sys.exit(main())
