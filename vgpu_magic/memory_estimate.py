"""Will it fit? Each rank's peak memory on N devices, before anyone rents them (docs/estimates.md)."""

from __future__ import annotations

import contextlib
import html
import json
import linecache
import os
import re
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any
from unittest import mock

from . import frameworks
from .errors import PlanError, excerpt
from .frameworks.base import code_names
from .inventory import CUDA_CONTEXT_MIB
from .units import format_bytes

#: Device memory as ``nvidia-smi`` reports it (MiB), by model; a name's spaces, dashes and case do not matter.
GPU_MODELS = {
    "H100 80GB": 81559,
    "H200": 143771,
    "A100 40GB": 40960,
    "A100 80GB": 81920,
    "L4": 23034,
    "T4": 15360,
    "RTX 4090": 24564,
}
_MODEL_KEYS = {re.sub(r"[\s_-]", "", name.lower()): name for name in GPU_MODELS} | {"h100": "H100 80GB"}
_GPU_RE = re.compile(r"\s*(?:([0-9]{1,6})\s*[x×]\s*)?(.+?)\s*", re.ASCII | re.IGNORECASE)
MAX_ALL_RANKS = 64


def parse_gpu(text: str) -> tuple[int | None, int, str]:
    """``"8x80GB"`` -> ``(8, 81920, "80 GiB")``; ``"H100"`` -> ``(None, 81559, "H100 80GB")``; else PlanError."""
    match = _GPU_RE.fullmatch(text)
    count, what = (match.group(1) and int(match.group(1)), match.group(2)) if match else (None, text)
    if count == 0:
        raise PlanError(f"--gpu {excerpt(text)} counts no GPUs; use e.g. 8x80GB")
    model = _MODEL_KEYS.get(re.sub(r"[\s_-]", "", what.lower()))
    if model:
        return count, GPU_MODELS[model], model
    from .grammar import parse_memory

    try:
        mib = parse_memory(what)
    except PlanError:
        mib = 0
    if mib == 0:
        raise PlanError(
            f"--gpu {excerpt(text)} is neither a size nor a GPU model known here; use a size "
            f"(80GB, 8x80GB) or one of {', '.join(GPU_MODELS)}"
        )
    if what.isdigit() and mib < 1024:  # a bare number is MiB, and no GPU has less than a GiB: a unit was left out
        raise PlanError(f"--gpu {excerpt(text)} would be {mib} MiB per GPU; give the unit, e.g. {text.strip()}GB")
    return count, mib, f"{mib // 1024} GiB" if mib % 1024 == 0 else format_bytes(mib * 2**20)


@dataclass
class RankMemory:
    """One rank's estimated peak (bytes), its parts by category and the phase where it peaks."""

    rank: int
    peak_bytes: int
    categories: dict[str, int]
    phase: str | None = None


@dataclass(repr=False)
class MemoryEstimate:
    """What :func:`estimate` found; ``str()`` for terminals, HTML in notebooks, :meth:`to_json`."""

    framework: str
    world: int
    ranks: list[RankMemory]
    parallelism: str = "single device"
    gpu_label: str | None = None
    gpu_bytes: int | None = None
    kept_bytes: int = 0  #: what CUDA and the framework keep on each device before any tensor
    levers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The largest rank's peak."""
        return max(r.peak_bytes for r in self.ranks)

    @property
    def spare_bytes(self) -> int | None:
        return None if self.gpu_bytes is None else self.gpu_bytes - self.kept_bytes - self.peak_bytes

    @property
    def fits(self) -> bool | None:
        """True or False against the device size; ``None`` without one."""
        return None if self.spare_bytes is None else self.spare_bytes >= 0

    @property
    def verdict(self) -> str | None:
        """``"fits, 31.20 GiB to spare"`` or ``"does not fit by 4.10 GiB"``."""
        spare = self.spare_bytes
        if spare is None:
            return None
        return f"fits, {format_bytes(spare)} to spare" if spare >= 0 else f"does not fit by {format_bytes(-spare)}"

    def outcome(self, peak: int, bound: bool = False) -> str:
        """How a lever's ``peak`` fares on the device: ``"peak 20.00 GiB, fits"``; a bound's is "at best"."""
        spare = self.gpu_bytes - self.kept_bytes - peak
        verdict = ("could fit" if bound else "fits") if spare >= 0 else f"still does not fit by {format_bytes(-spare)}"
        return f"{'at best ' * bound}peak {format_bytes(peak)}, {verdict}"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "peak_bytes": self.peak_bytes, "fits": self.fits, "verdict": self.verdict})

    def _lines(self) -> list[tuple[str, str]]:
        rows = [("", f"{self.framework}, {self.parallelism}, {self.world} rank{'s' * (self.world > 1)}")]
        if self.verdict:
            kept = f"{format_bytes(self.kept_bytes)} for CUDA, cuBLAS and {self.framework}"
            rows.append(("verdict", f"on {self.gpu_label}, less {kept}: {self.verdict}"))
        for r in self.ranks:
            parts = " · ".join(f"{k} {format_bytes(v)}" for k, v in r.categories.items() if v)
            where = f" {r.phase}" if r.phase else ""
            rows.append((f"rank {r.rank}", f"peak {format_bytes(r.peak_bytes)}{where}; held at that moment: {parts}"))
        rows += [("lever", lever) for lever in self.levers] + [("note", note) for note in self.notes]
        return rows

    def __repr__(self) -> str:
        return "\n".join(
            f"{label}: {text}" if label else f"Estimated peak memory per rank ({text})" for label, text in self._lines()
        )

    def _repr_html_(self) -> str:
        (_, title), *rows = self._lines()
        colour = f"font-weight:bold;color:var(--jp-{'success' if self.fits else 'error'}-color1)"
        body = "".join(
            f"<tr style='{colour * (a == 'verdict')}'><th style='text-align:left'>{html.escape(a)}</th>"
            f"<td style='text-align:left'>{html.escape(b)}</td></tr>"
            for a, b in rows
        )
        return f"<table><caption>Estimated peak memory per rank ({html.escape(title)})</caption>{body}</table>"


CELL_FILE = "<vgpu_estimate cell>"


def _compiled(cell: str) -> types.CodeType:
    """The cell's code, its lines kept for tracebacks; a syntax error is a PlanError naming its line."""
    try:
        code = compile(cell, CELL_FILE, "exec")
    except SyntaxError as exc:
        raise PlanError(f"line {exc.lineno} of the cell: {exc.msg}: {excerpt((exc.text or '').strip())}") from None
    linecache.cache[CELL_FILE] = (len(cell), None, cell.splitlines(True), CELL_FILE)
    return code


def _framework(code: types.CodeType, requested: str | None, namespace: dict) -> str:
    # The names the code uses (not its comments), and the packages of the notebook's objects among them.
    used = code_names(code)
    values = [v for k, v in namespace.items() if k in used]
    modules = [getattr(v, "__module__", None) or "" for v in values] + [
        c.__module__ for v in values for c in (v if isinstance(v, type) else type(v)).__mro__
    ]
    roots = {module.split(".")[0] for module in modules}
    found = [n for n in ("torch", "jax", "tensorflow") if n in used | roots]
    found += ["tensorflow"] * (not found and "keras" in used | roots)
    name = frameworks.resolve_name(requested) if requested else found and found[0]
    if not name:
        raise PlanError("cannot tell the framework of this cell; say --framework torch or --framework jax")
    if name not in ("torch", "jax"):
        raise PlanError(
            f"{name} cannot be estimated: it has no fake tensors and no compile-only memory analysis; "
            "measure it on a real GPU split (%vgpu_split N --memory SIZE) instead"
        )
    if found and name not in found:  # the cell would run for real in the other framework's estimate
        raise PlanError(
            f"--framework {requested}: the cell uses {found[0]}; say --framework {found[0]} or leave it out"
        )
    return name


def estimate(
    code_or_function: str | Callable[[], Any],
    ranks: int | None = None,
    gpu: str | None = None,
    framework: str | None = None,
    rank: int = 0,
    *,
    all_ranks: bool = False,
    namespace: dict | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> MemoryEstimate:
    """Each rank's peak memory when ``code_or_function`` (a cell's code, or a function of no arguments) runs on
    ``ranks`` devices; the other arguments are ``%%vgpu_estimate``'s options (docs/estimates.md). ``namespace``: the
    names the code may use, in a copy; ``progress``: called with a line before each run of the cell. Bad input,
    TensorFlow or a cell without a training step raise :class:`PlanError` (one line, nothing changed)."""
    count, gpu_mib, gpu_label = parse_gpu(gpu) if gpu is not None else (None, None, None)
    ranks = ranks if ranks is not None else count or 1
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlanError(f"ranks {excerpt(ranks)} is not a number of ranks; use a whole number ≥ 1, e.g. ranks=8")
    if count is not None and count != ranks:
        raise PlanError(f"--gpu {excerpt(gpu)} names {count} GPUs but ranks is {ranks}; make them agree")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise PlanError(f"rank {excerpt(rank)} is not a rank of {ranks}; use 0..{ranks - 1}")
    if all_ranks and ranks > MAX_ALL_RANKS:
        raise PlanError(f"--all-ranks runs every rank, {ranks} is too many; use --rank R (ranks differ little)")
    if not callable(code_or_function) and not (isinstance(code_or_function, str) and code_or_function.strip()):
        raise PlanError("nothing to estimate; give the code that builds the model and runs a training step")
    code = code_or_function.__code__ if callable(code_or_function) else _compiled(code_or_function)
    name = _framework(code, framework, getattr(code_or_function, "__globals__", namespace or {}))
    chosen = list(range(ranks)) if all_ranks else [rank]
    __tracebackhide__ = True
    label = frameworks.get(name).label
    try:
        if name == "torch":
            with _without_triton(), mock.patch.dict(os.environ):  # torch's tools set TORCHINDUCTOR_CACHE_DIR
                from .frameworks.torch.estimate import estimate_rank

                cell = code_or_function if callable(code_or_function) else code
                gpu_named = (gpu_label, gpu_mib * 2**20) if gpu is not None else None
                found = []
                for r in chosen:
                    progress(f"estimating: the cell runs as rank {r} of {ranks} ({label}, fake tensors)…")
                    found.append((r, estimate_rank(cell, ranks, r, namespace, gpu_named)))
        else:
            from .frameworks.jax.estimate import estimate_ranks

            progress(f"estimating: the cell's jitted steps compile for {ranks} devices ({label})…")
            found = list(zip(chosen, estimate_ranks(code_or_function, ranks, chosen, namespace)))
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the cell raises is its own, shown in its lines
        raise _as_the_cells(exc) from None
    if not any(f["peak_bytes"] for _, f in found):
        if name == "jax":
            raise PlanError("the cell ran no jitted step; wrap the training step in jax.jit and call it")
        raise PlanError("the cell made no tensors; put the model and one training step in it")
    if name == "torch" and not any(f["backward"] for _, f in found):
        raise PlanError("the cell has no training step (no backward pass ran); add one, e.g. loss.backward()")
    first = found[0][1]
    per_rank = [RankMemory(r, f["peak_bytes"], f["categories"], f["phase"]) for r, f in found]
    result = MemoryEstimate(label, ranks, per_rank, first["parallelism"], gpu_label, notes=list(first.get("notes", [])))
    if gpu_mib is not None:
        result.gpu_bytes, result.kept_bytes = gpu_mib * 2**20, _kept_mib(name, gpu_mib) * 2**20
        if not result.fits:
            rerun = partial(estimate, code_or_function, framework=name, namespace=namespace, progress=progress)
            result.levers = _levers(result, set(first.get("uses", ())), rerun)
    return result


@contextlib.contextmanager
def _without_triton() -> Iterator[None]:
    # With TensorFlow loaded, importing Triton (torch's tools import torch._dynamo, which looks for it) crashes
    # the process (TensorFlow 2.21 beside torch 2.14's Triton: a segfault). The estimate needs no Triton; the
    # kernel's own later import of it is the kernel's, so nothing of this stays.
    hidden = "tensorflow" in sys.modules and "triton" not in sys.modules
    if hidden:
        sys.modules["triton"] = None
    try:
        yield
    finally:
        if hidden and sys.modules.get("triton", "") is None:
            del sys.modules["triton"]


def _as_the_cells(exc: Exception) -> Exception:
    """The cell's own error with the cell's lines only (and the notebook's code they called): not the frames of
    vgpu_magic, torch or the standard library between them, nor the errors torch raised on the way."""
    ours = (os.path.dirname(__file__), *{sysconfig.get_path(p) for p in ("stdlib", "purelib", "platlib")})
    kept = [(f, line) for f, line in traceback.walk_tb(exc.__traceback__) if not f.f_code.co_filename.startswith(ours)]
    trace = None
    for frame, line in reversed(kept):
        trace = types.TracebackType(trace, frame, frame.f_lasti, line)
    return exc.with_traceback(trace)


def _kept_mib(name: str, gpu_mib: int) -> int:
    if name == "jax":  # XLA's client takes 75 % of the card by default (XLA_CLIENT_MEM_FRACTION, or its old name)
        fraction = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        return gpu_mib - int(gpu_mib * float(fraction or "0.75"))
    return CUDA_CONTEXT_MIB  # torch keeps nothing back itself: its planner reserve is this same allowance


def _levers(result: MemoryEstimate, uses: set[str], rerun: Callable[[int], MemoryEstimate]) -> list[str]:
    """What could make it fit, each against the device: re-estimated, or bounded by what the peak holds of
    what it shrinks (a lever saves at most that); none that the cell already uses."""
    parts = max(result.ranks, key=lambda r: r.peak_bytes).categories
    peak, world, bound, levers = result.peak_bytes, result.world, partial(result.outcome, bound=True), []
    batch = parts.get("activations", 0) + parts.get("temporaries", 0)  # what grows with the batch, at most
    if result.framework == "JAX":  # XLA's temporaries are activations, gradients and scratch alike
        tools = [t for t, use in (("jax.checkpoint", "checkpointing"), ("bf16", "bf16")) if use not in uses]
        return [f"{', '.join([*tools, 'a smaller batch'])} shrink XLA's temporaries: {bound(peak - batch)} (with none)"]
    state = sum(parts.get(k, 0) for k in ("parameters", "gradients", "optimizer state")) * (world - 1) // world
    if "FSDP" in result.parallelism:
        levers.append(f"FSDP over {2 * world} ranks: {result.outcome(rerun(2 * world).peak_bytes)} (re-estimated)")
    elif world > 1:
        levers.append(f"shard the model's state with FSDP2 (fully_shard): {bound(peak - state)}")
    if "no reshard" in uses:
        levers.append("reshard_after_forward=True (the default; this cell passes False): not re-estimated")
    if parts.get("activations") and "checkpointing" not in uses:
        kept = "if nothing were kept for the backward; it keeps each checkpointed block's input"
        levers.append(f"activation checkpointing: {bound(peak - parts['activations'])} ({kept})")
    if batch and "bf16" not in uses:
        levers.append(f"bf16 compute (torch.autocast): {bound(peak - batch // 2)}")
    return levers + [f"half the batch: {bound(peak - batch // 2)}"] * bool(batch)
