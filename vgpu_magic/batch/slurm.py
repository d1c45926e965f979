"""SLURM's job backend, on SLURM's own commands: ``sbatch`` submits a batch script a user could have written
(and can keep, edit and ``sbatch`` by hand), ``scontrol show job`` says the state while SLURM holds the job,
``scancel`` cancels it. Without SLURM's accounting (``sacct``) a job SLURM has forgotten is read from what its
tasks left in its folder. submitit was weighed and not used: it runs pickled functions, not an unchanged
script, and reads a finished job's state from ``sacct``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from . import JobBackend, JobSpec

__all__ = ["SlurmJobs"]

#: The batch script: its folder made first (``$SLURM_JOB_ID`` is known only then), one ``srun`` whose tasks
#: each write their exit status beside their output, then the step's status.
TEMPLATE = """#!/bin/bash
{options}#SBATCH --output=/dev/null
# vgpu_magic: {framework} wiring computed on each task from SLURM's variables (python -m vgpu_magic.batch.task)
job={jobs}/$SLURM_JOB_ID
mkdir -p "$job" && exec >"$job/job.out" 2>&1
# Each line of the ranks' output reaches their logs when printed (followed with %vgpu_job logs --follow).
export PYTHONUNBUFFERED=1
srun --kill-on-bad-exit=1 --output="$job/rank-%t.log" \\
  sh -c '"$@"; echo $? >"$0/rank-$SLURM_PROCID.exit"' "$job" \\
  {python} -m vgpu_magic.batch.task {framework} {port} {command}
status=$?
echo $status >"$job/job.exit"
exit $status
"""


class SlurmJobs(JobBackend):
    """Jobs on SLURM through ``sbatch``, ``scontrol`` and ``scancel``."""

    name = "slurm"

    def script(self, spec: JobSpec) -> str:
        options = {
            "job-name": spec.name or f"vgpu-{Path(spec.script).stem}",
            "nodes": spec.nodes,
            "ntasks-per-node": spec.ranks_per_node,
            "gpus-per-node": spec.gpus_per_node,
            "time": spec.time,
            "partition": spec.partition,
            "account": spec.account,
            "chdir": os.getcwd(),
        }
        return TEMPLATE.format(
            options="".join(f"#SBATCH --{k}={shlex.quote(str(v))}\n" for k, v in options.items() if v is not None),
            jobs=shlex.quote(str(spec.folder)),
            python=shlex.quote(sys.executable),
            framework=spec.framework,
            port=spec.port or 0,
            command=shlex.join([spec.script, *spec.args]),
        )

    def submit(self, spec: JobSpec) -> str:
        if shutil.which("sbatch") is None:
            raise ValueError("SLURM's sbatch is not on PATH: submit from a SLURM login node")
        done = _run(["sbatch", "--parsable"], self.script(spec))
        if done.returncode != 0:
            reason = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
            raise ValueError(f"SLURM refused the job: {reason[0].removeprefix('sbatch: error: ')}")
        return done.stdout.strip().split(";")[0]

    def state(self, job_id: str, folder: Path) -> tuple[str, str]:
        shown = _run(["scontrol", "show", "job", "-o", job_id]).stdout
        found = re.search(r"JobState=(\S+)", shown)
        if found:
            reason = re.search(r"Reason=(\S+)", shown)
            return found.group(1), "" if reason is None or reason.group(1) == "None" else reason.group(1)
        # SLURM has forgotten the job (MinJobAge): its batch script wrote its end, unless SLURM ended it first.
        ended = folder / "job.exit"
        if ended.exists():
            status = ended.read_text().strip()
            return ("COMPLETED", "") if status == "0" else ("FAILED", f"srun exited with status {status}")
        said = "".join(path.read_text(errors="replace") for path in sorted(folder.glob("*.log")))
        if "DUE TO TIME LIMIT" in said:
            return "TIMEOUT", "its time limit was reached"
        return "CANCELLED", "it ended before its batch script did"

    def cancel(self, job_id: str) -> None:
        _run(["scancel", job_id])

    def logs(self, folder: Path, rank: int) -> str:
        path = folder / f"rank-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)
