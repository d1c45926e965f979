"""What happens when cells start TensorFlow's runtime in different orders.

Every scenario is a fresh interpreter with a real ``InteractiveShell``; cells run
through ``shell.run_cell(source, store_history=True)`` so execution counts
advance as in a notebook, and each cell's stdout and stderr are captured
separately.
"""

from __future__ import annotations

import json

import pytest

from support import last_json, run_python

pytestmark = pytest.mark.slow

DRIVER = """
import contextlib, io, json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
cells = []


def runtime_started():
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context
    return bool(context.context()._initialized)


def cell(source):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = shell.run_cell(source, store_history=True)
    value = result.result
    cells.append({
        "count": result.execution_count,
        "ok": result.success,
        "out": out.getvalue(),
        "err": err.getvalue(),
        "started": runtime_started(),
        "result": value.to_dict() if hasattr(value, "to_dict") else None,
    })
"""


def run_cells(*sources: str, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``sources`` as consecutive cells of one fresh shell; one dict per cell."""
    code = DRIVER + "".join(f"cell({s!r})\n" for s in sources) + "print(json.dumps(cells))\n"
    cells = last_json(run_python(code, env=env).stdout)
    assert [c["count"] for c in cells] == list(range(1, len(sources) + 1))
    return cells


def assert_blocked(cell: dict, culprit: str) -> None:
    """The cell tried a different split after the runtime started."""
    assert cell["ok"], cell
    assert cell["result"]["status"] == "blocked"
    lines = cell["err"].strip().splitlines()
    # Short lines: what happened, which cell (quoted), what to do.
    assert lines[0] == "vgpu_magic warning: TensorFlow's runtime already started, so devices can no longer change."
    assert lines[1] == f"  started by: {culprit}"
    assert "nothing was configured" in lines[2]
    assert "restart the kernel and run %vgpu_split" in lines[3] and "before any TensorFlow code" in lines[3]
    assert "VGPU_MAGIC_SPLIT" in lines[3]
    assert "Traceback" not in cell["out"] + cell["err"]


STARTERS = {
    "tf op": "x = tf.constant([1.0, 2.0]) * 2",
    "keras model": "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])",
    "MirroredStrategy": "strategy = tf.distribute.MirroredStrategy()",
    "list_logical_devices": "tf.config.list_logical_devices()",
    "tf.device": "with tf.device('/CPU:0'):\n    y = tf.zeros(1)",
}


@pytest.mark.parametrize("starter", STARTERS.values(), ids=STARTERS.keys())
def test_split_after_the_runtime_started_names_the_culprit_cell(starter):
    cells = run_cells(
        "%load_ext vgpu_magic",
        "import tensorflow as tf\nimport keras",
        starter,
        "%vgpu_split 2 -r",
        "%vgpu_split 1 -r",
    )
    assert [c["started"] for c in cells] == [False, False, True, True, True]
    # The line that started it (`with tf.device(...)` itself does, before its body).
    assert_blocked(cells[3], f"line 1 of the cell In [3]: `{starter.splitlines()[0]}`")
    assert cells[3]["result"]["devices"] == ["/device:CPU:0"]
    # One uncapped CPU is what the runtime already has: identical, so quiet.
    assert cells[4]["result"]["status"] == "unchanged"
    assert cells[4]["err"] == ""


def test_identical_split_after_start_is_quiet_and_a_different_one_is_blocked():
    cells = run_cells(
        "%load_ext vgpu_magic",
        "%vgpu_split 2",
        "import tensorflow as tf\nstrategy = tf.distribute.MirroredStrategy()\nstrategy.num_replicas_in_sync",
        "%vgpu_split 2 -r",
        "%vgpu_split 3 -r",
        "tf.distribute.MirroredStrategy().num_replicas_in_sync",
    )
    assert cells[1]["started"] is False
    assert "vgpu_magic: TensorFlow configured 2 logical CPUs" in cells[1]["out"]
    assert "Out[3]: 2" in cells[2]["out"]
    assert cells[3]["result"]["status"] == "unchanged"
    assert cells[3]["err"] == ""
    # A quiet no-op: one line.
    first = cells[3]["out"].splitlines()[0]
    assert first == "vgpu_magic: TensorFlow already has 2 logical CPUs on CPU:0; nothing changed"
    assert len([line for line in cells[3]["out"].splitlines() if line.startswith(("vgpu_magic", "  "))]) == 1
    assert_blocked(cells[4], "line 2 of the cell In [3]: `strategy = tf.distribute.MirroredStrategy()`")
    assert "it keeps its 2 replica devices" in cells[4]["err"]
    assert cells[4]["result"]["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert "Out[6]: 2" in cells[5]["out"]


@pytest.mark.parametrize(
    ("sources", "blocked", "culprit"),
    [
        # the cell that starts the runtime and splits is blamed, and again by the next split
        (
            ("%load_ext vgpu_magic", "import tensorflow as tf\nx = tf.ones(2)\n%vgpu_split 2 -r", "%vgpu_split 3 -r"),
            (1, 2),
            "line 2 of the cell In [2]: `x = tf.ones(2)`",
        ),
        # the extension loaded after TensorFlow's import but before its start: loading says nothing
        (
            ("import tensorflow as tf", "%load_ext vgpu_magic", "v = tf.Variable(3.0)", "%vgpu_split 4 -r"),
            (3,),
            "line 1 of the cell In [3]: `v = tf.Variable(3.0)`",
        ),
    ],
    ids=["splits-in-the-starting-cell", "loaded-after-the-import"],
)
def test_the_cell_that_started_the_runtime_is_blamed(sources, blocked, culprit):
    cells = run_cells(*sources)
    assert all(cells[i]["err"] == "" for i in range(blocked[0]) if "%load_ext" in sources[i])
    for i in blocked:
        assert_blocked(cells[i], culprit)


def test_the_line_that_started_the_runtime_is_named_not_the_cells_first():
    cells = run_cells(
        "%load_ext vgpu_magic",
        "import numpy as np\nx = 1\nimport tensorflow as tf\ny = tf.constant(1)",
        "%vgpu_split 2 -r",
        "%vgpu_status --json",
    )
    assert_blocked(cells[2], "line 4 of the cell In [2]: `y = tf.constant(1)`")
    [status] = json.loads(cells[3]["out"])["frameworks"]
    assert status["runtime"]["started_by"] == "line 4 of the cell In [2]: `y = tf.constant(1)`"


#: Where torch sees no GPU, its CUDA start runs as on a GPU machine but for the driver's own call.
TORCH = "import torch\nif not torch.cuda.is_available():\n    torch._C._cuda_init = lambda: None"


@pytest.mark.parametrize("first", [("%load_ext vgpu_magic", TORCH), (TORCH, "%load_ext vgpu_magic")])
def test_the_line_that_started_torch_cuda_is_named(first):
    cells = run_cells(
        *first,
        "import numpy as np\nx = np.ones(2)\ntorch.cuda.init()\ny = torch.ones(1)",
        "%vgpu_status --framework torch --json",
        "from vgpu_magic.runtime import runtime_state\nprint(runtime_state(framework='tensorflow').describe())",
        "%vgpu_status --framework torch",
    )
    assert all(c["ok"] for c in cells), cells
    culprit = "line 3 of the cell In [3]: `torch.cuda.init()`"
    [status] = json.loads(cells[3]["out"])["frameworks"]
    assert status["runtime"]["started"] is True and status["runtime"]["started_by"] == culprit
    # What another framework's status and split say of the CUDA context torch holds.
    assert cells[4]["out"].strip().endswith(f"CUDA context already held by PyTorch (since {culprit})")
    # In torch's words: its CUDA runtime, a device per process (not TensorFlow's runtime and replicas).
    text = cells[5]["out"].splitlines()
    assert text[0].startswith("PyTorch ")
    assert text[0].endswith(f" — CUDA runtime started by {culprit} — devices can no longer change")
    assert text[-1] == (
        "Devices: a DistributedDataParallel rank would use 1 device; "
        "more devices are more ranks: %vgpu_cluster start 2 --framework torch"
    )


def test_extension_loaded_after_the_runtime_started():
    cells = run_cells(
        "import tensorflow as tf",
        "x = tf.constant(1.0)",
        "%load_ext vgpu_magic",
        "%vgpu_split 2 -r",
        "%vgpu_split 1 -r",
    )
    warning = cells[2]["err"].strip()
    assert len(warning.splitlines()) == 1, warning
    assert warning.startswith(
        "vgpu_magic warning: TensorFlow's runtime already started, so devices can no longer change. "
        "Started by: a cell run before vgpu_magic"
    )
    assert "Restart the kernel and run %load_ext vgpu_magic before any TensorFlow code" in warning
    assert_blocked(cells[3], "a cell run before vgpu_magic was loaded")
    assert cells[4]["result"]["status"] == "unchanged"


def test_status_and_dry_run_never_start_the_runtime():
    cells = run_cells(
        "%load_ext vgpu_magic",
        "%vgpu_status",
        "%vgpu_split 2",
        "%vgpu_status --json",
        "report = %vgpu_status -r\nimport vgpu_magic\napi_report = vgpu_magic.status()",
        "%vgpu_split 4 --dry-run -r",
        "import tensorflow as tf\ntf.distribute.MirroredStrategy().num_replicas_in_sync",
        "%vgpu_status --json",
    )
    assert [c["started"] for c in cells] == [False] * 6 + [True, True]
    assert all(c["ok"] for c in cells), cells
    assert "runtime not started" in cells[1]["out"]

    [before] = json.loads(cells[3]["out"])["frameworks"]
    assert before["runtime"]["started"] is False
    assert before["replicas"] == 2
    assert [d["name"] for d in before["logical"]] == ["/device:CPU:0", "/device:CPU:1"]
    assert before["host_memory_shared"] is None

    dry = cells[5]["result"]
    assert dry["status"] == "planned"
    assert len(dry["devices"]) == 4
    assert "Out[7]: 2" in cells[6]["out"]  # the dry run configured nothing

    [after] = json.loads(cells[7]["out"])["frameworks"]
    assert after["runtime"]["started"] is True
    assert after["runtime"]["started_by"] == (
        "line 2 of the cell In [7]: `tf.distribute.MirroredStrategy().num_replicas_in_sync`"
    )
    assert after["replicas"] == 2
