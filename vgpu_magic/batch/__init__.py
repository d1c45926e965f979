"""Batch jobs: the rehearsed script submitted unchanged, each task wired as the rehearsal wires its rank, tracked
from ``.vgpu_jobs/<id>/`` beside the script, so a job outlives the kernel that submitted it (docs/jobs.md)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from .. import frameworks
from ..ranks.launchers import SlurmLauncher

__all__ = ["BACKENDS", "FOLDER", "Job", "JobBackend", "JobSpec", "jobs", "submit"]

FOLDER = ".vgpu_jobs"
BACKENDS = {"slurm": "vgpu_magic.batch.slurm:SlurmJobs"}
#: The states after which nothing changes (SLURM's words).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL")


@dataclass(frozen=True)
class JobSpec:
    """``script ARGS`` under ``framework``'s wiring on ``nodes`` × ``ranks_per_node`` tasks; ``port``: rank 0's
    (default: from the job id). Checked whole when made: a one-line :class:`ValueError` quotes what is wrong."""

    script: str
    args: tuple[str, ...] = ()
    framework: str = "torch"
    nodes: int = 1
    ranks_per_node: int = 1
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    #: More ``#SBATCH`` lines, as the SLURM launcher of the ranks takes them (``"--mem=4G"``).
    sbatch: tuple[str, ...] = ()
    name: str | None = None
    port: int | None = None
    backend: str = "slurm"

    def __post_init__(self) -> None:
        if not Path(self.script).expanduser().is_file():
            raise ValueError(f"script {self.script!r} is not a file (looked in {os.getcwd()})")
        object.__setattr__(self, "script", str(Path(self.script).expanduser().resolve()))
        object.__setattr__(self, "args", tuple(map(str, self.args)))
        object.__setattr__(self, "framework", frameworks.resolve_name(self.framework))
        for key, low in (("nodes", 1), ("ranks_per_node", 1), ("gpus_per_node", 0), ("port", 1)):
            value = getattr(self, key)
            if value is not None and (type(value) is not int or not low <= value <= 65535):
                raise ValueError(f"{key}={value!r} is not a whole number {low}..65535")
        # Time, partition, account and #SBATCH lines as the ranks' SLURM launcher checks them (SLURM says the rest).
        object.__setattr__(self, "sbatch", tuple(SlurmLauncher.sbatch_options(vars(self))[1]))
        if not re.fullmatch(r"[^\s'\"]*", self.name or ""):
            raise ValueError(f"name={self.name!r} is not one word; e.g. name=run1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


class JobBackend(Protocol):
    """One way to run jobs; docs/jobs.md has each call's contract (``state``: SLURM's word, why, time run)."""

    def script(self, spec: JobSpec) -> str: ...
    def submit(self, spec: JobSpec) -> str: ...
    def state(self, job_id: str, folder: Path) -> tuple[str, str, timedelta]: ...
    def cancel(self, job_id: str) -> None: ...
    def logs(self, folder: Path, rank: int) -> str: ...


def backend(name: str) -> JobBackend:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


class Job:
    """A submitted job, read from its folder and its backend: any kernel can make one."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        said = json.loads((self.folder / "job.json").read_text())
        self.job_id: str = said.pop("job_id")
        self.spec = JobSpec(**said)
        self.backend = backend(self.spec.backend)

    def __repr__(self) -> str:
        return f"<vgpu_magic Job {self.job_id} {Path(self.spec.script).name}: {self.state}>"

    @property
    def state(self) -> str:
        return self.backend.state(self.job_id, self.folder)[0]

    @property
    def elapsed(self) -> timedelta:
        """How long it has run (a :class:`~datetime.timedelta`; zero while pending), or ran once it ended."""
        return self.backend.state(self.job_id, self.folder)[2]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each rank's exit status, by rank: ``None`` until it ends, and where SLURM killed its step (a rank failed,
        a cancel, the time limit); above 128 where a signal killed it."""
        paths = [self.folder / f"rank-{r}.exit" for r in range(self.spec.ranks)]
        return [int(path.read_text()) if path.exists() and path.read_text().strip() else None for path in paths]

    def logs(self, rank: int | None = None, read: dict[int, int] | None = None) -> str:
        """Each rank's output (or rank ``rank``'s), every line labelled ``[rank r]`` as ``%vgpu_run`` labels it;
        with ``read`` (rank -> characters read, updated) only the whole lines written since."""
        added = []
        for r in range(self.spec.ranks) if rank is None else [rank]:
            text, start = self.backend.logs(self.folder, r), 0 if read is None else read.get(r, 0)
            done = len(text) if read is None else text.rfind("\n") + 1
            added += [f"[rank {r}] {line}\n" for line in text[start:done].splitlines()]
            if read is not None:
                read[r] = max(start, done)
        return "".join(added)

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> str:
        """Wait for the job to end; its state. :class:`TimeoutError` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (state := self.state) not in ENDED:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} is still {state} after {timeout} s")
            time.sleep(poll)
        return state

    def cancel(self) -> None:
        self.backend.cancel(self.job_id)

    def summary(self, lines: int = 5) -> str:
        """``ID NAME: STATE, elapsed [D-]HH:MM:SS, ...``, each failed rank's exit status and last lines, why it ended"""
        state, reason, elapsed = self.backend.state(self.job_id, self.folder)
        codes, (hours, seconds) = self.exit_codes, divmod(elapsed.seconds, 3600)
        ran = f"{elapsed.days}-" * bool(elapsed.days) + f"{hours:02}:{seconds // 60:02}:{seconds % 60:02}"
        said = [
            f"{self.job_id} {Path(self.spec.script).name}: {state}, elapsed {ran}, {self.spec.nodes} node(s) × "
            f"{self.spec.ranks_per_node} rank(s), exit codes by rank [{', '.join(map(str, codes))}]"
        ]
        for rank, code in enumerate(codes):
            if code:
                tail = [line for line in self.backend.logs(self.folder, rank).splitlines() if line.strip()]
                said += [f"  rank {rank} exited with status {code}:", *(f"    {line}" for line in tail[-lines:])]
        return "\n".join(said + ([f"  {state}: {reason}"] if state in ENDED and reason else []))


def submit(script: str, args=(), framework: str = "torch", nodes: int = 1, ranks_per_node: int = 1, **options) -> Job:
    """Submit ``script ARGS`` as a batch job of ``nodes`` × ``ranks_per_node`` tasks, each wired as the rehearsal
    wires its rank under ``framework``; returns at once. ``options``: the other :class:`JobSpec` fields."""
    spec = JobSpec(script, tuple(args), framework, nodes, ranks_per_node, **options)
    job_id = backend(spec.backend).submit(spec)
    folder = Path(spec.script).parent / FOLDER / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps({"job_id": job_id, **dataclasses.asdict(spec)}))
    return Job(folder)


def jobs(root: str | os.PathLike = ".") -> list[Job]:
    """The jobs submitted from scripts in ``root``'s tree (default: this folder's), oldest first."""
    found = [Job(path.parent) for path in Path(root).resolve().rglob(f"{FOLDER}/*/job.json")]
    return sorted(found, key=lambda job: (len(job.job_id), job.job_id))
