"""The project's vocabulary for user mistakes.

A mistake a user can make (a bad ``%vgpu_split`` line, a framework that is not
installed, a GPU NVML cannot read) is an exception whose message is one line
that quotes the bad value (:func:`excerpt`) and says what would work. Every
face catches :data:`USER_ERRORS` and shows that line: the magics as a
:class:`~IPython.core.error.UsageError`, the panel in its output, the CLI on
stderr; the Python API lets them through as they are.
"""

from __future__ import annotations

from .frameworks import FrameworkChoiceError, FrameworkImportError
from .inventory import NVMLReadError

__all__ = ["EXCERPT_CHARS", "PlanError", "excerpt", "USER_ERRORS"]

#: Characters ``str.splitlines`` breaks on; quoted user tokens may contain them.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})

#: Longest user text quoted back in a message.
EXCERPT_CHARS = 40


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``repr`` of a user value, shortened to an excerpt: a 10 kB line is not echoed whole."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        return repr(text[: limit - 3] + "...") + f" ({len(text)} characters)"
    return repr(text) if isinstance(value, str) else text


class PlanError(ValueError):
    """A request that cannot be carried out. The message is one line that quotes
    the offending value and says what would work."""

    def __init__(self, message: str) -> None:
        # A bad token echoed back must not break the line.
        super().__init__(str(message).translate(_LINE_BREAKS))


#: Every error a user can cause; each face shows its message as one line.
USER_ERRORS: tuple[type[Exception], ...] = (PlanError, FrameworkChoiceError, FrameworkImportError, NVMLReadError)
