"""The memory monitor with real TensorFlow and Keras: CPU splits in fresh
interpreters (TensorFlow's device configuration is process-global).

Covers ``fit`` (with validation), ``evaluate`` and ``predict`` with and without
a strategy scope, a ``strategy.run`` loop, the text summary of a script, a
plotting error, ``KeyboardInterrupt``, and ``%vgpu_monitor on/off`` restoring
``keras.Model`` exactly.
"""

from __future__ import annotations

import pytest

from support import last_json, run_python

pytestmark = pytest.mark.slow

SETUP = """
import contextlib, io, json, sys
import numpy as np
import vgpu_magic
from vgpu_magic.frameworks import get as _framework
tf_runtime_started = _framework("tensorflow").runtime_started

vgpu_magic.split({count}, cpu=True)
import keras
import tensorflow as tf

def build():
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 16)).astype("float32")
y = rng.integers(0, 4, 256)

def per_replica_bytes(model):
    # From Keras' own shapes and dtypes, not from the per-device components.
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.variables + model.optimizer.variables)
"""

FIT_EVALUATE_PREDICT = (
    SETUP
    + """
mon = vgpu_magic.MemoryMonitor(display="text")
started_after_construction = tf_runtime_started()
if {scope}:
    with vgpu_magic.strategy().scope():
        model = build()
else:
    model = build()
out = io.StringIO()
with contextlib.redirect_stdout(out):
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, validation_split=0.25, callbacks=[mon])
    model.evaluate(x, y, batch_size=32, verbose=0, callbacks=[mon])
    model.predict(x, batch_size=32, verbose=0, callbacks=[mon])
fit = mon.traces[0]
csv_path = mon.traces[-1].to_csv("{tmp}/predict.csv")
fit_csv = fit.to_csv("{tmp}/fit.csv")
mon.savefig("{tmp}/predict.png")
print(json.dumps({{
    "started_after_construction": started_after_construction,
    "kinds": [t.kind for t in mon.traces],
    "series": [[s.key, s.label, list(s.devices), s.cap] for s in fit.series],
    "samples": [len(t) for t in mon.traces],
    "rows": [len(list(t.rows())) for t in mon.traces],
    "devices_in_rows": sorted({{r.device for r in fit.rows()}}),
    "rss": fit.latest(1)[0],
    "phases": sorted({{fit.phase(i) for i in range(len(fit))}}),
    "epochs": [e for _, e in fit.epoch_starts],
    "steps": [fit.step[0], fit.step[-1]],
    "monotone_time": all(a <= b for a, b in zip(fit.time, fit.time[1:])),
    "variable_bytes": fit.variable_bytes,
    "per_replica": per_replica_bytes(model),
    "finished": [t.finished and not t.interrupted for t in mon.traces],
    "stdout": out.getvalue().splitlines(),
}}))
"""
)


# Under the strategy's scope and without it, on two split counts: a third run (4 under the scope) took no other
# path through the monitor or the split.
@pytest.mark.parametrize(("count", "scope"), [(2, True), (4, False)], ids=["2-scope", "4-no-scope"])
def test_fit_evaluate_predict_under_a_cpu_split(count, scope, tmp_path):
    result = last_json(run_python(FIT_EVALUATE_PREDICT.format(count=count, scope=scope, tmp=tmp_path)).stdout)
    devices = [f"/device:CPU:{i}" for i in range(count)]

    assert result["started_after_construction"] is False
    assert result["kinds"] == ["fit", "evaluate", "predict"]
    # One series for the one host allocator, never N identical lines, and the
    # process' RSS, which is never empty.
    assert result["series"] == [
        ["host", f"host allocator (shared by {count} logical CPUs)", devices, None],
        ["process", "process RSS (all memory of this Python process)", [], None],
    ]
    assert result["rows"] == [2 * n for n in result["samples"]] and min(result["samples"]) >= 2
    assert result["devices_in_rows"] == ["host", "process"]
    assert result["rss"] > 50 * 1024 * 1024
    assert result["phases"] == ["fit", "validate"]
    assert result["epochs"] == [0, 1]
    assert result["steps"] == [0, 2 * 12 - 1]  # 192 training rows / 16 per batch, two epochs
    assert result["monotone_time"] and all(result["finished"])
    # Each replica's own copy of the variables, exactly; without a strategy they all live on CPU:0.
    if scope:
        assert result["variable_bytes"] == dict.fromkeys(devices, result["per_replica"])
    else:
        assert result["variable_bytes"] == {d: result["per_replica"] if d.endswith(":0") else 0 for d in devices}

    lines = result["stdout"]
    assert [line.split(" · ")[1] for line in lines[:2]] == ["epoch 1/2", "epoch 2/2"]
    assert all(f"host allocator (shared by {count} logical CPUs): " in line for line in lines)
    assert all("process RSS (all memory of this Python process): now " in line for line in lines)
    ends = [line.split(" · ")[1].split(" in ")[0] for line in lines[2:]]
    assert ends == ["fit done", "evaluate done", "predict done"]
    assert len(lines) == 5

    csv_lines = (tmp_path / "predict.csv").read_text().splitlines()
    assert csv_lines[0] == "time,step,epoch,phase,device,current,peak"
    assert len(csv_lines) == 1 + 2 * result["samples"][2]
    assert len((tmp_path / "fit.csv").read_text().splitlines()) == 1 + 2 * result["samples"][0]

    from PIL import Image

    data = (tmp_path / "predict.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    with Image.open(tmp_path / "predict.png") as image:
        assert image.size[0] >= 800 and image.size[1] >= 300


CUSTOM_LOOP = """
strategy = vgpu_magic.strategy()
with strategy.scope():
    model = build()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    model.optimizer.build(model.trainable_variables)
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))

@tf.function
def train_step(batch):
    def step(features, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(features, training=True)) / 32.0
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return strategy.run(step, args=batch)

out = io.StringIO()
with contextlib.redirect_stdout(out):
    with vgpu_magic.MemoryMonitor(model=model, display="text", interval=0.05) as mon:
        for epoch in range(2):
            mon.begin_epoch(epoch)
            for step, batch in enumerate(dataset):
                train_step(batch)
                mon.sample(step=epoch * 8 + step)
            mon.end_epoch(epoch)
trace = mon.trace

# sample() at every step of a fast loop reads memory at most every interval,
# and the monitor keeps only its latest runs.
quick = vgpu_magic.MemoryMonitor(display="none", interval=np.float32(60))  # numpy numbers are numbers
for run in range(12):
    with quick:
        for step in range(2000):
            quick.sample(step=step)
print(json.dumps({
    "quick_samples": [len(t) for t in quick.traces],
    "quick_steps": quick.trace.step[-1],
    "kind": trace.kind, "samples": len(trace), "steps": list(trace.step),
    "epochs": [e for _, e in trace.epoch_starts], "variable_bytes": trace.variable_bytes,
    "per_replica": per_replica_bytes(model), "finished": trace.finished, "active": mon.active,
    "lines": len(out.getvalue().splitlines()),
}))
"""


def test_custom_strategy_run_loop_is_sampled_by_hand():
    result = last_json(run_python(SETUP.format(count=2) + CUSTOM_LOOP).stdout)
    assert result["kind"] == "custom" and result["finished"] and not result["active"]
    # The start, each epoch's end and the end at least, and what the monitor's thread took meanwhile
    # (how many depends on the machine's speed): at the steps the loop said, in order.
    steps = result["steps"]
    assert result["samples"] == len(steps) >= 1 + 2 + 1
    assert steps == sorted(steps) and set(steps) <= set(range(16)) and steps[-1] == 15
    assert result["epochs"] == [0, 1]
    assert result["variable_bytes"] == {"/device:CPU:0": result["per_replica"], "/device:CPU:1": result["per_replica"]}
    assert result["lines"] == 3  # two epoch lines and the final one
    # 2000 sample() calls within a 60 s interval: the run's first and last
    # samples only (sample() only says the step), and 10 runs kept of 12.
    assert result["quick_samples"] == [2] * 10
    assert result["quick_steps"] == 1999


NO_RUNTIME = """
import json
import vgpu_magic
from vgpu_magic.frameworks import get as _framework
tf_runtime_started = _framework("tensorflow").runtime_started

mon = vgpu_magic.MemoryMonitor()
with mon:
    mon.sample(step=0)
after_with = tf_runtime_started()
result = vgpu_magic.split(2, cpu=True)
print(json.dumps({"after_with": after_with, "series": [s.key for s in mon.trace.series], "samples": len(mon.trace) >= 2,
                  "split": result.status}))
"""


def test_monitor_never_starts_the_runtime_itself():
    # Before the runtime runs, a run records the process' memory alone, at its start and its end at least.
    assert last_json(run_python(NO_RUNTIME).stdout) == {
        "after_with": False,
        "series": ["process"],
        "samples": True,
        "split": "applied",
    }


JAX_LOOP = """
import json, os, sys
import vgpu_magic
%s
import jax, jax.numpy as jnp
x = jnp.ones((256, 256))
with vgpu_magic.MemoryMonitor() as mon:
    for step in range(5):
        x = (x @ x) / 256
        mon.sample(step=step)
quick = vgpu_magic.MemoryMonitor()
with quick:
    pass
quick.to_csv(os.devnull)
print(json.dumps({"series": [s.key for s in mon.trace.series], "samples": len(mon.trace), "quick": len(quick.trace),
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} & {"tensorflow", "keras", "matplotlib"})}))
"""


@pytest.mark.parametrize("split", ["", "vgpu_magic.split(2, framework='jax')"])
def test_a_custom_jax_loop_is_monitored_without_importing_tensorflow_or_keras(split):
    pytest.importorskip("jax")
    result = last_json(run_python(JAX_LOOP % split).stdout)
    assert result["loaded"] == []
    devices = ["/device:CPU:0", "/device:CPU:1"] if split else ["/device:CPU:0"]
    assert result["series"] == [*devices, "process"]
    # A short block still has a trace: a sample when it starts and one when it ends.
    assert result["samples"] >= 2 and result["quick"] == 2


PLOT_ERROR = """
from vgpu_magic.monitor.live import LiveMemoryView

def broken_display(obj, display_id=None):
    raise OSError("the frontend went away")

with vgpu_magic.strategy().scope():
    model = build()
mon = vgpu_magic.MemoryMonitor(view=LiveMemoryView(broken_display, clock=lambda: 1e9))
history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[mon])
print(json.dumps({"epochs": len(history.history["loss"]), "samples": len(mon.trace), "view": mon.view is None}))
"""


def test_a_plotting_error_is_reported_once_and_fit_completes():
    proc = run_python(SETUP.format(count=2) + PLOT_ERROR)
    assert last_json(proc.stdout) == {"epochs": 3, "samples": last_json(proc.stdout)["samples"], "view": True}
    assert last_json(proc.stdout)["samples"] >= 5
    reports = [line for line in proc.stderr.splitlines() if line.startswith("vgpu_magic: the memory plot")]
    assert reports == [
        "vgpu_magic: the memory plot stopped after an error (OSError: the frontend went away); "
        "training goes on and the trace is still recorded"
    ]


INTERRUPT = """
from IPython.core.interactiveshell import InteractiveShell

class StopAt(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 6:
            raise KeyboardInterrupt

with vgpu_magic.strategy().scope():
    model = build()

# A script: the interrupt propagates, the trace stays, finish() draws the end.
script_mon = vgpu_magic.MemoryMonitor(display="text")
try:
    model.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[script_mon, StopAt()])
except KeyboardInterrupt:
    pass
script = {"samples": len(script_mon.trace), "active": script_mon.active}
script_mon.finish(interrupted=True)
script["interrupted"] = script_mon.trace.interrupted

# IPython: the run ends with its cell.
shell = InteractiveShell.instance()
shell.user_ns.update(model=model, x=x, y=y, StopAt=StopAt, vgpu_magic=vgpu_magic)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    shell.run_cell("mon = vgpu_magic.MemoryMonitor()\\n"
                   "model.fit(x, y, batch_size=16, epochs=5, verbose=0, callbacks=[mon, StopAt()])")
mon = shell.user_ns["mon"]
print(json.dumps({
    "script": script, "samples": len(mon.trace), "step": mon.trace.step[-1], "active": mon.active,
    "interrupted": mon.trace.interrupted, "summary": [l for l in out.getvalue().splitlines() if l.startswith("memory")],
    "hooks": sum(getattr(f, "__self__", None) is mon for f in shell.events.callbacks["post_run_cell"]),
}))
"""


def test_keyboard_interrupt_keeps_the_trace_and_the_last_frame():
    result = last_json(run_python(SETUP.format(count=2) + INTERRUPT).stdout)
    assert result["script"]["samples"] >= 2 and result["script"]["active"] and result["script"]["interrupted"]
    assert result["samples"] >= 2 and result["step"] == 6
    assert result["interrupted"] and not result["active"]
    assert len(result["summary"]) == 1 and result["summary"][0].startswith("memory · fit interrupted in ")
    assert result["hooks"] == 0  # the cell hook removed itself


AUTO = """
import json
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from vgpu_magic.frameworks import get as _framework
tf_runtime_started = _framework("tensorflow").runtime_started

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "vgpu_magic")
import vgpu_magic
# %vgpu_monitor is the monitor's own magic, registered by the extension.
assert type(shell.find_line_magic("vgpu_monitor").__self__).__name__ == "MonitorMagics"
shell.run_line_magic("vgpu_split", "2 --quiet")
import keras
import numpy as np
from vgpu_magic.monitor import auto

originals = {name: getattr(keras.Model, name) for name in ("fit", "evaluate", "predict")}
own = {name: name in keras.Model.__dict__ for name in originals}
errors = []
for line in ("maybe", "status --display text", "on --display sometimes", "on --interval 0", "on --interval inf"):
    try:
        shell.run_line_magic("vgpu_monitor", line)
    except UsageError as exc:
        errors.append(str(exc))

shell.run_line_magic("vgpu_monitor", "on --display none")
patched = {name: getattr(keras.Model, name) is not original for name, original in originals.items()}
started_by_on = tf_runtime_started()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("sgd", "mse")
x = np.zeros((64, 4), "float32"); y = np.zeros((64, 2), "float32")
model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_split=0.25)
after_fit = len(auto.AUTO.monitors)
fit_trace = auto.AUTO.monitors[-1].traces[0]
model.evaluate(x, y, verbose=0)
model.predict(x, verbose=0)
mine = vgpu_magic.MemoryMonitor(display="none")
model.fit(x, y, verbose=0, callbacks=[mine])
kinds = [m.traces[0].kind for m in auto.AUTO.monitors]
status_on = auto.status()

shell.run_line_magic("vgpu_monitor", "off")
off = {name: getattr(keras.Model, name) is original for name, original in originals.items()}
own_off = {name: name in keras.Model.__dict__ for name in originals}

# Another tool patches fit after ours; off must leave its patch alone, and
# ours, still called inside it, must stop monitoring.
shell.run_line_magic("vgpu_monitor", "on --display none")
ours, other_calls = keras.Model.fit, []
def other_tool_fit(self, *args, **kwargs):
    other_calls.append(1)
    return ours(self, *args, **kwargs)
keras.Model.fit = other_tool_fit
shell.run_line_magic("vgpu_monitor", "off")
monitors_before = len(auto.AUTO.monitors)
model.fit(x, y, verbose=0)
other = {
    "kept": keras.Model.fit is other_tool_fit, "evaluate": keras.Model.evaluate is originals["evaluate"],
    "monitored": len(auto.AUTO.monitors) - monitors_before, "calls": len(other_calls), "status": auto.status(),
}
del keras.Model.fit  # the other tool undoes its own patch
shell.run_line_magic("vgpu_monitor", "on")
shell.run_line_magic("unload_ext", "vgpu_magic")
unloaded = {name: getattr(keras.Model, name) is original for name, original in originals.items()}
print(json.dumps({
    "own": own, "errors": errors, "patched": patched, "started_by_on": started_by_on,
    "after_fit": after_fit, "fit_phases": sorted({fit_trace.phase(i) for i in range(len(fit_trace))}),
    "kinds": kinds, "mine": [t.kind for t in mine.traces], "status_on": status_on,
    "off": off, "own_off": own_off, "unloaded": unloaded, "status_off": auto.status(), "other": other,
}))
"""


def test_vgpu_monitor_on_off_patches_and_restores_keras_exactly():
    result = last_json(run_python(AUTO).stdout)
    assert result["own"] == {"fit": False, "evaluate": False, "predict": False}  # inherited in Keras 3
    assert result["errors"] == [
        "'maybe' is not an action; use on, off or status",
        "options go with 'on', e.g. %vgpu_monitor on --display text",
        "--display 'sometimes' is not a display mode; use auto, rich, text, none",
        "--interval '0' is out of range; use 0.001 to 3600 seconds",
        "--interval 'inf' is not a number of seconds; use e.g. --interval 0.05",
    ]
    assert result["patched"] == {"fit": True, "evaluate": True, "predict": True}
    assert result["started_by_on"] is False
    # fit's validation runs inside the fit's monitor, not in a second one
    assert result["after_fit"] == 1 and result["fit_phases"] == ["fit", "validate"]
    # a call that brings its own monitor gets no second one
    assert result["kinds"] == ["fit", "evaluate", "predict"] and result["mine"] == ["fit"]
    assert result["status_on"] == (
        "automatic memory monitoring is on for keras.Model.fit/evaluate/predict (display='none')"
    )
    assert result["off"] == {"fit": True, "evaluate": True, "predict": True}
    assert result["own_off"] == {"fit": False, "evaluate": False, "predict": False}
    assert result["unloaded"] == {"fit": True, "evaluate": True, "predict": True}
    assert result["status_off"] == "automatic memory monitoring is off"
    assert result["other"] == {
        "kept": True,
        "evaluate": True,
        "monitored": 0,
        "calls": 1,
        "status": "automatic memory monitoring is off (keras.Model.fit was patched again by another tool "
        "afterwards; that patch stays, and ours inside it no longer monitors)",
    }


LIGHT = """
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "vgpu_magic")
import vgpu_magic, vgpu_magic.monitor, vgpu_magic.monitor.auto
shell.run_line_magic("vgpu_monitor", "status")
shell.run_line_magic("vgpu_monitor", "off")
heavy = ("tensorflow", "keras", "matplotlib", "PIL")
print(json.dumps([m for m in sys.modules if m.split(".")[0] in heavy]))
"""


def test_importing_and_asking_the_status_loads_nothing_heavy():
    proc = run_python(LIGHT)
    assert last_json(proc.stdout) == []
    assert "automatic memory monitoring is off" in proc.stdout
