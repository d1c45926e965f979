"""Formatting sizes for people: one place, used by the status report, the
monitor's data and its views."""

from __future__ import annotations

__all__ = ["MIB", "GIB", "format_bytes"]

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
