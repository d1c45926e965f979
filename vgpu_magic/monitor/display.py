"""Where the memory view goes: the front end (:func:`detect_frontend`) and, in a notebook, the final image
(:class:`MemoryFrame`, PNG plus its text form)."""

from __future__ import annotations

import base64
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["DISPLAY_MODES", "MemoryFrame", "detect_frontend", "interrupts_deferred"]

#: ``display=``: ``"auto"`` (live plot in Jupyter, else text), ``"rich"``, ``"text"`` (per epoch) or ``"none"``.
DISPLAY_MODES = ("auto", "rich", "text", "none")


def running_shell() -> Any:
    """IPython's running shell, or ``None``; imports no IPython."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def detect_frontend() -> str:
    """``"rich"`` inside a Jupyter kernel, else ``"text"`` (terminal IPython, scripts)."""
    return "text" if getattr(running_shell(), "kernel", None) is None else "rich"


class MemoryFrame:
    """The final image: PNG (``None`` without matplotlib) plus its text form."""

    def __init__(self, png: bytes | None, text: str) -> None:
        self.png, self.text = png, text

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        bundle = {"text/plain": self.text}
        if self.png is not None:
            bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        return bundle

    def __repr__(self) -> str:
        return self.text


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """Hold back ``SIGINT`` in the main thread, recording it: a final image must not die in an event hook."""
    arrived: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield arrived
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        yield arrived
        return
    try:
        yield arrived
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
