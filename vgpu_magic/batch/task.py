"""Run on each task of a job (``python -m vgpu_magic.batch.task FRAMEWORK PORT SCRIPT ARGS...``): give this
process what the rehearsal gives its rank on these hosts, then become ``python SCRIPT ARGS``.

The ranks' hosts come from SLURM's own variables (the step's node list, tasks per node, this task's place),
as the reports the rehearsal's engines make (:func:`~vgpu_magic.ranks.hosts.report_host`) would say them;
:func:`~vgpu_magic.layout.layout_ranks` and the framework's ``plan_ranks`` then compute the wiring, the same
code as the rehearsal's. Only the environment is applied: per-rank memory caps and device splits are a
rehearsal's, a job has its real GPUs.
"""

from __future__ import annotations

import os
import sys

from .. import frameworks
from ..frameworks.base import RankPlan
from ..inventory import visible_gpus
from ..layout import HostReport, SlurmStep, layout_ranks
from ..ranks.hosts import LAUNCHER_VARIABLES

#: The port rank 0 listens at where none is given, from the job id as PyTorch Lightning's SLURM environment
#: chooses it: every task computes it alone, so they agree without talking.
PORT_BASE = 15000


def plan_tasks(framework: str, env: dict[str, str], port: int | None = None) -> list[RankPlan]:
    """Every task's :class:`RankPlan`, in rank order, from a SLURM step's environment ``env`` (SLURM's block
    distribution: the first node's tasks are ranks 0..k-1). Pure but for this host's GPUs (NVML)."""
    step = SlurmStep.from_env(env)
    if step is None:
        raise RuntimeError("not a task of a SLURM job step (SLURM_JOB_ID, SLURM_STEP_NODELIST, ... unset)")
    shared = {name: env[name] for name in LAUNCHER_VARIABLES if name in env}
    gpus = visible_gpus()
    reports = []
    for node, (host, count) in enumerate(zip(step.hosts, step.tasks_per_node)):
        for local in range(count):
            rank = len(reports)
            place = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
            reports.append(HostReport(rank, host, host, 0, gpus, PORT_BASE + step.job_id % 10000, {**shared, **place}))
    return frameworks.get(framework).plan_ranks(layout_ranks(reports, gpus), None, None, port)


def main(argv: list[str]) -> None:
    framework, port, script, *args = argv
    rank = int(os.environ["SLURM_PROCID"])
    plan = plan_tasks(framework, dict(os.environ), int(port) or None)[rank]
    if rank == 0:
        print(
            f"vgpu_magic job: {'; '.join(plan.notes[:1])}; the rehearsal's per-rank memory caps and device splits "
            "are not applied (a job has its real GPUs)",
            flush=True,
        )
    os.execve(sys.executable, [sys.executable, script, *args], {**os.environ, **plan.env})


if __name__ == "__main__":
    main(sys.argv[1:])
