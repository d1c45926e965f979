"""Import TensorFlow the way the user's log level asks.

TensorFlow 2.21 writes INFO lines (the oneDNN notice, absl's "before
InitializeLog" preamble) straight to file descriptor 2 while it is being
imported, before it reads ``TF_CPP_MIN_LOG_LEVEL``. In a notebook they land in
red above ``%vgpu_split``'s output even when the user set the level to hide
INFO. When vgpu_magic is the one importing TensorFlow and the level is 1 or
more, those INFO lines are dropped; every other line (warnings, errors) is
passed through unchanged. At level 0 (TensorFlow's default) nothing is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["import_tensorflow"]

_INFO_LINE = re.compile(
    r"^(?:I\d{4} \d\d:\d\d:\d+(?:\.\d+)?\s+\d+ \S+:\d+\] .*"
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR)$"
)


def _info_hidden() -> bool:
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    return level.isdigit() and int(level) >= 1


@contextlib.contextmanager
def _without_cpp_info_lines() -> Iterator[None]:
    """Send fd 2 to a temporary file, then write back every line but INFO ones."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not _INFO_LINE.match(line.rstrip("\n"))]
            if kept:
                os.write(2, "".join(kept).encode())


def import_tensorflow():
    """Return the ``tensorflow`` module, importing it if needed (see module docstring)."""
    if "tensorflow" in sys.modules or not _info_hidden():
        import tensorflow

        return tensorflow
    with _without_cpp_info_lines():
        import tensorflow
    return tensorflow
