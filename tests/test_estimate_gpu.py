"""The PyTorch estimate against a real GPU's own count (``torch.cuda.max_memory_allocated``).
Skipped where torch sees no GPU. Uses the framework engine alone, so it runs where
only torch is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

CELL = """
import torch
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, device="cuda") for _ in range(8)])
{wrap}
opt = torch.optim.Adam(model.parameters())
x = torch.randn(256, 2048, device="cuda")
for _ in range(2):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""
FSDP = "for layer in model:\n    fully_shard(layer)\nfully_shard(model)"


@pytest.mark.parametrize("wrap", ["", FSDP], ids=["single-device", "fsdp2-one-rank"])
def test_estimate_within_ten_percent_of_max_memory_allocated(wrap):
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU here")
    import torch.distributed as dist

    from vgpu_magic.frameworks.torch.estimate import estimate_rank

    cell = CELL.format(wrap=wrap)
    estimated = estimate_rank(cell, 1, 0, None)["peak_bytes"]
    assert not dist.is_initialized()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if wrap:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        exec(cell, {})
        torch.cuda.synchronize()
        real = torch.cuda.max_memory_allocated() - before
    finally:
        if wrap:
            dist.destroy_process_group()
    print(f"estimated {estimated} B, max_memory_allocated {real} B ({estimated / real - 1:+.1%})")
    assert abs(estimated - real) <= 0.10 * real


JAX_CELL = (Path(__file__).parent / "scripts" / "jax_step_cell.py").read_text()


def test_jax_estimate_within_ten_percent_of_a_gpu_peak():
    """The estimate compiles for CPU devices; a GPU's own peak after the same cell."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU here")
    from vgpu_magic.frameworks.jax.estimate import estimate_ranks

    estimated = estimate_ranks(JAX_CELL, 1, [0], None)[0]["peak_bytes"]
    before = jax.devices()[0].memory_stats()["bytes_in_use"]
    exec(JAX_CELL, {})
    real = jax.devices()[0].memory_stats()["peak_bytes_in_use"] - before
    print(f"JAX: estimated {estimated} B, GPU peak_bytes_in_use {real} B ({estimated / real - 1:+.1%})")
    assert abs(estimated - real) <= 0.10 * real
