"""SLURM's job backend on its own commands (``sbatch``, ``scontrol show job``, ``scancel``; why not submitit:
docs/jobs.md), and each task's :func:`main`: the hosts from SLURM's variables, wired by the rehearsal's ``layout_ranks``
and ``plan_ranks``; only the environment (caps and splits are a rehearsal's) goes to ``SCRIPT``, run as by python."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from .. import frameworks
from ..frameworks.base import RankPlan
from ..inventory import visible_gpus
from ..layout import HostReport, layout_ranks
from ..ranks.hosts import free_port
from ..ranks.launched import run_main
from ..ranks.launchers import SlurmLauncher
from ..ranks.spec import RESTART_COUNTS
from . import FOLDER, JobBackend, JobSpec
from .stacks import Answering

#: The batch script: the job's folder (its id is known only then) and start time; then per attempt (``max_restarts``
#: more, as torchrun's agent: ``srun`` stops every task when one fails) its number, rank 0's free port, one ``srun``
#: whose tasks write their exit status (and torch's ``@record`` error file) beside their output; the last status.
TEMPLATE = """#!/bin/bash
{options}#SBATCH --output=/dev/null
job={jobs}/$SLURM_JOB_ID
mkdir -p "$job" && date +%s >"$job/job.start" && exec >"$job/job.out" 2>&1
# Each line of the ranks' output reaches their logs when printed (%vgpu_job logs --follow).
export PYTHONUNBUFFERED=1 TORCHELASTIC_MAX_RESTARTS={restarts}
for TORCHELASTIC_RESTART_COUNT in $(seq 0 {restarts}); do
  export TORCHELASTIC_RESTART_COUNT && echo $((TORCHELASTIC_RESTART_COUNT + 1)) >"$job/job.attempt"
  rm -f "$job"/rank-*.exit "$job"/rank-*.error.json "$job"/rank-*.state.json "$job"/stacks.*  # the last attempt's only
  free=$({python} -m vgpu_magic.batch.slurm --free-port)
  srun --kill-on-bad-exit=1 --output="$job/rank-%t.log" --open-mode=append \\
    sh -c 'export TORCHELASTIC_ERROR_FILE="$0/rank-$SLURM_PROCID.error.json"; "$@"; s=$?
           echo $s >"$0/rank-$SLURM_PROCID.exit"; exit $s' "$job" \\
    {python} -m vgpu_magic.batch.slurm {framework} {port} "$free" "$job" {hang_after} {command}
  status=$?
  [ $status = 0 ] && break
done
echo $status >"$job/job.exit"
exit $status
"""


class SlurmJobs(JobBackend):
    def script(self, spec: JobSpec) -> str:
        words, lines = SlurmLauncher.sbatch_options(vars(spec))
        name = spec.name or f"vgpu-{Path(spec.script).stem}"
        options = {"nodes": spec.nodes, **words, "job-name": name, "chdir": os.getcwd()}
        options.update({"ntasks-per-node": spec.ranks_per_node, "gpus-per-node": spec.gpus_per_node})
        return TEMPLATE.format(
            options="".join(f"#SBATCH --{k}={shlex.quote(str(v))}\n" for k, v in options.items() if v is not None)
            + "".join(f"{line}\n" for line in lines),
            jobs=shlex.quote(str(Path(spec.script).parent / FOLDER)),
            python=shlex.quote(sys.executable),
            framework=spec.framework,
            port=spec.port or 0,
            restarts=spec.max_restarts,
            hang_after=spec.hang_after,
            command=shlex.join([spec.script, *spec.args]),
        )

    def submit(self, spec: JobSpec) -> str:
        """``sbatch``, once ``sbatch --test-only`` says SLURM could ever start the job (else it may pend forever)."""
        script = self.script(spec)
        for test in (["--test-only"], ["--parsable"]):
            try:
                done = _run(["sbatch", *test], script)
            except FileNotFoundError:
                raise ValueError("SLURM's sbatch is not on PATH: submit from a SLURM login node") from None
            if done.returncode != 0:
                reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
                for said in ("sbatch: error: ", "allocation failure: "):
                    reason = reason.removeprefix(said)
                raise ValueError(f"SLURM refused the job: {reason}")
        return done.stdout.strip().split(";")[0]

    def state(self, job_id: str, folder: Path) -> tuple[str, str, timedelta]:
        said = _run(["scontrol", "show", "job", "-o", job_id]).stdout
        shown = dict(re.findall(r"(JobState|Reason|RunTime)=(\S+)", said))
        if shown:
            days, hours, minutes, seconds = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", shown["RunTime"]).groups()
            elapsed = timedelta(days=int(days or 0), hours=int(hours), minutes=int(minutes), seconds=int(seconds))
            # A cancelled job keeps the reason it was pending for, which is not why it ended.
            stale = shown.get("Reason", "None") == "None" or shown["JobState"] == "CANCELLED"
            return shown["JobState"], "" if stale else shown["Reason"], elapsed
        # SLURM forgot it (MinJobAge): it ran until its folder's last write (the script's end, or SLURM's CANCELLED AT).
        start, ended = folder / "job.start", max(path.stat().st_mtime for path in folder.iterdir())
        elapsed = timedelta(seconds=round(ended - float(start.read_text()))) if start.exists() else timedelta(0)
        return (*_ended(folder), elapsed)

    def cancel(self, job_id: str) -> None:
        done = _run(["scancel", job_id])
        if done.returncode != 0 or done.stderr.strip():
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise ValueError(f"SLURM did not cancel job {job_id}: {reason.removeprefix('scancel: error: ')}")

    def logs(self, folder: Path, rank: int) -> str:
        path = folder / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _ended(folder: Path) -> tuple[str, str]:
    """A job's end from its folder: SLURM's time-limit line in a log (checked first: the script may still write its
    status after SIGTERM), else what the batch script wrote, unless SLURM ended it first."""
    if "DUE TO TIME LIMIT" in "".join(path.read_text(errors="replace") for path in folder.glob("*.log")):
        return "TIMEOUT", "its time limit was reached"
    if (folder / "job.exit").exists():
        status = (folder / "job.exit").read_text().strip()
        return ("COMPLETED", "") if status == "0" else ("FAILED", f"srun exited with status {status}")
    return "CANCELLED", "it ended before its batch script did"


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)


def plan_tasks(framework: str, env: dict[str, str], port: int | None = None, free: int = 0) -> list[RankPlan]:
    """Every task's plan, in rank order, from a SLURM step's environment (block distribution), each host with this
    one's GPUs; ``free``: a port free on the first node (rank 0's where the framework takes it and ``port`` is None)."""
    step = SlurmLauncher.launched(env).step
    if step is None:
        raise RuntimeError("not a task of a SLURM job step (SLURM_JOB_ID, SLURM_STEP_NODELIST, ... unset)")
    shared = {k: v for k, v in env.items() if k.startswith(SlurmLauncher.task_variables)}
    gpus, reports = visible_gpus(), []
    for node, (host, count) in enumerate(zip(step.hosts, step.tasks_per_node)):
        for local in range(count):
            place = {"SLURM_PROCID": str(len(reports)), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
            reports.append(HostReport(len(reports), host, host, 0, gpus, free, {**shared, **place}))
    return frameworks.get(framework).plan_ranks(layout_ranks(reports, gpus, SlurmLauncher.launched), None, None, port)


def main(framework: str, port: str, free: str, folder: str, hang_after: str, script: str, *args: str) -> None:
    """Task ``SLURM_PROCID``, wired, runs ``script ARGS`` as ``python`` would, beside :class:`~.stacks.Answering`."""
    rank, ranks = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_STEP_NUM_TASKS"])
    plan = plan_tasks(framework, dict(os.environ), int(port) or None, int(free))[rank]
    # The attempt is the batch script's (the job's agent), not the framework's first-launch default.
    attempt = {key: os.environ[key] for key in RESTART_COUNTS if key in os.environ}
    os.environ.update({**plan.env, **attempt})
    if rank == 0:
        print(f"vgpu_magic job: {plan.notes[0]}; no per-rank memory caps or device splits (a job has its real GPUs)")
    # As python puts it first on the import path: the script's folder (links resolved).
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(os.path.realpath(script))
    Answering(Path(folder), rank, ranks, float(hang_after))
    run_main(script)


if __name__ == "__main__":
    if sys.argv[1:] == ["--free-port"]:  # the batch script's, on the first node
        print(free_port())
    else:
        main(*sys.argv[1:])
