"""Split the CPU into 1, 2, 4 and 8 logical devices and train under the strategy.

Each case is a fresh interpreter (TensorFlow's device configuration is
process-global and one-way): split through the magic in a real
``InteractiveShell`` or through :func:`vgpu_magic.split`, then check what
``MirroredStrategy()`` and :func:`vgpu_magic.strategy` see and fit a tiny Keras
model under the strategy's scope.
"""

from __future__ import annotations

import pytest

from support import last_json, run_python

pytestmark = pytest.mark.slow

SCENARIO = """
import json
count, face = {count}, {face!r}

if face == "magic":
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "vgpu_magic")
    result = shell.run_line_magic("vgpu_split", f"{{count}} --quiet --return")
else:
    import vgpu_magic

    result = vgpu_magic.split(count)

import numpy as np
import keras
import tensorflow as tf
import vgpu_magic
from tensorflow.python.eager import context

started_by_split = context.context()._initialized
mirrored = tf.distribute.MirroredStrategy()
strategy = vgpu_magic.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
kernel_copies = len(strategy.experimental_local_results(model.layers[0].kernel.value))
rng = np.random.default_rng(0)
x = rng.normal(size=(8 * count, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
history = model.fit(x, y, epochs=1, batch_size=2 * count, verbose=0)
print(json.dumps({{
    "status": result.status,
    "result_devices": result.devices,
    "started_by_split": started_by_split,
    "logical_cpus": [d.name for d in tf.config.list_logical_devices("CPU")],
    "mirrored": mirrored.num_replicas_in_sync,
    "strategy": strategy.num_replicas_in_sync,
    "strategy_devices": list(strategy.extended.worker_devices),
    "kernel_copies": kernel_copies,
    "loss": history.history["loss"],
}}))
"""


# Each count once and each face on both paths (1 changes nothing, the others apply a split): the faces only differ
# in how the count reaches the one planner, and 2, 4 and 8 take the same path through it.
@pytest.mark.parametrize(("count", "face"), [(1, "magic"), (1, "api"), (2, "magic"), (4, "api"), (8, "magic")])
def test_split_cpu_and_fit(count, face):
    result = last_json(run_python(SCENARIO.format(count=count, face=face)).stdout)
    expected = [f"/device:CPU:{i}" for i in range(count)]
    # One uncapped CPU is what TensorFlow has anyway, so `1` changes nothing.
    assert result["status"] == ("unchanged" if count == 1 else "applied")
    assert result["result_devices"] == expected
    assert result["started_by_split"] is False
    assert [name.split("device:")[-1] for name in result["logical_cpus"]] == [f"CPU:{i}" for i in range(count)]
    assert result["mirrored"] == count
    assert result["strategy"] == count
    assert [d.split("device:")[-1] for d in result["strategy_devices"]] == [f"CPU:{i}" for i in range(count)]
    assert result["kernel_copies"] == count
    assert len(result["loss"]) == 1 and result["loss"][0] > 0
