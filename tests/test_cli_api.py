"""``python -m vgpu_magic`` and the Python API.

The CLI runs as a real child process. Invalid API calls run in the test process
(they are refused before anything is configured, which the tests check); valid
splits run in fresh interpreters.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from IPython.core.error import UsageError

import vgpu_magic
import vgpu_magic.api
from support import CHILD_ENV, ROOT, last_json, run_python, tf_device_configuration, two_gpus
from vgpu_magic.errors import PlanError
from vgpu_magic.planner import plan_split


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vgpu_magic", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=CHILD_ENV,
        cwd=ROOT,
    )


def error_lines(stderr: str) -> list[str]:
    """The CLI's own error lines (TensorFlow may log to stderr too)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# -- CLI ----------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_status_json_does_not_start_the_runtime():
    proc = cli("status", "--json")
    assert proc.returncode == 0, proc.stderr
    [report] = json.loads(proc.stdout)["frameworks"]
    assert report["framework"] == "tensorflow"
    assert report["runtime"]["started"] is False
    assert report["runtime"]["started_by"] is None
    assert report["runtime"]["cuda_context_holders"] == []
    assert report["version"].count(".") >= 2
    assert report["logical"][0]["name"] == "/device:CPU:0"
    assert report["replicas"] == 1
    assert report["host_memory_shared"] is None


@pytest.mark.slow
def test_cli_plan_validates_without_configuring():
    proc = cli("plan", "4")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["status"] == "planned"
    assert result["devices"] == [f"/device:CPU:{i}" for i in range(4)]
    assert result["plan"]["device_type"] == "CPU"
    assert result["plan"]["memory_limits_mib"] == [None] * 4
    assert result["plan"]["magic_line"] == "%vgpu_split 4"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["plan", "4", "--memory", "10"], "memory caps are not supported on CPU devices"),
        (["plan", "0"], "device count 0 is out of range"),
        (["plan", "four"], "'four' is not a device count"),
        (["plan"], "nothing to do"),
    ],
)
def test_cli_plan_errors_exit_2_with_one_line(args, fragment):
    proc = cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr
    assert fragment in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_keeps_a_quoted_size_list_as_one_argument():
    # `--memory "1024, 2048"` is one argument; the CLI used to re-join argv with spaces and split it again.
    proc = cli("plan", "2", "--memory", "1024, 2048")
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        "error: memory caps are not supported on CPU devices (TensorFlow cannot cap logical CPUs); "
        "drop --memory, e.g. %vgpu_split 2"
    ]


@pytest.mark.slow
def test_a_broken_tensorflow_is_reported_with_its_reason(tmp_path):
    # TensorFlow that is installed but cannot be imported (a missing CUDA library, an interrupted first import)
    # is not "not installed".
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ImportError('libcudnn.so.9: cannot open shared object file: No such file or directory')\n"
    )
    env = {**CHILD_ENV, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_magic", "status"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        "error: TensorFlow failed to import: libcudnn.so.9: cannot open shared object file: No such file or directory"
    ]
    missing = tmp_path / "empty"
    missing.mkdir()
    (missing / "tensorflow.py").write_text("import tensorflow_core_that_is_missing\n")
    env = {**CHILD_ENV, "PYTHONPATH": f"{missing}:{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu_magic", "status"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert error_lines(proc.stderr) == [
        "error: TensorFlow failed to import: No module named 'tensorflow_core_that_is_missing'"
    ]


@pytest.mark.slow
def test_cli_usage_error_from_argparse():
    proc = cli("frobnicate")
    assert proc.returncode == 2
    assert "invalid choice: 'frobnicate'" in proc.stderr


# -- API: refusals (in process; nothing gets configured) ------------------------------


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        (("x",), {}, "count 'x' is not a whole number"),
        ((2.5,), {}, "count 2.5 is not a whole number"),
        ((True,), {}, "count True is not a whole number"),
        ((0,), {}, "device count 0 is out of range"),
        ((-1,), {}, "device count -1 is out of range"),
        ((65,), {}, "device count 65 is out of range"),
        ((2,), {"memory": 1024}, "memory caps are not supported on CPU devices"),
        ((2,), {"memory": [1024, 2048]}, "memory caps are not supported on CPU devices"),
        ((2,), {"memory": "lots"}, "memory 'lots' is not a size"),
        ((2,), {"memory": 1.5}, "memory 1.5 is not a size"),
        ((2,), {"memory": [1024, None]}, "memory item None is not a size"),
        ((2,), {"gpu": 0}, "TensorFlow sees no GPU here"),
        ((2,), {"gpu": "0"}, "gpu '0' is not a GPU index"),
        ((2,), {"cpu": True, "gpu": 0}, "--cpu and --gpu contradict each other"),
        ((2,), {"visible": "0"}, "visible '0' is not a list of GPU indices"),
        ((2,), {"others": "maybe"}, "--others 'maybe' is not a choice"),
        ((2,), {"growth": True}, "--growth cannot be combined with a split"),
        ((), {}, "nothing to do"),
    ],
)
def test_api_split_refuses_with_value_error(args, kwargs, fragment, cpu_inventory):
    before = tf_device_configuration()
    with pytest.raises(ValueError) as err:
        vgpu_magic.split(*args, **kwargs)
    assert isinstance(err.value, vgpu_magic.PlanError)
    assert fragment in str(err.value)
    assert len(str(err.value).splitlines()) == 1
    assert tf_device_configuration() == before


def test_api_plan_returns_a_plan_without_configuring(cpu_inventory):
    before = tf_device_configuration()
    plan = vgpu_magic.plan(4)
    assert isinstance(plan, vgpu_magic.SplitPlan)
    assert (plan.device_type, plan.count, plan.memory_limits) == ("CPU", 4, (None,) * 4)
    with pytest.raises(ValueError, match="memory caps are not supported"):
        vgpu_magic.plan(4, memory="2GB")
    assert tf_device_configuration() == before


# -- API: splits and status (fresh interpreters) ----------------------------------------

AFTER_START = """
import json, re, warnings
import vgpu_magic

first = vgpu_magic.split(3)
before_start = vgpu_magic.status()
import tensorflow as tf
big = tf.random.normal((256, 1024))  # starts the runtime and keeps 1 MiB on the host allocator
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    different = vgpu_magic.split(2)
with warnings.catch_warnings(record=True) as caught_same:
    warnings.simplefilter("always")
    same = vgpu_magic.split(3)
report = vgpu_magic.status()
print(json.dumps({
    "first": first.status,
    "different": different.status,
    "different_devices": different.devices,
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
    "same": same.status,
    "same_warnings": len(caught_same),
    "before_text": str(before_start),
    "before_html": before_start._repr_html_(),
    "text": str(report),
    "html": report._repr_html_(),
    "json": report.to_dict(),
    "replicas": vgpu_magic.strategy().num_replicas_in_sync,
}))
"""

#: A formatted byte figure, as status prints memory ("1.0 MiB", "0 B").
FIGURE = re.compile(r"\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB)\b")


@pytest.fixture(scope="module")
def after_start():
    return last_json(run_python(AFTER_START).stdout)


@pytest.mark.slow
def test_different_split_after_start_warns_and_is_blocked(after_start):
    assert after_start["first"] == "applied"
    assert after_start["different"] == "blocked"
    assert after_start["different_devices"] == ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    categories = [c for c, _ in after_start["warnings"]]
    assert categories == ["RuntimeStartedWarning"]
    message = after_start["warnings"][0][1]
    assert message.splitlines()[:2] == [
        "TensorFlow's runtime already started, so devices can no longer change.",
        "  started by: code outside a notebook cell",
    ]
    assert "restart the kernel and run %vgpu_split 2 before any TensorFlow code" in message
    assert after_start["same"] == "unchanged"
    assert after_start["same_warnings"] == 0
    assert after_start["replicas"] == 3


@pytest.mark.slow
def test_status_before_start_lists_planned_devices(after_start):
    devices = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    for rendering in (after_start["before_text"], after_start["before_html"]):
        assert all(d in rendering for d in devices)
        assert "planned; created when the runtime starts" in rendering
        assert FIGURE.search(rendering) is None  # no memory figures before the runtime runs
    assert "MirroredStrategy() would use 3 devices" in after_start["before_text"]


@pytest.mark.slow
def test_status_after_start_shows_host_memory_once_as_shared(after_start):
    devices = ["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"]
    for rendering in (after_start["text"], after_start["html"]):
        assert all(d in rendering for d in devices)
        assert rendering.count("one allocator shared by 3 logical CPUs") == 1
        # One "in use" and one "peak" figure for the host, never one per logical CPU.
        assert len(FIGURE.findall(rendering)) == 2, rendering
    in_use = re.search(r"(\d+(?:\.\d+)?) MiB in use", after_start["text"])
    assert in_use and float(in_use.group(1)) >= 1.0  # the live 1 MiB tensor is counted
    [report] = after_start["json"]["frameworks"]
    assert report["runtime"]["started"] is True
    assert report["host_memory_shared"]["current"] >= 256 * 1024 * 4
    assert report["host_memory_shared"]["peak"] >= report["host_memory_shared"]["current"]
    assert [d["current"] for d in report["logical"]] == [None, None, None]
    assert report["replicas"] == 3


# -- the API takes numpy integers and iterators, and refuses the rest with ValueError ----------


def test_numpy_integers_are_accepted(cpu_inventory):
    before = tf_device_configuration()
    plan = vgpu_magic.plan(np.int64(3))
    assert plan.count == 3
    result = vgpu_magic.split(np.int32(3), dry_run=True)
    assert result.status == "planned" and result.replicas == 3
    request = vgpu_magic.api.make_request(2, memory=np.int64(1024), gpu=np.int64(0), visible=[np.int64(0)])
    assert (request.memory, request.gpu, request.visible) == (1024, 0, (0,))
    assert tf_device_configuration() == before


def test_an_iterator_for_visible_is_read_once():
    request = vgpu_magic.api.make_request(4, gpu=1, visible=iter([1]))
    assert request.visible == (1,)
    assert plan_split(request, two_gpus()).visible_gpus == (1,)  # not "--visible none"


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: vgpu_magic.api.make_request(4, visible=0), "visible 0 is not a list of GPU indices"),
        (lambda: vgpu_magic.api.make_request(4, visible=[0.5]), "visible [0.5] is not a list"),
        # The value as numpy writes it: np.float64(2.0) from numpy 2, 2.0 before (numpy 1.26 with TensorFlow 2.16).
        (lambda: vgpu_magic.api.make_request(np.float64(2.0)), f"count {np.float64(2.0)!r} is not a whole number"),
        (lambda: vgpu_magic.api.make_request(2, memory=object()), "is not a size"),
        (lambda: vgpu_magic.plan(3, dry_run=True, colour="red"), "unknown option 'colour'"),
    ],
)
def test_bad_api_values_raise_value_error_not_type_error(call, fragment):
    with pytest.raises(ValueError) as err:
        call()
    assert fragment in str(err.value)


def test_plan_takes_splits_arguments(cpu_inventory):
    assert vgpu_magic.plan(3, dry_run=True).count == 3


def test_dir_lists_the_lazy_public_names():
    names = dir(vgpu_magic)
    for name in ("split", "plan", "status", "strategy", "panel", "MemoryMonitor", "SplitResult", "PlanError"):
        assert name in names


def test_long_bad_values_are_quoted_as_an_excerpt(cpu_inventory, ip):
    huge = "x" * 10_000
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("vgpu_split", huge)
    assert len(str(err.value)) < 200 and "(10000 characters)" in str(err.value)
    with pytest.raises(PlanError) as err:
        vgpu_magic.api.make_request(2, memory=huge)
    assert len(str(err.value)) < 200
