"""Sizes and seconds, read from people and written for people; the parsers know nothing of IPython, take ASCII
digits only (``int()`` would take ``"1_0"``, ``"+3"`` or ``"٣"``) and refuse with a PlanError quoting the text."""

from __future__ import annotations

import itertools
import math
import numbers
import re
from fractions import Fraction

from .errors import PlanError, excerpt

MIB = 1024 * 1024
GIB = 1024 * MIB


#: Units people read bytes in, largest first, with the decimals :func:`format_bytes` writes.
UNITS = (("GiB", GIB, 2), ("MiB", MIB, 1), ("KiB", 1024, 1), ("B", 1, 0))


def unit_for(top: float, smallest: str = "B") -> tuple[str, int]:
    """``(name, bytes)`` of the unit ``top`` bytes are read in: the largest not above it, ``smallest`` at least."""
    for name, scale, _ in UNITS:
        if top >= scale or name == smallest:
            return name, scale
    return "B", 1


def format_bytes(n: int | float | None, unit: str | None = None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; in a given ``unit``: ``'1536.0 MiB'``; ``None`` -> ``'—'``."""
    if n is None:
        return "—"
    name = unit or unit_for(n)[0]
    _, scale, decimals = next(u for u in UNITS if u[0] == name)
    return f"{n / scale:.{decimals}f} {name}" if decimals else f"{int(n)} B"


def joined_alike(parts: list[tuple[str, ...]], between: str) -> list[str]:
    """``(label, text[, group])`` as ``label + between + text``; three or more alike in a row as one label."""
    out: list[str] = []
    for _, alike in itertools.groupby(parts, key=lambda part: part[1:]):
        run = list(alike)
        if len(run) >= 3:
            out.append(f"{run[0][0]}…{run[-1][0]}, each{between}{run[0][1]}")
        else:
            out.extend(f"{part[0]}{between}{part[1]}" for part in run)
    return out


_WHOLE = re.compile(r"[0-9]{1,18}", re.ASCII)
_DECIMAL = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?|\.[0-9]{1,9}", re.ASCII)
_UNITS = {
    **dict.fromkeys(("", "m", "mb", "mib"), 1),
    **dict.fromkeys(("g", "gb", "gib"), 1024),
    **dict.fromkeys(("t", "tb", "tib"), 1024**2),
}
_MEMORY_RE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$", re.ASCII)


def parse_whole_number(text: str) -> int | None:
    """ASCII digits only, at most 18 of them; ``None`` otherwise."""
    return int(text) if _WHOLE.fullmatch(text) else None


def parse_memory(text: str) -> int:
    """One memory size in MiB: ``2048`` (TensorFlow's "MB"), ``2048MB``, ``1.5G``, ``2GiB`` (``G`` is 1024 MiB)."""
    match = _MEMORY_RE.match(text)
    unit = match.group("unit").lower() if match else None
    if match is None or unit not in _UNITS:
        raise PlanError(
            f"memory {excerpt(text)} is not a size; use MiB as a whole number (2048) or with a unit (2048MB, 1.5GB)"
        )
    number = match.group("num")
    if len(number.split(".")[0]) > 16:
        # Far beyond MAX_MEMORY_MIB; also keeps huge digit strings away from int().
        raise PlanError(f"memory {excerpt(text)} is absurdly large; sizes are in MiB, e.g. --memory 2048 or 2GB")
    if len(number) > 40:
        raise PlanError(f"memory {excerpt(text)} has too many digits; use a whole number of MiB, e.g. 2048")
    value = Fraction(number) * _UNITS[unit]
    if value.denominator != 1:
        raise PlanError(f"memory {excerpt(text)} is not a whole number of MiB; round it, e.g. {math.floor(value)}")
    return int(value)


def parse_memory_list(text: str) -> tuple[int, ...]:
    """``"1024,2GB"`` -> ``(1024, 2048)``: the one grammar for memory lists (magic, API, config)."""
    parts = text.split(",")
    if any(not p.strip() for p in parts):
        raise PlanError(f"memory list {excerpt(text)} has an empty item; use sizes separated by commas, e.g. 1024,2048")
    return tuple(parse_memory(p) for p in parts)


def parse_seconds(
    text: str | float,
    *,
    minimum: float = 0.001,
    maximum: float = 3600.0,
    option: str = "--interval",
    example: str = "0.05",
) -> float:
    """Seconds in ``[minimum, maximum]`` in ASCII digits or, for an API ``option``, a real number; else PlanError."""
    if option.endswith("="):
        valid = isinstance(text, numbers.Real) and not isinstance(text, bool)
    else:
        valid = isinstance(text, str) and _DECIMAL.fullmatch(text.strip())
        option += " "
    if not valid:
        raise PlanError(f"{option}{excerpt(text)} is not a number of seconds; use e.g. {option}{example}")
    value = float(text)
    if not (math.isfinite(value) and minimum <= value <= maximum):
        raise PlanError(f"{option}{excerpt(text)} is out of range; use {minimum:g} to {maximum:g} seconds")
    return value
