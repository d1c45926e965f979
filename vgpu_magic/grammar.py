"""The argument grammar of the faces: ``%vgpu_split`` lines, the persistent
split (config trait, environment variable) and the CLI all parse here into a
:class:`~vgpu_magic.planner.SplitRequest`; the planner then validates it.

Nothing is evaluated: a line is split like a shell line and read by argparse,
whose messages are turned into one plain sentence that quotes the bad token
(an excerpt of it) and says what would work. Numbers have one grammar for
every option: ASCII digits (``int()`` would also take ``"1_0"``, ``"+3"`` or
``"٣"``), finite and bounded.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import math
import re
import shlex

from .errors import PlanError, excerpt
from .planner import MAX_DEVICES, SplitRequest, parse_memory_list

__all__ = [
    "parse_split_line",
    "split_argument_parser",
    "parse_whole_number",
    "parse_seconds",
    "friendly_argparse_error",
]

_WHOLE = re.compile(r"[0-9]{1,18}", re.ASCII)
_DECIMAL = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?|\.[0-9]{1,9}", re.ASCII)


def parse_whole_number(text: str) -> int | None:
    """ASCII digits only, at most 18 of them; ``None`` otherwise."""
    return int(text) if _WHOLE.fullmatch(text) else None


def parse_seconds(text: str, *, minimum: float = 0.001, maximum: float = 3600.0, option: str = "--interval") -> float:
    """A positive, finite number of seconds in ``[minimum, maximum]`` written with
    ASCII digits (``0.05``, ``2``); raises :class:`PlanError` otherwise."""
    if not _DECIMAL.fullmatch(text.strip()):
        raise PlanError(f"{option} {excerpt(text)} is not a number of seconds; use e.g. {option} 0.05")
    value = float(text)
    if not (math.isfinite(value) and minimum <= value <= maximum):
        raise PlanError(f"{option} {excerpt(text)} is out of range; use {minimum:g} to {maximum:g} seconds")
    return value


def friendly_argparse_error(message: str, options: list[str], magic: str) -> str:
    """Turn argparse's wording into one plain sentence."""
    match = re.match(r"unrecognized arguments: (.+)$", message, re.S)
    if match:
        rest = match.group(1)
        token = rest.split()[0] if rest.split() else rest
        if token.startswith("-"):
            close = difflib.get_close_matches(token.split("=")[0], options, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"see {magic}? for the options"
            return f"unknown option {excerpt(token)}; {hint}"
        return f"unexpected {excerpt(rest)}; see {magic}? for the options"
    match = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: (.+?) \(choose from (.+)\)$", message)
    if match:
        name, value, choices = match.groups()
        choices = ", ".join(c.strip(" '") for c in choices.split(","))
        shown = excerpt(value.strip("'"))
        return f"{shown} is not a valid {name.lstrip('-')}; use one of {choices}"
    match = re.match(r"argument (\S+?)(?:/\S+)?: expected one argument", message)
    if match:
        return f"{match.group(1)} needs a value; see {magic}? for examples"
    # Our own type errors already say what would work: drop argparse's "argument X: " prefix.
    return re.sub(r"^argument \S+: ", "", message)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`PlanError` with one plain sentence instead of printing and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        options = [s for a in self._actions for s in a.option_strings]
        raise PlanError(friendly_argparse_error(message, options, self.prog))

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise PlanError((message or "invalid arguments").strip())


#: Options taking a value, and what a valid value looks like.
_VALUE_OPTIONS = {
    "--memory": "sizes are positive MiB, e.g. --memory 2048",
    "-m": "sizes are positive MiB, e.g. -m 2048",
    "--gpu": "GPU indices start at 0, e.g. --gpu 1",
    "--visible": "GPU indices start at 0, e.g. --visible 0,1",
}


def _count_type(text: str) -> int:
    count = parse_whole_number(text)
    if count is None:
        raise argparse.ArgumentTypeError(
            f"{excerpt(text)} is not a device count; use a whole number 1..{MAX_DEVICES}, e.g. %vgpu_split 4"
        )
    return count


def _index_type(text: str) -> int:
    index = parse_whole_number(text)
    if index is None:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a GPU index; use 0, 1, ...")
    return index


def _memory_type(text: str) -> tuple[int, ...]:
    try:
        return parse_memory_list(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _visible_type(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "none":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(parse_whole_number(p) is None for p in parts):
        raise argparse.ArgumentTypeError(
            f"--visible {excerpt(text)} is not a list of GPU indices; use e.g. --visible 0 or --visible 0,2"
        )
    return tuple(int(p) for p in parts)


def _framework_type(text: str) -> str:
    from .frameworks import FrameworkChoiceError, resolve_name

    try:
        return resolve_name(text)
    except FrameworkChoiceError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@functools.lru_cache(maxsize=4)
def split_argument_parser(prog: str = "%vgpu_split") -> argparse.ArgumentParser:
    """The argument grammar shared by ``%vgpu_split``, the config trait, the
    environment variable and the CLI (built once: parsing never changes it)."""
    parser = _ArgumentParser(
        prog=prog,
        add_help=False,
        allow_abbrev=False,
        description=(
            "Split the GPU (or, without one, the CPU) into COUNT logical devices so a data-parallel strategy "
            "sees COUNT replicas. Must run before the framework's runtime starts."
        ),
    )
    parser.add_argument("count", nargs="?", type=_count_type, help=f"number of logical devices, 1..{MAX_DEVICES}")
    parser.add_argument(
        "--memory",
        "-m",
        type=_memory_type,
        metavar="MB[,MB...]",
        help="memory cap per logical GPU in MiB (units MB/GB accepted): one size for every device or one per "
        "device. Default: free memory minus the framework's reserve, split evenly. `1 --memory N` caps without "
        "splitting.",
    )
    parser.add_argument("--gpu", type=_index_type, default=None, metavar="INDEX", help="physical GPU to split (default 0)")
    parser.add_argument("--cpu", action="store_true", help="split the CPU even if a GPU is present")
    parser.add_argument(
        "--others",
        choices=("hide", "keep"),
        default="hide",
        help="with several GPUs: hide the others (default) or keep them visible as whole GPUs",
    )
    parser.add_argument(
        "--visible",
        type=_visible_type,
        metavar="I[,J...]",
        help="physical GPUs the framework may use; 'none' hides all GPUs",
    )
    parser.add_argument(
        "--growth", action="store_true", help="turn on memory growth for visible GPUs instead of splitting"
    )
    parser.add_argument(
        "--framework",
        "-f",
        type=_framework_type,
        metavar="NAME",
        help="tensorflow (alias tf) or jax; default: the one imported in the kernel, else the one installed, "
        "else TensorFlow",
    )
    parser.add_argument("--dry-run", "-n", action="store_true", help="plan and print, configure nothing")
    parser.add_argument("--return", "-r", dest="return_result", action="store_true", help="return the result object")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing unless something is wrong")
    return parser


def _short(word: str) -> str:
    return word if len(word) <= 20 else excerpt(word)


def parse_split_line(line: str) -> tuple[SplitRequest, argparse.Namespace]:
    """Parse a ``%vgpu_split`` argument line into a :class:`SplitRequest`.

    The text is split like a shell line and parsed with argparse; nothing is
    evaluated. Returns the request and the namespace (for the face-only flags
    ``--dry-run``, ``--return`` and ``--quiet``).
    """
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise PlanError(f"cannot read {excerpt(line)}: {exc}; quote values with matching quotes") from None
    for i, word in enumerate(words):
        # argparse would read "-3" as an unknown option; say what is wrong with it.
        if re.fullmatch(r"-[0-9]+", word):
            option = words[i - 1] if i and words[i - 1] in _VALUE_OPTIONS else None
            if option is not None:
                raise PlanError(f"{option} {_short(word)} is negative; {_VALUE_OPTIONS[option]}")
            raise PlanError(f"device count {_short(word)} is negative; use 1..{MAX_DEVICES}, e.g. %vgpu_split 4")
    args = split_argument_parser().parse_args(words)
    memory: int | tuple[int, ...] | None = None
    if args.memory is not None:
        memory = args.memory[0] if len(args.memory) == 1 else args.memory
    request = SplitRequest(
        count=args.count,
        memory=memory,
        target="cpu" if args.cpu else "auto",
        gpu=args.gpu,
        others=args.others,
        visible=args.visible,
        memory_growth=args.growth,
        framework=args.framework,
    )
    return request, args
