"""The faces' argument grammar: the ``type=`` callables of the ``@magic_arguments()`` declarations (so help comes
from what parses), over :mod:`vgpu_magic.units`' parsers, each refusal one sentence quoting the token and saying what
would work. ``%vgpu_split`` lines, the persistent split and the CLI parse into a ``SplitRequest`` here."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import itertools
import re
import shlex
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments

from . import frameworks
from .errors import USER_ERRORS, PlanError, excerpt
from .planner import MAX_DEVICES
from .plans import SplitRequest
from .units import parse_memory, parse_memory_list, parse_seconds, parse_whole_number  # noqa: F401 - and from here

_NEGATIVE = re.compile(r"-[0-9]+", re.ASCII)


def with_example(text: str) -> Callable[[Callable], Callable]:
    """Attach the example :func:`parse_arguments` shows when the option's value is missing."""

    def attach(func: Callable) -> Callable:
        func.example = text  # type: ignore[attr-defined]
        return func

    return attach


def choice(values: Sequence[str], refusal: str, example: str) -> Callable[[str], str]:
    """A ``type=`` accepting one of ``values``, else ``refusal`` (``{value}``: the token); ``example`` works."""

    @with_example(example)
    def one_of(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(refusal.format(value=excerpt(text)))
        return text

    return one_of


def seconds(option: str, minimum: float, maximum: float, example: str = "0.05") -> Callable[[str], float]:
    """A ``type=`` for :func:`parse_seconds`; ``example``: a value that works."""

    @with_example(f"{option} {example}")
    def number_of_seconds(text: str) -> float:
        with usage_errors(PlanError, into=argparse.ArgumentTypeError):
            return parse_seconds(text, minimum=minimum, maximum=maximum, option=option, example=example)

    return number_of_seconds


def whole(subject: str, minimum: int, maximum: int, example: str) -> Callable[[str], int]:
    """A ``type=`` for a whole number in ``[minimum, maximum]`` in ASCII digits (not ``"+2"``, ``"1_0"``)."""

    @with_example(example)
    def whole_number(text: str) -> int:
        _refuse_negative(text, subject, f"use {minimum}..{maximum}, e.g. {example}")
        value = parse_whole_number(text)
        if value is None:
            raise argparse.ArgumentTypeError(
                f"{subject} {excerpt(text)} is not a whole number; use {minimum}..{maximum}, e.g. {example}"
            )
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{subject} {_short(text)} is out of range; use {minimum}..{maximum}")
        return value

    return whole_number


def _short(word: str) -> str:
    return word if len(word) <= 20 else excerpt(word)


def _refuse_negative(text: str, subject: str, hint: str) -> None:
    # argparse hands "-3" to the type (it has no option that looks like a number), so say what is wrong with it.
    if _NEGATIVE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{subject} {_short(text)} is negative; {hint}")


@with_example("%vgpu_split 4")
def _count(text: str) -> int:
    _refuse_negative(text, "device count", f"use 1..{MAX_DEVICES}, e.g. %vgpu_split 4")
    count = parse_whole_number(text)
    if count is None:
        raise argparse.ArgumentTypeError(
            f"{excerpt(text)} is not a device count; use a whole number 1..{MAX_DEVICES}, e.g. %vgpu_split 4"
        )
    return count


@with_example("--gpu 1")
def _gpu_index(text: str) -> int:
    _refuse_negative(text, "--gpu", "GPU indices start at 0, e.g. --gpu 1")
    index = parse_whole_number(text)
    if index is None:
        raise argparse.ArgumentTypeError(f"{excerpt(text)} is not a GPU index; use 0, 1, ...")
    return index


@with_example("--memory 2048")
def _memory(text: str) -> tuple[int, ...]:
    _refuse_negative(text, "--memory", "sizes are positive MiB, e.g. --memory 2048")
    with usage_errors(PlanError, into=argparse.ArgumentTypeError):
        return parse_memory_list(text)


@with_example("--visible 0,1")
def _visible(text: str) -> tuple[int, ...]:
    _refuse_negative(text, "--visible", "GPU indices start at 0, e.g. --visible 0,1")
    if text.strip().lower() == "none":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not parts or any(parse_whole_number(p) is None for p in parts):
        raise argparse.ArgumentTypeError(
            f"--visible {excerpt(text)} is not a list of GPU indices; use e.g. --visible 0 or --visible 0,2"
        )
    return tuple(int(p) for p in parts)


@with_example("--framework jax")
def framework_name(text: str) -> str:
    """A ``type=`` for ``--framework``: the registry's name for ``text`` (aliases resolved)."""
    from .frameworks import FrameworkChoiceError, resolve_name

    with usage_errors(FrameworkChoiceError, into=argparse.ArgumentTypeError):
        return resolve_name(text)


_others = choice(("hide", "keep"), "--others {value} is not a choice; use hide or keep", "--others keep")

#: ``%vgpu_split``'s arguments, in the order ``%vgpu_split?`` lists them.
_SPLIT_ARGUMENTS = (
    argument("count", nargs="?", type=_count, help=f"number of logical devices, 1..{MAX_DEVICES}"),
    argument(
        "--memory",
        "-m",
        type=_memory,
        metavar="MB[,MB...]",
        help="memory cap per logical GPU in MiB (units MB/GB accepted): one size for every device or one per "
        "device. Default: free memory minus the framework's reserve, split evenly. `1 --memory N` caps without "
        "splitting.",
    ),
    argument("--gpu", type=_gpu_index, default=None, metavar="INDEX", help="physical GPU to split (default 0)"),
    argument("--cpu", action="store_true", help="split the CPU even if a GPU is present"),
    argument(
        "--others",
        type=_others,
        default="hide",
        metavar="hide|keep",
        help="with several GPUs: hide the others (default) or keep them visible as whole GPUs",
    ),
    argument(
        "--visible", type=_visible, metavar="I[,J...]", help="physical GPUs the framework may use; 'none' hides all"
    ),
    argument("--growth", action="store_true", help="turn on memory growth for visible GPUs instead of splitting"),
    argument(
        "--framework",
        "-f",
        type=framework_name,
        metavar="NAME",
        help=f"{frameworks.choices()}; default: the one imported in the kernel, else the one installed, "
        f"else {frameworks.DEFAULT}",
    ),
    argument("--dry-run", "-n", action="store_true", help="plan and print, configure nothing"),
    argument("--return", "-r", dest="return_result", action="store_true", help="return the result object"),
    argument("--quiet", "-q", action="store_true", help="print nothing unless something is wrong"),
)


def split_arguments(func: Callable) -> Callable:
    """Declare ``%vgpu_split``'s arguments on ``func`` (put it under ``@magic_arguments()``)."""
    for declared in reversed(_SPLIT_ARGUMENTS):
        func = declared(func)
    return func


@magic_arguments("vgpu_split")
@split_arguments
def _split_grammar(line: str = "") -> None:
    """Split the GPU (or, without one, the CPU) into COUNT logical devices so a
    data-parallel strategy sees COUNT replicas. Must run before the framework's
    runtime starts."""


def _refused(parser: argparse.ArgumentParser, err: argparse.ArgumentError, magic: str) -> str:
    """One sentence for an option argparse refused."""
    if isinstance(err.__context__, argparse.ArgumentTypeError):
        return err.message  # a type= callable's own sentence
    name = err.argument_name
    action = next((a for a in parser._actions if name in ("/".join(a.option_strings), a.metavar, a.dest)), None)
    option = action.option_strings[0] if action is not None and action.option_strings else name
    if action is not None and action.nargs == 0:
        return f"{option} takes no value; write {option} alone"
    example = getattr(getattr(action, "type", None), "example", None)
    return f"{option} needs a value, " + (f"e.g. {example}" if example else f"see {magic}? for examples")


def _parsed(parser: argparse.ArgumentParser, words: list[str], magic: str) -> tuple[argparse.Namespace, list[str]]:
    """``parser.parse_known_args(words)``, each refusal one PlanError line (``--gpu -1GB`` read as ``--gpu=-1GB``)."""
    try:
        return parser.parse_known_args(words)
    except argparse.ArgumentError as err:
        options = {*err.argument_name.split("/")} if err.argument_name else set()
        known = {s for a in parser._actions for s in a.option_strings}
        for i, (word, value) in enumerate(itertools.pairwise(words)):
            if word in options and value.startswith("-") and value.split("=")[0] not in known:
                return _parsed(parser, [*words[:i], f"{word}={value}", *words[i + 2 :]], magic)
        raise PlanError(_refused(parser, err, magic)) from None
    except UsageError as exc:  # what argparse still reports through parser.error()
        raise PlanError(str(exc)) from None


@contextlib.contextmanager
def usage_errors(*errors: type[Exception], into: type[Exception] = UsageError) -> Iterator[None]:
    """Around a magic's work: each of ``errors`` (default: ``USER_ERRORS``) becomes its one-line ``into`` (a ``type=``
    callable's: ``argparse.ArgumentTypeError``)."""
    caught = errors or USER_ERRORS
    try:
        yield
    except caught as exc:
        raise into(str(exc)) from None


def parse_arguments(
    parser: argparse.ArgumentParser, line: str, *, example: str, options_hint: str | None = None
) -> argparse.Namespace:
    """Read ``line`` with ``magic_func.parser``, each refusal one :class:`PlanError` line showing ``example``."""
    magic = f"%{parser.prog}"
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise PlanError(f"cannot read {excerpt(line)}: {exc}; quote values with matching quotes") from None
    # Structured errors instead of argparse's printed English; and no abbreviations (--mem is not --memory).
    parser.exit_on_error = False
    parser.allow_abbrev = False
    args, extras = _parsed(parser, words, magic)
    if extras:
        first = extras[0]
        if first.startswith("-") and not _NEGATIVE.fullmatch(first):
            options = [s for a in parser._actions for s in a.option_strings]
            close = difflib.get_close_matches(first.split("=")[0], options, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else (options_hint or f"see {magic}? for the options")
            raise PlanError(f"unknown option {excerpt(first)}; {hint}")
        raise PlanError(f"{excerpt(' '.join(extras))} is not understood here; use e.g. {example}")
    return args


def parse_split_line(line: str, parser: Any = None) -> tuple[SplitRequest, argparse.Namespace]:
    """A ``%vgpu_split`` line as a :class:`SplitRequest`, and the namespace of the face-only flags (``--quiet``...)."""
    args = parse_arguments(parser or _split_grammar.parser, line, example="%vgpu_split 4 --memory 2048")
    memory = args.memory[0] if args.memory is not None and len(args.memory) == 1 else args.memory
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
