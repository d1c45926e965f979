"""Running one piece of work on every rank under the fault policy.

:class:`RankRun` submits the work to each rank (one ipyparallel
``AsyncResult`` per rank) and then watches all of them from the kernel:

* each rank's stdout/stderr streams live as whole lines labelled
  ``[rank r]`` (a partial line waits for its newline, so lines of different
  ranks never interleave);
* each rank's memory is sampled (:mod:`.memory`) and plotted when asked;
* the first rank that raises, dies, or outlives ``timeout`` ends the run:
  every other rank still running gets SIGINT at once; a rank that has not
  come back within :data:`GRACE` seconds (blocked in a collective, where a
  signal cannot reach Python) is killed, and the cluster is then marked as
  needing a restart. The run raises :class:`RankRunError` carrying the
  failing rank's traceback labelled with its rank;
* an interrupt of the kernel (KeyboardInterrupt while watching) interrupts
  the ranks the same way.

This module also finds which notebook names a cell reads and packs them
with cloudpickle (:func:`names_to_send`, :func:`pack_names`).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TextIO

from .memory import RankMonitor

__all__ = [
    "GRACE",
    "RankFailure",
    "RankRunError",
    "RankRun",
    "UnsendableName",
    "names_to_send",
    "names_written",
    "pack_names",
    "split_last_expression",
    "script_code",
    "process_alive",
]

#: Seconds a rank has to come back after SIGINT before it is killed.
GRACE = 3.0
#: Seconds between looks at the ranks (output, completion, liveness).
POLL = 0.05
#: Seconds to wait, at the end of a run, for output still on its way from finished ranks.
OUTPUT_WAIT = 5.0
#: Seconds between memory samples.
SAMPLE_EVERY = 0.2


@dataclass(frozen=True)
class RankFailure:
    """Why one rank did not finish: ``kind`` is ``"error"``, ``"died"`` or ``"timeout"``."""

    rank: int
    kind: str
    summary: str
    traceback: tuple[str, ...] = ()


class RankRunError(RuntimeError):
    """A run on the ranks failed; IPython shows :meth:`_render_traceback_`
    (the failing rank's traceback, each line labelled with its rank)."""

    def __init__(self, failure: RankFailure, interrupted: list[int], killed: list[int], must_restart: bool) -> None:
        self.failure = failure
        self.rank = failure.rank
        self.interrupted = interrupted
        self.killed = killed
        self.must_restart = must_restart
        super().__init__(self.headline())

    def headline(self, state: bool = True) -> str:
        """One line: what failed, what was done to the others, and (``state``) whether the cluster is usable."""
        parts = [f"rank {self.failure.rank} {self.failure.summary}"]
        if self.interrupted:
            parts.append(f"interrupted rank{'s' if len(self.interrupted) > 1 else ''} {_ranks(self.interrupted)}")
        if self.killed:
            parts.append(
                f"killed rank{'s' if len(self.killed) > 1 else ''} {_ranks(self.killed)} "
                f"(did not stop within {GRACE:g} s of SIGINT)"
            )
        if state and self.must_restart:
            parts.append("the cluster must be restarted: %vgpu_cluster restart")
        elif state:
            parts.append("the cluster is still usable")
        return "; ".join(parts)

    def _render_traceback_(self) -> list[str]:
        label = f"[rank {self.failure.rank}] "
        lines = [label + line for block in self.failure.traceback for line in block.splitlines()]
        return [*lines, f"RankRunError: {self.headline()}"]


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def _rank_s(ranks: list[int]) -> str:
    """``"rank 0"`` or ``"ranks 0, 1"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"


class UnsendableName(ValueError):
    """A notebook name the cell reads cannot be pickled for the ranks."""


# -- names a cell reads ---------------------------------------------------------------

#: Names IPython puts in every namespace; never sent.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


class _ReadsBeforeWrites(ast.NodeVisitor):
    """Names whose first use, in evaluation order, is a read (so the cell needs
    the notebook's value). Right-hand sides are visited before their targets.

    ``written`` holds the names bound on every path so far (a name bound only in
    one branch of an ``if``, or in a loop body that may not run, is still read
    from the notebook after it); ``bound`` holds every name bound anywhere.
    Comprehensions, lambdas and function bodies are scopes of their own: their
    targets and parameters are neither reads nor notebook names.
    """

    def __init__(self, written: set[str] | None = None) -> None:
        self.read: list[str] = []
        self.written: set[str] = set(written or ())
        self.bound: set[str] = set()

    def _store(self, name: str) -> None:
        self.written.add(name)
        self.bound.add(name)

    def _load(self, name: str) -> None:
        if name not in self.written and name not in self.read:
            self.read.append(name)

    def _inner(self, node: Any, local: set[str], parts: list[Any]) -> None:
        """Reads of a nested scope (``local`` bound in it) that come from this one."""
        inner = _ReadsBeforeWrites(self.written | local)
        for part in parts:
            inner.visit(part)
        for name in inner.read:
            if name not in self.read and name not in self.written:
                self.read.append(name)
        # `(y := ...)` inside a comprehension binds y in the enclosing scope.
        for sub in ast.walk(node):
            if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
                self.bound.add(sub.target.id)

    def _branch(self, statements: list[ast.stmt]) -> set[str]:
        """Visit statements that may not run; return what they bind, leaving ``written`` as it was."""
        before = set(self.written)
        for statement in statements:
            self.visit(statement)
        added, self.written = self.written - before, before
        return added

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._store(node.id)
        else:
            # Load, and Del: `del name` needs the name to exist.
            self._load(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._load(node.target.id)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        both = self._branch(node.body) & self._branch(node.orelse)
        self.written |= both

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self._branch(node.body)
        self._branch(node.orelse)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self._branch([ast.Assign(targets=[node.target], value=ast.Constant(None)), *node.body])
        self._branch(node.orelse)

    visit_AsyncFor = visit_For

    def visit_Try(self, node: ast.Try) -> None:
        self._branch(node.body)
        for handler in node.handlers:
            if handler.type is not None:
                self.visit(handler.type)
            self._branch(handler.body)
        self._branch(node.orelse)
        for statement in node.finalbody:
            self.visit(statement)

    visit_TryStar = visit_Try

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._store(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            self._store(alias.asname or alias.name)

    def _comprehension(self, node: Any) -> None:
        first, *rest = node.generators
        # The first iterable is evaluated in the enclosing scope; everything else in the comprehension's own.
        self.visit(first.iter)
        local = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        parts: list[Any] = [*first.ifs]
        for generator in rest:
            parts.extend([generator.iter, *generator.ifs])
        parts.extend([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt])
        self._inner(node, local, parts)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        self._inner(node, {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}, [node.body])

    def _definition(self, node: Any) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        if not isinstance(node, ast.ClassDef):
            for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                self.visit(default)
        else:
            for base in node.bases:
                self.visit(base)
        self._store(node.name)
        # The body runs later, when it is called; its free names are read then.
        if isinstance(node, ast.ClassDef):
            local = set()
        else:
            local = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        inner = _ReadsBeforeWrites(self.written | local)
        for statement in node.body:
            inner.visit(statement)
        for name in inner.read:
            if name not in self.read and name not in self.written:
                self.read.append(name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition


def names_to_send(code: str, namespace: dict[str, Any], on_ranks: set[str] = frozenset()) -> list[str]:
    """The notebook names ``code`` reads before assigning them, that ``namespace`` holds.

    Names in ``on_ranks`` (assigned by earlier cells run on the ranks: a DDP
    model, an optimizer) live on the ranks and are never overwritten from the
    notebook, even where the notebook has a variable of the same name.
    """
    visitor = _ReadsBeforeWrites()
    visitor.visit(ast.parse(code))
    return [
        name
        for name in visitor.read
        if name in namespace
        and name not in on_ranks
        and not name.startswith("_")
        and name not in _SHELL_NAMES
        and not (hasattr(builtins, name) and namespace[name] is getattr(builtins, name))
    ]


def names_written(code: str) -> set[str]:
    """The names ``code`` may bind at its top level (assignments, imports,
    definitions, loop targets, on any path; not comprehension variables). Which
    of them a run did bind is asked of the ranks afterwards
    (:meth:`~.rank_cluster.RankCluster.run`)."""
    visitor = _ReadsBeforeWrites()
    visitor.visit(ast.parse(code))
    return visitor.bound


def pack_names(namespace: dict[str, Any], names: list[str]) -> dict[str, bytes]:
    """Each named value cloudpickled on its own (so a rank that cannot unpickle one can say
    which); :class:`UnsendableName` names the first that cannot be pickled."""
    import cloudpickle

    blobs = {}
    for name in names:
        try:
            blobs[name] = cloudpickle.dumps(namespace[name])
        except Exception as exc:  # noqa: BLE001 - pickling user objects raises anything (TypeError, PicklingError, ...)
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UnsendableName(
                f"cannot send {name!r} ({type(namespace[name]).__name__}) to the ranks: {reason}; "
                "create it inside the cell instead"
            ) from None
    return blobs


def split_last_expression(code: str, target: str) -> str:
    """``code`` with its last statement, if an expression, assigned to ``target``
    (so ``-o NAME`` can pull the value); else ``code`` plus ``target = None``."""
    tree = ast.parse(code)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(
            ast.Assign(targets=[ast.Name(id=target, ctx=ast.Store())], value=last.value), last
        )
    else:
        tree.body.append(ast.Assign(targets=[ast.Name(id=target, ctx=ast.Store())], value=ast.Constant(None)))
    return ast.unparse(ast.fix_missing_locations(tree))


def script_code(path: str, args: list[str]) -> str:
    """Code that runs the script ``path`` on a rank as ``python path ARGS`` would
    (``sys.argv``, ``__name__ == "__main__"``, its folder first on ``sys.path``, a
    namespace of its own), then puts the engine's ``sys.argv`` and ``sys.path``
    back, and collects the script's garbage. ``sys.exit(0)`` (argparse's ``--help``) ends it quietly;
    another status is a failure."""
    folder = os.path.dirname(path)
    return (
        "import runpy as _vgpu_runpy, sys as _vgpu_sys\n"
        "_vgpu_saved = (_vgpu_sys.argv, list(_vgpu_sys.path))\n"
        f"_vgpu_sys.argv = {[path, *args]!r}\n"
        f"_vgpu_sys.path.insert(0, {folder!r})\n"
        "try:\n"
        f"    _vgpu_runpy.run_path({path!r}, run_name='__main__')\n"
        "except SystemExit as _vgpu_exit:\n"
        "    if _vgpu_exit.code not in (0, None):\n"
        # IPython takes a SystemExit for "quit the shell" and only warns; the run must fail instead.
        "        class ScriptExited(Exception):\n"
        "            pass\n"
        f"        raise ScriptExited({os.path.basename(path)!r} "
        "+ f' exited with status {_vgpu_exit.code}') from None\n"
        "finally:\n"
        "    _vgpu_sys.argv, _vgpu_sys.path[:] = _vgpu_saved\n"
        "    del _vgpu_runpy, _vgpu_sys, _vgpu_saved\n"
        # The script's objects (a model, its data) go now, as they go with its process under torchrun.
        "    import gc as _vgpu_gc; _vgpu_gc.collect(); del _vgpu_gc\n"
    )


# -- watching the ranks ---------------------------------------------------------------


class _LineStream:
    """Whole lines of one rank's stream, labelled; the partial tail waits.

    ``feed`` gets the rank's whole output so far. It is counted in lines, not
    characters: ipyparallel rewrites the collected text when a ``\\r`` arrives
    (it keeps what follows the last ``\\r`` of a line), so the text can shrink,
    but never loses a newline. Each line is shown as a terminal leaves it
    (:func:`as_terminal_shows`): a progress line's final text.
    """

    def __init__(self, label: str, out: TextIO) -> None:
        self.label = label
        self.out = out
        self.emitted = 0
        self.last = ""

    def feed(self, text: str, final: bool = False) -> None:
        if text == self.last and not final:
            return
        self.last = text
        lines = text.split("\n")
        tail = lines.pop()
        if final and tail:
            lines.append(tail)
        new = lines[self.emitted :]
        if not new:
            return
        self.emitted = len(lines)
        self.out.write("".join(f"{self.label}{as_terminal_shows(line)}\n" for line in new))
        self.out.flush()


def as_terminal_shows(line: str) -> str:
    """The text a terminal shows for ``line``: each ``\\r`` returns to the start,
    and what follows overwrites what was there (``'10/30\\r20/30'`` -> ``'20/30'``)."""
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part) :]
    return shown


@dataclass
class RankRun:
    """One run on every rank. ``submit(rank)`` returns that rank's AsyncResult.

    ``pids`` are the ranks' process IDs (for liveness, signals and memory);
    ``exit_code(rank)`` returns how a dead rank exited, when known.
    """

    pids: list[int]
    submit: Callable[[int], Any]
    exit_code: Callable[[int], int | None]
    timeout: float | None = None
    plot: bool = False
    gpu: bool = False
    stdout: TextIO = field(default_factory=lambda: sys.stdout)
    stderr: TextIO = field(default_factory=lambda: sys.stderr)

    def __post_init__(self) -> None:
        self.trace = None  # the run's MemoryTrace, once it ended
        self.killed: list[int] = []

    def _emit(self, results: list[Any], streams: list[tuple[_LineStream, _LineStream]], final: bool = False) -> None:
        for ar, (out, err) in zip(results, streams):
            out.feed(ar.stdout or "", final)
            err.feed(ar.stderr or "", final)

    def _drain(self, results: list[Any]) -> None:
        """Wait (briefly) for the last output of every finished, living rank: ipyparallel can deliver a
        rank's reply before the iopub messages carrying its last lines."""
        deadline = time.monotonic() + OUTPUT_WAIT
        for rank, ar in enumerate(results):
            if ar.ready() and self._alive(rank):
                ar.wait_for_output(max(0.0, deadline - time.monotonic()))

    def _alive(self, rank: int) -> bool:
        return process_alive(self.pids[rank])

    def _failure(self, rank: int, ar: Any) -> RankFailure:
        exc = ar.exception(timeout=0)
        tb = tuple(exc.render_traceback()) if hasattr(exc, "render_traceback") else (str(exc),)
        ename = getattr(exc, "ename", type(exc).__name__)
        evalue = getattr(exc, "evalue", str(exc))
        if ename == "EngineError" or not self._alive(rank):
            return self._death(rank)
        # The headline is one line; the whole message is in the traceback.
        first = (str(evalue).strip().splitlines() or [""])[0]
        return RankFailure(rank, "error", f"raised {ename}: {first}".rstrip(": "), tb)

    def _death(self, rank: int) -> RankFailure:
        code = None
        deadline = time.monotonic() + 1.0
        while code is None and time.monotonic() < deadline:
            code = self.exit_code(rank)
            if code is None:
                time.sleep(POLL)
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            how = f"exited with status {code}"
        else:
            how = "died (exit status unknown)"
        return RankFailure(rank, "died", f"{how} (pid {self.pids[rank]})", (f"rank {rank} {how}",))

    def _stop_others(self, results: list[Any], culprit: int | None) -> tuple[list[int], list[int]]:
        """SIGINT every rank still running; kill those not back within GRACE."""
        running = [r for r, ar in enumerate(results) if not ar.ready() and r != culprit and self._alive(r)]
        for rank in running:
            _signal(self.pids[rank], signal.SIGINT)
        deadline = time.monotonic() + GRACE
        while time.monotonic() < deadline and any(not results[r].ready() and self._alive(r) for r in running):
            time.sleep(POLL)
        stuck = [r for r in running if not results[r].ready() and self._alive(r)]
        for rank in stuck:
            _signal(self.pids[rank], signal.SIGKILL)
        # SIGKILL is delivered asynchronously: report the ranks killed once they are gone.
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(self._alive(r) for r in stuck):
            time.sleep(POLL)
        self.killed = stuck
        return running, stuck

    def run(self) -> list[Any]:
        """Run to the end; the per-rank AsyncResults, or :class:`RankRunError`."""
        n = len(self.pids)
        streams = [
            (_LineStream(f"[rank {r}] ", self.stdout), _LineStream(f"[rank {r}] ", self.stderr)) for r in range(n)
        ]
        memory = RankMonitor(self.pids, self.gpu, live=self.plot, interval=SAMPLE_EVERY)
        start = time.monotonic()
        results: list[Any] = []
        failure: RankFailure | None = None
        try:
            memory.start()
            results = [self.submit(rank) for rank in range(n)]
            while True:
                self._emit(results, streams)
                now = time.monotonic()
                memory.sample()
                for rank, ar in enumerate(results):
                    if ar.ready() and not ar.successful():
                        failure = self._failure(rank, ar)
                        break
                    if not ar.ready() and not self._alive(rank):
                        failure = self._death(rank)
                        break
                if failure is None and self.timeout is not None and now - start > self.timeout:
                    late = [r for r, ar in enumerate(results) if not ar.ready()]
                    failure = RankFailure(
                        late[0],
                        "timeout",
                        f"did not finish within --timeout {self.timeout:g} s (still running: {_rank_s(late)})",
                        (f"timed out after {self.timeout:g} s",),
                    )
                if failure is not None or all(ar.ready() for ar in results):
                    break
                # AsyncResults are futures: wake as soon as one finishes, else look again after POLL.
                futures.wait(
                    [ar for ar in results if not ar.ready()], timeout=POLL, return_when=futures.FIRST_COMPLETED
                )
        except KeyboardInterrupt:
            _, killed = self._stop_others(results, None)
            self._drain(results)
            self._emit(results, streams, final=True)
            self.trace = memory.finish(interrupted=True)
            if killed:
                self.stderr.write(
                    f"{_rank_s(killed)} did not stop within {GRACE:g} s of SIGINT and "
                    f"{'was' if len(killed) == 1 else 'were'} killed; "
                    "the cluster must be restarted: %vgpu_cluster restart\n"
                )
            raise
        if failure is not None:
            culprit = None if failure.kind == "timeout" else failure.rank
            interrupted, killed = self._stop_others(results, culprit)
        self._drain(results)
        self._emit(results, streams, final=True)
        self.trace = memory.finish(interrupted=failure is not None)
        if failure is not None:
            raise RankRunError(failure, interrupted, killed, must_restart=bool(killed) or failure.kind == "died")
        return results


def process_alive(pid: int) -> bool:
    """Is ``pid`` running (a zombie, dead but not yet reaped, is not)?"""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(pid: int, sig: int) -> None:
    import os

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
