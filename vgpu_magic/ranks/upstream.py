"""Every use of ipyparallel's and ipykernel's private members, each with why and what it relies on, which
``tests/test_upstream_contract.py`` checks. The cluster and launchers are at module level, so that the cluster file
names classes ipyparallel's tools can import. Importing this module imports ipyparallel."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable
from typing import Any

import psutil
from ipyparallel.cluster.cluster import Cluster, ClusterManager
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher, SlurmEngineSetLauncher
from traitlets import Dict, Unicode

#: Where ipyparallel's cluster objects log: nowhere (the ranks report their failures; a stop is silent).
QUIET = logging.getLogger("vgpu_magic.ranks.ipyparallel")
QUIET.addHandler(logging.NullHandler())
QUIET.propagate = False


class RanksCluster(Cluster):
    """ipyparallel's cluster, whose file its ``owner`` kernel owns. A copy loaded from it (JupyterLab's panel) logs
    nothing, leaves files to the owner, and leaves its manager once stopped (upstream logged each log as a failure)."""

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

    # ipyparallel calls ``on_stop`` callbacks; ``_is_running`` and ``ClusterManager._cluster_key`` are its own.
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
    """ipyparallel's local engine launcher; ``process.exit_code``: the engine's exit status once reaped."""

    # ipyparallel's ``_start_waiting`` thread reaps the engine by ``process.wait``; upstream would keep its status.
    def _start_waiting(self) -> None:
        self.process = ExitRecordingProcess(self.process.pid)
        super()._start_waiting()


class ExitRecordingEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, of :class:`ExitRecordingEngineLauncher`."""

    launcher_class = ExitRecordingEngineLauncher
    # What the cluster file names: ipyparallel's "module:Class" abbreviation does not import back.
    entrypoint_name = f"{__name__}.ExitRecordingEngineSetLauncher"


class ReasonedSlurmEngineSetLauncher(SlurmEngineSetLauncher):
    """ipyparallel's SLURM launcher, keeping ``sbatch``/``scancel``'s stderr so that a failing submit says why."""

    entrypoint_name = f"{__name__}.ReasonedSlurmEngineSetLauncher"
    # ipyparallel's own template with, through its ``namespace``, what it has no trait for: more #SBATCH lines (its
    # template never writes ``SlurmLauncher.options``) and srun's own arguments.
    default_template = Unicode(
        "#!/bin/sh\n#SBATCH --export=ALL\n#SBATCH --job-name=ipengine-{cluster_id}\n"
        "{sbatch}srun {srun}{program_and_args}\n"
    )
    namespace = Dict({"sbatch": "", "srun": ""}, config=True)

    # ipyparallel's ``_run_command`` returns only stdout; upstream would need stderr kept in the error it raises.
    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        proc = subprocess.run(command, capture_output=True, check=False, **kwargs)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, command, proc.stdout, proc.stderr)
        return proc.stdout.decode("utf8", "replace")


def message_futures(ar: Any) -> list[Any]:
    """The futures of ``ar``'s requests (``AsyncResult._children``); ``output`` resolves when its engine idles."""
    return list(getattr(ar, "_children", None) or ())


def watch_requests(client: Any, watch: Callable[[str, Any], Callable[[dict], None]]) -> None:
    """Call ``watch(msg_id, future)`` as ``client`` makes each request's future, and what it returns with each IOPub
    message of it (no public hook: ``Client.create_message_futures``, ``Client._dispatch_iopub``)."""
    create = client.create_message_futures

    def create_watched(msg_id: str, *args: Any, **kwargs: Any) -> list[Any]:
        futures = create(msg_id, *args, **kwargs)
        futures[0].iopub_callbacks.append(watch(msg_id, futures[0]))
        return futures

    client.create_message_futures = create_watched


def set_handler_hooks(kernel: Any, pre: Callable[[], None], post: Callable[[], None]) -> None:
    """Make ipykernel's ``kernel`` call ``pre`` and ``post`` around each request (``Kernel.dispatch_shell``)."""
    kernel.pre_handler_hook = pre
    kernel.post_handler_hook = post


def no_abort_after_an_error(kernel: Any) -> None:
    """Keep ``kernel`` from aborting requests queued behind a failed cell (``_abort_queues``, ``stop_on_error``)."""
    kernel._abort_queues = lambda *args, **kwargs: None
