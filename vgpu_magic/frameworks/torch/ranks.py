"""PyTorch's ranks get what ``torchrun --standalone`` gives each worker, from their hosts (in a job step the step's
first host is ``MASTER_ADDR``; with no agent, rank 0 hosts the TCP store and the agent's variables are left out); NCCL
where every rank has a GPU of its own, else gloo (:func:`gloo_for_nccl`) unless ``--backend nccl`` asks for NCCL 2.30's
multi-rank mode (docs/ranks.md). Each rank is capped with ``set_per_process_memory_fraction``. Imports no PyTorch."""

from __future__ import annotations

import functools
import os
import sys
import uuid
from typing import Any

from ...budget import rank_share_mib
from ...devices import cuda_context_mib, nccl_buffers_mib
from ...layout import RankPlan
from ..rank_places import checked_places, shared_gpu_channels, shared_gpu_env

SETUP = "vgpu_magic.frameworks.torch.ranks:setup_rank"
SPLIT_REFUSED = "--split {split} has no meaning for torch: a rank is one process with one device; start more ranks"
NCCL_INSTEAD = "leave --backend out and they share it over gloo, or start one rank per GPU"


def plan_ranks(framework, layout, split, memory_mib, port, backend=None) -> list[RankPlan]:
    """What ``torchrun`` gives each worker: :meth:`~vgpu_magic.frameworks.base.Framework.plan_ranks` (typed there)."""
    refused = dict.fromkeys((True, False), SPLIT_REFUSED)
    places, _ = checked_places(layout, split, memory_mib, refused, backend, framework.capabilities)
    n = len(places)
    master_port = port or places[0].port
    own_gpus = all(p.gpu is not None for p in places) and not layout.gpus_shared
    backend = backend or ("nccl" if own_gpus else "gloo")
    channels = shared_gpu_channels(layout, framework.label, NCCL_INSTEAD) if backend == "nccl" else {}
    notes = [f"MASTER_ADDR:MASTER_PORT = {layout.leader}:{master_port}, world size {n}, backend {backend!r}"]
    if layout.gpus_shared:
        shared = ", ".join(map(str, sorted({p.gpu.index for p in places if p.gpu and p.gpu_shared_by > 1})))
        how = (
            f"NCCL in its experimental multi-rank mode (NVLS off, at most {min(channels.values())} CTAs a rank)"
            if channels
            else "gloo: NCCL refuses two ranks on one GPU, so init_process_group's 'nccl' (and its default) run on "
            "gloo, for CUDA tensors too"
        )
        reach = "LOCAL_RANK is that GPU's index, so set_device(LOCAL_RANK) reaches it"
        notes.append(f"ranks share GPU {shared}: {reach}; {how}")
    buffers = {p.rank: nccl_buffers_mib(channels.get(p.rank)) for p in places}
    caps = [
        rank_share_mib(p.gpu, p.gpu_shared_by, memory_mib, framework.capabilities, buffers[p.rank]) if p.gpu else None
        for p in places
    ]
    # Gloo stands in for NCCL on the host (on CPU, or ranks sharing a GPU); ranks on GPUs of their own run for real.
    gloo = ["collectives over gloo on the host, not NCCL", layout.sharing()] if backend == "gloo" else []
    simulated = tuple(filter(None, gloo))
    if any(caps):
        least = min(c for c in caps if c)
        notes.append(f"each rank capped at {least} MiB of its GPU (set_per_process_memory_fraction)")
    # One id per run for every rank: the job's own where the ranks are a job step's tasks (each plans alone).
    run_id = str(layout.step.job_id) if layout.step is not None else uuid.uuid4().hex
    hosts = len({p.node_rank for p in places})
    plans = []
    for place, cap in zip(places, caps):
        env = {
            "MASTER_ADDR": layout.leader,
            "MASTER_PORT": str(master_port),
            "RANK": str(place.rank),
            "LOCAL_RANK": str(place.local_rank if place.gpu is None else place.gpu.index),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
            "GROUP_RANK": str(place.node_rank),
            "GROUP_WORLD_SIZE": str(hosts),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(place.rank),
            "ROLE_WORLD_SIZE": str(n),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            # The hang doctor's record of each rank's collectives (docs/hangs.md), on every rank alike: a setting on
            # some ranks only hangs torch's start-up (pytorch #129672).
            "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "64"),
        }
        shares = place.rank in channels
        if shares:
            # MPS's own limit on the rank (where a daemon serves it): all the pre-flight counted for it.
            limit = cap + cuda_context_mib(place.gpu) + buffers[place.rank]
            env.update(shared_gpu_env(channels[place.rank]))
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{place.gpu.index}={limit}M"
        gpu_args = () if place.gpu is None else (place.gpu.index, cap)
        plans.append(
            RankPlan(place.rank, env, SETUP, (backend, *gpu_args), tuple(notes), mps=shares, simulated=simulated)
        )
    return plans


def setup_rank(backend: str, gpu: int | None = None, cap_mib: int | None = None, join: bool = False) -> str:
    """On the rank: pick and cap its GPU; gloo for GPU ranks maps NCCL to gloo; ``join``: join the process group."""
    if gpu is None and not join:
        return "torchrun's environment set"
    import torch
    import torch.distributed as dist

    said = []
    if gpu is not None:
        torch.cuda.set_device(gpu)
        fraction = min(cap_mib * 2**20 / torch.cuda.get_device_properties(gpu).total_memory, 1.0)
        torch.cuda.set_per_process_memory_fraction(fraction, gpu)
        say_the_cap(
            f"vgpu_magic: this rank hit the rehearsal's simulated cap of {cap_mib} MiB on GPU {gpu} "
            "(--memory, or an even share of the card), not the card's size"
        )
        said.append(f"GPU {gpu}, capped at {cap_mib} MiB ({fraction:.4f} of CUDA's total)")
        if backend == "gloo":
            _map_nccl_to_gloo(dist)
            said.append("NCCL mapped to gloo")
    if join:
        dist.init_process_group(backend)
        said.append(f"rank {dist.get_rank()} of {dist.get_world_size()} ({dist.get_backend()})")
    return "; ".join(said)


def say_the_cap(note: str) -> None:
    """Add ``note`` to a CUDA out-of-memory error ending a script or cell: torch's counts the card, not the cap."""
    import torch

    def noted(error: BaseException) -> None:
        if isinstance(error, torch.OutOfMemoryError) and note not in str(error):
            error.args = (f"{error.args[0] if error.args else ''}\n{note}", *error.args[1:])

    def excepthook(kind: type, error: BaseException, tb: Any, hook=sys.excepthook) -> None:
        noted(error)
        hook(kind, error, tb)

    sys.excepthook = excepthook
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None:

        def in_a_cell(shell: Any, kind: type, error: BaseException, tb: Any, tb_offset: int | None = None) -> None:
            noted(error)
            shell.showtraceback((kind, error, tb), tb_offset=tb_offset)

        shell.set_custom_exc((torch.OutOfMemoryError,), in_a_cell)


def gloo_for_nccl(backend: str | None) -> str:
    """The backend a rank sharing a GPU uses for ``backend`` (``None``: torch's default): NCCL replaced by gloo."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    asked = BackendConfig(Backend.UNDEFINED if backend is None else backend).get_device_backend_map()
    mapped = {"cpu": "gloo", **{device: "gloo" if str(b) == "nccl" else str(b) for device, b in asked.items()}}
    return ",".join(f"{device}:{b}" for device, b in mapped.items())


def _map_nccl_to_gloo(dist) -> None:
    """Make ``init_process_group`` (``torch.distributed``'s and ``distributed_c10d``'s) take :func:`gloo_for_nccl`."""
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    if getattr(original, "vgpu_magic_maps_nccl", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if args:
            args = (gloo_for_nccl(args[0]), *args[1:])
        else:
            kwargs["backend"] = gloo_for_nccl(kwargs.get("backend"))
        return original(*args, **kwargs)

    init_process_group.vgpu_magic_maps_nccl = True
    distributed_c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
