"""Batch jobs: the rehearsed script submitted unchanged, each task wired as the rehearsal wires its rank
(:mod:`.task`), tracked from a folder of its own beside the script, ``.vgpu_jobs/<id>/``, so a job outlives
the kernel that submitted it and any later kernel finds it (:func:`jobs`).

The folder holds what the job's tasks leave (``rank-R.log``, ``rank-R.exit``, ``job.out``, ``job.exit``) and what
submitting it said (``job.json``, the batch script); while the scheduler still holds the job it says the state.
A job backend is one class (:class:`JobBackend`: ``script``, ``submit``, ``state``, ``cancel``, ``logs``) found
through :data:`BACKENDS`; SLURM's (:class:`~.slurm.SlurmJobs`) is the one there is. Nothing here imports a
framework.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from .. import frameworks

__all__ = ["BACKENDS", "FOLDER", "Job", "JobBackend", "JobSpec", "jobs", "submit"]

#: The folder beside the script that holds its jobs, one sub-folder per job id.
FOLDER = ".vgpu_jobs"
#: Backend name -> "module:Class".
BACKENDS = {"slurm": "vgpu_magic.batch.slurm:SlurmJobs"}
#: The states after which nothing changes.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
_WORD = re.compile(r"[A-Za-z0-9_.,:@+=-]+")
_TIME = re.compile(r"[0-9]+(-[0-9]{1,2})?(:[0-9]{1,2}){0,2}")


@dataclass(frozen=True)
class JobSpec:
    """What to run and on what: ``script ARGS`` under ``framework``'s wiring on ``nodes`` × ``ranks_per_node``
    tasks. Checked whole when made: a :class:`ValueError` in one line quotes what is wrong."""

    script: str
    args: tuple[str, ...] = ()
    framework: str = "torch"
    nodes: int = 1
    ranks_per_node: int = 1
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    name: str | None = None
    #: Rank 0's port (torch's MASTER_PORT, JAX's coordinator, the first TF worker); ``None``: the usual one.
    port: int | None = None
    backend: str = "slurm"

    def __post_init__(self) -> None:
        path = Path(self.script).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"script {self.script!r} is not a file (looked in {os.getcwd()})")
        object.__setattr__(self, "script", str(path))
        object.__setattr__(self, "args", tuple(str(a) for a in self.args))
        object.__setattr__(self, "framework", frameworks.resolve_name(self.framework))
        for key, low in (("nodes", 1), ("ranks_per_node", 1), ("gpus_per_node", 0), ("port", 1)):
            value = getattr(self, key)
            if value is not None and (type(value) is not int or not low <= value <= 65535):
                raise ValueError(f"{key}={value!r} is not a whole number {low}..65535")
        for key in ("partition", "account", "name"):
            value = getattr(self, key)
            if value is not None and not _WORD.fullmatch(str(value)):
                raise ValueError(f"{key}={value!r} is not one word; e.g. {key}=gpu")
        if self.time is not None and not _TIME.fullmatch(str(self.time)):
            raise ValueError(f"time={self.time!r} is not a time limit; use minutes (30) or HH:MM:SS (01:00:00)")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    @property
    def folder(self) -> Path:
        """Where this script's jobs keep their folders."""
        return Path(self.script).parent / FOLDER

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


class JobBackend:
    """One way to run jobs. Subclasses implement each call; ``folder`` is the job's own folder."""

    name = ""

    def script(self, spec: JobSpec) -> str:
        """What is submitted (for SLURM the batch script): a user may keep it and submit it by hand."""
        raise NotImplementedError

    def submit(self, spec: JobSpec) -> str:
        """Submit; the job's id. A refusal is a :class:`ValueError` with the scheduler's own reason."""
        raise NotImplementedError

    def state(self, job_id: str, folder: Path) -> tuple[str, str]:
        """The job's state (SLURM's words: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT) and why."""
        raise NotImplementedError

    def cancel(self, job_id: str) -> None:
        raise NotImplementedError

    def logs(self, folder: Path, rank: int) -> str:
        """Rank ``rank``'s output (stdout and stderr) so far."""
        raise NotImplementedError


def backend(name: str) -> JobBackend:
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


class Job:
    """A submitted job, read from its folder (``.vgpu_jobs/<id>/``) and its backend: any kernel can make one."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        said = json.loads((self.folder / "job.json").read_text())
        self.job_id: str = said.pop("job_id")
        self.spec = JobSpec(**{**said, "args": tuple(said["args"])})
        self.backend = backend(self.spec.backend)

    def __repr__(self) -> str:
        return f"<vgpu_magic Job {self.job_id} {self.spec.name or Path(self.spec.script).name}: {self.state}>"

    @property
    def state(self) -> str:
        return self.backend.state(self.job_id, self.folder)[0]

    @property
    def exit_codes(self) -> list[int | None]:
        """Each rank's exit status, by rank; ``None`` where it has not ended, or was killed with its job step."""
        found = [self.folder / f"rank-{r}.exit" for r in range(self.spec.ranks)]
        return [int(path.read_text()) if path.exists() and path.read_text().strip() else None for path in found]

    def logs(self, rank: int | None = None) -> str:
        """Each rank's output (or rank ``rank``'s), every line labelled ``[rank r]`` as ``%vgpu_run`` labels it."""
        ranks = range(self.spec.ranks) if rank is None else [rank]
        return "".join(f"[rank {r}] {line}\n" for r in ranks for line in self.backend.logs(self.folder, r).splitlines())

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

    def failures(self, lines: int = 5) -> list[str]:
        """One line per rank that failed (its exit status, the last lines of its output), then how the job ended
        where the scheduler gave a reason: the lines ``status`` shows under a job."""
        said = []
        for rank, code in enumerate(self.exit_codes):
            if code:
                tail = [line for line in self.backend.logs(self.folder, rank).splitlines() if line.strip()][-lines:]
                how = f"killed by signal {code - 128}" if code > 128 else f"exit {code}"
                said.append(f"rank {rank}: {how}" + "".join(f"\n    {line}" for line in tail))
        state, reason = self.backend.state(self.job_id, self.folder)
        if state in ENDED and state != "COMPLETED" and reason:
            said.append(f"{state}: {reason}")
        return said

    def summary(self) -> str:
        """``ID NAME STATE, N node(s) × R ranks, exit codes [..]`` and the failures, for ``%vgpu_job status``."""
        spec = self.spec
        codes = ", ".join("-" if c is None else str(c) for c in self.exit_codes)
        head = (
            f"{self.job_id} {spec.name or Path(spec.script).name}: {self.state}, {spec.nodes} node(s) × "
            f"{spec.ranks_per_node} rank(s), exit codes by rank [{codes}]"
        )
        return "\n".join([head, *(f"  {line}" for line in self.failures())])


def submit(script: str, args=(), framework: str = "torch", nodes: int = 1, ranks_per_node: int = 1, **options) -> Job:
    """Submit ``script ARGS`` as a batch job of ``nodes`` × ``ranks_per_node`` tasks, each wired as the rehearsal
    wires its rank under ``framework``; returns at once. ``options``: the other :class:`JobSpec` fields
    (``gpus_per_node``, ``time``, ``partition``, ``account``, ``name``, ``port``)."""
    return submit_spec(JobSpec(script, tuple(args), framework, nodes, ranks_per_node, **options))


def submit_spec(spec: JobSpec) -> Job:
    """Submit what ``spec`` says; its folder then holds ``job.json`` for any later kernel."""
    job_id = backend(spec.backend).submit(spec)
    folder = spec.folder / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps({"job_id": job_id, **dataclasses.asdict(spec)}, indent=1))
    return Job(folder)


def jobs(root: str | os.PathLike = ".") -> list[Job]:
    """The jobs submitted from scripts in ``root``'s tree (default: this folder's), oldest first."""
    found = [Job(path.parent) for path in Path(root).resolve().rglob(f"{FOLDER}/*/job.json")]
    return sorted(found, key=lambda job: (len(job.job_id), job.job_id))
