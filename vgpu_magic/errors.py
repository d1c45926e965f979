"""The project's vocabulary for user mistakes: exceptions whose message is one line that quotes the bad value
(:func:`excerpt`) and says what would work. Every face catches :data:`USER_ERRORS` and shows that line; the Python API
lets them through."""

from __future__ import annotations

#: Characters ``str.splitlines`` breaks on; quoted user tokens may contain them.
_LINE_BREAKS = str.maketrans({c: repr(c)[1:-1] for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})

#: Longest user text quoted back in a message.
EXCERPT_CHARS = 40


def excerpt(value: object) -> str:
    """``repr`` of a user value, shortened to an excerpt: a 10 kB line is not echoed whole."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > EXCERPT_CHARS:
        return repr(text[: EXCERPT_CHARS - 3] + "...") + f" ({len(text)} characters)"
    return repr(text) if isinstance(value, str) else text


class PlanError(ValueError):
    """A request that cannot be carried out; its message quotes the offending value and says what would work."""

    def __init__(self, message: str) -> None:
        # A bad token echoed back must not break the line.
        super().__init__(str(message).translate(_LINE_BREAKS))


class FrameworkChoiceError(ValueError):
    """A framework name that is not registered, or a choice that cannot be made."""


class FrameworkImportError(ImportError):
    """The framework is not installed, or failed to import: the message says which, with the real reason."""

    @classmethod
    def of(cls, label: str, module: str, install_hint: str, exc: BaseException) -> FrameworkImportError:
        """The one-line error for ``exc``, a failed import of ``module`` (shown as ``label``)."""
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == module:
            return cls(f"{label} is not installed in this kernel; {install_hint}")
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return cls(f"{label} failed to import: {reason}")


class NVMLReadError(RuntimeError):
    """NVML failed while a GPU was read (a GPU or driver gone): one line saying which call failed."""


class ClusterStartError(RuntimeError):
    """The cluster could not start or be wired; nothing it started is left running."""


class UnsendableName(ValueError):
    """A notebook name the cell reads cannot be pickled for the ranks."""


#: Every error a user can cause; each face shows its message as one line.
USER_ERRORS: tuple[type[Exception], ...] = (
    PlanError,
    FrameworkChoiceError,
    FrameworkImportError,
    NVMLReadError,
    ClusterStartError,
    UnsendableName,
)
