"""A throwaway single-node SLURM cluster on this machine, to rehearse ``--launcher slurm`` without a real one.

Debian's ``slurm-wlm`` and ``munge``, run as root: a ``munged`` of its own, a ``slurm.conf`` with ports chosen by
the OS, ``slurmctld`` and ``slurmd``, all in a temporary folder that :meth:`LocalSlurm.stop` removes; the system's
``/etc/slurm`` and munge are not touched. While it runs, ``os.environ["SLURM_CONF"]`` points at it. The node
declares more CPUs than the machine has (``SlurmdParameters=config_overrides``); more nodes are
:class:`SlurmNode` entries, each ``slurmd`` started under a command prefix (``ip netns exec NS``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from vgpu_magic.ranks import lifetime
from vgpu_magic.ranks.hosts import free_port

__all__ = ["LocalSlurm", "SlurmNode", "missing_commands"]

#: The commands a local cluster needs (Debian: apt-get install slurm-wlm munge).
COMMANDS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "srun", "squeue", "scancel", "scontrol")
#: Seconds the daemons may take to report the node idle.
READY_TIMEOUT = 60.0


def missing_commands() -> list[str]:
    """The commands :class:`LocalSlurm` needs that are not on PATH (or in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in COMMANDS if shutil.which(name, path=path) is None]


@dataclass(frozen=True)
class SlurmNode:
    """One compute node: its name, the address its ``slurmd`` is reached at, and the
    command words its ``slurmd`` is started under (none: on this host as it is)."""

    name: str
    address: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


class LocalSlurm:
    """One ``slurmctld`` (reached at ``address``) and a ``slurmd`` per node (default: this host), each
    declaring ``cpus`` CPUs, and their ``munged``, in a temporary folder."""

    def __init__(self, cpus: int = 16, nodes: list[SlurmNode] | None = None, address: str = "127.0.0.1") -> None:
        if os.geteuid() != 0:
            raise RuntimeError("a local SLURM cluster needs root (slurmd runs jobs as their user)")
        missing = missing_commands()
        if missing:
            raise RuntimeError(f"a local SLURM cluster needs {', '.join(missing)}: apt-get install slurm-wlm munge")
        self.cpus = cpus
        self.nodes = list(nodes or [SlurmNode(socket.gethostname())])
        self.address = address
        self.folder: Path | None = None
        self.conf: Path | None = None
        self.processes: list[subprocess.Popen] = []
        self._previous_conf: str | None = None
        self._watcher: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> LocalSlurm:
        """Start munged, slurmctld and slurmd; return once the nodes are idle, else :class:`RuntimeError` with
        the daemons' log tail and nothing left running."""
        self.folder = Path(tempfile.mkdtemp(prefix="vgpu-slurm-"))
        try:
            self._start_munge()
            self.conf = self._write_conf()
            self._previous_conf = os.environ.get("SLURM_CONF")
            os.environ["SLURM_CONF"] = str(self.conf)
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(
                    f"slurmd-{node.name}", [*node.prefix, "slurmd", "-D", "-N", node.name, "-f", str(self.conf)]
                )
            self._wait_idle()
            # A watched process (:mod:`.lifetime`) sweeps the daemons if this process dies without stop().
            sweep = shlex.join(["sh", "-c", self._sweep_script()])
            self._watcher = lifetime.run_when_this_process_dies(sweep)
        except BaseException:
            self.stop()
            raise
        return self

    def _sweep_script(self, daemons: bool = True) -> str:
        """Shell lines that SIGKILL this cluster's daemons (with ``daemons``: not once reaped) and its jobs'
        step daemons (by ``SLURM_CONF`` in their environment: ``slurmd`` leaves them to init), then remove the
        folder."""
        pids = " ".join(str(proc.pid) for proc in self.processes) if daemons else ""
        return (
            (f"kill -9 {pids} 2>/dev/null; " if pids else "") + "for p in $(pgrep -x slurmstepd); do "
            f"grep -qa 'SLURM_CONF={self.conf}' /proc/$p/environ 2>/dev/null && pkill -9 -P $p; "
            f"grep -qa 'SLURM_CONF={self.conf}' /proc/$p/environ 2>/dev/null && kill -9 $p; done; "
            + f"rm -rf '{self.folder}'"
        )

    def stop(self) -> None:
        """Cancel every job, stop the daemons and remove the folder. Safe to call twice."""
        if self._watcher is not None:
            self._watcher.kill()
            self._watcher.wait(timeout=10)
            self._watcher = None
        if self.conf is not None and self.processes:
            subprocess.run(
                ["scancel", "--full", "--user", "root"], env=self.env(), capture_output=True, timeout=30, check=False
            )
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.processes):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self.conf is not None and self.processes:
            # Step daemons of jobs still running when slurmd stopped are left to init.
            sweep = ["sh", "-c", self._sweep_script(daemons=False)]
            subprocess.run(sweep, capture_output=True, timeout=30, check=False)
        self.processes = []
        if self.conf is not None and os.environ.get("SLURM_CONF") == str(self.conf):
            if self._previous_conf is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = self._previous_conf
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = self.conf = None

    def env(self) -> dict[str, str]:
        """The environment for SLURM commands aimed at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def step_daemons(self) -> set[int]:
        """The PIDs of this cluster's ``slurmstepd`` processes, which hold its slurmd's log (in :attr:`folder`) open:
        another SLURM on the machine (another test run's, a user's) has its own. Not by their ``SLURM_CONF``: a step
        daemon's title overwrites most of its environment."""
        found = set()
        for proc in psutil.process_iter(["name", "status"]):
            if proc.info["name"] == "slurmstepd" and proc.info["status"] != psutil.STATUS_ZOMBIE:
                with contextlib.suppress(psutil.Error):
                    if any(Path(f.path).parent == self.folder for f in proc.open_files()):
                        found.add(proc.pid)
        return found

    def squeue(self) -> list[str]:
        """The jobs in the queue, one ``"JOBID STATE NAME"`` line each."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %j"], env=self.env(), capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return [line for line in out.splitlines() if line.strip()]

    def scontrol(self, *args: str) -> str:
        """``scontrol ARGS`` on this cluster; its output."""
        return subprocess.run(
            ["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30, check=True
        ).stdout

    # -- pieces ---------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        # SIGINT back to its default: a kernel or test run started in the background ignores it, and
        # the jobs' tasks would inherit that (the ranks are interrupted with SIGINT).
        with open(self.folder / f"{name}.out", "wb") as log:
            proc = subprocess.Popen(
                ["env", "--default-signal=INT", *argv],
                env=self.env() if self.conf else os.environ.copy(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.processes.append(proc)

    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={munge / 'munged.log'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            if self.processes[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self._tail('munged.out')}")
            time.sleep(0.05)

    def _write_conf(self) -> Path:
        folder = self.folder
        for sub in ("state", "spool"):
            (folder / sub).mkdir()
        host = socket.gethostname()
        lines = [
            "ClusterName=vgpu",
            f"SlurmctldHost={host}({self.address})",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"AuthInfo=socket={self.munge_socket}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={folder / 'slurmctld.log'}",
            f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MinJobAge=2",
            "KillWait=5",
            "InactiveLimit=0",
            *(f"NodeName={node.name} NodeAddr={node.address} CPUs={self.cpus} State=UNKNOWN" for node in self.nodes),
            f"PartitionName=debug Nodes={','.join(node.name for node in self.nodes)} "
            "Default=YES MaxTime=INFINITE State=UP",
        ]
        conf = folder / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        state = ""
        names = ["munged", "slurmctld", *(f"slurmd-{node.name}" for node in self.nodes)]
        while time.monotonic() < deadline:
            for proc, name in zip(self.processes, names):
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited ({proc.returncode}): {self._tail(name + '.out')} {self._tail(name + '.log')}"
                    )
            result = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"],
                env=self.env(),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            state = result.stdout.strip() or result.stderr.strip()
            if result.returncode == 0 and state.split() == ["idle"] * len(self.nodes):
                return
            time.sleep(0.2)
        logs = " ".join(self._tail(f"slurmd-{node.name}.log") for node in self.nodes)
        raise RuntimeError(f"the SLURM nodes did not become idle (sinfo: {state!r}): {logs}")

    def _tail(self, name: str, lines: int = 5) -> str:
        path = self.folder / name if self.folder else None
        if path is None or not path.exists():
            return ""
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
