"""How the ranks' engines start: one :class:`Launcher` per ipyparallel engine-set launcher (local, ``mpiexec``,
SLURM, SSH) in :data:`LAUNCHERS`, with its options, validation, configuration, failure words and clean-up;
:func:`plan_launcher` validates and starts nothing. Under ``slurm`` and ``ssh`` engines reach the controller at
``controller_address`` (default: this host's name; under SSH its address on the route to the first host)."""

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

from .hosts import route_address

__all__ = ["LAUNCHERS", "MAX_RANKS", "Launcher", "LauncherPlan", "plan_launcher", "ssh_target"]

#: The most ranks a cluster has.
MAX_RANKS = 64

#: Seconds a cancelled batch job may take to leave the queue, and remote engines to exit.
REMOTE_STOP_TIMEOUT = 30.0
#: Launcher name -> its class, in the order they are defined.
LAUNCHERS: dict[str, type[Launcher]] = {}


@dataclass(frozen=True)
class LauncherPlan:
    """What ipyparallel is told: the engine launcher (``name``), its ``config`` (``{class: {trait: value}}``), where
    the controller listens (``"*"``: everywhere) and is reached (None: loopback), the SSH hosts in rank order."""

    name: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    controller_ip: str | None = None
    controller_location: str | None = None
    ssh_hosts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def launcher(self) -> type[Launcher]:
        return LAUNCHERS[self.name]


def plan_launcher(name: str, n: int, options: dict[str, Any] | None = None, cluster_id: str = "vgpu") -> LauncherPlan:
    """Validate ``name`` and ``options`` for ``n`` ranks and plan their start; else a one-line :class:`ValueError`."""
    options = dict(options or {})
    if name not in LAUNCHERS:
        raise ValueError(f"launcher {name!r} is not supported; use {', '.join(LAUNCHERS)}")
    unknown = sorted(set(options) - set(LAUNCHERS[name].options))
    if unknown:
        accepted = ", ".join(LAUNCHERS[name].options) or "none"
        raise ValueError(f"the {name} launcher has no option {unknown[0]!r}; it takes: {accepted}")
    return LAUNCHERS[name].plan(n, options, cluster_id)


class Launcher:
    """One way ipyparallel starts engines; ``options``: each option's argparse keywords (``None``: Python API only)."""

    name: ClassVar[str]
    #: Where the engines run, for the start summary.
    description: ClassVar[str]
    #: ipyparallel's engine-set launcher: its abbreviation, or a class by its import name.
    engines: ClassVar[str]
    options: ClassVar[dict[str, dict[str, Any] | None]] = {}
    #: Can engines run on another host than the kernel's?
    remote: ClassVar[bool] = False
    #: What a script run is, where more than a launch (the start summary).
    launches: ClassVar[str] = ""
    #: The prefixes of the launch's variables (``srun``'s ``SLURM_*``) that a script run keeps over the kernel's.
    task_variables: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls) -> None:
        LAUNCHERS[cls.name] = cls

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
        """How ipyparallel starts ``n`` engines with ``options`` (their names already checked)."""
        return LauncherPlan(cls.name)

    @classmethod
    def configure(cls, cluster: Any) -> None:
        """Configure ipyparallel's ``cluster`` where its plan cannot: what depends on the cluster's own folders."""

    @classmethod
    def describe(cls, cluster: Any) -> str:
        """Where ``cluster``'s engines run, for the start summary, with their batch jobs."""
        return cls.description + "".join(f", job {es.job_id}" for es in _batch_sets(cluster))

    @classmethod
    def start_failure(cls, exc: BaseException | None, plan: LauncherPlan) -> str:
        """Why a start failed, in the launcher's own words (a command's stderr: ``sbatch: fatal: ...``), or ``""``."""
        while exc is not None:
            if isinstance(exc, subprocess.CalledProcessError) and _last_line(exc.stderr):
                return _last_line(exc.stderr).rstrip(".")
            exc = exc.__cause__ or exc.__context__
        return ""

    @classmethod
    def clean_up_commands(cls, cluster: Any, plan: LauncherPlan) -> list[list[str]]:
        """What ends the engines a PID watch cannot reach if the kernel dies: their batch jobs' ``scancel``."""
        return [[*es.delete_command, es.job_id] for es in _batch_sets(cluster)]

    @classmethod
    def stopper(cls, cluster: Any, plan: LauncherPlan) -> Callable[[], list[str]]:
        """Read before ipyparallel stops ``cluster`` (it forgets what it stopped): what then says what is left."""
        return list


class LocalLauncher(Launcher):
    name, description = "local", "local ipyparallel engines"
    # Ours (:mod:`.upstream`): it keeps each engine's exit status.
    engines = "vgpu_magic.ranks.upstream.ExitRecordingEngineSetLauncher"


class MPILauncher(Launcher):
    name, description, engines = "mpi", "ipyparallel engines started by mpiexec", "mpi"
    options: ClassVar = {"mpi_args": None}
    # Open MPI's (and its PMIx's, PSM's); MPICH's Hydra gives PMI_* and MPI_LOCAL*.
    task_variables = ("OMPI_", "PMIX_", "HFI_", "IPATH_", "PMI_", "MPI_LOCAL")

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
        if shutil.which("mpiexec") is None:
            raise ValueError("the mpi launcher needs mpiexec on PATH (e.g. apt-get install openmpi-bin)")
        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError("the mpi launcher needs mpi4py on the engines: pip install 'vgpu_magic[mpi]'")
        config = {"MPIEngineSetLauncher": {"mpi_args": _strings("mpi_args", options.get("mpi_args", []))}}
        return LauncherPlan("mpi", config)


#: The flag of the address engines reach this kernel's controller at, which SLURM and SSH share.
_CONTROLLER_ADDRESS = {"help": "the address engines reach this kernel's controller at"}


class SlurmLauncher(Launcher):
    name, description = "slurm", "ipyparallel engines in one SLURM job (sbatch + srun)"
    remote, launches = True, ", as steps of the job's allocation"
    task_variables = ("SLURM_", "SLURMD_")
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
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
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
        return LauncherPlan("slurm", {"SlurmEngineSetLauncher": traits}, "*", str(address))

    @classmethod
    def configure(cls, cluster: Any) -> None:
        # Not the kernel's working folder (the user's notebooks): the profile's log folder, removed by the stop.
        batch_file = os.path.join(cluster.profile_dir, "log", f"ipengine-{cluster.cluster_id}.sbatch")
        cluster.config.SlurmEngineSetLauncher.batch_file_name = batch_file

    @classmethod
    def stopper(cls, cluster: Any, plan: LauncherPlan) -> Callable[[], list[str]]:
        """The batch jobs out of the queue (``scancel -s KILL`` if they do not leave), the batch script removed."""
        jobs = [es.job_id for es in _batch_sets(cluster)]

        def make_sure() -> list[str]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(cluster.config.SlurmEngineSetLauncher.batch_file_name)
            left = []
            for job in jobs:
                if not _job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                    subprocess.run(["scancel", "-s", "KILL", job], capture_output=True, timeout=30, check=False)
                    if not _job_gone(job, REMOTE_STOP_TIMEOUT / 2):
                        left.append(f"SLURM job {job} is still in squeue")
            return left

        return make_sure


class SSHLauncher(Launcher):
    """``hosts``: a list spreads the ranks evenly, a ``{host: count}`` dict says how many."""

    name, description, remote, engines = "ssh", "ipyparallel engines started over SSH", True, "ssh"
    task_variables = ("SSH_",)
    options: ClassVar = {
        "hosts": {"help": "the hosts, comma-separated (user@host or host:port); ranks spread evenly"},
        "ssh_args": None,
        "python": None,
        "controller_address": _CONTROLLER_ADDRESS,
        "environment": None,
    }

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
        if shutil.which("ssh") is None or shutil.which("scp") is None:
            raise ValueError("the ssh launcher needs ssh and scp on PATH (apt-get install openssh-client)")
        hosts = options.get("hosts")
        if not hosts:
            raise ValueError(
                "the ssh launcher needs hosts, e.g. --hosts node1,node2 or launcher_options={'hosts': ['node1']}"
            )
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(",") if h.strip()]
        if isinstance(hosts, Mapping):
            counts = {str(h).strip(): c for h, c in hosts.items()}
            bad = [(h, c) for h, c in counts.items() if not isinstance(c, int) or c < 1]
            if bad:
                raise ValueError(f"hosts {{{bad[0][0]!r}: {bad[0][1]!r}}} needs a positive rank count")
            if sum(counts.values()) != n:
                raise ValueError(
                    f"hosts {hosts!r} hold {sum(counts.values())} ranks, not {n}; make the counts add up to {n}"
                )
        else:
            names = [str(h).strip() for h in hosts]
            if len(set(names)) != len(names):
                raise ValueError(
                    f"hosts {names!r} names a host twice; give {{host: count}} to put several ranks on one"
                )
            if len(names) > n:
                raise ValueError(
                    f"{len(names)} hosts for {n} rank{'s' if n > 1 else ''}; give at most {n} or start more ranks"
                )
            counts = {h: n // len(names) + (1 if i < n % len(names) else 0) for i, h in enumerate(names)}
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
        config = {
            "SSHEngineSetLauncher": {
                "engines": engines,
                "remote_python": python,
                "engine_cmd": engine_cmd,
                # The cluster's own folder, removed by stop: the kernel's profile may be on a shared file system.
                "remote_profile_dir": f"/tmp/vgpu_magic-{cluster_id}",
            },
        }
        return LauncherPlan("ssh", config, "*", str(address), tuple(targets))

    @classmethod
    def start_failure(cls, exc: BaseException | None, plan: LauncherPlan) -> str:
        """Also ssh's reason for the first host it cannot reach (ipyparallel: "Unable to get remote shell info...")."""
        said = super().start_failure(exc, plan)
        for location, args in plan.ssh_hosts if not said else ():
            reached, reason = ssh(location, ("-o", "ConnectTimeout=10", *args), "true", timeout=15)
            if not reached:
                return reason.rstrip(".")
        return said

    @classmethod
    def clean_up_commands(cls, cluster: Any, plan: LauncherPlan) -> list[list[str]]:
        return [
            ["ssh", *args, location, f"kill {pids} 2>/dev/null; {cleanup}"]
            for location, args, pids, cleanup in _ssh_cleanups(cluster, plan)
        ]

    @classmethod
    def stopper(cls, cluster: Any, plan: LauncherPlan) -> Callable[[], list[str]]:
        """Each host with no engine nor the cluster's folder left."""
        cleanups = _ssh_cleanups(cluster, plan)

        def make_sure() -> list[str]:
            left = []
            for location, args, pids, cleanup in cleanups:
                reached, out = ssh(location, args, cleanup)
                if not reached and pids:
                    left.append(f"{location}: engines {pids} may be left ({out})")
                elif reached and out.partition("left:")[2].strip():
                    left.append(f"{location}: engines {out.partition('left:')[2].strip()} left")
                # Not reached and no engine started there: nothing was left to end.
            return left

        return make_sure


def ssh_target(host: str) -> tuple[str, str | None]:
    """``"user@node:2222"`` -> ``("user@node", "2222")``; the port is None when not given."""
    location, _, port = host.partition(":")
    return location, port or None


#: Run on an SSH host at stop: wait for the engines, SIGKILL survivors, remove the folder, say which PIDs are left.
REMOTE_CLEANUP = (
    "pids='{pids}'; for i in $(seq 40); do alive=''; "
    'for p in $pids; do kill -0 $p 2>/dev/null && alive="$alive $p"; done; '
    '[ -z "$alive" ] && break; sleep 0.25; done; [ -n "$alive" ] && kill -9 $alive 2>/dev/null && sleep 0.5; '
    "still=''; for p in $pids; do kill -0 $p 2>/dev/null && still=\"$still $p\"; done; "
    "rm -rf '{folder}'; echo left:$still"
)


def ssh(location: str, args: tuple[str, ...], command: str, timeout: float = REMOTE_STOP_TIMEOUT) -> tuple[bool, str]:
    """Run ``command`` on ``location`` over ssh, never asking for a password: whether it ran, its stdout or why not."""
    argv = ["ssh", "-o", "BatchMode=yes", *args, location, command]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"ssh {location}: no answer within {timeout:g} s"
    if proc.returncode == 0:
        return True, proc.stdout
    return False, _last_line(proc.stderr) or f"ssh {location} exited with status {proc.returncode}"


def _ssh_cleanups(cluster: Any, plan: LauncherPlan) -> list[tuple[str, tuple[str, ...], str, str]]:
    """``(location, ssh args, PIDs of the cluster's engines there, REMOTE_CLEANUP command)`` per SSH host."""
    engines = [
        (launcher.location, launcher.pid)
        for engine_set in cluster.engines.values()
        for launcher in getattr(engine_set, "launchers", {}).values()
        if (getattr(launcher, "pid", None) or -1) > 0
    ]
    folder = plan.config["SSHEngineSetLauncher"]["remote_profile_dir"]
    found = []
    for location, args in plan.ssh_hosts:
        pids = " ".join(str(pid) for where, pid in engines if where == location)
        found.append((location, args, pids, REMOTE_CLEANUP.format(pids=pids, folder=folder)))
    return found


def _batch_sets(cluster: Any) -> list[Any]:
    """``cluster``'s engine sets that are batch jobs (a ``job_id``)."""
    return [es for es in getattr(cluster, "engines", {}).values() if getattr(es, "job_id", "")]


def _job_gone(job: str, timeout: float) -> bool:
    """Has SLURM job ``job`` left ``squeue`` within ``timeout`` seconds?"""
    deadline, squeue = time.monotonic() + timeout, ["squeue", "-h", "-j", job, "-o", "%i"]
    while True:
        proc = subprocess.run(squeue, capture_output=True, text=True, timeout=30, check=False)
        # squeue exits non-zero for a job id it no longer knows: gone as well.
        if proc.returncode != 0 or not proc.stdout.strip():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


def _last_line(text: str | bytes | None) -> str:
    text = text.decode("utf8", "replace") if isinstance(text, bytes) else text or ""
    return ([line.strip() for line in text.splitlines() if line.strip()] or [""])[-1]


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
