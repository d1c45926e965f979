"""What reaches a user's notebook: framework start-up chatter is held back, never lost, and everything a
user's code writes arrives.

* The ranks (:mod:`vgpu_magic.ranks.shown`): each framework's chatter lines held back per rank, shown by
  ``%vgpu_cluster log`` and with a failing rank, all of them with ``verbose``; each framework's log settings
  given to the ranks where the user set none; a rank's traceback names the notebook's cell.
* The kernel: loaded before TensorFlow, the extension starts it quietly where the user set nothing.

The slow tests run in kernels started as users start theirs (:func:`support.as_a_user`); so do the notebooks
under nbval (``notebooks/conftest.py``), which proves that no framework chatter reaches a user's notebook there.
"""

from __future__ import annotations

import io

import pytest

from support import answering, as_a_user, kernel_output, kernel_run, refused_changing_nothing, started_kernel
from vgpu_magic.frameworks import get
from vgpu_magic.frameworks.jax import GLOO_END
from vgpu_magic.ranks.failures import notebook_traceback
from vgpu_magic.ranks.run import RankRun, RankRunError, RankWork
from vgpu_magic.ranks.shown import HeldBack, LineStream, rank_env

#: What TensorFlow 2.21's workers and Gloo wrote on a rank in a kernel started as a user starts one.
TF_START = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795537565.717880    6785 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. "
    "To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795537565.755243    6785 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
    "INFO:tensorflow:Enabled multi-worker collective ops with available devices: ['/job:worker/replica:0/task:0/"
    "device:CPU:0', '/job:worker/replica:0/task:1/device:CPU:0']",
]
GLOO = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
#: A user's own lines, and the framework's warnings and errors: always shown.
SHOWN = [
    "epoch 1 loss 0.25",
    "WARNING:tensorflow:Using CollectiveAllReduceStrategy eagerly has significant overhead currently.",
    "E0000 00:00:1795537565.1 6785 coordination_service.cc:1] Task /job:worker/task:1 heartbeat timeout",
    "/tmp/train.py:3: UserWarning: a warning of the user's",
    "[Gloo] an error of Gloo's own",
    "Traceback (most recent call last):",
]


def test_framework_start_up_lines_are_held_back_per_rank_and_the_rest_shown():
    tf, jax = HeldBack(get("tensorflow").chatter), HeldBack(get("jax").chatter)
    assert [line for line in TF_START + SHOWN if tf.shown(1, line)] == SHOWN
    assert not jax.shown(1, GLOO)
    assert [line for line in SHOWN if jax.shown(1, line)] == SHOWN
    assert tf.lines(1) == [f"[rank 1] {line}" for line in TF_START]
    assert tf.lines(0) == []
    assert jax.lines() == [f"[rank 1] {GLOO}"]


def _greeting(rank: int) -> list[str]:
    """Gloo's greeting as ``printConnectivityInfo`` writes it: one ``std::cout`` piece at a time."""
    return ["[Gloo] Rank ", str(rank), " is connected to ", "3", " peer ranks. ", GLOO_END, "3", "\n"]


def test_gloos_greetings_interleaved_by_two_communicators_connecting_at_once_are_held_back_whole():
    """CI's notebook 09 showed ``[rank 0] [Gloo] Rank [Gloo] Rank 1 is connected ...`` and ``[rank 0] 0 is connected
    ...``: a rank's two communicators (one per device) wrote their greetings at once, piece by piece."""
    a, b = _greeting(0), _greeting(1)
    # One greeting written inside the other after each of its pieces, and the two alternating piece by piece.
    writes = [a[:k] + b + a[k:] for k in range(1, len(a))] + [[p for pair in zip(a, b) for p in pair]]
    for pieces in writes:
        out, held = io.StringIO(), HeldBack.of(get("jax"))
        stream = LineStream("[rank 0] ", out, lambda line, held=held: held.shown(0, line))
        stream.feed("".join(pieces) + "epoch 1\n\n0\n")
        assert out.getvalue() == "[rank 0] epoch 1\n[rank 0] \n[rank 0] 0\n", pieces
        assert "".join(held.lines(0)).count(GLOO_END) == 2
    # Gloo's word that a peer is missing, a user's numbers and empty lines are the user's to see.
    held = HeldBack.of(get("jax"))
    # A long number before other text is refused at once (a repeated \d+ tried every split of it: 2**n steps).
    shown = ["[Gloo] Rank 0 is NOT connected to: [1]", "42", "", "3 is connected to nothing", "1" * 5000 + " loss"]
    assert [line for line in shown if held.shown(0, line)] == shown


def test_verbose_shows_every_line():
    verbose = HeldBack(get("tensorflow").chatter, verbose=True)
    assert all(verbose.shown(0, line) for line in TF_START)
    assert verbose.lines() == []


def test_ranks_get_the_frameworks_quiet_settings_unless_the_user_set_them(monkeypatch):
    import vgpu_magic

    tf = get("tensorflow")
    assert rank_env(tf, environ={}) == {"TF_CPP_MIN_LOG_LEVEL": "2"}
    assert rank_env(tf, verbose=True, environ={}) == {"TF_CPP_MIN_LOG_LEVEL": "0"}
    # The user's own level wins, verbose or not.
    assert rank_env(tf, environ={"TF_CPP_MIN_LOG_LEVEL": "1"}) == {}
    assert rank_env(tf, verbose=True, environ={"TF_CPP_MIN_LOG_LEVEL": "1"}) == {}
    # A level the extension set in the kernel is not the user's: verbose overrides it on the ranks.
    monkeypatch.setattr(vgpu_magic, "_quieted", lambda: {"TF_CPP_MIN_LOG_LEVEL": "2"})
    assert rank_env(tf, verbose=True, environ={"TF_CPP_MIN_LOG_LEVEL": "2"}) == {"TF_CPP_MIN_LOG_LEVEL": "0"}
    assert rank_env(get("torch"), environ={}) == {}


def test_a_ranks_traceback_names_the_notebooks_cell_or_no_count():
    # IPython's colours, as a rank's traceback arrives (notebook 07's failing rank).
    text = "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[4]\x1b[39m\x1b[32m, line 3\x1b[39m\nValueError: bad"
    assert (
        notebook_traceback(text, 8)[0]
        == "\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[8]\x1b[39m\x1b[32m, line 3\x1b[39m"
    )
    assert notebook_traceback("Cell In[12], line 3\nValueError: bad", None) == ["Cell, line 3", "ValueError: bad"]


def test_log_takes_a_rank_of_the_cluster_and_verbose_only_goes_with_start(ip):
    from vgpu_magic.ranks.rank_cluster import RankCluster

    ranks = RankCluster(2, "torch", verbose=True)
    assert ranks.log() == [] and ranks.log(1) == []
    with pytest.raises(ValueError, match=r"rank 5 is not one of this cluster's ranks 0\.\.1"):
        ranks.log(5)
    refused_changing_nothing(ip, "vgpu_cluster", "status --verbose", "'--verbose' only goes with start")
    refused_changing_nothing(ip, "vgpu_cluster", "log --join", "'--join' only goes with start")


class _Failed(__import__("concurrent.futures").futures.Future):
    """A rank's finished AsyncResult that raised, with what the rank wrote (a future, as the fault
    policy waits on the ranks' results)."""

    output_events = (("stderr", "\n".join([*TF_START, "the rank's own last words", ""])),)

    def __init__(self):
        super().__init__()
        error = Exception("bad")
        error.ename, error.evalue = "ValueError", "bad"
        error.traceback = "Traceback (most recent call last):\n  Cell In[3], line 2\nValueError: bad"
        self.set_exception(error)

    def ready(self):
        return True

    def successful(self):
        return False

    def wait_for_output(self, timeout=None):
        return True


def test_a_failing_ranks_held_back_lines_are_shown_with_its_traceback():
    out, err = io.StringIO(), io.StringIO()
    held = HeldBack(get("tensorflow").chatter)
    error = RankRunError(RankRun(answering([_Failed()]), RankWork("1"), stdout=out, stderr=err, held=held).run())
    # What it wrote to stderr as it wrote it (issue 45: on stderr), then what was held back.
    assert out.getvalue() == ""
    assert err.getvalue().splitlines() == ["[rank 0] the rank's own last words", *(f"[rank 0] {x}" for x in TF_START)]
    # ipyparallel's "[0:execute]" heading is gone; no rank's own cell count (no notebook cell runs here).
    assert error._render_traceback_()[:2] == [
        "[rank 0] Traceback (most recent call last):",
        "[rank 0]   Cell, line 2",
    ]


# -- as a user runs it ----------------------------------------------------------------------------------------------

FIT = """
import numpy as np, tensorflow as tf, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
model.fit(np.ones((64, 4), "float32"), np.ones((64, 1), "float32"), epochs=2, batch_size=16, verbose=0)
import os, sys, warnings
os.write(2, b"E0000 00:00:1.000000   1 fake.cc:1] an error line that must arrive\\n")
print("the user's own stderr", file=sys.stderr)
warnings.warn("the user's warning")
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", [None, "0"])
def test_the_kernel_starts_tensorflow_quietly_unless_the_user_set_a_level(level, no_process_left_behind):
    with started_kernel(env={**as_a_user(), "TF_CPP_MIN_LOG_LEVEL": level}) as (_, kc):
        kernel_run(kc, "%load_ext vgpu_magic")
        out = kernel_output(kc, FIT, timeout=240)
    assert not out["error"], out
    for arrives in ("an error line that must arrive", "the user's own stderr", "UserWarning: the user's warning"):
        assert arrives in out["stderr"]
    if level is None:
        # Nothing else: no import-time INFO line, no dataset warning of Keras' own.
        others = [line for line in out["stderr"].splitlines() if line.strip() and "warn" not in line]
        assert others == [line for line in others if "must arrive" in line or "own stderr" in line], out["stderr"]
    else:
        # The user asked for everything: TensorFlow's import-time INFO lines are shown.
        assert "oneDNN custom operations are on" in out["stderr"]


RANKS_REDUCE = """%%vgpu_run
import sys, warnings
import tensorflow as tf
s = tf.distribute.MultiWorkerMirroredStrategy()
print("sum", s.reduce("SUM", s.run(lambda: tf.constant(1.0)), axis=None).numpy())
print("the rank's own stderr", file=sys.stderr)
warnings.warn("the rank's warning")
"""


@pytest.mark.slow
def test_tensorflow_ranks_are_quiet_and_their_tracebacks_name_the_notebooks_cell(no_process_left_behind):
    with started_kernel(env=as_a_user()) as (_, kc):
        kernel_run(kc, "%load_ext vgpu_magic")
        start = kernel_output(kc, "%vgpu_cluster start 2 --framework tensorflow", timeout=300)
        assert not start["error"] and not start["stderr"], start
        try:
            run = kernel_output(kc, RANKS_REDUCE, timeout=300)
            log = kernel_output(kc, "%vgpu_cluster log 1")
            failing = kernel_run(kc, "%%vgpu_run\nx = 1\nraise ValueError('bad')", timeout=120)
        finally:
            kernel_run(kc, "%vgpu_cluster stop", timeout=120)
    assert not run["error"], run
    assert run["stdout"].count("sum 2.0") == 2
    assert "INFO:tensorflow" not in run["stdout"]
    # A rank's stderr is shown on the notebook's stderr, as a cell's is (issue 45).
    for rank in (0, 1):
        assert f"[rank {rank}] the rank's own stderr" in run["stderr"].splitlines()
        assert f"[rank {rank}] " in run["stderr"] and "UserWarning: the rank's warning" in run["stderr"]
    for chatter in ("absl::InitializeLog", "oneDNN", "I0000", "coordination", "grpc"):
        assert chatter not in run["stdout"] + run["stderr"], run
    assert "[rank 1] " in log["stdout"] and "oneDNN custom operations are on" in log["stdout"]
    count = next(m["content"]["execution_count"] for m in failing if m["msg_type"] == "execute_input")
    error = next(m["content"] for m in failing if m["msg_type"] == "error")
    traceback = "\n".join(error["traceback"])
    assert f"In[{count}]" in traceback and "line 3" in traceback, traceback
    assert ":execute]" not in traceback
