"""Ranks that share this machine's GPU, started as the planner plans them, for the tests that need a real card
(``test_gpu_real.py``, ``test_estimate_gpu.py``), and the record ``make gpu-check`` keeps of their estimates.
Needs only the framework: no IPython, no ipyparallel."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from support import CHILD_ENV, ROOT

#: A rank: the plan's devices and setup, through ``prepare_rank`` as on an engine, then the user's script, unchanged.
RANK = """
import json, os, runpy, sys
from vgpu_magic.plans import SplitRequest
from vgpu_magic.ranks.hosts import prepare_rank
devices = json.loads(os.environ.pop("VGPU_TEST_DEVICES"))
setup, args = os.environ.pop("VGPU_TEST_SETUP"), tuple(json.loads(os.environ.pop("VGPU_TEST_ARGS")))
said = prepare_rank({}, setup, args, devices=SplitRequest(**devices) if devices else None)
print(json.dumps({"setup": said}), flush=True)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))  # as python, torchrun and %vgpu_run give a script
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gpus_for(framework: str):
    """The GPUs this machine shows, or a skip with the reason."""
    from vgpu_magic.inventory import visible_gpus

    if importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed here")
    gpus = visible_gpus()
    if not gpus:
        pytest.skip(f"no GPU visible to {framework} (none through NVML)")
    return gpus


def rank_layout(n: int, gpus):
    """``n`` ranks on this host sharing its first GPU, as its engines would report it."""
    from vgpu_magic.inventory import nccl_version
    from vgpu_magic.layout import HostReport, layout_ranks

    ports = []
    for _ in range(n):
        with socket.socket() as sock:
            sock.bind(("", 0))
            ports.append(sock.getsockname()[1])
    return layout_ranks(
        [HostReport(e, socket.gethostname(), "127.0.0.1", 0, gpus[:1], ports[e], nccl=nccl_version()) for e in range(n)]
    )


def run_ranks(plans, caps_mib, script: str, *args: str, timeout: float = 300) -> list[list[dict]]:
    """Start one process per plan with its environment, its setup and ``script`` (a path, or a name in
    tests/scripts); every JSON line each printed."""
    procs = []
    path = ROOT / "tests" / "scripts" / script if not os.path.isabs(script) else Path(script)
    for plan, cap in zip(plans, caps_mib):
        env = {
            **CHILD_ENV,
            **plan.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "VGPU_TEST_SETUP": plan.setup,
            "VGPU_TEST_ARGS": json.dumps(plan.args),
            "VGPU_TEST_DEVICES": json.dumps(plan.devices and dataclasses.asdict(plan.devices)),
            "VGPU_TEST_CAP_MIB": str(cap),
        }
        command = [sys.executable, "-c", RANK, str(path), *args]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    return [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outputs]


def record_estimate(case: str, ranks: int, estimated: list[int], measured: list[int]) -> None:
    """Keep an estimate and the card's own count, rank by rank, for ``make gpu-check``'s results (where it asks)."""
    path = os.environ.get("VGPU_GPU_CHECK_ESTIMATES")
    if not path:
        return
    mib = 2**20
    with open(path, "a") as out:
        for rank, (guess, real) in enumerate(zip(estimated, measured)):
            row = {"case": case, "ranks": ranks, "rank": rank, "estimated_mib": round(guess / mib, 1)}
            out.write(json.dumps({**row, "measured_mib": round(real / mib, 1)}) + "\n")
