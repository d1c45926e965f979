"""TensorFlow and JAX ranks on real ipyparallel engines: MultiWorkerMirroredStrategy
over TF_CONFIG (same weights as two plain TF_CONFIG processes), and
jax.distributed with 2 processes × 2 CPU devices. Each TensorFlow test starts its own
processes, the JAX tests share one cluster; each stop checks that no process of ours is left."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import CHILD_ENV, ROOT, our_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPTS = Path(__file__).parent / "scripts"


@contextlib.contextmanager
def ranks_of(framework: str, n: int, **options):
    from vgpu_magic.ranks import RankCluster

    before = our_processes()
    ranks = RankCluster(n, framework, **options).start()
    try:
        yield ranks
    finally:
        ranks.stop()
        assert our_processes() <= before


def quiet_run(ranks, code: str):
    """Run ``code`` with ``-o`` semantics; the ranks' (TensorFlow-chatty) output is kept, not shown."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return ranks.run(code, output=True), out.getvalue()


@pytest.mark.anycpu
def test_tensorflow_workers_match_plain_tf_config_processes(tmp_path):
    from vgpu_magic.ranks.hosts import free_port

    ports = {free_port()}
    while len(ports) < 2:
        ports.add(free_port())
    workers = [f"localhost:{p}" for p in sorted(ports)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "mwms_parity.py")],
            env={
                **CHILD_ENV,
                "PARITY_OUT": str(tmp_path / "weights"),
                "TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}),
            },
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in results]
    plain = [json.loads((tmp_path / f"weights.{i}").read_text()) for i in range(2)]

    with ranks_of("tensorflow", 2) as ranks:
        # Wiring a CPU worker imports nothing: TensorFlow's runtime is the user's to start.
        imported, _ = quiet_run(ranks, "import sys\n'tensorflow' in sys.modules")
        assert imported == [False, False]
        ours, _ = quiet_run(ranks, (SCRIPTS / "mwms_parity.py").read_text())
        replicas, _ = quiet_run(ranks, "(strategy.num_replicas_in_sync, strategy.cluster_resolver.task_id)")
        assert replicas == [(2, 0), (2, 1)]
    assert ours == plain
    assert plain[0] == plain[1]


def test_a_tensorflow_rank_with_devices_reads_what_the_script_set_before_importing_tensorflow(tmp_path):
    """Issue 37, row 17: a rank with devices to split (TensorFlow's GPU ranks) imported TensorFlow before the
    script, so what the script set before its ``import tensorflow`` (``TF_ENABLE_ONEDNN_OPTS``, read once at
    import) was ignored. Launched as an engine launches a rank (:func:`~vgpu_magic.ranks.launch.run_rank`), with a
    CPU split standing in for the GPU's (CPU ranks have no devices to split); compared with plain python."""
    from vgpu_magic.layout import RankPlan
    from vgpu_magic.plans import SplitRequest
    from vgpu_magic.ranks import launch

    script = tmp_path / "onednn.py"
    script.write_text(
        "import os\nasked = os.environ.get('TF_ENABLE_ONEDNN_OPTS') != '1'\n"
        "os.environ['TF_ENABLE_ONEDNN_OPTS'] = str(int(asked))\n"
        "import tensorflow as tf\nfrom tensorflow.python.util import _pywrap_util_port\n"
        "print(_pywrap_util_port.IsMklEnabled() == asked, len(tf.config.list_logical_devices('CPU')))\n"
    )
    plain = subprocess.run([sys.executable, str(script)], env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert plain.stdout.split() == ["True", "1"], plain.stderr[-2000:]
    before = our_processes()
    plan = RankPlan(0, {}, "", (), (), SplitRequest(count=2, target="cpu", framework="tensorflow"))
    request = launch.LaunchRequest(plan, str(script), [], str(tmp_path), "tensorflow", ["tensorflow"], spare=False)
    request = dataclasses.replace(request, environ=dataclasses.replace(request.environ, environ=CHILD_ENV))
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
        launch.run_rank(request)
    assert out.getvalue().split() == ["True", "2"]
    assert our_processes() <= before


@pytest.fixture(scope="module")
def jax_ranks():
    """Two JAX ranks of 2 CPU devices each, shared by the tests below, which only need them running: a script run
    is a launch in new processes, so what one test ran leaves nothing for the next. They come last in the module,
    after the tests that count their own processes."""
    with ranks_of("jax", 2, split=2) as ranks:
        yield ranks


def test_jax_two_processes_of_two_cpu_devices(jax_ranks):
    # The cell's own jax.distributed.initialize(), with no arguments, as a script calls it under a launcher.
    seen, _ = quiet_run(
        jax_ranks,
        "import jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
        "jax.distributed.initialize()\n"
        "gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))\n"
        "(jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),"
        " gathered.ravel().tolist())",
    )
    assert seen == [(0, 2, 2, 4, [10, 11]), (1, 2, 2, 4, [10, 11])]


def test_a_jax_multi_process_script_runs_twice_in_a_row(jax_ranks, tmp_path):
    """Issue 22, defect 3: the second run of a script calling jax.distributed.initialize() failed ("must be
    called before any JAX calls"): the ranks were the first run's processes. Each run is a launch now."""
    script = SCRIPTS / "jax_processes.py"
    for run in range(2):
        with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()):
            jax_ranks.run_script(str(script), ["--out", str(tmp_path / f"run{run}")])
        assert sorted(x for x in out.getvalue().splitlines() if x.startswith("[rank") and "process" in x) == [
            "[rank 0] process 0 of 2",
            "[rank 1] process 1 of 2",
        ]
        seen = [json.loads((tmp_path / f"run{run}.{p}").read_text()) for p in range(2)]
        assert seen == [{"seen": [p, 2, 2, 4], "gathered": [0, 1, 10, 11]} for p in range(2)]


def test_a_jax_script_that_sets_its_environment_before_importing_jax_gets_it(jax_ranks, tmp_path):
    """Issue 37, row 17: the rank's setup (its devices, the cluster environment) imported JAX before the script,
    so ``JAX_ENABLE_X64=1`` set by the script before ``import jax`` gave float32 under %vgpu_run, float64 under
    plain python. The setup now runs when the script imports JAX: the devices and wiring are still the rank's."""
    script = tmp_path / "x64.py"
    script.write_text(
        "import os\nos.environ['JAX_ENABLE_X64'] = '1'\nimport jax, jax.numpy as jnp\n"
        "if 'JAX_COORDINATOR_ADDRESS' in os.environ:\n    jax.distributed.initialize()\n"
        "print(jnp.zeros(1).dtype, jax.process_count(), jax.local_device_count())\n"
    )
    plain = subprocess.run([sys.executable, str(script)], env=CHILD_ENV, capture_output=True, text=True, timeout=240)
    assert plain.stdout.split() == ["float64", "1", "1"], plain.stderr[-2000:]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        jax_ranks.run_script(str(script))
    assert sorted(line for line in out.getvalue().splitlines() if "float" in line) == [
        "[rank 0] float64 2 2",
        "[rank 1] float64 2 2",
    ]
