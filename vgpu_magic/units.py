"""Formatting sizes for people: one place, used by the status report, the
monitor's data and its views; and lists of alike figures written once
(:func:`joined_alike`)."""

from __future__ import annotations

__all__ = ["MIB", "GIB", "format_bytes", "joined_alike"]

MIB = 1024 * 1024
GIB = 1024 * MIB


def format_bytes(n: int | float | None) -> str:
    """``1536 * 2**20`` -> ``'1.50 GiB'``; ``None`` -> ``'—'``."""
    if n is None:
        return "—"
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


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
