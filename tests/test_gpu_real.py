"""Splits of a real GPU, and ranks that share one. Each test is skipped, with the reason,
where its framework sees no GPU (TensorFlow's tests where TensorFlow sees none; torch's and
JAX's where NVML shows no GPU or the framework is missing).

The planning logic for GPUs is tested everywhere on GPU-shaped data
(``test_planner.py``, ``test_gpu_contract.py``); these tests check what only a real card
can show: that the caps are enforced by TensorFlow's allocator and that each logical GPU has
its own memory figures; that unchanged DDP / FSDP2 scripts run on torch ranks that share one
GPU, each within its cap; that JAX ranks sharing one GPU run, or are refused before they start
where their NCCL cannot have two ranks on one GPU.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from gpu_ranks import gpus_for, rank_layout, run_ranks
from support import last_json, run_python

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MIB = 1024 * 1024


CAPPED_SPLIT = """
import json
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "vgpu_magic")
result = shell.run_line_magic("vgpu_split", "2 --memory 1024 --quiet --return")

import numpy as np
import keras
import tensorflow as tf
import vgpu_magic

logical = [d.name for d in tf.config.list_logical_devices("GPU")]
with tf.device("/GPU:1"):
    block = tf.ones((1024, 1024))  # 4 MiB on the second logical GPU only
memory = {name: tf.config.experimental.get_memory_info(name.replace("/device:", "")) for name in logical}
try:
    with tf.device("/GPU:0"):
        too_big = tf.zeros((300, 1024, 1024))  # 1200 MiB, over the 1024 MiB cap
        too_big.numpy()
    over_cap = None
except Exception as exc:
    over_cap = type(exc).__name__

strategy = vgpu_magic.strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
history = model.fit(x, x.sum(axis=1, keepdims=True), epochs=1, batch_size=8, verbose=0)
report = vgpu_magic.status().to_dict()
print(json.dumps({
    "status": result.status,
    "plan_limits": list(result.plan.memory_limits),
    "logical": logical,
    "memory": memory,
    "over_cap": over_cap,
    "mirrored": tf.distribute.MirroredStrategy().num_replicas_in_sync,
    "strategy": strategy.num_replicas_in_sync,
    "loss": history.history["loss"],
    "report_logical": report["logical"],
}))
"""


def test_split_two_capped_logical_gpus(gpu_count):
    result = last_json(run_python(CAPPED_SPLIT).stdout)
    assert result["status"] == "applied"
    assert result["plan_limits"] == [1024, 1024]
    # With several physical GPUs the others are hidden (--others hide), so exactly two.
    assert result["logical"] == ["/device:GPU:0", "/device:GPU:1"]
    assert result["mirrored"] == 2
    assert result["strategy"] == 2
    assert result["over_cap"] == "ResourceExhaustedError"
    assert len(result["loss"]) == 1

    # Each logical GPU has its own allocator: the 4 MiB block shows on GPU:1 only.
    on_0 = result["memory"]["/device:GPU:0"]["current"]
    on_1 = result["memory"]["/device:GPU:1"]["current"]
    assert on_1 >= 4 * MIB
    assert on_0 < on_1

    gpus = [d for d in result["report_logical"] if "GPU" in d["name"]]
    assert [d["name"] for d in gpus] == ["/device:GPU:0", "/device:GPU:1"]
    assert [d["cap_mib"] for d in gpus] == [1024, 1024]
    assert all(isinstance(d["current"], int) and isinstance(d["peak"], int) for d in gpus)


EVEN_SPLIT = """
import json
import vgpu_magic
from vgpu_magic.frameworks.tensorflow import FRAMEWORK, system_reserve_mib

inventory = FRAMEWORK.probe_inventory()
gpu = inventory.gpus[0]
try:
    vgpu_magic.split(2, memory=10 * gpu.total_mib)
    too_big = None
except ValueError as exc:
    too_big = str(exc)

import tensorflow as tf

untouched = tf.config.get_logical_device_configuration(tf.config.list_physical_devices("GPU")[0])
result = vgpu_magic.split(4)
print(json.dumps({
    "free_mib": gpu.free_mib,
    "reserve_mib": system_reserve_mib(gpu.free_mib, gpu.compute_capability),
    "too_big": too_big,
    "untouched": untouched,
    "status": result.status,
    "limits": list(result.plan.memory_limits),
    "usable_mib": result.plan.usable_mib,
    "logical": [d.name for d in tf.config.list_logical_devices("GPU")],
}))
"""


def test_even_split_uses_free_memory_minus_reserve(gpu_count):
    result = last_json(run_python(EVEN_SPLIT).stdout)
    assert "does not fit GPU 0" in result["too_big"]
    assert result["untouched"] is None
    assert result["status"] == "applied"
    limits = result["limits"]
    assert len(set(limits)) == 1 and len(limits) == 4
    # The split reads free memory again when it plans; other processes may have moved it
    # a little since the reading above.
    assert abs(result["usable_mib"] - (result["free_mib"] - result["reserve_mib"])) <= 256
    assert 0 <= result["usable_mib"] - sum(limits) < 4  # only the rounding is left over
    assert result["logical"] == [f"/device:GPU:{i}" for i in range(4)]


MULTI_GPU = """
import json
import vgpu_magic
import tensorflow as tf

result = vgpu_magic.split(2, memory=1024, gpu=1)
print(json.dumps({
    "visible": [d.name for d in tf.config.get_visible_devices("GPU")],
    "logical": [d.name for d in tf.config.list_logical_devices("GPU")],
    "replicas": vgpu_magic.strategy().num_replicas_in_sync,
}))
"""


def test_split_of_second_gpu_hides_the_others(gpu_count):
    if gpu_count < 2:
        pytest.skip(f"needs two GPUs, TensorFlow sees {gpu_count}")
    result = last_json(run_python(MULTI_GPU).stdout)
    assert result["visible"] == ["/physical_device:GPU:1"]
    assert result["logical"] == ["/device:GPU:0", "/device:GPU:1"]
    assert result["replicas"] == 2


# -- ranks sharing one GPU, started as the planner plans them ------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [("--backend", "nccl"), ("--backend", "default"), ("--backend", "nccl", "--wrap", "fsdp2")],
    ids=["ddp-nccl", "ddp-default-backend", "fsdp2-nccl"],
)
def test_two_torch_ranks_share_one_gpu_with_an_unchanged_script(args):
    from vgpu_magic.frameworks import get
    from vgpu_magic.inventory import cuda_context_mib

    gpus = gpus_for("torch")
    plans = get("torch").plan_ranks(rank_layout(2, gpus), None, None, None)
    caps = [plan.args[2] for plan in plans]
    assert [plan.env["LOCAL_RANK"] for plan in plans] == [str(gpus[0].index)] * 2
    ranks = run_ranks(plans, caps, "ddp_cuda.py", *args)
    results = [lines[-1] for lines in ranks]
    print(json.dumps({"plans": [p.args for p in plans], "setup": [lines[0] for lines in ranks], "results": results}))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["device"] == gpus[0].index and r["all_reduce"] == 3.0 for r in results)
    assert all("gloo" in r["backend"] for r in results)
    assert results[0]["checksum"] == results[1]["checksum"]  # the same weights on both ranks
    for result, cap in zip(results, caps):
        assert result["peak_reserved"] <= cap * MIB
        assert result["over_cap"] == "OutOfMemoryError"
        if result["nvml_used"] is not None:  # NVML's figure for this process: its cap and its own CUDA context
            assert result["nvml_used"] - result["reserved_now"] <= cuda_context_mib(gpus[0]) * MIB
    assert_the_preflight_held(gpus[0], plans, results)


def assert_the_preflight_held(gpu, plans, results) -> None:
    """The card's free memory (``torch.cuda.mem_get_info``) as the ranks end went down by no more than the
    pre-flight counted: each rank's cap, CUDA context and NCCL's buffers (its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``)."""
    from vgpu_magic.inventory import cuda_context_mib

    counted = [
        int(p.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split("=")[1].rstrip("M"))
        if "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in p.env
        else p.args[2] + cuda_context_mib(gpu)
        for p in plans
    ]
    used = gpu.free_mib * MIB - min(r["cuda_free"] for r in results)
    print(json.dumps({"preflight_mib": counted, "free_before_mib": gpu.free_mib, "used_mib": used // MIB}))
    assert used <= sum(counted) * MIB


def test_two_torch_ranks_share_one_gpu_over_nccl_with_gloos_weights(tmp_path):
    """``--backend nccl``: NCCL 2.30's multi-rank mode, under an MPS daemon of the ranks' own where MPS can run; DDP's
    weights equal gloo's to float tolerance, and the pre-flight's figures hold. Refused before starting with an older
    NCCL."""
    import shutil

    from vgpu_magic.frameworks import get
    from vgpu_magic.inventory import MULTI_RANK_NCCL, nccl_version
    from vgpu_magic.ranks.mps import CONTROL, MPSDaemon

    gpus = gpus_for("torch")
    torch = get("torch")
    if nccl_version() is None or nccl_version() < MULTI_RANK_NCCL:
        with pytest.raises(ValueError, match="refuses two ranks on one GPU at the first collective"):
            torch.plan_ranks(rank_layout(2, gpus), None, None, None, "nccl")
        return
    gloo = torch.plan_ranks(rank_layout(2, gpus), None, None, None)
    nccl = torch.plan_ranks(rank_layout(2, gpus), None, None, None, "nccl")
    assert [p.args[0] for p in gloo + nccl] == ["gloo"] * 2 + ["nccl"] * 2
    expected = [lines[-1] for lines in run_ranks(gloo, [p.args[2] for p in gloo], "ddp_cuda.py")]
    daemon = MPSDaemon(str(tmp_path / "mps")) if shutil.which(CONTROL) else None
    if daemon is not None:
        daemon.start()
        nccl = [dataclasses.replace(p, env={**p.env, **daemon.env}) for p in nccl]
    try:
        results = [lines[-1] for lines in run_ranks(nccl, [p.args[2] for p in nccl], "ddp_cuda.py")]
    finally:
        if daemon is not None:
            daemon.stop()
    print(json.dumps({"mps": daemon is not None, "gloo": expected, "nccl": results}))
    assert daemon is None or not (tmp_path / "mps").exists()
    assert all(r["backend"] == "nccl" and r["all_reduce"] == 3.0 for r in results)
    assert [r["checksum"] for r in results] == pytest.approx([r["checksum"] for r in expected], rel=1e-5)
    assert_the_preflight_held(gpus[0], nccl, results)


def test_two_jax_ranks_share_one_gpu_or_are_refused_before_starting():
    from vgpu_magic.frameworks import get
    from vgpu_magic.inventory import MULTI_RANK_NCCL, nccl_version

    gpus = gpus_for("jax")
    layout = rank_layout(2, gpus)
    if nccl_version() is None or nccl_version() < MULTI_RANK_NCCL:
        with pytest.raises(ValueError, match="refuses two ranks on one GPU at the first collective"):
            get("jax").plan_ranks(layout, None, None, None)
        # One rank has the GPU to itself: its cap is what XLA allows, of CUDA's total, under jaxlib's current
        # variable where the user set it (never both names: jaxlib refuses that and JAX falls back to CPU).
        layout = rank_layout(1, gpus)
        env = {"XLA_CLIENT_MEM_FRACTION": "0.9"}
    else:
        env = {}
    plans = get("jax").plan_ranks(layout, None, 2048, None)
    plans = [dataclasses.replace(p, env={**p.env, **env}) for p in plans]
    ranks = run_ranks(plans, [2048] * len(plans), "jax_psum.py")
    results = [lines[-1] for lines in ranks]
    print(json.dumps({"plans": [p.args for p in plans], "setup": [lines[0] for lines in ranks], "results": results}))
    n = len(plans)
    assert all(r["platform"] == "gpu" and r["sum"] == n * (n + 1) / 2 for r in results)
    for result in results:
        assert abs(result["bytes_limit"] - 2048 * MIB) < MIB  # the cap asked, to the MiB
        assert result["peak"] <= result["bytes_limit"]
        assert result["over_cap"] == "RESOURCE_EXHAUSTED"
        assert not ("XLA_CLIENT_MEM_FRACTION" in result["env"] and "XLA_PYTHON_CLIENT_MEM_FRACTION" in result["env"])
