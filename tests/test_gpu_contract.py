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
    "total_bytes": 85_520_809_984,
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
