"""Plain data: a rank cluster's request, state and a run's end (torch elastic's WorkerSpec, WorkerState, RunResult)."""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "RESTART_COUNTS",
    "ClusterNotRunning",
    "ClusterSpec",
    "ClusterState",
    "Fault",
    "RankFailure",
    "RankOutcome",
    "RunResult",
    "RunState",
    "checked_faults",
    "parse_fail",
    "parse_preempt",
]


@dataclass(frozen=True)
class ClusterSpec:
    """``RankCluster``'s validated arguments, all in equality: a start differing in any is never "already running"."""

    n: int
    framework: str
    split: int | None = None
    memory: int | None = None
    port: int | None = None
    gpus: tuple[tuple[int, int], ...] | None = None
    launcher: str = "local"
    launcher_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    join: bool = False
    verbose: bool = False
    spares: bool = True
    backend: str | None = None
    mps: bool | None = None

    def __post_init__(self) -> None:
        # A list and a tuple of the same values are the same request; nothing the caller still holds can change it.
        object.__setattr__(self, "launcher_options", _frozen(self.launcher_options))
        object.__setattr__(self, "gpus", _frozen(self.gpus))


def _frozen(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


class ClusterState(enum.Enum):
    """Where a cluster stands; the value is how ``%vgpu_cluster status`` says it."""

    STARTING = "starting"
    RUNNING = "running"
    #: A rank died or was killed: the ranks' state is gone, and a restart is the way on.
    MUST_RESTART = "must be restarted"
    STOPPED = "stopped"


class ClusterNotRunning(RuntimeError):
    """The cluster is stopped or must be restarted; the message says which command helps."""


@dataclass(frozen=True)
class RankFailure:
    """Why a rank did not finish: ``kind`` "error", "died", "timeout", "peer" (a peer failed first; traceback kept)."""

    rank: int
    kind: str
    summary: str
    traceback: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankOutcome:
    """How a rank's part of a run ended: ``end`` ``"finished"``, ``"failed"``, ``"peer"`` (its peer failed) or
    ``"interrupted"`` (fault policy); ``failure`` why; ``killed`` why SIGINT did not stop it (``""``: it did)."""

    end: str
    failure: RankFailure | None = None
    killed: str = ""


class RunState(enum.Enum):
    """How a run ended (torch elastic's ``WorkerState``): ``FAILED`` leaves the cluster usable, ``MUST_RESTART`` not."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    MUST_RESTART = "must restart"


@dataclass(frozen=True)
class RunResult:
    """How a run ended (torch elastic's), on success and failure alike: its ``state``, the run's one verdict, and
    (``MUST_RESTART``) the ``reason``, its dead or killed ranks; ``outcomes`` by rank, failures first as seen."""

    state: RunState
    outcomes: Mapping[int, RankOutcome]
    reason: str = ""
    #: How many times the ranks were launched (``max_restarts`` gives more than one).
    attempts: int = 1
    #: Each rank's ipyparallel ``AsyncResult`` (its output and values), not part of what the run ended as.
    replies: Sequence[Any] = field(default=(), compare=False, repr=False)


#: torchrun's agent's restart counters (this one, the most allowed): a launch sets them where the plan has them.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
#: A preemption's default grace between SIGTERM and SIGKILL: SLURM's ``KillWait``.
PREEMPT_GRACE = 30.0


@dataclass(frozen=True)
class Fault:
    """A failure injected into a script's first launch: ``signum`` ``after`` s to ``rank`` (None: all), SIGKILL
    ``kill_after`` s later if given (preemption); ``said``: the option as typed, quoted so none takes it for a bug."""

    rank: int | None
    after: float
    signum: int
    kill_after: float | None
    said: str


_FAIL = re.compile(r"(\d+)@(\d+(?:\.\d*)?|\.\d+)(?::(\w+))?")
_PREEMPT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?::(\d+(?:\.\d*)?|\.\d+))?")


def parse_fail(text: str) -> Fault:
    """``--fail RANK@SECONDS[:SIGNAL]`` (SIGKILL by default, as a lost node): a :class:`Fault`, or ``ValueError``."""
    match = _FAIL.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"--fail {text!r} is not RANK@SECONDS[:SIGNAL]; use e.g. --fail 1@4 or --fail 1@4:SIGTERM")
    name = (match[3] or "SIGKILL").upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not hasattr(signal.Signals, name) or name in ("SIGSTOP", "SIGCONT"):
        raise ValueError(f"--fail {text!r}: {match[3]!r} is not a signal that ends a process; use e.g. SIGTERM")
    return Fault(int(match[1]), _positive(match[2], f"--fail {text!r}"), signal.Signals[name], None, f"--fail {text}")


def parse_preempt(text: str) -> Fault:
    """``--preempt SECONDS[:GRACE]``: every rank SIGTERM, SIGKILL after GRACE (SLURM's preemption and ``KillWait``)."""
    match = _PREEMPT.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"--preempt {text!r} is not SECONDS[:GRACE]; use e.g. --preempt 3 or --preempt 3:10")
    grace = PREEMPT_GRACE if match[2] is None else float(match[2])
    return Fault(None, _positive(match[1], f"--preempt {text!r}"), signal.SIGTERM, grace, f"--preempt {text}")


def _positive(seconds: str, said: str) -> float:
    value = float(seconds)
    if not 0 < value <= 7 * 24 * 3600:
        raise ValueError(f"{said}: the seconds must be above 0 (and within a week), e.g. 4")
    return value


def checked_faults(n: int, max_restarts: int, fail: Sequence[str] | str, preempt: str | None) -> list[Fault]:
    """A script run's restarts and faults on ``n`` ranks, checked before anything runs: the faults, or ValueError."""
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or not 0 <= max_restarts <= 100:
        raise ValueError(f"--max-restarts {max_restarts!r} is not a count; use 0..100, e.g. --max-restarts 2")
    faults = [parse_fail(text) for text in ([fail] if isinstance(fail, str) else fail)]
    faults += [parse_preempt(preempt)] if preempt is not None else []
    for fault in faults:
        if fault.rank is not None and not 0 <= fault.rank < n:
            raise ValueError(f"{fault.said}: rank {fault.rank} is not one of the ranks 0..{n - 1}")
    return faults
