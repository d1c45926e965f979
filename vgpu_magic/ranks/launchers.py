"""How the ranks' engines start: one :class:`Launcher` per way (local, ``mpiexec``, SLURM, SSH) in :data:`LAUNCHERS`,
planned for one cluster by :func:`plan_launcher` (which validates and starts nothing), then owning what it started:
which engines :mod:`.lifetime` watches, how a rank is reached, how its variables number the ranks, its clean-up.
Under ``slurm`` and ``ssh`` engines reach the controller at ``controller_address`` (default: this host's name; under
SSH its address on the route to the first host)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..layout import JobStep, LaunchedAs, expand_hostlist, expand_tasks_per_node
from . import lifetime
from .hosts import REMOTE_CLEANUP, REMOTE_STOP_TIMEOUT, last_line, route_address, ssh, ssh_target

__all__ = ["LAUNCHERS", "MAX_RANKS", "BatchLauncher", "Launcher", "plan_launcher"]

#: The most ranks a cluster has.
MAX_RANKS = 64

#: Launcher name -> its class, in the order they are defined.
LAUNCHERS: dict[str, type[Launcher]] = {}


def plan_launcher(name: str, n: int, options: dict[str, Any] | None = None, cluster_id: str = "vgpu") -> Launcher:
    """Validate ``name`` and ``options`` for ``n`` ranks and plan their start; else a one-line :class:`ValueError`."""
    options = dict(options or {})
    if name not in LAUNCHERS:
        raise ValueError(f"launcher {name!r} is not supported; use {', '.join(LAUNCHERS)}")
    unknown = sorted(set(options) - set(LAUNCHERS[name].options))
    if unknown:
        accepted = ", ".join(LAUNCHERS[name].options) or "none"
        raise ValueError(f"the {name} launcher has no option {unknown[0]!r}; it takes: {accepted}")
    return LAUNCHERS[name].plan(n, options, cluster_id)


@dataclass
class Launcher:
    """One way ipyparallel starts engines, planned for one cluster: what ipyparallel is told (``config``:
    ``{class: {trait: value}}``; where the controller listens, ``"*"``: everywhere, and is reached, None: loopback),
    then the cluster it started (:meth:`configure`). ``options``: each option's argparse keywords (``None``: Python
    API only)."""

    name: ClassVar[str]
    #: Where the engines run, for the start summary.
    description: ClassVar[str]
    #: ipyparallel's engine-set launcher: its abbreviation, or a class by its import name (ours keeps exit statuses).
    engines: ClassVar[str] = "vgpu_magic.ranks.upstream.ExitRecordingEngineSetLauncher"
    #: The ipyparallel class whose traits ``config`` sets for the engines.
    engine_set: ClassVar[str] = "LocalEngineSetLauncher"
    options: ClassVar[dict[str, dict[str, Any] | None]] = {}
    #: Are its engines this host's processes, under :mod:`.lifetime`'s watch of this kernel and ended by PID? Else
    #: another host's: reached through their engines and ended through the launcher.
    watched: ClassVar[bool] = True
    #: What a script run is, where more than a launch (the start summary).
    launches: ClassVar[str] = ""
    #: The prefixes of the variables its launch gives a process (``srun``'s ``SLURM_*``): each engine reports them,
    #: :meth:`launched` reads the ranks from them, and a script run keeps them over the kernel's.
    task_variables: ClassVar[tuple[str, ...]] = ()

    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    controller_ip: str | None = None
    controller_location: str | None = None
    #: ipyparallel's cluster it starts, and the variables that put a process under :mod:`.lifetime`'s watch of this
    #: kernel (its PID, the cluster's token) (:meth:`configure`).
    cluster: Any = field(default=None, compare=False, repr=False)
    marks: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            LAUNCHERS[cls.name] = cls

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> Launcher:
        """How ipyparallel starts ``n`` engines with ``options`` (their names already checked)."""
        return cls()

    @classmethod
    def launched(cls, variables: Mapping[str, str]) -> LaunchedAs:
        """A process's place as this launcher numbered it, read from its ``variables`` (none by default)."""
        return LaunchedAs()

    def configure(self, cluster: Any, marks: dict[str, str]) -> None:
        """Take ipyparallel's ``cluster`` (not started) as its own; watched engines run under :mod:`.lifetime`'s
        watch, with ``marks``."""
        self.cluster, self.marks = cluster, marks
        if self.watched:
            cluster.config[self.engine_set].engine_cmd = lifetime.watched_command("ipyparallel.engine")
            cluster.config[self.engine_set].environment = dict(marks)

    def start(self, n: int) -> None:
        """Start the cluster's controller and ``n`` engines."""
        self.cluster.start_cluster_sync(n=n)

    def reaches_by_pid(self, hostname: str) -> bool:
        """Is a rank on ``hostname`` reached by its PID (signals, liveness, memory), not through its engine?"""
        return self.watched or hostname == socket.gethostname()

    def describe(self) -> str:
        """Where the engines run, for the start summary."""
        return self.description

    def start_failure(self, exc: BaseException | None) -> str:
        """Why a start failed, in the launcher's own words (a command's stderr: ``sbatch: fatal: ...``), or ``""``."""
        while exc is not None:
            if isinstance(exc, subprocess.CalledProcessError) and last_line(exc.stderr):
                return last_line(exc.stderr).rstrip(".")
            exc = exc.__cause__ or exc.__context__
        return ""

    def clean_up_commands(self) -> list[list[str]]:
        """What ends the engines a PID watch cannot reach if the kernel dies (watched ones need nothing)."""
        return []

    def stop_check(self) -> Callable[[], list[str]]:
        """Read before ipyparallel stops the cluster (it forgets what it stopped): what then says what is left."""
        return list


class LocalLauncher(Launcher):
    name, description = "local", "local ipyparallel engines"


class MPILauncher(Launcher):
    name, description, engines = "mpi", "ipyparallel engines started by mpiexec", "mpi"
    engine_set = "MPIEngineSetLauncher"
    options: ClassVar = {"mpi_args": None}
    # Open MPI's (and its PMIx's, PSM's); MPICH's Hydra gives PMI_* and MPI_LOCAL*.
    task_variables = ("OMPI_", "PMIX_", "HFI_", "IPATH_", "PMI_", "MPI_LOCAL")

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> Launcher:
        if shutil.which("mpiexec") is None:
            raise ValueError("the mpi launcher needs mpiexec on PATH (e.g. apt-get install openmpi-bin)")
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError("the mpi launcher needs mpi4py on the engines: pip install 'vgpu_magic[mpi]'")
        return cls({cls.engine_set: {"mpi_args": _strings("mpi_args", options.get("mpi_args", []))}})

    @classmethod
    def launched(cls, variables: Mapping[str, str]) -> LaunchedAs:
        local = _number(variables, "OMPI_COMM_WORLD_LOCAL_RANK")
        return LaunchedAs(_number(variables, "OMPI_COMM_WORLD_RANK", "PMI_RANK"), local)


#: The flag of the address engines reach this kernel's controller at, which SLURM and SSH share.
_CONTROLLER_ADDRESS = {"help": "the address engines reach this kernel's controller at"}


class BatchLauncher(Launcher):
    """Engines in batch jobs (ipyparallel's ``BatchSystemLauncher``): on the queue's hosts, ended through the queue."""

    watched = False
    #: The command that lists a job (by its id, appended) while the queue holds it; the one that kills it.
    queue_command: ClassVar[tuple[str, ...]]
    kill_command: ClassVar[tuple[str, ...]]

    def configure(self, cluster: Any, marks: dict[str, str]) -> None:
        super().configure(cluster, marks)
        # Not the kernel's working folder (the user's notebooks): the profile's log folder, removed by the stop.
        batch_file = os.path.join(cluster.profile_dir, "log", f"ipengine-{cluster.cluster_id}.{self.name}")
        cluster.config[self.engine_set].batch_file_name = batch_file

    def batch_sets(self) -> list[Any]:
        """The cluster's engine sets that are batch jobs (a ``job_id``)."""
        return [es for es in getattr(self.cluster, "engines", {}).values() if getattr(es, "job_id", "")]

    def describe(self) -> str:
        return self.description + "".join(f", job {es.job_id}" for es in self.batch_sets())

    def clean_up_commands(self) -> list[list[str]]:
        """Each batch job's delete command (``scancel JOBID``)."""
        return [[*es.delete_command, es.job_id] for es in self.batch_sets()]

    def stop_check(self) -> Callable[[], list[str]]:
        """The batch jobs out of the queue (killed if they do not leave), the batch script removed."""
        jobs, script = [es.job_id for es in self.batch_sets()], self.cluster.config[self.engine_set].batch_file_name

        def remaining() -> list[str]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(script)
            left = []
            for job in jobs:
                if not self.job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                    subprocess.run([*self.kill_command, job], capture_output=True, timeout=30, check=False)
                    if not self.job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                        left.append(f"{self.name} job {job} is still queued ({self.queue_command[0]})")
            return left

        return remaining

    def job_gone(self, job: str, timeout: float) -> bool:
        """Has batch job ``job`` left the queue within ``timeout`` seconds?"""
        deadline = time.monotonic() + timeout
        while True:
            proc = subprocess.run([*self.queue_command, job], capture_output=True, text=True, timeout=30, check=False)
            # A queue command exits non-zero for a job id it no longer knows: gone as well.
            if proc.returncode != 0 or not proc.stdout.strip():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)


class SlurmLauncher(BatchLauncher):
    name, description = "slurm", "ipyparallel engines in one SLURM job (sbatch + srun)"
    launches, engine_set = ", as steps of the job's allocation", "SlurmEngineSetLauncher"
    task_variables = ("SLURM_", "SLURMD_")
    queue_command, kill_command = ("squeue", "-h", "-o", "%i", "-j"), ("scancel", "-s", "KILL")
    # Ours (:mod:`.upstream`): it keeps what sbatch says on stderr.
    engines = "vgpu_magic.ranks.upstream.ReasonedSlurmEngineSetLauncher"
    options: ClassVar = {
        "partition": {"help": "the partition (#SBATCH --partition)"},
        "account": {"help": "the account to charge (#SBATCH --account)"},
        "time": {"help": "the job's time limit, e.g. 30 or 01:00:00 (#SBATCH --time)"},
        "qos": None,
        "sbatch": {
            "action": "append",
            "metavar": "OPTION",
            "help": "an #SBATCH option (repeatable): --sbatch=--mem=4G",
        },
        "srun": None,
        "controller_address": _CONTROLLER_ADDRESS,
        "environment": None,
    }
    #: The one-word options: the trait of ipyparallel's ``SlurmLauncher`` each sets, and a value each takes.
    _WORDS: ClassVar = {
        "partition": ("queue", "gpu"),
        "account": ("account", "myproject"),
        "time": ("timelimit", "01:00:00"),
        "qos": ("qos", "normal"),
    }

    @classmethod
    def sbatch_options(cls, options: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
        """``options``' one-word options by name and its extra ``#SBATCH`` lines, checked (:class:`ValueError`)."""
        words = {key: options[key] for key in cls._WORDS if options.get(key) is not None}
        for key, value in words.items():
            if not isinstance(value, (str, int)) or not str(value).strip() or any(c.isspace() for c in str(value)):
                raise ValueError(f"slurm {key}={value!r} is not one word; e.g. --{key}={cls._WORDS[key][1]}")
        lines = []
        for line in _strings("sbatch", options.get("sbatch", [])):
            text = line.strip()
            if not text.startswith("#SBATCH"):
                if not text.startswith("-"):
                    raise ValueError(f"sbatch line {line!r} is neither '#SBATCH ...' nor an option; e.g. '--mem=4G'")
                text = f"#SBATCH {text}"
            if text.split()[1:2] and text.split()[1].split("=")[0] in ("--ntasks", "-n", "--export", "--output"):
                raise ValueError(
                    f"sbatch line {line!r} sets what the launcher sets itself (one task per rank, --export=ALL)"
                )
            lines.append(text)
        return {key: str(value) for key, value in words.items()}, lines

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> Launcher:
        for command in ("sbatch", "srun", "scancel", "squeue"):
            if shutil.which(command) is None:
                raise ValueError(
                    f"the slurm launcher needs {command} on PATH "
                    "(run it on a SLURM login node, or apt-get install slurm-client)"
                )
        words, lines = cls.sbatch_options(options)
        srun = "".join(f"{shlex.quote(arg)} " for arg in _strings("srun", options.get("srun", [])))
        traits: dict[str, Any] = {cls._WORDS[key][0]: value for key, value in words.items()}
        # The job gets sbatch's environment (--export=ALL), which ipyparallel gives the launcher's.
        traits["environment"] = _environment(options)
        # What ipyparallel's traits cannot say, for the template of ours (:mod:`.upstream`).
        traits["namespace"] = {"sbatch": "".join(f"{line}\n" for line in lines), "srun": srun}
        address = options.get("controller_address") or socket.gethostname()
        return cls({cls.engine_set: traits}, "*", str(address))

    @classmethod
    def launched(cls, variables: Mapping[str, str]) -> LaunchedAs:
        """The task's rank, local rank and node, and its step where the variables JAX's and TensorFlow's SLURM
        support read are all there."""
        step, needed = None, ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
        if all(variables.get(name) for name in needed):
            hosts = tuple(expand_hostlist(variables["SLURM_STEP_NODELIST"]))
            per_node = variables.get("SLURM_STEP_TASKS_PER_NODE") or variables.get("SLURM_TASKS_PER_NODE")
            counts = tuple(expand_tasks_per_node(per_node)) if per_node else (1,) * len(hosts)
            step = JobStep(int(variables["SLURM_JOB_ID"]), hosts, counts)
        places = (_number(variables, name) for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
        return LaunchedAs(*places, step)


@dataclass
class SSHLauncher(Launcher):
    """``hosts``: a list spreads the ranks evenly, a ``{host: count}`` dict says how many."""

    name, description, watched, engines = "ssh", "ipyparallel engines started over SSH", False, "ssh"
    engine_set = "SSHEngineSetLauncher"
    task_variables = ("SSH_",)
    options: ClassVar = {
        "hosts": {"help": "the hosts, comma-separated (user@host or host:port); ranks spread evenly"},
        "ssh_args": None,
        "python": None,
        "controller_address": _CONTROLLER_ADDRESS,
        "environment": None,
    }
    #: The hosts, in rank order, each with its ssh arguments.
    ssh_hosts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> Launcher:
        if shutil.which("ssh") is None or shutil.which("scp") is None:
            raise ValueError("the ssh launcher needs ssh and scp on PATH (apt-get install openssh-client)")
        hosts = options.get("hosts")
        if isinstance(hosts, (str, list, tuple)):
            # Blank names (``--hosts ,``) are no hosts.
            hosts = [str(h).strip() for h in (hosts.split(",") if isinstance(hosts, str) else hosts) if str(h).strip()]
        if not hosts or not isinstance(hosts, (list, Mapping)):
            raise ValueError(
                "the ssh launcher needs hosts, e.g. --hosts node1,node2 or launcher_options={'hosts': ['node1']}"
            )
        if not isinstance(hosts, Mapping):
            names = hosts
            if len(set(names)) != len(names):
                raise ValueError(
                    f"hosts {names!r} names a host twice; give {{host: count}} to put several ranks on one"
                )
            if len(names) > n:
                raise ValueError(
                    f"{len(names)} hosts for {n} rank{'s' if n > 1 else ''}; give at most {n} or start more ranks"
                )
            hosts = {h: n // len(names) + (1 if i < n % len(names) else 0) for i, h in enumerate(names)}
        counts = {str(h).strip(): c for h, c in hosts.items()}
        bad = [(h, c) for h, c in counts.items() if not isinstance(c, int) or c < 1]
        if bad:
            raise ValueError(f"hosts {{{bad[0][0]!r}: {bad[0][1]!r}}} needs a positive rank count")
        if sum(counts.values()) != n:
            raise ValueError(
                f"hosts {hosts!r} hold {sum(counts.values())} ranks, not {n}; make the counts add up to {n}"
            )
        ssh_args = _strings("ssh_args", options.get("ssh_args", []))
        python = str(options.get("python") or sys.executable)
        env = _environment(options)
        engine_cmd = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        engine_cmd += [python, "-m", "ipyparallel.engine"]
        # Each host's port in its own ssh/scp arguments: ipyparallel's "host:port" shares one list between hosts.
        engines: dict[str, dict[str, Any]] = {}
        targets = []
        for host, count in counts.items():
            location, port = ssh_target(host)
            args = ssh_args + (["-p", port] if port else [])
            targets.append((location, tuple(args)))
            engines[location] = {"n": count, "ssh_args": args, "scp_args": ["-P" if a == "-p" else a for a in args]}
        try:
            address = options.get("controller_address") or route_address(targets[0][0])
        except ValueError as exc:
            raise ValueError(f"ssh {exc}") from None
        # The cluster's own folder, removed by stop: the kernel's profile may be on a shared file system.
        folder = f"/tmp/vgpu_magic-{cluster_id}"
        traits = {"engines": engines, "remote_python": python, "engine_cmd": engine_cmd, "remote_profile_dir": folder}
        return cls({cls.engine_set: traits}, "*", str(address), ssh_hosts=tuple(targets))

    def start_failure(self, exc: BaseException | None) -> str:
        """Also ssh's reason for the first host it cannot reach (ipyparallel: "Unable to get remote shell info...")."""
        said = super().start_failure(exc)
        for location, args in self.ssh_hosts if not said else ():
            reached, reason = ssh(location, ("-o", "ConnectTimeout=10", *args), "true", timeout=15)
            if not reached:
                return reason.rstrip(".")
        return said

    def clean_up_commands(self) -> list[list[str]]:
        """On each host: its engines killed, the cluster's folder removed."""
        return [
            ["ssh", *args, location, f"kill {pids} 2>/dev/null; {cleanup}"]
            for location, args, pids, cleanup in self._cleanups()
        ]

    def stop_check(self) -> Callable[[], list[str]]:
        """Each host with no engine nor the cluster's folder left."""
        cleanups = self._cleanups()

        def remaining() -> list[str]:
            left = []
            for location, args, pids, cleanup in cleanups:
                reached, out = ssh(location, args, cleanup)
                if not reached and pids:
                    left.append(f"{location}: engines {pids} may be left ({out})")
                elif reached and out.partition("left:")[2].strip():
                    left.append(f"{location}: engines {out.partition('left:')[2].strip()} left")
                # Not reached and no engine started there: nothing was left to end.
            return left

        return remaining

    def _cleanups(self) -> list[tuple[str, tuple[str, ...], str, str]]:
        """``(location, ssh args, PIDs of the cluster's engines there, REMOTE_CLEANUP command)`` per SSH host."""
        engines = [
            (launcher.location, launcher.pid)
            for engine_set in self.cluster.engines.values()
            for launcher in getattr(engine_set, "launchers", {}).values()
            if (getattr(launcher, "pid", None) or -1) > 0
        ]
        folder = self.config[self.engine_set]["remote_profile_dir"]
        found = []
        for location, args in self.ssh_hosts:
            pids = " ".join(str(pid) for where, pid in engines if where == location)
            found.append((location, args, pids, REMOTE_CLEANUP.format(pids=pids, folder=folder)))
        return found


def _number(variables: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that ``variables`` sets to a number."""
    return next((int(variables[name]) for name in names if variables.get(name, "").isdigit()), None)


def _strings(key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return shlex.split(value) if key != "sbatch" else [line for line in value.splitlines() if line.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} {value!r} must be a list of strings, e.g. {key}=['--exclusive']")
    return list(value)


def _environment(options: dict[str, Any]) -> dict[str, str]:
    env = options.get("environment") or {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in env):
        raise ValueError(f"environment {env!r} must map variable names to values, e.g. {{'PYTHONPATH': '/src'}}")
    return {k: str(v) for k, v in env.items()}
