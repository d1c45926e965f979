"""Batch jobs: the rehearsed script submitted unchanged, each task wired as the rehearsal wires its rank, tracked
from ``.vgpu_jobs/<id>/`` beside the script and this user's index, so any later kernel finds it (docs/jobs.md)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from .. import frameworks
from ..ranks.doctor import HANG_AFTER, checked_hang_after, report
from ..ranks.launchers import SlurmLauncher
from ..ranks.shown import HeldBack
from ..ranks.spec import checked_faults

__all__ = ["BACKENDS", "FOLDER", "Job", "JobBackend", "JobSpec", "Jobs", "index_file", "jobs", "submit"]

FOLDER = ".vgpu_jobs"
BACKENDS = {"slurm": "vgpu_magic.batch.slurm:SlurmJobs"}
#: The states after which nothing changes (SLURM's words).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
#: ``#SBATCH`` flags that would contradict the job's own options (-> the option to use) or its wiring (-> None): the
#: tasks' count, placement (block: :func:`~vgpu_magic.batch.slurm.plan_tasks`), folder and output are the job's.
SET_BY_THE_JOB = {
    **dict.fromkeys(("--nodes", "-N"), "nodes"),
    **dict.fromkeys(("--ntasks-per-node", "--ntasks", "-n"), "ranks_per_node"),
    "--gpus-per-node": "gpus_per_node",
    **dict.fromkeys(("--time", "-t"), "time"),
    **dict.fromkeys(("--partition", "-p"), "partition"),
    **dict.fromkeys(("--account", "-A"), "account"),
    **dict.fromkeys(("--job-name", "-J"), "name"),
    **dict.fromkeys(("--chdir", "-D", "--output", "-o", "--error", "-e", "--distribution", "-m", "--array", "-a")),
}


@dataclass(frozen=True)
class JobSpec:
    """``script ARGS`` under ``framework``'s wiring on ``nodes`` × ``ranks_per_node`` tasks; ``port``: rank 0's
    (default: a free one). Checked when made (one-line :class:`ValueError`); a stored one: a record (:meth:`stored`)."""

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
    #: Every task's script launched again when one fails, up to this many times (``torchrun --max-restarts``).
    max_restarts: int = 0
    #: Seconds a task waits in a collective before the job's log gets the hang doctor's report (0: none).
    hang_after: float = HANG_AFTER
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
        checked_faults(self.ranks, self.max_restarts, (), None)
        object.__setattr__(self, "hang_after", checked_hang_after(self.hang_after))
        # Time, partition, account and #SBATCH lines as the ranks' SLURM launcher checks them (SLURM says the rest).
        object.__setattr__(self, "sbatch", tuple(SlurmLauncher.sbatch_options(vars(self))[1]))
        for line in self.sbatch:
            word = (line.split()[1:2] or [""])[0].split("=")[0]
            flag = word if word.startswith("--") else word[:2]  # -N2 is -N 2
            if flag in SET_BY_THE_JOB:
                option = SET_BY_THE_JOB[flag]
                use = f"use {option}= (--{option.replace('_', '-')})" if option else "the job sets it itself"
                raise ValueError(f"sbatch line {line!r} sets what the job's own options or wiring set: {use}")
        # SLURM counts limits in whole minutes and rounds seconds up: 00:00:20 would be one minute.
        _, days, clock = str(self.time or "").rpartition("-")  # M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
        if len(clock.split(":")) >= (3 if days else 2) and clock.split(":")[-1].strip("0"):
            raise ValueError(f"time={self.time!r} has seconds, which SLURM rounds up to a minute; e.g. time=1")
        if not re.fullmatch(r"[^\s'\"]*", self.name or ""):
            raise ValueError(f"name={self.name!r} is not one word; e.g. name=run1")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")

    @classmethod
    def stored(cls, said: dict) -> JobSpec:
        """A request as its job's folder keeps it, read as written, never checked again (its script may have moved)."""
        spec = object.__new__(cls)
        for field in dataclasses.fields(cls):
            value = said.get(field.name, field.default)
            object.__setattr__(spec, field.name, tuple(value) if isinstance(value, list) else value)
        return spec

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def layout(self) -> str:
        """``N node(s) × R rank(s)``, as the job's lines say it."""
        return f"{self.nodes} node(s) × {self.ranks_per_node} rank(s)"


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


class Shown:
    """Shown as its :meth:`summary`, except by the cell whose magic printed and returned it (no second ``Out[]``)."""

    printed_in: object = None

    def _ipython_display_(self) -> None:
        from IPython import get_ipython

        if self.printed_in is None or self.printed_in is not running_cell(get_ipython()):
            print(self.summary())


def running_cell(shell) -> object:
    """The result IPython fills in for the cell running now (one object per cell run), if any."""
    return getattr(getattr(shell, "displayhook", None), "exec_result", None)


class Job(Shown):
    """A submitted job, read from its folder and its backend: any kernel can make one."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        said = json.loads((self.folder / "job.json").read_text())
        self.job_id: str = said.pop("job_id")
        self.spec = JobSpec.stored(said)
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
    def attempt(self) -> int:
        """Which launch of the tasks' scripts runs (or ran last): 1, then 1 more for each restart."""
        path = self.folder / "job.attempt"
        return int(path.read_text()) if path.exists() and path.read_text().strip() else 1

    @property
    def exit_codes(self) -> list[int | None]:
        """Each rank's last exit status: ``None`` until it ends or where SLURM killed it; above 128: a signal's."""
        paths = [self.folder / f"rank-{r}.exit" for r in range(self.spec.ranks)]
        return [int(path.read_text()) if path.exists() and path.read_text().strip() else None for path in paths]

    def logs(self, rank: int | None = None, read: dict[int, int] | None = None) -> str:
        """Each rank's output (or rank ``rank``'s) labelled ``[rank r]``, start-up chatter held back as ``%vgpu_run``
        holds it; with ``read`` (rank -> characters read, updated) only the whole lines written since."""
        added, held = [], HeldBack.of(frameworks.get(self.spec.framework))
        for r in range(self.spec.ranks) if rank is None else [rank]:
            text, start = self.backend.logs(self.folder, r), 0 if read is None else read.get(r, 0)
            done = len(text) if read is None else text.rfind("\n") + 1
            added += [f"[rank {r}] {line}\n" for line in text[start:done].splitlines() if held.shown(r, line)]
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

    def stacks(self) -> str:
        """The hang doctor's report (docs/hangs.md) on its running tasks (a collective waited in for a second counts:
        the user asks now); :class:`ValueError` where its tasks are not running."""
        from .stacks import look

        state = self.state
        if state == "RUNNING":
            said, lines, answered = look(self.folder, self.spec.ranks, 1.0)
            if answered:
                return report(f"job {self.job_id}, attempt {self.attempt}: {said or 'no rank waits on another'}", lines)
        tasks = "its tasks are not running" if state != "RUNNING" else "none of its tasks answered (started yet?)"
        raise ValueError(f"job {self.job_id} is {state}: {tasks}; %vgpu_job logs {self.job_id} shows what they printed")

    def cancel(self) -> None:
        """Cancel it; :class:`ValueError` where it already ended (SLURM's ``scancel`` says nothing then)."""
        state = self.state
        if state in ENDED:
            raise ValueError(f"job {self.job_id} already ended ({state}): there is nothing to cancel")
        self.backend.cancel(self.job_id)

    def summary(self, lines: int = 5) -> str:
        """``ID NAME: STATE, elapsed [D-]HH:MM:SS, ...``, each failed rank's status and last lines, why it ended or
        pends. A rank SLURM's own signal ended, where SLURM ended the job (cancel, time limit), did not fail."""
        state, reason, elapsed = self.backend.state(self.job_id, self.folder)
        codes, (hours, seconds) = self.exit_codes, divmod(elapsed.seconds, 3600)
        ran = f"{elapsed.days}-" * bool(elapsed.days) + f"{hours:02}:{seconds // 60:02}:{seconds % 60:02}"
        attempts = f", attempt {self.attempt} of {self.spec.max_restarts + 1}" if self.spec.max_restarts else ""
        said = [
            f"{self.job_id} {Path(self.spec.script).name}: {state}, elapsed {ran}, {self.spec.layout}, "
            f"exit codes by rank [{', '.join(map(str, codes))}]{attempts}"
        ]
        slurms = (128 + signal.SIGTERM, 128 + signal.SIGKILL) if state in ("CANCELLED", "TIMEOUT") else ()
        for rank, code in enumerate(codes):
            if code and code not in slurms:
                tail = [line for line in self.backend.logs(self.folder, rank).splitlines() if line.strip()]
                killed = f" ({signal.Signals(code - 128).name})" if code - 128 in signal.valid_signals() else ""
                said += [f"  rank {rank} exited with status {code}{killed}:", *(f"    {x}" for x in tail[-lines:])]
        return "\n".join(said + ([f"  {state}: {reason}"] if reason and (state in ENDED or state == "PENDING") else []))


def submit(script: str, args=(), framework: str = "torch", nodes: int = 1, ranks_per_node: int = 1, **options) -> Job:
    """Submit ``script ARGS`` as a batch job of ``nodes`` × ``ranks_per_node`` tasks, each wired as the rehearsal
    wires its rank under ``framework``; returns at once. ``options``: the other :class:`JobSpec` fields."""
    spec = JobSpec(script, tuple(args), framework, nodes, ranks_per_node, **options)
    job_id = backend(spec.backend).submit(spec)
    folder = Path(spec.script).parent / FOLDER / job_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.json").write_text(json.dumps({"job_id": job_id, **dataclasses.asdict(spec)}))
    index_file().parent.mkdir(parents=True, exist_ok=True)
    with index_file().open("a") as index:  # one short appended line: whole even when two kernels submit at once
        index.write(f"{folder}\n")
    return Job(folder)


def index_file() -> Path:
    """This user's jobs, one folder a line, oldest first: ``$XDG_DATA_HOME/vgpu_magic/jobs`` (or ``~/.local/share``)."""
    data = os.environ.get("XDG_DATA_HOME", "")
    return (Path(data) if os.path.isabs(data) else Path.home() / ".local" / "share") / "vgpu_magic" / "jobs"


def jobs(root: str | os.PathLike | None = None) -> Jobs:
    """This user's jobs (:func:`index_file`, gone folders left out), oldest first; with ``root``, its scripts' only."""
    if root is not None:
        found = [Job(path.parent) for path in Path(root).resolve().rglob(f"{FOLDER}/*/job.json")]
        return Jobs(sorted(found, key=lambda job: (len(job.job_id), job.job_id)))
    listed = index_file().read_text().splitlines() if index_file().exists() else []
    return Jobs(Job(folder) for folder in dict.fromkeys(listed) if (Path(folder) / "job.json").is_file())


class Jobs(Shown, list):
    """Jobs (a list), displayed as their summaries."""

    def summary(self) -> str:
        return "\n".join(job.summary() for job in self)
