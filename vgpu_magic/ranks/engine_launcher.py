"""ipyparallel's engine launchers as the ranks use them: local engines record how they exit (ipyparallel
reaps an engine in a thread and hands its status to an event loop that may never run it while a cell watches the
ranks), SLURM's keeps what ``sbatch`` and ``scancel`` say. At module level, so that the cluster file names
classes ipyparallel's own tools can import. Importing this module imports ipyparallel.
"""

from __future__ import annotations

import subprocess
from typing import Any

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, SlurmEngineSetLauncher

__all__ = ["ExitRecordingEngineLauncher", "ExitRecordingEngineSetLauncher", "ReasonedSlurmEngineSetLauncher"]


class ExitRecordingProcess(psutil.Process):
    """A process whose ``wait`` keeps the exit status it returned (``exit_code``; negative: the signal)."""

    exit_code: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        code = super().wait(timeout)
        self.exit_code = None if code is None else int(code)
        return code


class ExitRecordingEngineLauncher(LocalEngineLauncher):
    """ipyparallel's local engine launcher; ``process.exit_code`` is the engine's exit status once reaped."""

    def _start_waiting(self) -> None:
        self.process = ExitRecordingProcess(self.process.pid)
        super()._start_waiting()


class ExitRecordingEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, of :class:`ExitRecordingEngineLauncher`."""

    launcher_class = ExitRecordingEngineLauncher
    # What the cluster file names: ipyparallel's "module:Class" abbreviation does not import back.
    entrypoint_name = f"{__name__}.ExitRecordingEngineSetLauncher"


class ReasonedSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """ipyparallel's SLURM launcher, keeping what ``sbatch``/``scancel`` say on stderr (ipyparallel lets it
    go to the kernel's terminal), so that a failing submit says why (:func:`~.processes.start_failure`)."""

    entrypoint_name = f"{__name__}.ReasonedSlurmEngineSetLauncher"

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        proc = subprocess.run(command, capture_output=True, check=False, **kwargs)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)
        return proc.stdout.decode("utf8", "replace")
