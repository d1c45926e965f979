"""ipyparallel's cluster and engine launchers as the ranks use them: local engines record how they exit
(ipyparallel reaps an engine in a thread and hands its status to an event loop that may never run it while a cell
watches the ranks), SLURM's keeps what ``sbatch`` and ``scancel`` say, and the cluster loaded from its file by
another process (JupyterLab's cluster panel) stays silent. At module level, so that the cluster file names classes
ipyparallel's own tools can import. Importing this module imports ipyparallel.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from typing import Any

import psutil
from ipyparallel.cluster.cluster import Cluster, ClusterManager
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, SlurmEngineSetLauncher

__all__ = [
    "ExitRecordingEngineLauncher",
    "ExitRecordingEngineSetLauncher",
    "RanksCluster",
    "ReasonedSlurmEngineSetLauncher",
]

#: Where ipyparallel's cluster objects log: nowhere. The ranks report what goes wrong themselves; a stop is silent
#: (ipyparallel logs a process's whole log file when it ends by a signal); a copy elsewhere stays out of its log.
QUIET = logging.getLogger("vgpu_magic.ranks.ipyparallel")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


class RanksCluster(Cluster):
    """ipyparallel's cluster; the kernel that started it owns its file (``owner``). A copy another process loads
    from it (JupyterLab's cluster panel: ipyparallel's ``ClusterManager``) watches the same processes; at their
    stop it logged each one's log file into the Jupyter server's terminal as a failure, wrote the file again and
    removed the logs. The copy logs nothing, leaves files to the owner, and leaves its manager once stopped."""

    owner = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], **kwargs: Any) -> Cluster:
        states = [d.get("controller", {}).get("state") or {}]
        for engine_set in d.get("engines", {}).get("sets", {}).values():
            states += [engine_set, *engine_set.get("engines", {}).values()]
        for state in states:
            if "output_file" in state:
                state["output_file"] = ""
        return super().from_dict(d, **{**kwargs, "log": QUIET})

    def update_cluster_file(self) -> None:
        if self.owner:
            super().update_cluster_file()

    def write_cluster_file(self) -> None:
        # Whole or not at all: the panel polls the file, and logs one read half-written as a failure to load.
        os.makedirs(os.path.dirname(self.cluster_file), exist_ok=True)
        with open(f"{self.cluster_file}.new", "w") as new:
            json.dump(self.to_dict(), new)
        os.replace(f"{self.cluster_file}.new", self.cluster_file)

    def _controller_stopped(self, stop_data: Any = None) -> None:
        super()._controller_stopped(stop_data)
        self._leave_manager()

    def _engines_stopped(self, engine_set_id: str, stop_data: Any = None) -> None:
        super()._engines_stopped(engine_set_id, stop_data)
        self._leave_manager()

    def _leave_manager(self) -> None:
        if not self.owner and not self._is_running() and isinstance(self.parent, ClusterManager):
            self.parent.clusters.pop(ClusterManager._cluster_key(self), None)


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
