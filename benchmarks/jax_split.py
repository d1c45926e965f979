"""What vgpu_magic costs a JAX notebook: the split, a memory sample, a monitored fit.

Run by hand (``make bench``), never by the test suite::

    python benchmarks/jax_split.py [--repeats 5] [--pairs 9]

(a) ``%vgpu_split 8 --framework jax`` in fresh interpreters: after ``import jax``
    (the split alone) and before it (JAX's import included), against
    ``import jax`` alone. Medians of ``--repeats`` fresh processes.
(b) One memory sample of 8 JAX CPU devices (the monitor's reader: the bytes of
    the live arrays' shards on each device) as the number of live arrays grows,
    per sample and per device; the first read of new arrays and later reads
    of the same arrays separately.
(c) Keras 3 ``fit`` on the JAX backend with ``DataParallel`` over 8 devices, with
    and without ``vgpu_magic.MemoryMonitor()`` and its live plot, in a real
    Jupyter kernel: ``--pairs`` interleaved pairs (the order alternates, so
    drift cancels), reported as the median of the per-pair ratios (goal <= 1.02).
    Both arms wait for each step's logs (see ``StepClock``).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time

from fresh_shell import LOADED, ROOT, run_fresh

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax"}
ENV.pop("VGPU_MAGIC_SPLIT", None)

IMPORT_THEN_SPLIT = (
    LOADED
    + """
import_ms = timed(__import__, "jax")
split_ms = timed(shell.run_line_magic, "vgpu_split", "8 --framework jax")
import jax
assert len(jax.devices()) == 8
print(json.dumps({"import_ms": import_ms, "split_ms": split_ms}))
"""
)

SPLIT_WITH_IMPORT = (
    LOADED
    + """
assert "jax" not in sys.modules
split_ms = timed(shell.run_line_magic, "vgpu_split", "8 --framework jax")
import jax
assert len(jax.devices()) == 8
print(json.dumps({"split_with_import_ms": split_ms}))
"""
)

SAMPLE_COST = """
import json, time
import numpy as np
import vgpu_magic
from vgpu_magic.frameworks.jax.memory import MemoryReader

vgpu_magic.split(8, framework="jax")
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = vgpu_magic.mesh()
names = [f"CPU:{i}" for i in range(8)]
rows = []
keep = []
for total in (10, 100, 1000, 10000):
    # Half single-device arrays, half sharded over the 8 devices, as in a data-parallel step.
    while len(keep) < total:
        i = len(keep)
        if i % 2:
            keep.append(jax.device_put(np.full((8, 4), i, np.float32), NamedSharding(mesh, P("data"))))
        else:
            keep.append(jnp.full((4,), i, np.float32))
    jax.block_until_ready(keep)
    read = MemoryReader(jax)  # counts on every call (the monitor's reader also keeps to a time budget)
    start = time.perf_counter()
    read(names)
    first = time.perf_counter() - start
    reps = max(5, 20000 // total)
    start = time.perf_counter()
    for _ in range(reps):
        read(names)
    again = (time.perf_counter() - start) / reps
    rows.append({"arrays": len(jax.live_arrays("cpu")), "first_us": first * 1e6, "again_us": again * 1e6})
print(json.dumps(rows))
"""


def fresh(code: str) -> dict:
    return run_fresh(code, ENV)


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.1f} ms (min {min(values):.1f}, max {max(values):.1f})"


def split_cost(repeats: int) -> None:
    fresh(IMPORT_THEN_SPLIT)  # warm the OS file cache, unreported
    after = [fresh(IMPORT_THEN_SPLIT) for _ in range(repeats)]
    before = [fresh(SPLIT_WITH_IMPORT)["split_with_import_ms"] for _ in range(repeats)]
    imports = [r["import_ms"] for r in after]
    splits = [r["split_ms"] for r in after]
    print(f"(a) split cost, {repeats} fresh interpreters each")
    print(f"  import jax                        {spread(imports)}")
    print(
        f"  %vgpu_split 8 after import jax    {spread(splits)}  "
        f"= {100 * statistics.median(splits) / statistics.median(imports):.1f} % of the import"
    )
    print(
        f"  %vgpu_split 8 before import jax   {spread(before)}  (imports JAX itself) "
        f"= {statistics.median(before) / statistics.median(imports):.2f} x the import"
    )


def sample_cost() -> None:
    rows = fresh(SAMPLE_COST)
    print("(b) one memory sample of 8 JAX CPU devices (bytes of live arrays' shards)")
    for row in rows:
        print(
            f"  {row['arrays']:>6} live arrays: first read {row['first_us']:9.1f} µs, later reads "
            f"{row['again_us']:8.1f} µs = {row['again_us'] / 8:7.1f} µs per device, "
            f"{row['again_us'] / row['arrays']:.2f} µs per array"
        )


FIT_SETUP = """
import os, time
os.environ["KERAS_BACKEND"] = "jax"
%load_ext vgpu_magic
%vgpu_split 8 --framework jax
import numpy as np, keras, vgpu_magic
keras.distribution.set_distribution(vgpu_magic.distribution())
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(256, activation="relu"),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(4)])
model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x = rng.normal(size=({steps} * 64, 32)).astype("float32")
y = rng.integers(0, 4, len(x))


# Times the fit. Its (empty) batch-end hook makes Keras wait for every step's logs: with
# hundreds of multi-device steps queued ahead, XLA:CPU on a small machine can stall in an
# all-reduce and abort the process (docs/split.md, Limits).
class StepClock(keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        pass

    def on_train_end(self, logs=None):
        self.seconds = time.perf_counter() - self.start


model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[StepClock()])  # compile outside the timing


def timed_fit(monitored):
    clock = StepClock()
    callbacks = [clock] + ([vgpu_magic.MemoryMonitor()] if monitored else [])
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=callbacks)
    return clock.seconds
"""


def fit_overhead(pairs: int, steps: int) -> None:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env=ENV, cwd=str(ROOT))
    try:

        def run(code: str) -> str:
            msg_id = kc.execute(code)
            text = []
            while True:
                try:
                    msg = kc.get_iopub_msg(timeout=5)
                except queue.Empty:
                    if not km.is_alive():
                        raise SystemExit("the benchmark kernel died") from None
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                    text.append(msg["content"]["text"])
                if msg["msg_type"] == "error":
                    raise SystemExit("kernel error: " + "\n".join(msg["content"]["traceback"]))
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    return "".join(text)

        run(FIT_SETUP.format(steps=steps))
        run("timed_fit(True); timed_fit(False)")  # warm-up pair, unreported
        ratios, off, on = [], [], []
        for i in range(pairs):
            order = (True, False) if i % 2 else (False, True)
            seconds = {}
            for monitored in order:
                seconds[monitored] = float(run(f"print(timed_fit({monitored}))").strip())
            off.append(seconds[False])
            on.append(seconds[True])
            ratios.append(seconds[True] / seconds[False])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    print(
        f"(c) Keras 3 fit on JAX, DataParallel over 8 devices, {steps} steps of 64, in a Jupyter kernel, "
        f"{pairs} interleaved pairs"
    )
    print(
        f"  without the monitor   median {statistics.median(off):.3f} s "
        f"({1000 * statistics.median(off) / steps:.2f} ms/step)"
    )
    print(f"  with the live plot    median {statistics.median(on):.3f} s")
    print(
        f"  ratio with/without    median {statistics.median(ratios):.3f}  (goal <= 1.02; "
        f"pairs {min(ratios):.3f}..{max(ratios):.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh interpreters per split figure (default 5)")
    parser.add_argument("--pairs", type=int, default=9, help="interleaved fit pairs (default 9)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per fit (default 300)")
    parser.add_argument("--only", choices=("split", "sample", "fit"), help="run one part only")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.only in (None, "split"):
        split_cost(args.repeats)
    if args.only in (None, "sample"):
        sample_cost()
    if args.only in (None, "fit"):
        fit_overhead(args.pairs, args.steps)
    print(f"(whole benchmark: {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
