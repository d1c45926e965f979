"""How the ranks' engines start: ipyparallel's engine-set launchers (local, ``mpiexec``, a SLURM job, SSH), one
:class:`Launcher` class each in :data:`LAUNCHERS`, owning its options, flags, validation and ipyparallel's
configuration. :func:`plan_launcher` validates a request completely and starts nothing. Under ``slurm`` and ``ssh``
the controller listens on every interface; engines reach it at ``controller_address`` (default: this host's name
under SLURM, its address on the route to the first host under SSH).
"""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .hosts import route_address

__all__ = ["LAUNCHERS", "MAX_RANKS", "Launcher", "LauncherPlan", "plan_launcher", "ssh_target"]

#: The most ranks a cluster has.
MAX_RANKS = 64

#: Launcher name -> its class, in the order they are defined.
LAUNCHERS: dict[str, type[Launcher]] = {}

#: The batch script ``sbatch`` gets: ipyparallel's own (``--export=ALL``, one ``srun`` of ``ipengine``) with the
#: user's lines; ipyparallel fills in ``{n}``, ``{cluster_id}``, ``{output_file}`` and ``{program_and_args}``.
SLURM_TEMPLATE = """#!/bin/sh
#SBATCH --export=ALL
#SBATCH --job-name=ipengine-{{cluster_id}}
#SBATCH --ntasks={{n}}
#SBATCH --output={{output_file}}
{lines}srun {srun}{{program_and_args}}
"""


@dataclass(frozen=True)
class LauncherPlan:
    """What ipyparallel is told: the engine launcher (``name``, an abbreviation ``ipp.Cluster(engines=...)`` takes),
    its configuration (``{class name: {trait: value}}``), where the controller listens (``"*"``: every interface)
    and is reached (None: loopback), and the SSH hosts ``[(user@host, (ssh args...)), ...]`` in rank order."""

    name: str
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    controller_ip: str | None = None
    controller_location: str | None = None
    ssh_hosts: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def launcher(self) -> type[Launcher]:
        return LAUNCHERS[self.name]


def plan_launcher(name: str, n: int, options: dict[str, Any] | None = None, cluster_id: str = "vgpu") -> LauncherPlan:
    """Validate ``name`` and ``options`` for ``n`` ranks and say how ipyparallel starts them; :class:`ValueError`
    in one line quoting what is wrong otherwise."""
    options = dict(options or {})
    if name not in LAUNCHERS:
        raise ValueError(f"launcher {name!r} is not supported; use {', '.join(LAUNCHERS)}")
    unknown = sorted(set(options) - set(LAUNCHERS[name].options))
    if unknown:
        accepted = ", ".join(LAUNCHERS[name].options) or "none"
        raise ValueError(f"the {name} launcher has no option {unknown[0]!r}; it takes: {accepted}")
    return LAUNCHERS[name].plan(n, options, cluster_id)


class Launcher:
    """One way ipyparallel starts the engines. ``options``: the ``launcher_options`` it takes, each with its flag's
    argparse keywords (``None``: the Python API's only). A subclass registers itself in :data:`LAUNCHERS`."""

    name: ClassVar[str]
    #: Where the engines run, for the start summary.
    description: ClassVar[str]
    options: ClassVar[dict[str, dict[str, Any] | None]] = {}
    #: Can engines run on another host than the kernel's?
    remote: ClassVar[bool] = False
    #: What a script run is, where more than a launch (the start summary).
    launches: ClassVar[str] = ""

    def __init_subclass__(cls) -> None:
        LAUNCHERS[cls.name] = cls

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
        """How ipyparallel starts ``n`` engines with ``options`` (their names already checked)."""
        return LauncherPlan(cls.name)


class LocalLauncher(Launcher):
    name, description = "local", "local ipyparallel engines"


class MPILauncher(Launcher):
    name, description = "mpi", "ipyparallel engines started by mpiexec"
    options: ClassVar = {"mpi_args": None}

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
    #: The one-word options and a value each takes.
    _WORDS: ClassVar[dict[str, str]] = {"partition": "gpu", "account": "myproject", "time": "01:00:00", "qos": "normal"}

    @classmethod
    def plan(cls, n: int, options: dict[str, Any], cluster_id: str) -> LauncherPlan:
        for command in ("sbatch", "srun", "scancel", "squeue"):
            if shutil.which(command) is None:
                raise ValueError(
                    f"the slurm launcher needs {command} on PATH "
                    "(run it on a SLURM login node, or apt-get install slurm-client)"
                )
        lines = []
        for key, example in cls._WORDS.items():
            value = options.get(key)
            if value is None:
                continue
            if not isinstance(value, (str, int)) or not str(value).strip() or any(c.isspace() for c in str(value)):
                raise ValueError(f"slurm {key} {value!r} is not one word; e.g. --{key}={example}")
            lines.append(f"#SBATCH --{key}={value}")
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
        srun = " ".join(shlex.quote(a) for a in _strings("srun", options.get("srun", [])))
        # The job gets the kernel's environment (--export=ALL); extra variables are exported by the script.
        lines += [f"export {k}={shlex.quote(v)}" for k, v in _environment(options).items()]
        script = SLURM_TEMPLATE.format(
            lines="".join(_escape(line) + "\n" for line in lines), srun=_escape(srun) + " " if srun else ""
        )
        config: dict[str, dict[str, Any]] = {"SlurmEngineSetLauncher": {"batch_template": script}}
        address = options.get("controller_address") or socket.gethostname()
        return LauncherPlan("slurm", config, controller_ip="*", controller_location=str(address))


class SSHLauncher(Launcher):
    """``hosts``: a list spreads the ranks evenly, a ``{host: count}`` dict says how many."""

    name, description, remote = "ssh", "ipyparallel engines started over SSH", True
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
            # As many engines on each host as evenly possible, the first hosts taking one more.
            counts = {h: n // len(names) + (1 if i < n % len(names) else 0) for i, h in enumerate(names)}
        ssh_args = _strings("ssh_args", options.get("ssh_args", []))
        python = str(options.get("python") or sys.executable)
        env = _environment(options)
        engine_cmd = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        engine_cmd += [python, "-m", "ipyparallel.engine"]
        # Each host's port goes into its own ssh/scp arguments: ipyparallel's "host:port" appends the
        # port to one list its launchers share, so a second host would get the first host's port.
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
                # A folder of this cluster's own on each host (removed by stop), never the kernel's
                # profile: on a host sharing the kernel's file system that would be the same files.
                "remote_profile_dir": f"/tmp/vgpu_magic-{cluster_id}",
            },
        }
        return LauncherPlan("ssh", config, "*", str(address), tuple(targets))


def ssh_target(host: str) -> tuple[str, str | None]:
    """``"user@node:2222"`` -> ``("user@node", "2222")``; the port is None when not given."""
    location, _, port = host.partition(":")
    return location, port or None


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


def _escape(text: str) -> str:
    """Braces in user text survive ipyparallel's template formatting."""
    return text.replace("{", "{{").replace("}", "}}")
