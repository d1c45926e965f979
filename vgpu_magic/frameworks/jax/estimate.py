"""JAX's part of :func:`vgpu_magic.estimate`: the cell's jitted steps compiled, not run, in a helper process with N CPU
devices, read with ``memory_analysis()``; a step returns ``jax.ShapeDtypeStruct`` s, so nothing is allocated."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

from ...errors import PlanError
from ..base import Lever, RankEstimate, RankMemory
from .memory import ENV_CLIENT_FRACTION, ENV_FRACTION

__all__ = ["estimate_ranks", "kept_mib", "levers", "SIMULATED"]

#: What the estimate only simulates (:func:`~vgpu_magic.devices.simulated_line`): nothing runs, no GPU compiles.
SIMULATED = ("the cell's jitted steps compiled for CPU devices, not run (XLA's memory_analysis())",)

_MARK = "VGPU_ESTIMATE "
_CELL = "<vgpu_estimate cell>"


def estimate_ranks(cell, code, world, ranks, namespace, gpu, progress) -> list[RankEstimate]:
    """Each device's peak: the cell's largest compiled step (the helper sees no notebook names; none: PlanError)."""
    if not isinstance(cell, str):
        raise PlanError("a JAX estimate takes the cell's code (it runs in a helper process with N devices)")
    progress(f"estimating: the cell's jitted steps compile for {world} devices (JAX)…")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={world}".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", __name__], input=cell, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if proc.returncode or not lines:  # the error's own line (JAX's notes follow it), and the cell's line
        errors = [line for line in proc.stderr.splitlines() if re.match(r"[A-Za-z_][\w.]*: ", line)]
        where = "".join(f"line {n} of the cell: " for n in re.findall(rf'"{_CELL}", line (\d+)', proc.stderr)[-1:])
        raise RuntimeError(f"{where}{(errors or ['no output'])[-1]} (in the estimate's helper, {world} devices)")
    found = json.loads(lines[-1][len(_MARK) :])
    if not found["peak_bytes"]:
        raise PlanError("the cell ran no jitted step; wrap the training step in jax.jit and call it")
    notes = (
        "compiled for CPU devices: a GPU compile chooses its own temporaries, and on an H100 the test "
        "cell's real peak was twice this estimate (tests/test_estimate_gpu.py's finding)",
    )
    parts = [found[k] for k in ("peak_bytes", "categories", "phase")]  # one SPMD program: the same on every device
    return [RankEstimate(RankMemory(r, *parts), found["parallelism"], (*found["uses"],), notes) for r in ranks]


def kept_mib(gpu_mib: int) -> int:
    """What XLA's client leaves of a GPU: 25 % by default (``XLA_CLIENT_MEM_FRACTION``, or its old name)."""
    fraction = os.environ.get(ENV_CLIENT_FRACTION) or os.environ.get(ENV_FRACTION)
    return gpu_mib - int(gpu_mib * float(fraction or "0.75"))


def levers(parts: dict[str, int], world: int, parallelism: str, uses: set[str]) -> list[Lever]:
    """One lever (none the cell uses) for XLA's temporaries (activations, gradients, scratch): it saves at most them."""
    tools = [t for t, use in (("jax.checkpoint", "checkpointing"), ("bf16", "bf16")) if use not in uses]
    shrink = f"{', '.join([*tools, 'a smaller batch'])} shrink XLA's temporaries"
    return [Lever(shrink, saves=parts.get("temporaries", 0), note="with none")]


def _run(cell: str) -> dict[str, Any]:
    import jax

    jit = jax.jit
    best: dict[str, Any] = {"peak_bytes": 0, "categories": {}, "phase": None, "parallelism": "single device"}
    uses = best["uses"] = []  # what a lever would offer: checkpointing, bf16

    def estimating_jit(fun: Any = None, **options: Any) -> Any:
        if fun is None:  # used as @jax.jit(**options)
            return lambda f: estimating_jit(f, **options)
        jitted = jit(fun, **options)

        def call(*args: Any, **kwargs: Any) -> Any:
            compiled = jitted.lower(*args, **kwargs).compile()
            if any(str(getattr(leaf, "dtype", "")) in ("bfloat16", "float16") for leaf in jax.tree.leaves(args)):
                uses.append("bf16")
            m = compiled.memory_analysis()
            parts = {
                "arguments": m.argument_size_in_bytes,
                "outputs": m.output_size_in_bytes - m.alias_size_in_bytes,
                "temporaries": m.temp_size_in_bytes,
            }
            if sum(parts.values()) > best["peak_bytes"]:
                name = getattr(fun, "__name__", "step")
                best.update(peak_bytes=sum(parts.values()), categories=parts, phase=f"in jitted {name}")
            devices = {d for s in jax.tree.leaves(compiled.output_shardings) for d in s.device_set}
            if len(devices) > 1:
                best["parallelism"] = f"SPMD over {len(devices)} devices"
            return jax.tree.map(
                lambda o, s: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=s),
                compiled.out_info,
                compiled.output_shardings,
            )

        return call

    put = jax.device_put

    def shapes_put(x: Any, device: Any = None, **options: Any) -> Any:
        # Outputs are shapes here: placing them places shapes, on one sharding or a pytree of them (as device_put).
        def one(where: Any, leaf: Any) -> Any:
            if not isinstance(leaf, jax.ShapeDtypeStruct):
                return put(leaf, where, **options)
            sharding = where if isinstance(where, jax.sharding.Sharding) else leaf.sharding
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

        if device is None or isinstance(device, (jax.sharding.Sharding, jax.Device)):
            return jax.tree.map(lambda leaf: one(device, leaf), x)
        return jax.tree.map(lambda where, part: jax.tree.map(lambda leaf: one(where, leaf), part), device, x)

    jax.jit, jax.device_put = estimating_jit, shapes_put
    checkpoint = jax.checkpoint

    def noted_checkpoint(*args: Any, **kwargs: Any) -> Any:
        uses.append("checkpointing")
        return checkpoint(*args, **kwargs)

    jax.checkpoint = jax.remat = noted_checkpoint
    exec(compile(cell, _CELL, "exec"), {"__name__": "__main__"})
    return best


if __name__ == "__main__":
    print(_MARK + json.dumps(_run(sys.stdin.read())), flush=True)
