"""The cluster's own MPS daemon for ranks sharing a GPU over NCCL (else collectives spin, 20× slower), in its own folder
(a machine's is untouched); stopped with the cluster, or by a watcher's ``python -m vgpu_magic.ranks.mps FOLDER``."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CONTROL = "nvidia-cuda-mps-control"
#: Seconds the control may take to answer.
TIMEOUT = 30


@dataclass(frozen=True)
class MPSDaemon:
    """The daemon whose pipes and logs are in ``folder``."""

    folder: str

    @property
    def env(self) -> dict[str, str]:
        """What its clients (the ranks) and its control read to find it."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.folder, "CUDA_MPS_LOG_DIRECTORY": self.folder}

    def start(self) -> None:
        """``nvidia-cuda-mps-control -d``, or :class:`RuntimeError` with what it said."""
        os.makedirs(self.folder, exist_ok=True)
        try:
            done = _control(["-d"], "", self.env)
        except (OSError, subprocess.SubprocessError) as error:
            raise RuntimeError(f"the MPS daemon could not start: {error}") from None
        if done.returncode:
            said = (done.stderr or done.stdout).strip() or "nothing"
            raise RuntimeError(f"the MPS daemon could not start: {CONTROL} -d exited {done.returncode} ({said})")

    def stop(self) -> None:
        """``echo quit | nvidia-cuda-mps-control`` (it waits for its clients: the ranks go first; none running: nothing
        to stop), then its folder."""
        if os.path.isdir(self.folder) and shutil.which(CONTROL):
            # A daemon that does not answer goes with its folder's pipes.
            with contextlib.suppress(subprocess.SubprocessError):
                _control([], "quit\n", self.env)
        shutil.rmtree(self.folder, ignore_errors=True)

    def stop_command(self) -> str:
        """:meth:`stop` as a command, for a watcher of the kernel (:func:`.lifetime.run_when_this_process_dies`)."""
        return shlex.join([sys.executable, "-m", __name__, self.folder])


def _control(args: list[str], stdin: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CONTROL, *args], input=stdin, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT
    )


def plan_mps(wanted: bool, asked: bool | None, remote: bool, cluster_id: str) -> tuple[MPSDaemon | None, str]:
    """The daemon a cluster starts where plans want one (``wanted``) and ``asked`` allows, and its start's line."""
    why = ""
    if not wanted:
        why = "it serves ranks that share a GPU over NCCL (--backend nccl), and these do not"
    elif remote:
        why = "the ranks run on other hosts, and the daemon would run on this one"
    elif shutil.which(CONTROL) is None:
        why = f"MPS is unavailable here: {CONTROL} is not on PATH"
    elif asked is False:
        why = "mps=False"
    if asked and why:
        raise ValueError(f"--mps cannot be honoured: {why}; leave --mps out")
    if not wanted:
        return None, ""
    if why:
        return None, f"no MPS daemon ({why}): the ranks' kernels take turns on the GPU, and collectives spin meanwhile"
    daemon = MPSDaemon(os.path.join(tempfile.gettempdir(), f"{cluster_id}-mps"))
    return daemon, f"an MPS daemon of this cluster's own serves the ranks (its pipes and logs in {daemon.folder})"


if __name__ == "__main__":
    MPSDaemon(sys.argv[1]).stop()
