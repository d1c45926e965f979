"""The hang doctor (issue 42, docs/hangs.md) on 2 real JAX processes, which record no collectives: a process that
leaves its loop early is named with its line, and the process that waits in the step's JAX call with its own, while
the run waits; ``--timeout`` then ends the run saying where each was, and the cluster is usable after it."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

#: A loop of steps that process 1 leaves at its second, then sleeps; each step's collective is line 14.
SCRIPT = """\
import time
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

jax.distributed.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("d",))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))
for step in range(3):
    if jax.process_index() == 1 and step == 1:
        break
    {step}
time.sleep(60)
"""
#: A step in JAX's Python code (``multihost_utils``), and a jitted function's, whose wait is in JAX's C++ dispatch.
STEPS = [
    "x = multihost_utils.process_allgather(jnp.ones(2) * step)",
    "x = total(jax.make_array_from_process_local_data(NamedSharding(mesh, P('d')), np.ones(jax.local_device_count())))",
]


@pytest.fixture(scope="module")
def shell(cluster_shell):
    cluster_shell.run_line_magic("vgpu_cluster", "start 2 --framework jax")
    return cluster_shell


@pytest.mark.parametrize("step", STEPS, ids=["allgather", "jitted"])
def test_a_jax_process_that_leaves_its_loop_early_is_named_with_its_line(shell, capsys, tmp_path, step):
    from vgpu_magic.ranks import RankRunError

    script = tmp_path / "hang.py"
    script.write_text(SCRIPT.format(step=step))
    capsys.readouterr()
    with pytest.raises(RankRunError) as info:
        shell.run_line_magic("vgpu_run", f"--no-plot --hang-after 3 --timeout 20 {script}")
    captured = capsys.readouterr()
    out = captured.out + captured.err
    said = "rank 1 never reached the JAX call that rank 0 waits in (hang.py:14); rank 1 is at hang.py:15, idle"
    assert "a hang, " in out and said in out, out
    assert re.search(rf"rank 0: waiting in a JAX call for \d+ s, at hang.py:14: {re.escape(step)}", out), out
    assert "rank 1: idle, at hang.py:15: time.sleep(60)" in out, out
    assert "rank 0 was waiting in a JAX call" in info.value.headline(), info.value.headline()
    ok = tmp_path / "ok.py"
    ok.write_text("import jax\njax.distributed.initialize()\nprint('usable', jax.process_count())\n")
    capsys.readouterr()
    shell.run_line_magic("vgpu_run", f"--no-plot {ok}")
    out = "".join(capsys.readouterr())
    assert "[rank 0] usable 2" in out and "[rank 1] usable 2" in out, out


def _answer(line: int, source: str, at: float, in_jax: bool = True, cpu: float = 1.0) -> dict:
    """A JAX process's answer as :func:`vgpu_magic.ranks.rank_state.answer` gives it, ``at`` s into the epoch."""
    stack = [["/w/train.py", line, "<module>", source]]
    return {"pid": line, "stack": stack, "in_torch": False, "in_jax": in_jax, "cpu": cpu, "at": at}


def test_the_jax_rule_counts_the_wait_from_the_first_answer_that_saw_it():
    from vgpu_magic.ranks.doctor import diagnose

    def look(at: float, cpu: float = 1.0) -> dict:
        return {0: _answer(12, "x = step(x)", at, cpu=cpu), 1: _answer(20, "time.sleep(60)", at, in_jax=False)}

    first, second, third = look(100.0), look(102.0), look(104.0)
    assert diagnose(first, {}, [False, False], 3.0)[0] is None  # one answer: a wait is not known yet
    assert diagnose(second, first, [False, False], 3.0)[0] is None  # 2 s of waiting, before --hang-after 3
    said, lines = diagnose(third, second, [False, False], 3.0)
    assert said == (
        "rank 1 never reached the JAX call that rank 0 waits in (train.py:12); rank 1 is at train.py:20, idle"
    )
    assert lines == [
        "rank 0: waiting in a JAX call for 4 s, at train.py:12: x = step(x)",
        "rank 1: idle, at train.py:20: time.sleep(60)",
    ]
    # Busy in JAX's code (compiling, computing) is no wait; nor are both processes at one line.
    assert diagnose(look(106.0, cpu=3.0), third, [False, False], 3.0)[0] is None
    both = {r: _answer(12, "x = step(x)", 100.0 + r) for r in (0, 1)}
    assert diagnose({r: _answer(12, "x = step(x)", 110.0) for r in (0, 1)}, both, [False, False], 3.0)[0] is None
    # A process past its script's end (in JAX's shutdown, which waits for the others) waits at no line of it.
    ended = {0: _answer(12, "x = step(x)", 104.0), 1: {**_answer(20, "", 104.0), "stack": []}}
    said, lines = diagnose(ended, {**second, 1: {**second[1], "in_jax": True, "stack": []}}, [False, False], 3.0)
    assert (
        said.endswith("rank 1 is at no line of the script, idle")
        and lines[1] == "rank 1: idle, at no line of the script"
    )
    # A process that exited is elsewhere too.
    assert diagnose(look(106.0), third, [False, True], 3.0)[0].startswith("rank 1 never reached the JAX call")
