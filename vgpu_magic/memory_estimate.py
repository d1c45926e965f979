"""Will it fit? Each rank's peak memory on N devices, before anyone rents them (docs/estimates.md)."""

from __future__ import annotations

import html
import json
import linecache
import os
import re
import sysconfig
import traceback
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from . import frameworks
from .devices import simulated_line
from .errors import PlanError, excerpt
from .frameworks.base import Framework, Lever, RankMemory, code_names
from .units import format_bytes, parse_memory

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
    #: What the estimate only simulates: its framework's estimator's ``SIMULATED``.
    simulated: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:  # the largest rank's
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
        label, _, said = simulated_line(self.simulated).partition(": ")
        return rows + [(label, said)] * bool(said)

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


def estimable() -> list[str]:
    """The registered frameworks whose cells can be estimated (:attr:`Framework.estimator`), by name."""
    return [fw.name for fw in frameworks.all_frameworks() if fw.estimator()]


def _framework(code: types.CodeType, requested: str | None, namespace: dict) -> Framework:
    # The names the code uses (not its comments), and the packages of the notebook's objects among them.
    used = code_names(code)
    values = [v for k, v in namespace.items() if k in used]
    modules = [getattr(v, "__module__", None) or "" for v in values] + [
        c.__module__ for v in values for c in (v if isinstance(v, type) else type(v)).__mro__
    ]
    # Those that can be estimated first: a cell may use another framework's tools (its data loading) too.
    found = sorted(frameworks.written_for(used | {m.split(".")[0] for m in modules}), key=lambda f: not f.estimator())
    if len(found) > 1 and found[1].estimator() and not requested:  # either estimate would run the other's code
        one, other = found[:2]
        raise PlanError(f"the cell uses {one.label} and {other.label}; say --framework {one.name} or {other.name}")
    chosen = frameworks.get(requested) if requested else found and found[0]
    if not chosen:
        raise PlanError(f"cannot tell the framework of this cell; say --framework {' or '.join(estimable())}")
    if not chosen.estimator():
        raise PlanError(
            f"{chosen.name} cannot be estimated: it has no fake tensors and no compile-only memory analysis; "
            "measure it on a real GPU split (%vgpu_split N --memory SIZE) instead"
        )
    if found and chosen not in found:  # the cell would run for real in the other framework's estimate
        raise PlanError(
            f"--framework {requested}: the cell uses {found[0].name}; say --framework {found[0].name} or leave it out"
        )
    return chosen


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
    """Each rank's peak memory when ``code_or_function`` (a cell's code, or a no-argument function) runs on ``ranks``
    devices, ``progress`` told before each run; PlanError for bad input, no estimator or no training step."""
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
    chosen = _framework(code, framework, getattr(code_or_function, "__globals__", namespace or {}))
    rank_list = list(range(ranks)) if all_ranks else [rank]
    gpu_named = (gpu_label, gpu_mib * 2**20) if gpu is not None else None
    __tracebackhide__ = True
    try:
        estimator = chosen.estimator()
        found = estimator.estimate_ranks(code_or_function, code, ranks, rank_list, namespace, gpu_named, progress)
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the cell raises is its own, shown in its lines
        raise _as_the_cells(exc) from None
    first, per_rank = found[0], [f.memory for f in found]
    notes, simulated = list(first.notes), list(estimator.SIMULATED)
    result = MemoryEstimate(
        chosen.label, ranks, per_rank, first.parallelism, gpu_label, notes=notes, simulated=simulated
    )
    if gpu_mib is not None:
        result.gpu_bytes, result.kept_bytes = gpu_mib * 2**20, estimator.kept_mib(gpu_mib) * 2**20
        if not result.fits:
            rerun = partial(estimate, code_or_function, framework=chosen.name, namespace=namespace, progress=progress)
            parts = max(per_rank, key=lambda r: r.peak_bytes).categories
            levers = estimator.levers(parts, ranks, result.parallelism, set(first.uses))
            result.levers = [_judged(lever, result, rerun) for lever in levers]
    return result


def _judged(lever: Lever, result: MemoryEstimate, rerun: Callable[[int], MemoryEstimate]) -> str:
    """A framework's lever against the device: re-estimated on its ``ranks``, or a bound from what it ``saves``."""
    if lever.ranks is not None:
        outcome = f"{result.outcome(rerun(lever.ranks).peak_bytes)} (re-estimated)"
    elif lever.saves is not None:
        outcome = result.outcome(result.peak_bytes - lever.saves, bound=True)
    else:
        outcome = "not re-estimated"
    return f"{lever.name}: {outcome}" + f" ({lever.note})" * bool(lever.note)


def _as_the_cells(exc: Exception) -> Exception:
    """The cell's own error, its traceback cut to the cell's (and the notebook's) frames."""
    ours = (os.path.dirname(__file__), *{sysconfig.get_path(p) for p in ("stdlib", "purelib", "platlib")})
    kept = [(f, line) for f, line in traceback.walk_tb(exc.__traceback__) if not f.f_code.co_filename.startswith(ours)]
    trace = None
    for frame, line in reversed(kept):
        trace = types.TracebackType(trace, frame, frame.f_lasti, line)
    return exc.with_traceback(trace)
