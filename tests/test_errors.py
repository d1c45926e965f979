"""The one vocabulary of user mistakes (vgpu_magic.errors): a leaf every layer can raise from, and one
tuple, USER_ERRORS, that every face shows as one line."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

import vgpu_magic.errors as errors
from vgpu_magic.errors import USER_ERRORS


def test_errors_imports_nothing_from_the_package():
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = [
        node.module or "."
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("vgpu_magic"))
    ]
    imported += [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("vgpu_magic")
    ]
    assert imported == []


def test_each_error_is_still_importable_where_it_was_and_is_one_of_the_user_errors():
    from vgpu_magic.frameworks import FrameworkChoiceError, FrameworkImportError
    from vgpu_magic.inventory import NVMLReadError
    from vgpu_magic.ranks import ClusterStartError, UnsendableName

    for error in (FrameworkChoiceError, FrameworkImportError, NVMLReadError, ClusterStartError, UnsendableName):
        assert error in USER_ERRORS and getattr(errors, error.__name__) is error


def _raising(exc):
    def call(*args, **kwargs):
        raise exc

    return call


@pytest.mark.parametrize("error", USER_ERRORS, ids=lambda e: e.__name__)
def test_a_user_error_in_a_cluster_start_is_one_usage_line(ip, monkeypatch, error):
    from vgpu_magic.ranks import RankCluster

    monkeypatch.setattr(RankCluster, "start", _raising(error("the reason, in one line")))
    with pytest.raises(UsageError, match=r"^the reason, in one line$"):
        ip.run_line_magic("vgpu_cluster", "start 2 --framework torch")


@pytest.mark.parametrize("error", USER_ERRORS, ids=lambda e: e.__name__)
def test_a_user_error_in_a_ranks_run_is_one_usage_line(ip, monkeypatch, error):
    from vgpu_magic.ranks import rank_cluster

    running = SimpleNamespace(must_restart=None, run=_raising(error("cannot send 'lock' to the ranks")))
    monkeypatch.setattr(rank_cluster, "current", lambda: running)
    with pytest.raises(UsageError, match=r"^cannot send 'lock' to the ranks$"):
        ip.run_cell_magic("vgpu_run", "--no-plot", "lock")


def test_keras_missing_for_the_monitor_is_said_as_a_frameworks_import_error(ip, monkeypatch):
    monkeypatch.setitem(sys.modules, "keras", None)  # `import keras` raises ModuleNotFoundError
    with pytest.raises(UsageError, match=r"^Keras is not installed in this kernel; pip install keras to monitor fit$"):
        ip.run_line_magic("vgpu_monitor", "on")


def test_help_and_error_texts_take_frameworks_limits_and_defaults_from_the_registry(ip, monkeypatch):
    from vgpu_magic import api, frameworks
    from vgpu_magic.errors import PlanError

    for magic in ("vgpu_status", "vgpu_split"):
        help_text = " ".join(ip.find_line_magic(magic).__doc__.split())
        assert frameworks.choices() in help_text, magic
    assert f"else {frameworks.DEFAULT}" in " ".join(ip.find_line_magic("vgpu_split").__doc__.split())
    monkeypatch.setattr(api, "MAX_DEVICES", 8)
    with pytest.raises(PlanError, match=r"count 1\.5 is not a whole number; use 1\.\.8, e.g. split\(4\)"):
        api.make_request(1.5)
