"""What a rank cluster was asked for (:class:`ClusterSpec`), where it stands (:class:`ClusterState`) and how a run on
it ended (:class:`RunResult`), as plain data: torch elastic's ``WorkerSpec``, ``WorkerState`` and ``RunResult``."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["ClusterNotRunning", "ClusterSpec", "ClusterState", "RankFailure", "RankOutcome", "RunResult"]


@dataclass(frozen=True)
class ClusterSpec:
    """:class:`~.rank_cluster.RankCluster`'s validated arguments. Every field takes part in equality: a start that
    differs from the running cluster in any is another request, never "already running"."""

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
    """Why one rank did not finish: ``kind`` is ``"error"``, ``"died"``, ``"timeout"`` or ``"peer"`` (its error said
    another rank, which failed first, went: its traceback is kept, not shown)."""

    rank: int
    kind: str
    summary: str
    traceback: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankOutcome:
    """How a rank's part of a run ended: ``end`` is ``"finished"``, ``"failed"``, ``"peer"`` (stopped: its peer failed)
    or ``"interrupted"`` (by the fault policy); ``failure`` says why; ``killed``, when it did not stop from SIGINT,
    why it was killed (``"made no progress for 10 s after SIGINT"``), else ``""``."""

    end: str
    failure: RankFailure | None = None
    killed: str = ""


@dataclass(frozen=True)
class RunResult:
    """How a failed run ended (torch elastic's ``RunResult``): ``outcomes`` by rank, those with a failure first in the
    order the failures were seen; whether the cluster ``must_restart``."""

    outcomes: Mapping[int, RankOutcome]
    must_restart: bool
