"""The GPU contract, checked on a machine without a GPU: GPU-shaped inputs (an NVML that
answers, CUDA's figures, environment variables, GPU physical devices injected into CPU
TensorFlow) fed to the frameworks' own decision code — torch's backend map, jaxlib's GPU
plugin options, TensorFlow's cross-device ops and ``GPUOptions`` — asserting what a real GPU
run would get. What only a real card can show is in ``test_gpu_real.py``.

Figures from an H100 (driver 580): NVML's total 85,520,809,984 B, CUDA's 85,017,493,504 B.
"""

from __future__ import annotations

import pytest

from support import last_json, run_python
from vgpu_magic.inventory import GPUInfo

MIB = 2**20
CUDA_TOTAL = 85_017_493_504
NVML_TOTAL_MIB = 85_520_809_984 // MIB
H100 = {
    "nvml_index": 0,
    "model": "NVIDIA H100 80GB HBM3",
    "total_mib": NVML_TOTAL_MIB,
    "free_mib": 81075,
    "compute_capability": (9, 0),
    "uuid": "GPU-0",
}


# -- torch: what init_process_group's backend becomes on ranks that share a GPU ----------------------------
def test_torch_maps_nccl_and_its_default_to_gloo_for_cuda(monkeypatch):
    """Asked of torch's own ``BackendConfig``, on a machine whose accelerator is CUDA: no backend
    means NCCL for cuda tensors (what fails with two ranks on one GPU); the mapped strings mean gloo."""
    torch = pytest.importorskip("torch")
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from vgpu_magic.frameworks.torch import gloo_for_nccl

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    if hasattr(torch._C, "_get_accelerator"):  # where torch 2.13's BackendConfig asks
        monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    assert BackendConfig(Backend.UNDEFINED).get_device_backend_map() == {"cuda": "nccl"}
    assert BackendConfig("nccl").get_device_backend_map() == {"cuda": "nccl"}
    for asked in (None, "nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"):
        mapped = BackendConfig(gloo_for_nccl(asked)).get_device_backend_map()
        assert mapped == {"cpu": "gloo", "cuda": "gloo"}, asked
    assert BackendConfig(gloo_for_nccl("gloo")).get_device_backend_map() == {"cpu": "gloo", "cuda": "gloo"}


TORCH_RANK_SETUP = """
import json, os, tempfile, types
import torch
import torch.distributed as dist
from vgpu_magic.frameworks.torch import setup_rank

# CUDA as an H100 shows it to torch; nothing else of torch is faked.
calls = []
torch.cuda.set_device = lambda gpu: calls.append(("set_device", gpu))
torch.cuda.get_device_properties = lambda gpu: types.SimpleNamespace(total_memory=85017493504)
torch.cuda.set_per_process_memory_fraction = lambda fraction, gpu: calls.append(("fraction", fraction, gpu))
said = setup_rank("gloo", 0, 8192)
store = tempfile.mktemp()
os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)  # as the user's script says
t = torch.ones(2)
dist.all_reduce(t)
print(json.dumps({"said": said, "calls": calls, "backend": dist.get_backend(), "sum": t.tolist()}))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_torch_rank_sharing_a_gpu_joins_on_gloo_capped_against_cudas_total():
    pytest.importorskip("torch")
    out = last_json(run_python(TORCH_RANK_SETUP).stdout)
    assert out["calls"][0] == ["set_device", 0]
    # torch multiplies the fraction by CUDA's total: 8192 MiB exactly, not 0.7 % less (NVML's total).
    fraction = out["calls"][1][1]
    assert out["calls"][1] == ["fraction", fraction, 0] and round(fraction * CUDA_TOTAL) == 8192 * MIB
    assert out["backend"] == "cpu:gloo,cuda:gloo"
    assert out["sum"] == [1.0, 1.0]
    assert "NCCL mapped to gloo" in out["said"]


# -- JAX: the fraction's variable, as jaxlib's GPU plugin reads it ----------------------------------------
@pytest.mark.parametrize("users_name", ["XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", None])
def test_jaxlib_reads_the_cap_under_one_name_as_a_fraction_of_cudas_total(monkeypatch, users_name):
    pytest.importorskip("jax")
    from jaxlib import xla_client

    from vgpu_magic.frameworks import jax as fj

    monkeypatch.setattr(fj.FRAMEWORK, "_gpus", lambda: ((GPUInfo(0, total_mib=NVML_TOTAL_MIB, free_mib=81075),), True))
    monkeypatch.setattr(fj, "cuda_total_bytes", lambda index: CUDA_TOTAL)
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE"):
        monkeypatch.delenv(name, raising=False)
    if users_name:
        monkeypatch.setenv(users_name, "0.9")  # the user's own setting, which the cap replaces
    old = fj.FRAMEWORK.read_configuration()
    new = fj.ConfigSnapshot(old.cpu_names, old.gpu_names, {"/physical_device:GPU:0": (2048,)}, (0,), (False,))
    fj.FRAMEWORK.write_configuration(old, new)
    options = xla_client.generate_pjrt_gpu_plugin_options()  # raises where both names are set
    assert round(options["memory_fraction"] * CUDA_TOTAL) == 2048 * MIB
    assert fj.FRAMEWORK.read_configuration().logical["/physical_device:GPU:0"] == (2048,)


# -- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------------------
def test_an_empty_cuda_visible_devices_shows_no_gpu(monkeypatch):
    from vgpu_magic import inventory
    from vgpu_magic.frameworks import jax as fj

    monkeypatch.setattr(inventory, "nvml_gpus", lambda: [H100])
    monkeypatch.setattr(fj, "nvml_gpus", lambda: [H100])
    monkeypatch.setattr(fj, "gpu_backend_installed", lambda: True)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.index for g in inventory.visible_gpus()] == [0]
    assert fj.FRAMEWORK._gpu_count([H100]) == 1
    for empty in ("", " "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", empty)  # CUDA: device_count() == 0
        assert inventory.visible_gpus() == ()
        assert fj.FRAMEWORK._gpu_count([H100]) == 0
        assert inventory.cuda_to_nvml_order(1, [H100]) == [None]


# -- TensorFlow: GPUs injected into CPU TensorFlow's eager context, read by TensorFlow's own code ---------
#: N GPUs as TensorFlow's eager context lists them before its runtime starts (what a CUDA build reads from
#: the driver), and NVML answering for them as an H100 does. Nothing starts TensorFlow's runtime.
INJECT = """
import json
import tensorflow as tf
from tensorflow.python.eager import context
import vgpu_magic
from vgpu_magic.frameworks import tensorflow as ftf

ctx = context.context()
ctx._initialize_physical_devices()
fake = [context.PhysicalDevice(f"/physical_device:GPU:{{i}}", "GPU") for i in range({n})]
ctx._physical_devices = ctx._physical_devices + fake
ctx._physical_device_to_index = {{d: i for i, d in enumerate(ctx._physical_devices)}}
ctx._visible_device_list = ctx._visible_device_list + fake
ctx._memory_growth_map.update({{d: None for d in fake}})
h100 = {h100}
ftf.nvml_gpus = lambda: [dict(h100, nvml_index=i, uuid=f"GPU-{{i}}") for i in range({n})]


def gpu_options():
    options = ctx._compute_gpu_options()  # what TensorFlow hands its runtime when it starts
    return {{
        "allow_growth": options.allow_growth,
        "visible": options.visible_device_list,
        "virtual": [list(v.memory_limit_mb) for v in options.experimental.virtual_devices],
    }}


def refused(call):
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None
"""


def _inject(n: int) -> str:
    return INJECT.format(n=n, h100=repr(H100))


GROWTH_THEN_CPU_SPLIT = """
growth = vgpu_magic.split(growth=True).status
after_growth = gpu_options()
# The CPU split with GPU 0 kept visible: TensorFlow would drop growth and preallocate the card.
visible_cpu_split = refused(lambda: vgpu_magic.split(4, cpu=True, visible=[0]))
unchanged = gpu_options()
# What TensorFlow itself would do with that configuration, had it been written:
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 4
)
print(json.dumps({"growth": growth, "after_growth": after_growth, "refused": visible_cpu_split,
                  "unchanged": unchanged, "tf_would": gpu_options()}))
"""


@pytest.mark.slow
def test_growth_and_a_cpu_split_with_a_visible_gpu_cannot_both_be_claimed():
    out = last_json(run_python(_inject(1) + GROWTH_THEN_CPU_SPLIT).stdout)
    assert out["growth"] == "applied"
    assert out["after_growth"] == {"allow_growth": True, "visible": "0", "virtual": []}
    assert out["refused"].startswith("memory growth is on for GPU 0, and TensorFlow drops it once any device is split")
    assert out["unchanged"] == out["after_growth"]
    # TensorFlow's own options for the refused configuration: growth gone, GPU 0 one device of the whole card.
    assert out["tf_would"] == {"allow_growth": False, "visible": "0", "virtual": [[]]}


UNDO = """
gpu0 = tf.config.list_physical_devices("GPU")[0]
def failing_growth(device, enable):
    raise RuntimeError("growth could not be set")
tf.config.experimental.set_memory_growth = failing_growth
old = ftf.FRAMEWORK.read_configuration()
new = ftf.ConfigSnapshot(old.cpu_names, old.gpu_names, {gpu0.name: (1024, 1024)}, old.visible_gpus, (True,))
try:
    ftf.FRAMEWORK.write_configuration(old, new)
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"error": error, "logical": tf.config.get_logical_device_configuration(gpu0),
                  "options": gpu_options(), "back": ftf.FRAMEWORK.read_configuration() == old}))
"""


@pytest.mark.slow
def test_a_failed_write_is_undone_back_to_no_logical_devices():
    out = last_json(run_python(_inject(1) + UNDO).stdout)
    assert out["error"] == "RuntimeError: growth could not be set"  # the failure itself, the undo worked
    assert out["logical"] is None and out["back"] is True
    assert out["options"] == {"allow_growth": False, "visible": "0", "virtual": []}


CROSS_DEVICE_OPS = """
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute.mirrored_strategy import MirroredExtended

result = vgpu_magic.split(2, memory=4096, gpu=0, dry_run=True)
plan = result.plan
snap = ftf.FRAMEWORK.read_configuration()
from vgpu_magic.planner import configuration_after
after = configuration_after(plan, snap)
logical = [context.LogicalDevice(name, "GPU") for name in after.replica_devices()]
# MirroredStrategy()'s own choice, asked with the devices the split gives (its runtime is not started).
ctx.list_logical_devices = lambda device_type=None: logical
extended = MirroredExtended.__new__(MirroredExtended)
extended._devices = tuple(d.name for d in logical)
extended._collective_key_base = 0
extended._communication_options = collective_util.Options()
extended._make_collective_ops_with_fallbacks()
print(json.dumps({"notes": list(plan.notes), "devices": list(extended._devices),
                  "implementation": extended._communication_options.implementation.name}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("gpus", "implementation"), [(1, "RING"), (2, "NCCL"), (4, "NCCL")])
def test_a_split_that_makes_mirrored_strategy_choose_nccl_says_so(gpus, implementation):
    out = last_json(run_python(_inject(gpus) + CROSS_DEVICE_OPS).stdout)
    assert out["devices"] == ["/device:GPU:0", "/device:GPU:1"]
    # AUTO where TensorFlow keeps its default: NCCL for GPUs (RING only with fewer physical GPUs than logical).
    chosen = "NCCL" if out["implementation"] == "AUTO" else out["implementation"]
    assert chosen == implementation
    warned = [note for note in out["notes"] if "would pick NCCL" in note]
    assert bool(warned) == (implementation == "NCCL")
    if warned:
        assert f"counts all {gpus} GPUs, hidden ones too, against 2 logical GPUs" in warned[0]
        assert "vgpu_magic.strategy()" in warned[0]


# -- MIG: a GPU in MIG mode is its MIG devices, each with its own memory --------------------------------
class NVMLError(Exception):
    pass


def _nvml_with_mig():
    """pynvml for one H100 in MIG mode with two 1g.10gb devices: the whole card's memory cannot be read
    (NVML answers "Not Supported" for a MIG-enabled parent on some drivers), each MIG device's can."""
    import types

    card, migs = object(), [object(), object()]

    def memory(handle):
        if handle is card:
            raise NVMLError("Not Supported")
        return types.SimpleNamespace(total=10 * 1024 * MIB, free=9 * 1024 * MIB)

    def mig_handle(handle, k):
        if k >= len(migs):
            raise NVMLError("Not Found")
        return migs[k]

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda i: card,
        nvmlDeviceGetMigMode=lambda handle: (1, 1),
        nvmlDeviceGetMaxMigDeviceCount=lambda handle: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetCudaComputeCapability=lambda handle: (9, 0),
        nvmlDeviceGetName=lambda handle: "NVIDIA H100 80GB HBM3" + ("" if handle is card else " MIG 1g.10gb"),
        nvmlDeviceGetUUID=lambda handle: "GPU-aaaa" if handle is card else f"MIG-{migs.index(handle)}bbb",
    )


def test_mig_devices_are_listed_with_their_own_memory_and_named_by_cuda_visible_devices(monkeypatch):
    from vgpu_magic import inventory
    from vgpu_magic.layout import HostReport, layout_ranks

    monkeypatch.setattr(inventory, "open_nvml", _nvml_with_mig)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1bbb")
    gpus = inventory.visible_gpus()
    assert [(g.index, g.uuid, g.total_mib, g.free_mib) for g in gpus] == [(0, "MIG-1bbb", 10240, 9216)]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    both = inventory.visible_gpus()
    assert [g.uuid for g in both] == ["MIG-0bbb", "MIG-1bbb"]
    # Two ranks, one on each MIG device of the same card: each has a device of its own.
    layout = layout_ranks([HostReport(e, "h", "127.0.0.1", 0, both, 0) for e in range(2)])
    assert [(p.gpu.uuid, p.gpu_shared_by) for p in layout.places] == [("MIG-0bbb", 1), ("MIG-1bbb", 1)]
