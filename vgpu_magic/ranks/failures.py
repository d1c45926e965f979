"""How a rank's failure reads: its exit status as a launcher says it, its traceback as the notebook numbers its cells,
a fatal signal's stack as Python's traceback, and what a rank another one's failure took down says of its error."""

from __future__ import annotations

import re
import signal
from itertools import takewhile

__all__ = ["PEER_GONE", "dumped_traceback", "how_it_ended", "notebook_traceback", "taken_down"]

#: What gloo and NCCL say where another rank's process went: its connection closed.
_CLOSED = re.compile(r"Connection (closed|reset) by peer|remote process exited")
#: An exception line of torch.distributed that says another rank went (gloo's, NCCL's).
PEER_GONE = re.compile(rf"DistBackendError|{_CLOSED.pattern}")
#: A traceback's frame: Python's (``  File "x.py", line 6, in f``), IPython's (``File /x.py:6, in f``, ``Cell In[3],
#: line 7``, whose source line is the one its arrow points at: ``----> 7 step()``).
_FRAME = re.compile(r'\s*(File "(?P<file>[^"]*)", line \d+|File (?P<path>.*):\d+, in |Cell( In\[\d+\])?, line \d+)')


def how_it_ended(code: int) -> str:
    """An exit status as a launcher says it: ``exited with status 3``, ``was killed by SIGSEGV``."""
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"


_COUNT = re.compile(r"(Cell(?:\x1b\[[0-9;]*m|\s)*)In\[\d+\]")


def notebook_traceback(text: str, count: int | None) -> list[str]:
    """A rank's traceback with the notebook cell's ``In[count]`` (or none) for the rank's own "Cell In[k]"."""
    return _COUNT.sub(lambda m: re.sub(r"\s", "", m[1]) if count is None else f"{m[1]}In[{count}]", text).splitlines()


def taken_down(traceback: list[str], first: str) -> list[str]:
    """What a rank that the ``first`` rank's failure took down says of its error (``traceback``'s lines): that it
    stopped, that its peer closed the connection where its error says so, and the innermost frame in the user's code,
    not a library's (torch's, Python's), with its source line, as the traceback has them."""
    import sysconfig

    library = (*{sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}, "<frozen")
    lines, own = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in traceback], []
    for at, line in enumerate(lines):
        frame = _FRAME.match(line)
        if frame and not (frame["file"] or frame["path"] or "").startswith(library):
            body = list(takewhile(lambda s: s.strip() and s[:1] in " -" and not _FRAME.match(s), lines[at + 1 :]))
            own = [line, *([s for s in body if re.match(r"-+> ?\d", s)] or body)[:1]]
    why = "its peer closed the connection" if _CLOSED.search("\n".join(lines)) else "its collective failed"
    return [f"stopped: {why} ({first} failed first)", *own]


def dumped_traceback(dump: str, launching: tuple[str, ...]) -> list[str]:
    """faulthandler's ``dump`` at a fatal signal as Python's traceback: the stack of the thread it was at (the current
    one, else the main one), without the frames of the files in ``launching``; none where it holds no frame."""
    import linecache

    stacks = [block for block in re.split(r"\n\s*\n", dump) if '\n  File "' in block]
    if not stacks:
        return []
    stack = max(reversed(stacks), key=lambda block: block.startswith("Current"))  # the main thread is listed last
    lines = ["Traceback (most recent call last):"]
    for file, line, name in reversed(re.findall(r'^  File "(.*)", line (\d+) in (.*)$', stack, re.M)):
        if file not in launching:
            source = linecache.getline(file, int(line)).strip()
            lines += [f'  File "{file}", line {line}, in {name}', *([f"    {source}"] if source else [])]
    return [*lines, dump.splitlines()[0]]
