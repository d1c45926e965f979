"""Formatting sizes for people: one place, used by the status report, the
monitor's data and its views; and lists of alike figures written once
(:func:`joined_alike`)."""

from __future__ import annotations

MIB = 1024 * 1024
GIB = 1024 * MIB


#: Units people read bytes in, largest first, with the decimals :func:`format_bytes` writes.
UNITS = (("GiB", GIB, 2), ("MiB", MIB, 1), ("KiB", 1024, 1), ("B", 1, 0))


def unit_for(top: float, smallest: str = "B") -> tuple[str, int]:
    """``(name, bytes)`` of the unit ``top`` bytes are read in: the largest
    not above it (as :func:`format_bytes` writes it), ``smallest`` at least.
    The one picker of the status, the live view's axes and the final image."""
    for name, scale, _ in UNITS:
        if top >= scale or name == smallest:
            return name, scale
    return "B", 1


def format_bytes(n: int | float | None, unit: str | None = None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; in a given ``unit`` (an axis'):
    ``'1536.0 MiB'``; ``None`` -> ``'—'``."""
    if n is None:
        return "—"
    name = unit or unit_for(n)[0]
    _, scale, decimals = next(u for u in UNITS if u[0] == name)
    return f"{n / scale:.{decimals}f} {name}" if decimals else f"{int(n)} B"


def joined_alike(parts: list[tuple[str, ...]], between: str) -> list[str]:
    """``(label, text)`` or ``(label, text, group)`` tuples as ``label + between + text``;
    three or more in a row with the same text (and group) become one:
    ``'CPU:0…CPU:7, each' + between + text``."""
    out: list[str] = []
    start = 0
    while start < len(parts):
        end = start
        while end + 1 < len(parts) and parts[end + 1][1:] == parts[start][1:]:
            end += 1
        if end - start >= 2:
            out.append(f"{parts[start][0]}…{parts[end][0]}, each{between}{parts[start][1]}")
        else:
            out.extend(f"{part[0]}{between}{part[1]}" for part in parts[start : end + 1])
        start = end + 1
    return out
