"""``vgpu_magic.estimate()`` and ``%%vgpu_estimate``: each estimate proved against a
real run measured by the same tracker (torch's MemTracker) in real mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from IPython.core.error import UsageError
from torch.nn.parallel import DistributedDataParallel

import vgpu_magic
from support import needs_jax
from vgpu_magic.errors import PlanError
from vgpu_magic.inventory import CUDA_CONTEXT_MIB
from vgpu_magic.memory_estimate import MemoryEstimate, RankMemory, parse_gpu
from vgpu_magic.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
MEASURE = ROOT / "tests" / "scripts" / "measure_cell.py"
GIB = 2**30

#: What every cell trains: two Adam steps of ``model`` on a batch of 64 rows of ``{width}``.
TWO_STEPS = """opt = torch.optim.Adam(model.parameters())
x = torch.randn(64, {width})
for _ in range(2):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
"""
FSDP_CELL = """
import torch
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1000, 1000) for _ in range(8)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
""" + TWO_STEPS.format(width=1000)
DDP_CELL = FSDP_CELL.replace(
    "for layer in model:\n    fully_shard(layer)\nfully_shard(model)",
    "model = torch.nn.parallel.DistributedDataParallel(model{options})",
)
TP_CELL = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
""" + TWO_STEPS.format(width=1024)
PLAIN_CELL = FSDP_CELL.replace("for layer in model:\n    fully_shard(layer)\nfully_shard(model)\n", "")


def measured_on_gloo_ranks(cell: str, ranks: int, tmp_path: Path) -> list[int]:
    """Each rank's peak on real gloo ranks under torchrun, by rank."""
    script = tmp_path / "cell.py"
    script.write_text(cell)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", str(ranks), str(MEASURE), str(script)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    return [r["peak_bytes"] for r in sorted(found, key=lambda r: r["rank"])]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cell", "ranks", "parallelism"),
    [(FSDP_CELL, 2, "FSDP2"), (FSDP_CELL, 4, "FSDP2"), (DDP_CELL.format(options=""), 2, "DDP"),
     (DDP_CELL.format(options=", gradient_as_bucket_view=True"), 2, "DDP"), (TP_CELL, 2, "TP (DTensor)")],
    ids=["fsdp2", "fsdp2-4-ranks", "ddp", "ddp-bucket-view", "tensor-parallel"],
)  # fmt: skip
def test_each_rank_within_ten_percent_of_a_real_gloo_run(cell, ranks, parallelism, tmp_path, no_process_left_behind):
    real = measured_on_gloo_ranks(cell, ranks, tmp_path)
    estimated = vgpu_magic.estimate(cell, ranks=ranks, all_ranks=True)
    assert len(real) == ranks and estimated.parallelism == parallelism
    for rank, peak in enumerate(real):
        assert abs(estimated.ranks[rank].peak_bytes - peak) <= 0.10 * peak, (rank, estimated, real)


def test_single_device_estimate_equals_the_same_step_run_for_real():
    from vgpu_magic.frameworks.torch.fake_rank import PeakTracker

    with PeakTracker() as tracker:
        exec(PLAIN_CELL, {})
    real = tracker.result()
    estimated = vgpu_magic.estimate(PLAIN_CELL, ranks=1)
    assert estimated.peak_bytes == real["peak_bytes"]
    assert estimated.ranks[0].categories == real["categories"]
    assert estimated.ranks[0].phase == real["phase"] == "in the optimizer step"
    assert estimated.parallelism == "single device"


@pytest.mark.slow
def test_the_estimate_and_its_tracker_import_after_tensorflow(py):
    """With TensorFlow loaded, importing Triton crashes the process (torch's memory tools import it): importing
    the tracker and estimating hide it (a test file that imported the tracker crashed a worker of `make test`)."""
    py(f"""
        import sys
        import tensorflow
        from vgpu_magic.frameworks.torch.fake_rank import PeakTracker
        import vgpu_magic
        assert vgpu_magic.estimate({PLAIN_CELL!r}, ranks=2).peak_bytes > 0
        assert "triton" not in sys.modules, "the hidden Triton stayed hidden"
        """)


def test_fsdp_over_more_ranks_needs_less_per_rank_and_ddp_keeps_its_buckets():
    two = vgpu_magic.estimate(FSDP_CELL, ranks=2)
    eight = vgpu_magic.estimate(FSDP_CELL, ranks=8)
    assert two.parallelism == "FSDP2"
    assert eight.ranks[0].categories["parameters"] < two.ranks[0].categories["parameters"] / 3
    ddp = vgpu_magic.estimate(DDP_CELL.format(options=""), ranks=8)
    params = ddp.ranks[0].categories["parameters"]
    assert ddp.parallelism == "DDP"
    assert ddp.ranks[0].categories["communication buffers"] == params  # one flat bucket per dtype


def test_cuda_code_is_estimated_without_a_gpu_with_cudas_defaults():
    """CUDA's 512 B blocks, and the optimizer's foreach kernels that it takes by default on CUDA."""
    cpu = vgpu_magic.estimate(FSDP_CELL.replace("parameters())", "parameters(), foreach=True)"), ranks=2)
    cuda = vgpu_magic.estimate(
        FSDP_CELL.replace("1000)", "1000, device='cuda')").replace("64, 1000)", "64, 1000, device='cuda')")
        + "\nassert x.device.type == 'cpu' and not torch.cuda.is_initialized()",
        ranks=2,
    )
    assert cpu.peak_bytes <= cuda.peak_bytes <= cpu.peak_bytes * 1.01
    assert all(v % 512 == 0 for v in cuda.ranks[0].categories.values())


def swapped_by_the_estimate() -> list:
    """What the estimate replaces for a rank's run, as the classes and modules themselves hold it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from vgpu_magic.frameworks.torch.fake_rank import mem_tracker

    held = [(torch.Tensor, "__deepcopy__"), (torch.nn.Parameter, "__deepcopy__"), (torch.nn.Module, "compile"),
            (DeviceMesh, "__init__"), (mem_tracker._WeakRefInfo, "_calculate_mem_consumed"), (torch, "compile"),
            (dist, "init_process_group"), (torch.cuda, "is_available"), (sys, "excepthook"),
            (torch.nn.parallel, "DistributedDataParallel")]  # fmt: skip
    return [vars(owner)[name] for owner, name in held]


def test_the_kernel_is_untouched_whatever_the_cell_raised():
    import torch.distributed as dist

    before = dict(os.environ), swapped_by_the_estimate()
    namespace = {"keep": 1}
    with pytest.raises(ZeroDivisionError):
        vgpu_magic.estimate(FSDP_CELL + "\nkeep = 2\n1 / 0", ranks=4, namespace=namespace)
    assert not dist.is_initialized()
    assert (dict(os.environ), swapped_by_the_estimate()) == before
    assert namespace == {"keep": 1}
    assert torch.ones(2).sum().item() == 2.0  # no fake mode left on
    with pytest.raises(ZeroDivisionError):
        vgpu_magic.estimate(ddp_step_that_fails, ranks=2)
    assert "left_behind" not in globals() and DistributedDataParallel.__module__ == "torch.nn.parallel.distributed"
    assert (dict(os.environ), swapped_by_the_estimate()) == before


def test_what_an_estimate_changes_in_a_mapping_is_put_back_when_it_raises():
    from vgpu_magic.frameworks.base import restored

    mapping = {"kept": "1", "changed": "2", "deleted": "3"}
    with pytest.raises(ZeroDivisionError), restored(mapping):
        mapping.update(changed="two", added="4")
        del mapping["deleted"]
        raise ZeroDivisionError
    assert mapping == {"kept": "1", "changed": "2", "deleted": "3"}


def ddp_step():
    """A step whose DDP is a name of this module, bound at import (not looked up in torch when it runs)."""
    model = DistributedDataParallel(torch.nn.Linear(1000, 1000))
    model(torch.randn(64, 1000)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def ddp_step_that_fails():
    """A step that leaves a name in its module before it fails."""
    global left_behind
    left_behind = DistributedDataParallel
    ddp_step()
    raise ZeroDivisionError


def test_a_function_is_estimated_with_its_own_module_names_stood_in_for():
    found = vgpu_magic.estimate(ddp_step, ranks=2)
    assert found.parallelism == "DDP"
    assert found.ranks[0].categories["communication buffers"] == 1001 * 1000 * 4
    assert DistributedDataParallel is torch.nn.parallel.distributed.DistributedDataParallel  # restored


def test_verdict_after_cuda_context_and_levers():
    fits = vgpu_magic.estimate(FSDP_CELL, gpu="2xT4")
    assert fits.world == 2 and fits.fits is True
    assert fits.spare_bytes == (15360 - CUDA_CONTEXT_MIB) * 2**20 - fits.peak_bytes
    assert fits.verdict == f"fits, {format_bytes(fits.spare_bytes)} to spare" and not fits.levers
    lines = []
    tight = vgpu_magic.estimate(FSDP_CELL, ranks=2, gpu="600MB", progress=lines.append)
    assert tight.fits is False and tight.verdict.startswith("does not fit by ")
    assert lines == [f"estimating: the cell runs as rank 0 of {n} (PyTorch, fake tensors)…" for n in (2, 4)]
    more = next(lever for lever in tight.levers if lever.startswith("FSDP over 4 ranks: peak "))
    assert more.endswith("(re-estimated)") and not any("reshard" in lever for lever in tight.levers)
    data = json.loads(tight.to_json())
    assert data["fits"] is False and data["ranks"][0]["peak_bytes"] == tight.peak_bytes
    assert "does not fit by" in str(tight) and "<table>" in tight._repr_html_()
    # What it only simulates, once, last (issue 48).
    said = "simulated: fake tensors and a fake process group; NCCL's buffers are a fixed reserve, not counted"
    assert [line for line in str(tight).splitlines() if "simulated" in line] == [said]
    assert str(fits).splitlines()[-1] == said
    assert "<th style='text-align:left'>simulated</th><td style='text-align:left'>fake tensors" in fits._repr_html_()


LEVER_CELL = """
import torch
from torch.utils.checkpoint import checkpoint
torch.manual_seed(0)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
            for _ in range(4)
        )
    def forward(self, x):
        for block in self.blocks:
            x = {call}
        return x
model = Net()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(4096, 256)
for _ in range(2):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled={bf16}):
        loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
PLAIN, CHECKPOINTED = "block(x)", "checkpoint(block, x, use_reentrant=False)"
KEPT = "(if nothing were kept for the backward; it keeps each checkpointed block's input)"


def test_levers_are_bounds_that_hold_each_marked_and_none_the_cell_uses():
    checkpointed = vgpu_magic.estimate(LEVER_CELL.format(call=CHECKPOINTED, bf16=False))
    size = f"{CUDA_CONTEXT_MIB + -(-checkpointed.peak_bytes // 2**20)}MB"  # checkpointing makes it fit
    plain = vgpu_magic.estimate(LEVER_CELL.format(call=PLAIN, bf16=False), gpu=size)
    assert plain.fits is False and checkpointed.peak_bytes < plain.peak_bytes
    lever = next(lever for lever in plain.levers if lever.startswith("activation checkpointing: at best peak "))
    assert lever.endswith(f"could fit {KEPT}")
    best = plain.peak_bytes - plain.ranks[0].categories["activations"]
    assert best <= checkpointed.peak_bytes and format_bytes(best) in lever  # a bound the real lever does not beat
    assert all(lever.endswith(("could fit", f"could fit {KEPT}")) or "still does not fit by" in lever
               for lever in plain.levers)  # fmt: skip
    tiny = f"{CUDA_CONTEXT_MIB + 1}MB"
    assert "still does not fit by" in vgpu_magic.estimate(LEVER_CELL.format(call=PLAIN, bf16=False), gpu=tiny).levers[0]
    uses = vgpu_magic.estimate(LEVER_CELL.format(call=CHECKPOINTED, bf16=True), gpu=tiny)
    assert uses.levers and not [lever for lever in uses.levers if "checkpointing" in lever or "bf16" in lever]
    half = vgpu_magic.estimate(LEVER_CELL.format(call=PLAIN, bf16=True), gpu=tiny)
    assert [lever.split(":")[0] for lever in half.levers] == ["activation checkpointing", "half the batch"]


def test_reshard_is_offered_only_to_a_cell_that_turned_it_off_and_jax_temporaries_are_not_activations():
    from vgpu_magic.frameworks.jax.estimate import levers
    from vgpu_magic.memory_estimate import _judged

    no_reshard = FSDP_CELL.replace("fully_shard(layer)", "fully_shard(layer, reshard_after_forward=False)")
    off = vgpu_magic.estimate(no_reshard, ranks=2, gpu="600MB")
    assert off.parallelism == "FSDP2"
    assert any(
        lever.startswith("reshard_after_forward=True (the default; this cell passes False)") for lever in off.levers
    )
    step = RankMemory(
        0, 3 * GIB, {"arguments": GIB, "outputs": GIB // 2, "temporaries": GIB + GIB // 2}, "in jitted step"
    )
    jax = MemoryEstimate("JAX", 8, [step], "SPMD over 8 devices", "2 GiB", 2 * GIB, GIB // 2)
    (lever,) = levers(step.categories, 8, jax.parallelism, set())
    assert lever.saves == GIB + GIB // 2
    assert [_judged(lever, jax, rerun=None)] == [
        "jax.checkpoint, bf16, a smaller batch shrink XLA's temporaries: at best peak 1.50 GiB, could fit (with none)"
    ]


@needs_jax
def test_a_jax_cell_that_checkpoints_in_bf16_is_offered_neither():
    cell = JAX_CELL.read_text().replace("jnp.ones((512, 1024))", "jnp.ones((512, 1024), jnp.bfloat16)")
    cell = cell.replace("def loss(", "@jax.checkpoint\ndef loss(")
    found = vgpu_magic.estimate(cell, gpu="2x16MB")
    assert found.fits is False and len(found.levers) == 1, found
    assert found.levers[0].startswith("a smaller batch shrink XLA's temporaries: at best peak ")


BLOCKS_CELL = """
import torch
from torch.distributed.fsdp import fully_shard
{build}
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(1, 4, 512, device="cuda")).sum().backward()
opt.step()
"""
BLOCK = "torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)"


@pytest.mark.parametrize(
    ("build", "phase"),
    [(f"model = torch.nn.Sequential(*[{BLOCK} for _ in range(8)])\nfor block in model:\n    fully_shard(block)",
      "while the model is built"),
     (f"with torch.device('meta'):\n    model = torch.nn.Sequential(*[{BLOCK} for _ in range(8)])\n"
      "for block in model:\n    fully_shard(block)\nmodel.to_empty(device='cuda')", "in the backward")],
    ids=["built-whole", "meta-recipe"],
)  # fmt: skip
def test_parameters_made_before_a_forward_are_parameters_and_meta_tensors_take_no_memory(build, phase):
    """The unsharded model built whole is its peak, as parameters; FSDP2's meta-device recipe holds only shards,
    as when each block is built and sharded in turn."""
    found = vgpu_magic.estimate(BLOCKS_CELL.format(build=build), ranks=8)
    in_turn = "model = torch.nn.Sequential()\nfor _ in range(8):\n    model.append(fully_shard(" + BLOCK + "))"
    each = vgpu_magic.estimate(BLOCKS_CELL.format(build=in_turn), ranks=8)
    assert found.ranks[0].phase == phase
    if phase == "while the model is built":
        assert set(found.ranks[0].categories) - {"parameters"} <= {
            k for k, v in found.ranks[0].categories.items() if not v
        }
        assert found.peak_bytes == found.ranks[0].categories["parameters"] > each.peak_bytes
    else:
        assert found.peak_bytes == each.peak_bytes and found.ranks[0].categories == each.ranks[0].categories


def test_a_memory_estimate_renders_its_figures():
    rank = RankMemory(0, 3 * GIB, {"parameters": GIB, "activations": 2 * GIB}, "in the backward")
    found = MemoryEstimate("PyTorch", 2, [rank], gpu_label="4 GiB", gpu_bytes=4 * GIB, kept_bytes=GIB // 2)
    assert found.verdict == "fits, 512.0 MiB to spare"
    shown = "rank 0: peak 3.00 GiB in the backward; held at that moment: parameters 1.00 GiB · activations 2.00 GiB"
    assert shown in str(found)
    assert str(found).splitlines()[1].startswith("verdict: ")  # first, above the figures it sums up
    assert "<tr style='font-weight:bold;color:var(--jp-success-color1)'><th style='text-align:left'>verdict" in (
        found._repr_html_()
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("80GB", (None, 81920)), ("8x80GB", (8, 81920)), ("H100", (None, 81559)), ("8 x a100-40gb", (8, 40960)),
     ("rtx 4090", (None, 24564)), ("2048", (None, 2048))],
)  # fmt: skip
def test_gpu_sizes_and_models(text, expected):
    assert parse_gpu(text)[:2] == expected


def test_a_gpu_size_prints_rounded_and_alone_means_one_gpu():
    assert [parse_gpu(t)[2] for t in ("1200MB", "80GB", "600MB", "1.5GB")] == [
        "1.17 GiB",
        "80 GiB",
        "600.0 MiB",
        "1.50 GiB",
    ]
    found = vgpu_magic.estimate(PLAIN_CELL, gpu="1200MB")
    assert found.world == 1 and "on 1.17 GiB, less" in str(found)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"gpu": "H900"}, "'H900' is neither a size nor a GPU model"), ({"ranks": 0}, "ranks 0 is not"),
     ({"ranks": 2, "rank": 2}, "rank 2 is not a rank of 2"), ({"gpu": "4x80GB", "ranks": 2}, "make them agree"),
     ({"ranks": 2, "framework": "tf"}, "tensorflow cannot be estimated"), ({"gpu": "0x80GB"}, "counts no GPUs"),
     ({"gpu": "8x24"}, "'8x24' would be 24 MiB per GPU; give the unit, e.g. 8x24GB$")],
)  # fmt: skip
def test_bad_input_is_one_line_before_anything_runs(kwargs, match):
    with pytest.raises(PlanError, match=match):
        vgpu_magic.estimate("raise AssertionError('ran')\nimport torch", **kwargs)


def test_magic_estimates_stores_and_refuses(ip, capsys):
    found = ip.run_cell_magic("vgpu_estimate", "--gpu 2xL4 -o fit", FSDP_CELL)
    assert "estimating: the cell runs as rank 0 of 2 (PyTorch, fake tensors)…" in capsys.readouterr().out
    assert ip.user_ns["fit"] is found and found.fits is True and found.world == 2
    assert "model" not in ip.user_ns
    for line, match in [
        ("--ranks 0", "--ranks 0 is out of range; use 1.."),
        ("--ranks 2 --gpu H900", "'H900' is neither"),
        ("--ranks 2 --rank -1", "--rank -1 is negative"),
        ("--ranks 2 -o 1a", "not a variable name"),
        ("--ranks 2 --gpu", "--gpu needs a value"),
        ("--ranks 2 --gpu -1GB", "--gpu '-1GB' is neither a size nor a GPU model"),
        ("--gpu -1GB --ranks 2", "--gpu '-1GB' is neither a size nor a GPU model"),
        ("--gpu 8x24", "e.g. 8x24GB"),
    ]:
        with pytest.raises(UsageError, match=match):
            ip.run_cell_magic("vgpu_estimate", line, "raise AssertionError('ran')\nimport torch")
    with pytest.raises(UsageError, match="no training step"):
        ip.run_cell_magic("vgpu_estimate", "--ranks 2", "import torch\ntorch.nn.Linear(3, 3)(torch.ones(3))")
    with pytest.raises(UsageError, match="made no tensors"):
        ip.run_cell_magic("vgpu_estimate", "--ranks 2", "import torch\nx = 1")


def test_a_capped_ranks_out_of_memory_error_names_the_cap_in_scripts_and_cells(ip, capsys):
    """What setup_rank installs on a rank with a --memory cap, here without CUDA (test_estimate_gpu.py runs it
    against a real cap): a script's uncaught error, as launch.py reports it, and a cell's."""
    from vgpu_magic.frameworks.torch import say_the_cap

    note = "vgpu_magic: this rank hit the rehearsal's simulated cap of 1024 MiB on GPU 0"
    script = f"from vgpu_magic.frameworks.torch import say_the_cap\nimport torch\nsay_the_cap({note!r})\n"
    script += "raise torch.OutOfMemoryError('CUDA out of memory.')"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.stderr.strip().endswith(f"torch.OutOfMemoryError: CUDA out of memory.\n{note}"), proc.stderr
    hook = sys.excepthook
    try:
        say_the_cap(note)
        ip.run_cell("import torch\nraise torch.OutOfMemoryError('CUDA out of memory.')")
        ip.run_cell("raise RuntimeError('CUDA out of memory.')")  # not torch's: left alone
    finally:
        sys.excepthook = hook
        ip.set_custom_exc((), None)
    shown = capsys.readouterr().out
    assert shown.count(note) == 1 and "OutOfMemoryError: CUDA out of memory." in shown, shown


@pytest.mark.slow
def test_a_cell_on_a_real_engine_that_runs_out_of_memory_names_the_cap(no_process_left_behind):
    import ipyparallel as ipp

    from vgpu_magic.frameworks.torch import say_the_cap

    note = "vgpu_magic: this rank hit the rehearsal's simulated cap of 1024 MiB on GPU 0"
    with ipp.Cluster(n=1, log_level=40) as client:
        engine = client[:]
        engine.apply_sync(say_the_cap, note)
        with pytest.raises(ipp.error.CompositeError) as raised:
            engine.execute("import torch\nraise torch.OutOfMemoryError('CUDA out of memory.')", block=True)
    assert raised.value.elist[0][:2] == ("OutOfMemoryError", f"CUDA out of memory.\n{note}")


JAX_CELL = ROOT / "tests" / "scripts" / "jax_step_cell.py"


@pytest.mark.slow
def test_jax_step_on_eight_devices_matches_the_live_bytes_of_a_real_run(no_process_left_behind):
    """Arguments and outputs per device, against a real 8-device run's live arrays on device 0
    (CPU devices keep no allocator statistics, so temporaries are proved on a GPU only)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "measure_jax_cell.py"), str(JAX_CELL)],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.split("MEASURED ", 1)[1])["live_bytes"]
    had_jax = "jax" in sys.modules
    estimated = vgpu_magic.estimate(JAX_CELL.read_text(), ranks=8)
    assert ("jax" in sys.modules) == had_jax  # compiled in a helper process: this one's JAX is untouched
    parts = estimated.ranks[0].categories
    assert estimated.parallelism == "SPMD over 8 devices" and estimated.framework == "JAX"
    assert str(estimated).splitlines()[-1] == (
        "simulated: the cell's jitted steps compiled for CPU devices, not run (XLA's memory_analysis())"
    )
    assert parts["temporaries"] > 0
    assert abs(parts["arguments"] + parts["outputs"] - real) <= 0.10 * real, (parts, real)


@needs_jax
def test_jax_without_a_jitted_step_and_tensorflow_are_refused():
    with pytest.raises(PlanError, match="no jitted step"):
        vgpu_magic.estimate("import jax.numpy as jnp\nx = jnp.ones(3)", ranks=2)
    with pytest.raises(PlanError, match="tensorflow cannot be estimated"):
        vgpu_magic.estimate("import tensorflow as tf\nx = tf.ones(3)", ranks=2)
