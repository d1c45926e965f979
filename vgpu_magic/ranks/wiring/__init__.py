"""How each framework's real launcher wires its processes, one module per framework.

A wiring answers, as plain data and small functions:

* :meth:`RankWiring.validate`: is ``N`` ranks with ``--split K`` / ``--memory``
  possible here? Raises :class:`ValueError` quoting the bad value, before
  anything starts;
* :meth:`RankWiring.plan`: the environment each rank gets and the setup call
  each rank runs, as a :class:`RankPlan` (pure: ports and GPUs are inputs, so
  the GPU path is tested on GPU-shaped data);
* the setup function itself, which runs *on the engine* after the
  environment is set (a GPU and its cap, TensorFlow's logical GPUs) and,
  only with ``join=True``, makes the call a script makes under its launcher
  (``init_process_group``, ``jax.distributed.initialize``); by default that
  call is the user's, as under ``torchrun``. Setup functions import their
  framework only there, and never start TensorFlow's runtime.

Adding a framework is one module and one line in :data:`WIRINGS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GPU", "RankPlan", "RankWiring", "WIRINGS", "ALIASES", "get_wiring", "parse_memory", "prepare_rank"]

_MIB = 1024 * 1024

#: name -> module defining ``WIRING``.
WIRINGS = {
    "torch": "vgpu_magic.ranks.wiring.torch",
    "tensorflow": "vgpu_magic.ranks.wiring.tensorflow",
    "jax": "vgpu_magic.ranks.wiring.jax",
}
ALIASES = {"pytorch": "torch", "tf": "tensorflow"}


@dataclass(frozen=True)
class GPU:
    """One physical GPU as NVML reports it (index in CUDA's order, total bytes)."""

    index: int
    total_bytes: int


@dataclass(frozen=True)
class RankPlan:
    """What one rank gets: its environment, then ``setup(*args)`` run on it."""

    rank: int
    env: dict[str, str]
    setup: str
    args: tuple[Any, ...] = ()
    #: Lines shown by ``%vgpu_cluster start`` / ``status`` (the same for every rank).
    notes: tuple[str, ...] = field(default=(), compare=False)


class RankWiring:
    """One framework's launcher, reproduced. Subclasses fill in the class attributes
    and :meth:`plan`."""

    name: str = ""
    label: str = ""
    #: The module the ranks import, and the vgpu_magic extra that installs it.
    module: str = ""
    extra: str = ""
    #: Loopback ports the cluster must reserve: a function of the rank count.
    ports_per_cluster: str = "one"  # "one" or "per_rank"
    #: The call a script makes under the real launcher to join the others ("": none to make).
    join_call: str = ""

    def ports_needed(self, n: int) -> int:
        """How many loopback ports ``n`` ranks need (one coordinator, or one per TensorFlow worker)."""
        return n if self.ports_per_cluster == "per_rank" else 1

    def validate(self, n: int, split: int | None, memory: int | None, gpus: list[GPU]) -> None:
        """Raise :class:`ValueError` (one line, quoting the value) if the request cannot work here."""
        if split is not None and not 1 <= split <= 64:
            raise ValueError(f"--split {split} is out of range; use 1..64 devices per rank")
        if memory is not None:
            if not gpus:
                raise ValueError(
                    f"--memory {memory // _MIB}MiB needs a GPU; on CPU the ranks share host memory and cannot be capped"
                )
            shared = shared_gpu_ranks(n, gpus)
            total = gpus[0].total_bytes
            if memory * shared > total:
                raise ValueError(
                    f"--memory {memory // _MIB}MiB × {shared} ranks on one GPU exceeds its "
                    f"{total // _MIB} MiB; use at most {total // shared // _MIB}MiB"
                )

    def plan(self, n: int, ports: list[int], split: int | None, memory: int | None, gpus: list[GPU]) -> list[RankPlan]:
        """One :class:`RankPlan` per rank, in rank order, for a request :meth:`validate` accepted."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<vgpu_magic rank wiring {self.name}>"


def shared_gpu_ranks(n: int, gpus: list[GPU]) -> int:
    """How many ranks share each GPU: 1 when every rank has its own, else all share GPU 0."""
    return 1 if len(gpus) >= n else n


def rank_gpu(rank: int, n: int, gpus: list[GPU]) -> GPU:
    """The GPU a rank uses: its own where there are enough, else GPU 0 shared."""
    return gpus[rank] if len(gpus) >= n else gpus[0]


def rank_memory(n: int, memory: int | None, gpus: list[GPU]) -> int:
    """Each rank's cap in bytes on its GPU: ``--memory`` or an even share."""
    if memory is not None:
        return memory
    return gpus[0].total_bytes // shared_gpu_ranks(n, gpus)


def resolve(name: str) -> str:
    """``"tf"`` -> ``"tensorflow"``; :class:`ValueError` quoting an unknown name."""
    key = ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in WIRINGS:
        raise ValueError(f"framework {name!r} is not supported by %vgpu_cluster; use torch, tensorflow or jax")
    return key


def get_wiring(name: str) -> RankWiring:
    """The wiring for ``torch`` / ``tensorflow`` (``tf``) / ``jax``; imports no framework."""
    return importlib.import_module(WIRINGS[resolve(name)]).WIRING


def parse_memory(text: str) -> int:
    """``"2048"`` (MiB), ``"2GB"``, ``"1.5G"``, ``"512MiB"`` -> bytes; ValueError quoting the text."""
    raw = text.strip()
    units = {"": _MIB, "m": _MIB, "mb": _MIB, "mib": _MIB, "g": 1024 * _MIB, "gb": 1024 * _MIB, "gib": 1024 * _MIB}
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = raw[len(number):].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise ValueError(f"--memory {text!r} is not a size; use MiB (2048) or a unit (2GB, 1.5G, 512MiB)")
    return int(value * units[unit])


def prepare_rank(env: dict[str, str], setup: str, args: tuple[Any, ...], join: bool = False) -> str:
    """Run on the rank (through ipyparallel's ``apply``): set its environment, as
    a launcher would before the process starts (no framework is imported on an
    engine before this), then run its framework's setup, if any. ``join``: the
    setup also makes the call the user's script would make
    (``init_process_group``, ``jax.distributed.initialize``)."""
    import os

    os.environ.update(env)
    if not setup:
        return "environment set"
    module, _, function = setup.partition(":")
    return getattr(importlib.import_module(module), function)(*args, join=join)
