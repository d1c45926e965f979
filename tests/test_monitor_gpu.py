"""The memory monitor on a real split GPU. Skipped, with the reason, where
TensorFlow sees no GPU.

Elsewhere the GPU path is tested on GPU-shaped data (``test_monitor.py``);
this checks what only a card can show: one series per logical GPU with its
cap, and memory that moves on one logical GPU only.
"""

from __future__ import annotations

import pytest

from support import last_json, run_python

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MIB = 1024 * 1024


GPU_SPLIT = """
import json
import numpy as np
import vgpu_magic

vgpu_magic.split(2, memory=1024)
import keras
import tensorflow as tf

with vgpu_magic.strategy().scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(4)])
    model.compile("adam", "mse")
fit = vgpu_magic.MemoryMonitor(display="none")
x = np.zeros((512, 64), "float32")
y = np.zeros((512, 4), "float32")
model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[fit])

with vgpu_magic.MemoryMonitor(display="none") as mon:
    mon.sample(step=0)
    with tf.device("/GPU:1"):
        block = tf.ones((1024, 1024))  # 4 MiB on the second logical GPU only
    mon.sample(step=1)
trace = fit.trace
print(json.dumps({
    "series": [[s.key, s.cap] for s in trace.series],
    "devices_in_rows": sorted({r.device for r in trace.rows()}),
    "variable_bytes": trace.variable_bytes,
    "delta": [mon.trace.current[i][2] - mon.trace.current[i][1] for i in range(2)],
    "peaks_below_cap": all(max(trace.peak[i]) <= 1024 * 1024 * 1024 for i in range(2)),
}))
"""


def test_each_logical_gpu_is_its_own_series_with_its_cap(gpu_count):
    result = last_json(run_python(GPU_SPLIT).stdout)
    assert result["series"] == [["/device:GPU:0", 1024 * MIB], ["/device:GPU:1", 1024 * MIB]]
    assert result["devices_in_rows"] == ["/device:GPU:0", "/device:GPU:1"]
    sizes = result["variable_bytes"]
    assert sizes["/device:GPU:0"] == sizes["/device:GPU:1"] > 0
    assert result["delta"][1] >= 4 * MIB > result["delta"][0]
    assert result["peaks_below_cap"]
