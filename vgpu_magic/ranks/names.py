"""Which notebook names a cell reads (:func:`names_to_send`) and binds (:func:`names_written`: rank state), and how
:class:`RankNames` sends them to the ranks, each cloudpickled on its own."""

from __future__ import annotations

import ast
import builtins
from typing import Any

from ..errors import UnsendableName

__all__ = ["RankNames", "UnsendableName", "names_to_send", "names_written", "pull_values", "split_last_expression"]


#: Names IPython puts in every namespace; never sent.
_SHELL_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


class _ReadsBeforeWrites(ast.NodeVisitor):
    """Names read before written (``written``: on every path so far; ``bound``: anywhere); nested scopes apart."""

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

    def _inner(self, local: set[str], parts: list[Any], walrus_from: Any = None) -> None:
        """Reads of a nested scope (``local`` bound in it) from this one; ``walrus_from``: its ``:=`` bind here."""
        inner = _ReadsBeforeWrites(self.written | local)
        for part in parts:
            inner.visit(part)
        for name in inner.read:
            self._load(name)
        for sub in ast.walk(walrus_from) if walrus_from is not None else ():
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
        # Load, and Del: `del name` needs the name to exist.
        (self._store if isinstance(node.ctx, ast.Store) else self._load)(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign | ast.NamedExpr) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.visit(node.target)

    visit_NamedExpr = visit_AnnAssign

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._load(node.target.id)
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

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:  # `import a.b` binds a; `from a import b` binds b, a name without dots
            self._store(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import

    def _comprehension(self, node: Any) -> None:
        first, *rest = node.generators
        # The first iterable is evaluated in the enclosing scope; everything else in the comprehension's own.
        self.visit(first.iter)
        local = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        parts: list[Any] = [*first.ifs]
        for generator in rest:
            parts.extend([generator.iter, *generator.ifs])
        parts.extend([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt])
        self._inner(local, parts, walrus_from=node)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def _parameters(self, args: ast.arguments) -> set[str]:
        """Visit the defaults (evaluated in this scope); the parameters (bound in the body's)."""
        for default in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(default)
        return {a.arg for a in ast.walk(args) if isinstance(a, ast.arg)}

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inner(self._parameters(node.args), [node.body], walrus_from=node)

    def _definition(self, node: Any) -> None:
        for decorator in node.decorator_list:
            self.visit(decorator)
        for base in node.bases if isinstance(node, ast.ClassDef) else ():
            self.visit(base)
        local = set() if isinstance(node, ast.ClassDef) else self._parameters(node.args)
        self._store(node.name)
        # The body runs later, when it is called; its free names are read then.
        self._inner(local, node.body)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _definition


def names_to_send(code: str, namespace: dict[str, Any], on_ranks: set[str] = frozenset()) -> list[str]:
    """The notebook names ``code`` reads before assigning, held in ``namespace``, but those ``on_ranks``."""
    return [
        name
        for name in _visited(code).read
        if name in namespace
        and name not in on_ranks
        and not name.startswith("_")
        and name not in _SHELL_NAMES
        and not (hasattr(builtins, name) and namespace[name] is getattr(builtins, name))
    ]


def names_written(code: str) -> set[str]:
    """The names ``code`` may bind at its top level, on any path (not comprehension variables)."""
    return _visited(code).bound


def _visited(code: str) -> _ReadsBeforeWrites:
    visitor = _ReadsBeforeWrites()
    visitor.visit(ast.parse(code))
    return visitor


def pack_names(namespace: dict[str, Any], names: list[str]) -> dict[str, bytes]:
    """Each named value cloudpickled on its own (a rank can say which it cannot unpickle); else UnsendableName."""
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
    """``code`` with its last statement, if an expression, assigned to ``target`` (else ``target = None``)."""
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else ast.Expr(ast.Constant(None))
    tree.body.append(ast.Assign(targets=[ast.Name(id=target, ctx=ast.Store())], value=last.value))
    return ast.unparse(ast.fix_missing_locations(tree))


#: Run on the ranks: bind each pushed name, stopping at the first that cannot be unpickled there.
_UNPACK_NAMES = """
import cloudpickle as _vgpu_cp
_vgpu_failed = None
for _vgpu_name, _vgpu_blob in _vgpu_names.items():
    try:
        globals()[_vgpu_name] = _vgpu_cp.loads(_vgpu_blob)
    except Exception as _vgpu_error:
        _vgpu_first = str(_vgpu_error).splitlines()[0] if str(_vgpu_error) else ""
        _vgpu_failed = (_vgpu_name, f"{type(_vgpu_error).__name__}: {_vgpu_first}".rstrip(": "))
        break
del _vgpu_cp, _vgpu_names
"""

#: Run on the ranks: can the cell's last value be pickled back to the kernel?
_CHECK_OUT = """
import pickle as _vgpu_pickle
_vgpu_out_failed = None
try:
    _vgpu_pickle.dumps(_vgpu_out)
except Exception as _vgpu_error:
    _vgpu_out_failed = (type(_vgpu_out).__name__, f"{type(_vgpu_error).__name__}: {_vgpu_error}")
del _vgpu_pickle
"""


def _first_failure(view: Any, code: str, variable: str) -> tuple[int, Any] | None:
    """Run ``code`` on every rank of ``view``: ``(rank, value)`` of the first whose ``variable`` it set, or ``None``."""
    view.execute(code, block=True)
    return next(((rank, failed) for rank, failed in enumerate(view.pull(variable, block=True)) if failed), None)


def pull_values(view: Any) -> list[Any]:
    """Each rank's ``_vgpu_out``, in the order of ``view``'s ranks; UnsendableName if one cannot come back."""
    failure = _first_failure(view, _CHECK_OUT, "_vgpu_out_failed")
    if failure:
        rank, (kind, reason) = failure
        raise UnsendableName(
            f"the cell's last value on rank {rank} ({kind}) cannot be sent back to the notebook: {reason}; "
            "end the cell with plain values (numbers, lists, arrays), e.g. list(...) of a generator"
        )
    return view.pull("_vgpu_out", block=True)


class RankNames:
    """The names cells assigned on the ranks: rank state, never overwritten from the notebook."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def send(self, view: Any, code: str, namespace: dict[str, Any]) -> None:
        """Bind the names ``code`` reads from ``namespace`` on the ranks of ``view``, by value, except rank state."""
        to_send = names_to_send(code, namespace, self.names)
        if not to_send:
            return
        view.push({"_vgpu_names": pack_names(namespace, to_send)}, block=True)
        failure = _first_failure(view, _UNPACK_NAMES, "_vgpu_failed")
        if failure:
            rank, (name, reason) = failure
            raise UnsendableName(
                f"cannot send {name!r} ({type(namespace[name]).__name__}) to the ranks: rank {rank} cannot "
                f"unpickle it ({reason}); make it importable on the ranks, or create it inside the cell"
            )

    def settle(self, view: Any, candidates: set[str]) -> None:
        """Rank state: its names and ``candidates`` that exist on the ranks (one deleted is the notebook's again)."""
        from ipyparallel.error import IPythonError

        asked = sorted(self.names | candidates)
        if not asked:
            return
        try:
            view.execute(f"_vgpu_present = [n for n in {asked!r} if n in globals()]", block=True)
            present = view.pull("_vgpu_present", block=True)
        except (IPythonError, OSError, TimeoutError):
            # A rank that cannot answer (it died): every candidate stays rank state, the safe side.
            self.names |= candidates
            return
        self.names = set().union(*map(set, present))
