"""``%vgpu_job``: a thin face over :func:`~vgpu_magic.batch.submit`, :class:`~vgpu_magic.batch.Job` and ``jobs``."""

from __future__ import annotations

import argparse
import shlex
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..errors import PlanError, excerpt
from ..frameworks import choices
from ..grammar import choice, framework_name, parse_arguments, seconds, whole
from ..ranks.launchers import SlurmLauncher
from . import ENDED, Job, Jobs, JobSpec, Shown, backend, index_file, jobs, running_cell, submit

__all__ = ["JobMagics"]

_ACTIONS = ("submit", "script", "status", "logs", "stacks", "cancel")
_SUBMIT = "%vgpu_job submit --framework torch --nodes 2 --ranks-per-node 8 train.py --epochs 2"
#: Seconds between two looks at a followed job's logs.
FOLLOW_POLL = 0.5
#: The options each action takes, by their long flags (the others take none).
_TAKES = {
    "submit": {"--framework", "--nodes", "--ranks-per-node", "--gpus-per-node", "--time", "--partition", "--account"}
    | {"--sbatch", "--name", "--port", "--max-restarts", "--hang-after"},
    "logs": {"--rank", "--follow"},
}
_TAKES["script"] = _TAKES["submit"]


@magics_class
class JobMagics(Magics):
    """``%vgpu_job``."""

    @magic_arguments()
    @argument(
        "action",
        type=choice(_ACTIONS, "{value} is not an action; use " + ", ".join(_ACTIONS), _SUBMIT),
        help="submit or show the batch script of FILE ARGS; the status, logs, stacks or cancel of job ID",
    )
    @argument("target", nargs="?", metavar="FILE|ID", help="the script (submit, script) or the job id")
    @argument("--framework", "-f", type=framework_name, default="torch", help=f"{choices()}: how tasks are wired")
    @argument("--nodes", "-N", type=whole("--nodes", 1, 4096, "--nodes 2"), default=1, help="nodes (default 1)")
    @argument("--ranks-per-node", "-n", type=whole("--ranks-per-node", 1, 1024, "-n 8"), default=1, help="default 1")
    @argument("--gpus-per-node", type=whole("--gpus-per-node", 0, 1024, "--gpus-per-node 8"), help="GPUs per node")
    @argument("--time", **SlurmLauncher.options["time"])
    @argument("--partition", **SlurmLauncher.options["partition"])
    @argument("--account", **SlurmLauncher.options["account"])
    @argument("--sbatch", **SlurmLauncher.options["sbatch"])
    @argument("--name", help="the job's name (default vgpu-<script name>)")
    @argument("--port", type=whole("--port", 1, 65535, "--port 29500"), help="rank 0's port (default: a free one)")
    @argument(
        "--max-restarts",
        type=whole("--max-restarts", 0, 100, "--max-restarts 2"),
        help="launch every task's script again when one fails, up to N times, as torchrun --max-restarts N",
    )
    @argument(
        "--hang-after",
        type=seconds("--hang-after", 0, 7 * 24 * 3600, "30"),
        help="write a hang's report into the job's log after a task waits this long in a collective (0: never)",
    )
    @argument("--rank", "-r", type=whole("--rank", 0, 2**20, "--rank 0"), help="logs: this rank's only")
    @argument("--follow", action="store_true", help="logs: stream until the job ends (interrupt stops following)")
    @argument("script_args", nargs="*", metavar="ARGS", help="the script's own arguments (its sys.argv[1:])")
    @line_magic
    def vgpu_job(self, line: str):
        """Submit the rehearsed script as a batch job, each task wired as the rehearsal wires
        its rank; follow it from any notebook.

        ::

            %vgpu_job submit --framework torch --nodes 2 --ranks-per-node 8 --time 01:00:00 train.py --epochs 2
            %vgpu_job submit --max-restarts 2 train.py   # every task's script again when one fails, twice at most
            %vgpu_job script --framework torch --nodes 2 --ranks-per-node 8 train.py   # the batch script
            %vgpu_job status          # every job of yours, wherever its script was
            %vgpu_job logs 123 --rank 0 --follow
            %vgpu_job stacks 123      # where each rank is, and which one a hang waits for
            %vgpu_job cancel 123
        """
        args = self._parse(line)
        if args.action in ("submit", "script"):
            if args.target is None:
                raise UsageError(f"say which script to {args.action}, e.g. {_SUBMIT}")
            keys = [flag[2:].replace("-", "_") for flag in _TAKES["submit"]]  # JobSpec's fields
            options = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
            request = (args.target, tuple(args.script_args))
            try:
                if args.action == "script":
                    text = backend("slurm").script(JobSpec(*request, **options))
                    print(text, end="")
                    return text
                job = submit(*request, **options)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            command = shlex.join(["python", args.target, *args.script_args])
            print(f"submitted job {job.job_id}, {job.spec.layout}: {command}")
            print(f"follow it with %vgpu_job logs {job.job_id} --follow")
            return self._printed(job)
        if args.action == "status":
            found = jobs() if args.target is None else Jobs([self._job(args.target)])
            print(found.summary() or f"no jobs yet (listed in {index_file()})")
            return self._printed(found)
        if args.target is None:
            raise UsageError(f"say which job, e.g. %vgpu_job {args.action} 12 (%vgpu_job status lists them)")
        job = self._job(args.target)
        if args.action in ("cancel", "stacks"):
            try:
                said = job.stacks() if args.action == "stacks" else job.cancel() or f"cancelled job {job.job_id}\n"
            except ValueError as exc:
                raise UsageError(str(exc)) from None
            return print(said, end="")
        if args.rank is not None and args.rank >= job.spec.ranks:
            raise UsageError(f"--rank {args.rank} is not a rank of job {job.job_id}; use 0..{job.spec.ranks - 1}")
        if args.follow:
            return self._follow(job, args.rank)
        print(job.logs(args.rank), end="")

    def _parse(self, line: str) -> argparse.Namespace:
        """As %vgpu_run's and torchrun's, for submit and script: our options, FILE, then the script's words."""
        parser = self.vgpu_job.parser
        try:
            try:
                words, options, target, at = shlex.split(line), [], [], 1
            except ValueError:
                parse_arguments(parser, line, example=_SUBMIT)  # raises the grammar's sentence for what it is
            script = words[:1] in (["submit"], ["script"])
            while at < len(words) and not (script and target):
                option = parser._option_string_actions.get(words[at].split("=")[0])
                step = 1 if option is None or option.nargs == 0 or "=" in words[at] else 2
                (options if words[at].startswith("-") else target).extend(words[at : at + step])
                at += step
            args = parse_arguments(parser, shlex.join([*words[:1], *target, *options]), example=_SUBMIT)
            if args.script_args:  # a second id
                raise PlanError(f"{excerpt(' '.join(args.script_args))} is not understood here; use e.g. {_SUBMIT}")
            for word in options:
                action = parser._option_string_actions.get(word.split("=")[0])
                flag = action and max(action.option_strings, key=len)
                if flag and flag not in _TAKES.get(args.action, ()):
                    takes = ", ".join(sorted(_TAKES.get(args.action, ()))) or "no options"
                    raise PlanError(f"{args.action} does not take {flag}; it takes {takes}")
            args.script_args = words[at:]
            return args
        except PlanError as exc:
            raise UsageError(str(exc)) from None

    def _printed(self, shown: Shown) -> Shown:
        """``shown``, not displayed again as this cell's ``Out[]``: the magic printed it."""
        shown.printed_in = running_cell(self.shell)
        return shown

    def _job(self, job_id: str) -> Job:
        """Job ``job_id`` of this user's (the newest of that id: ids start again on a new cluster)."""
        found = [job for job in jobs() if job.job_id == job_id]
        if not found:
            raise UsageError(f"job {job_id!r} is not one of your jobs (%vgpu_job status lists them)")
        return found[-1]

    def _follow(self, job: Job, rank: int | None) -> None:
        read: dict[int, int] = {}
        try:
            while True:
                ended = job.state in ENDED
                print(job.logs(rank, read), end="")
                if ended:
                    break
                time.sleep(FOLLOW_POLL)
        except KeyboardInterrupt:
            # Raised again: a notebook's Run All stops here as at any interrupted cell (the next may be a cancel).
            print(f"stopped following job {job.job_id}; the job goes on ({job.state})")
            raise
        print(job.summary())
