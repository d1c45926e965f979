"""``%%vgpu_estimate`` runs the user's cell as it is written: the README's example, a step that logs its loss,
the device idiom, ``torch.compile``, a pytree of JAX shardings; and leaves the notebook's objects as they were."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from IPython.core.error import UsageError

import vgpu_magic
from support import kernel_output, kernel_run, needs_jax, started_kernel
from vgpu_magic.errors import PlanError

ROOT = Path(__file__).resolve().parents[1]
CELL_FILE = "<vgpu_estimate cell>"
STEP = """import torch
device = {device}
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).to(device)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(64, 256, device=device)).sum().backward()
opt.step()
"""
CPU_STEP = STEP.format(device='"cpu"')


@pytest.fixture
def notebook(ip):
    """The test shell, with what a test's cells defined removed afterwards (other tests share the shell)."""
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        del ip.user_ns[name]


def test_the_notebooks_objects_are_untouched_by_a_cell_that_shards_and_trains_them(notebook):
    ip = notebook
    ip.run_cell("import torch\nmodel = torch.nn.Linear(16, 16)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
    model, weight = ip.user_ns["model"], ip.user_ns["model"].weight
    before = weight.detach().clone()
    ip.run_cell_magic("vgpu_estimate", "--ranks 2", "model(torch.randn(2, 16)).sum().backward()\nopt.step()")
    assert weight.grad is None and torch.equal(weight, before)
    cell = "from torch.distributed.fsdp import fully_shard\nmodel.to(torch.bfloat16)\nfully_shard(model)\n"
    ip.run_cell_magic("vgpu_estimate", "--ranks 2", cell + "model(torch.randn(2, 16)).sum().backward()")
    assert ip.user_ns["model"] is model and type(model) is torch.nn.Linear and model.weight is weight
    assert type(weight) is torch.nn.Parameter and weight.dtype == torch.float32 and weight.grad is None
    assert torch.equal(weight, before) and model(torch.randn(2, 16)).shape == (2, 16)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a notebook's CUDA model needs a CUDA build of torch")
def test_the_notebooks_functions_and_gpu_models_are_estimated_on_copies():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a notebook's model on a GPU, as the estimate sees it (a CUDA tensor), without one
        on_gpu = torch.nn.Linear(16, 16, device="cuda")
    model = torch.nn.Linear(16, 16)
    namespace = {"torch": torch, "model": model, "on_gpu": on_gpu}
    exec("def train():\n    model(torch.randn(2, 16)).sum().backward()", namespace)
    cell = "train()\non_gpu(torch.randn(2, 16, device='cuda')).sum().backward()"
    found = vgpu_magic.estimate(cell, ranks=2, namespace=namespace)
    assert found.ranks[0].categories["parameters"] >= 2 * (16 * 16 + 16) * 4  # both models
    assert model.weight.grad is None and on_gpu.weight.grad is None and namespace["train"].__globals__ is namespace


#: The example the README showed when issue 37 (row 18) was filed: a model built on the CPU, moved with .cuda().
OLD_README_EXAMPLE = (
    "--gpu 8xH100 -o fit",
    "model = Net().cuda()\nfor layer in model.layers:\n    fully_shard(layer)\nfully_shard(model)\n"
    "opt = torch.optim.AdamW(model.parameters())\nmodel(batch).sum().backward(); opt.step()\n",
)


def test_a_model_moved_with_cuda_runs_as_the_readme_wrote_it(notebook):
    ip = notebook
    line, cell = OLD_README_EXAMPLE
    ip.run_cell(
        "import torch\nfrom torch.distributed.fsdp import fully_shard\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layers = torch.nn.ModuleList(torch.nn.Linear(512, 512) for _ in range(4))\n"
        "    def forward(self, x):\n"
        "        for layer in self.layers:\n"
        "            x = layer(x)\n"
        "        return x\n"
        "batch = torch.randn(32, 512, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
    )
    found = ip.run_cell_magic("vgpu_estimate", line, cell)
    assert found.parallelism == "FSDP2" and found.world == 8 and found.fits is True
    assert ip.user_ns[line.split("-o ")[1]] is found


def test_a_step_that_reads_its_loss_is_estimated_and_names_the_lines():
    cell = CPU_STEP + "loss = model(torch.randn(4, 256)).sum()\nprint(loss.item())\n"
    cell += "if loss > 3:\n    print('high')\nprint(loss)\n"
    found = vgpu_magic.estimate(cell, ranks=2)
    assert found.peak_bytes > 0
    (note,) = found.notes
    assert note.startswith("lines 8, 9 read a tensor's value") and "0 stood in" in note


def test_a_step_behind_a_read_value_is_said_to_be_skipped_not_missing():
    cell = "import torch\nmodel = torch.nn.Linear(64, 64, device='cuda')\n"
    cell += "loss = model(torch.randn(8, 64, device='cuda')).pow(2).mean()\nif loss.item() > 0:\n    loss.backward()\n"
    with pytest.raises(PlanError) as refused:
        vgpu_magic.estimate(cell, ranks=2)
    said = str(refused.value)
    assert "no training step" not in said and "line 4 read a tensor's value" in said and "0 stood in" in said
    assert "\n" not in said


def test_a_value_dependent_shape_is_one_line_of_advice(ip):
    cell = CPU_STEP + "x = model(torch.randn(4, 256))\nidx = torch.nonzero(x > 0)\n"
    with pytest.raises(UsageError) as refused:
        ip.run_cell_magic("vgpu_estimate", "--ranks 2", cell)
    said = str(refused.value)
    assert said.startswith("line 8 ('idx = torch.nonzero(x > 0)')") and "torch.nonzero_static" in said
    assert "\n" not in said
    fixed = cell.replace("torch.nonzero(x > 0)", "torch.nonzero_static(x > 0, size=8)")
    assert vgpu_magic.estimate(fixed, ranks=2).peak_bytes > 0  # what the advice says works


def test_the_device_idiom_is_estimated_for_the_gpu():
    idiom = vgpu_magic.estimate(STEP.format(device='"cuda" if torch.cuda.is_available() else "cpu"'), gpu="2x80GB")
    cuda = vgpu_magic.estimate(STEP.format(device='"cuda"'), gpu="2x80GB")
    assert idiom.peak_bytes == cuda.peak_bytes and idiom.ranks[0].categories == cuda.ranks[0].categories
    assert not torch.cuda.is_available() or torch.cuda.device_count() > 0  # the kernel's own answer is back
    asks = "assert torch.cuda.device_count() == 2 and torch.cuda.get_device_properties(0).total_memory == 80 * 2**30\n"
    vgpu_magic.estimate(
        STEP.format(device='"cuda"') + asks + "torch.cuda.synchronize()\ntorch.cuda.empty_cache()\n", gpu="2x80GB"
    )


def test_a_compiled_model_is_estimated_eagerly_and_said_so():
    found = vgpu_magic.estimate(CPU_STEP.replace(".to(device)", "\nmodel = torch.compile(model)"), ranks=1)
    assert found.peak_bytes > 0 and any("torch.compile was estimated eagerly" in n for n in found.notes)
    method = vgpu_magic.estimate(CPU_STEP.replace(".to(device)", "\nmodel.compile()"), ranks=1)
    assert method.peak_bytes == found.peak_bytes
    assert torch.compile is not None and torch.compile.__module__ == "torch"


@needs_jax
def test_the_framework_is_what_the_code_uses_not_its_comments():
    with pytest.raises(PlanError, match="--framework jax: the cell uses torch; say --framework torch"):
        vgpu_magic.estimate("raise AssertionError('ran')\nimport torch", ranks=2, framework="jax")
    with pytest.raises(PlanError, match="no jitted step"):  # a JAX cell (no torch ran) whose comment names torch
        vgpu_magic.estimate("# as in torch\nimport jax.numpy as jnp\nx = jnp.ones(3)", ranks=2)


def test_a_cell_that_uses_two_frameworks_that_can_be_estimated_must_say_which():
    with pytest.raises(PlanError, match=r"the cell uses JAX and PyTorch; say --framework jax or torch$"):
        vgpu_magic.estimate("raise AssertionError('ran')\nimport torch, jax", ranks=2)
    with pytest.raises(PlanError, match="tensorflow cannot be estimated"):
        vgpu_magic.estimate("raise AssertionError('ran')\nimport torch, jax", ranks=2, framework="tf")
    with pytest.raises(PlanError, match="tensorflow cannot be estimated"):  # Keras alone: its default backend's
        vgpu_magic.estimate("raise AssertionError('ran')\nimport keras", ranks=2)


#: A framework that ``%%vgpu_estimate`` can estimate: one package, its ``estimate`` module beside it.
FAKE_PACKAGE = {
    "__init__.py": """
from vgpu_magic.devices import Capabilities
from vgpu_magic.frameworks.base import Framework

class Fake(Framework):
    capabilities = Capabilities(name="fakefw", label="FakeFW")
    module = "fakefw"
    runtime_started = probe_inventory = read_configuration = None

    def estimator(self):
        from . import estimate

        return estimate

FRAMEWORK = Fake()
""",
    "estimate.py": """
from vgpu_magic.frameworks.base import Lever, RankEstimate, RankMemory

SIMULATED = ()

def estimate_ranks(cell, code, world, ranks, namespace, gpu, progress):
    progress(f"{sorted(code.co_names)} on {world} ranks, {gpu}")
    return [RankEstimate(RankMemory(r, (r + 1) << 30, {"state": (r + 1) << 30}, "in its step"),
                         f"fake over {world}", ("fakefw.shard",)) for r in ranks]

def kept_mib(gpu_mib):
    return gpu_mib // 4

def levers(parts, world, parallelism, uses):
    return [Lever(f"{sorted(uses)} {parallelism}", ranks=2 * world),
            Lever("half the state", saves=parts["state"] // 2, note="at most")]
""",
}


def test_a_framework_package_and_its_registry_line_are_all_an_estimate_needs(tmp_path, monkeypatch):
    from vgpu_magic import frameworks
    from vgpu_magic.estimate_magics import EstimateMagics
    from vgpu_magic.memory_estimate import estimable

    assert f"{' or '.join(estimable())}; default: the cell's" in EstimateMagics.vgpu_estimate.parser.format_help()
    (tmp_path / "fakefw").mkdir()
    for name, text in FAKE_PACKAGE.items():
        (tmp_path / "fakefw" / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(frameworks, "_instances", {})
    # Imported before it is registered, as the extension's load imports every registered framework first.
    monkeypatch.setitem(frameworks.REGISTRY, "fakefw", importlib.import_module("fakefw").FRAMEWORK)
    try:
        lines = []
        found = vgpu_magic.estimate("import fakefw\nfakefw.step()", gpu="2x1GB", all_ranks=True, progress=lines.append)
        with pytest.raises(
            PlanError, match=r"cannot tell the framework of this cell; say --framework jax or torch or fakefw$"
        ):
            vgpu_magic.estimate("x = 1")
    finally:
        for name in ("fakefw", "fakefw.estimate"):
            sys.modules.pop(name, None)
    assert lines == ["['fakefw', 'step'] on 2 ranks, ('1 GiB', 1073741824)", "['fakefw', 'step'] on 4 ranks, None"]
    assert (found.framework, found.parallelism, [r.peak_bytes >> 30 for r in found.ranks]) == (
        "FakeFW",
        "fake over 2",
        [1, 2],
    )
    assert found.kept_bytes == 256 << 20 and found.fits is False
    assert found.levers == [
        "['fakefw.shard'] fake over 2: peak 1.00 GiB, still does not fit by 256.0 MiB (re-estimated)",
        "half the state: at best peak 1.00 GiB, still does not fit by 256.0 MiB (at most)",
    ]


@pytest.mark.slow
def test_jax_places_a_pytree_with_a_pytree_of_shardings(no_process_left_behind):
    cell = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((len(jax.devices()),), ("data",))
shardings = {"w1": NamedSharding(mesh, P()), "w2": NamedSharding(mesh, P())}
params = jax.device_put({"w1": jnp.ones((256, 256)), "w2": jnp.ones((256, 256))}, shardings)
x = jax.device_put(jnp.ones((64, 256)), NamedSharding(mesh, P("data")))
step = jax.jit(lambda p, x: jax.tree.map(lambda w, g: w - g, p, jax.grad(lambda p: jnp.mean(x @ p["w1"] @ p["w2"]))(p)))
params = jax.device_put(step(params, x), shardings)
params = step(params, x)
"""
    found = vgpu_magic.estimate(cell, ranks=4)
    assert found.framework == "JAX" and found.ranks[0].categories["arguments"] >= 2 * 256 * 256 * 4


def test_a_cells_own_errors_cite_the_cell_only(ip):
    with pytest.raises(UsageError, match=r"^line 3 of the cell: .*'def f\(:'$"):
        ip.run_cell_magic("vgpu_estimate", "--ranks 2", "import torch\nx = 1\ndef f(:\n    pass")
    with pytest.raises(ValueError, match="the cell's own") as raised:
        vgpu_magic.estimate(CPU_STEP + 'raise ValueError("the cell\'s own")', ranks=2)
    files = {frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)}
    assert files == {__file__, vgpu_magic.memory_estimate.__file__, CELL_FILE}  # the call, the raise, the cell
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UsageError, match=r"has its own torch\.distributed process group"):
            ip.run_cell_magic("vgpu_estimate", "--ranks 2", CPU_STEP)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_kernel_shows_a_failing_cell_in_its_own_lines(no_process_left_behind):
    with started_kernel() as (_, kc):
        kernel_run(kc, "%load_ext vgpu_magic")
        cell = CPU_STEP + "raise ValueError('the cell failed here')"
        (error,) = [
            m["content"] for m in kernel_run(kc, f"%%vgpu_estimate --ranks 2\n{cell}") if m["msg_type"] == "error"
        ]
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["traceback"]))
    assert "ValueError: the cell failed here" in shown and "raise ValueError" in shown
    assert "site-packages" not in shown and "vgpu_magic" not in shown, shown
    assert shown.count("File ") == 1 and len(shown.splitlines()) <= 14, shown  # IPython's own line, then the cell


@pytest.mark.slow
def test_an_estimate_beside_tensorflow_leaves_no_triton_placeholder(no_process_left_behind):
    code = (
        "import sys, tensorflow, vgpu_magic\n"
        f"vgpu_magic.estimate({CPU_STEP!r}, ranks=2)\n"
        "assert sys.modules.get('triton', 1) is not None, 'triton is None'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_status_in_a_torch_only_kernel_shows_torch_and_imports_no_tensorflow(no_process_left_behind):
    with started_kernel() as (_, kc):
        kernel_run(kc, "import sys, torch\n%load_ext vgpu_magic\nreport = %vgpu_status -r\n")
        shown = kernel_output(kc, "print('tensorflow' in sys.modules, [s.label for s in report.sections])")
    assert shown["stdout"].strip() == "False ['PyTorch']", shown


@pytest.mark.slow
def test_a_failing_jax_cell_names_its_line_and_error(no_process_left_behind):
    with pytest.raises(RuntimeError, match=r"^line 3 of the cell: ValueError: the cell's own \(in the estimate's"):
        vgpu_magic.estimate('import jax\nx = jax.numpy.ones(3)\nraise ValueError("the cell\'s own")', ranks=2)
