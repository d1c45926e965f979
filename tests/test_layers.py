"""No module of vgpu_magic imports itself through others: the import graph as import-linter builds it (grimp),
which counts imports inside functions and under ``TYPE_CHECKING``. import-linter's own ``acyclic_siblings``
contract (in ``make lint``) sees circles among the modules of one package, not one between a package's
``__init__`` and a module inside it, which this finds too. The layers themselves are checked by ``make lint``."""

from __future__ import annotations

import sys

import pytest

grimp = pytest.importorskip("grimp")


def circles(package: str) -> list[list[str]]:
    """Each module that reaches itself through its imports, with the shortest way round."""
    graph = grimp.build_graph(package, cache_dir=None)
    found = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                found.append([module, *back])
                break
    return found


def test_vgpu_magic_has_no_import_circle():
    assert circles("vgpu_magic") == []


def test_a_circle_through_a_function_level_or_type_checking_import_is_found(tmp_path, monkeypatch):
    package = tmp_path / "circled"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from . import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (package / "sub" / "__init__.py").write_text("from . import leaf\n")
    (package / "sub" / "leaf.py").write_text("def g():\n    import circled.sub\n")
    (package / "flat.py").write_text("from . import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = {tuple(sorted(set(circle))) for circle in circles("circled")}
    finally:
        sys.modules.pop("circled", None)
    assert found == {("circled.a", "circled.b"), ("circled.sub", "circled.sub.leaf")}
