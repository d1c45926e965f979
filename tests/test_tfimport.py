"""TensorFlow's noise is quieted where vgpu_magic causes it, and only there.

* Import-time C++ INFO lines (oneDNN notice, absl preamble) are dropped when
  vgpu_magic imports TensorFlow and the level hides INFO or was never set;
  an explicit ``TF_CPP_MIN_LOG_LEVEL=0`` keeps them.
* ``vgpu_magic.strategy()`` does not fill a fit's output with
  ``INFO:tensorflow:Reduce to ... then broadcast`` lines, and leaves the
  user's logging level and every other record alone.
"""

from __future__ import annotations

import pytest

from support import CHILD_ENV, last_json, run_python

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys
import vgpu_magic
report = vgpu_magic.status()
os.write(2, b"E0000 00:00:1.000000   1 fake.cc:1] an error line that must survive\\n")
print("tensorflow imported:", "tensorflow" in sys.modules)
"""


def test_info_lines_dropped_when_the_level_hides_info():
    proc = run_python(SCRIPT, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert "tensorflow imported: True" in proc.stdout
    assert "oneDNN" not in proc.stderr
    assert "absl::InitializeLog" not in proc.stderr
    assert "an error line that must survive" in proc.stderr


def test_info_lines_dropped_when_nobody_set_the_level(monkeypatch):
    # A plain `pip install` environment: nobody chose TensorFlow's level, and the first split
    # should not open with a block of red C++ notices (and their continuation lines).
    monkeypatch.delitem(CHILD_ENV, "TF_CPP_MIN_LOG_LEVEL")
    proc = run_python(SCRIPT)
    assert "oneDNN" not in proc.stderr
    assert "To enable the following instructions" not in proc.stderr
    assert "an error line that must survive" in proc.stderr


def test_info_lines_kept_at_an_explicit_level_0():
    proc = run_python(SCRIPT, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    # The user asked for TensorFlow's INFO lines: they are shown.
    assert "oneDNN" in proc.stderr


STRATEGY = """
import io, json, logging
import numpy as np
import vgpu_magic
vgpu_magic.split(2)
import tensorflow as tf, keras
logger = tf.get_logger()
logger.setLevel(logging.INFO)
stream = io.StringIO()
handler = logging.StreamHandler(stream)
logger.addHandler(handler)
strategy = vgpu_magic.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), epochs=1, batch_size=8, verbose=0)
logger.info("a record of the user's own")
print(json.dumps({"log": stream.getvalue(), "level": logger.level}))
"""


def test_strategy_quiets_only_its_own_info_records():
    out = last_json(run_python(STRATEGY).stdout)
    assert "Reduce to" not in out["log"]
    assert "Using MirroredStrategy" not in out["log"]
    assert "Collective all_reduce tensors" not in out["log"]  # at the first traced step of fit
    assert "a record of the user's own" in out["log"]
    assert out["level"] == 20  # the user's level, untouched
