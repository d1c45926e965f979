"""The suite's own helpers that decide what a run proves: the retries it allows (torch's abort at exit,
pytorch/pytorch#190489) cover only a run whose ranks all finished their work, are counted, and fail the session
above their rate; a reference run is read back only where everything it depends on is the same."""

from __future__ import annotations

from unittest import mock

import pytest

import support
from support import TORCH_EXIT_ABORT, again_after_torchs_exit_abort, reference_run


def aborting_run(
    folder, writes: list[str], aborts: int, said: str = f"rank 1 was killed by SIGABRT\n{TORCH_EXIT_ABORT}"
):
    """A run that writes ``writes`` in ``folder``, then aborts at exit saying ``said``, its first ``aborts`` times."""
    calls = []

    def run() -> str:
        calls.append(sorted(p.name for p in folder.iterdir()))
        for name in writes:
            (folder / name).write_text(str(len(calls)))
        if len(calls) <= aborts:
            raise RuntimeError(said)
        return "done"

    return run, calls


@pytest.fixture
def counts():
    with mock.patch.dict(support.EXIT_ABORTS, {"runs": 0, "again": 0}):
        yield support.EXIT_ABORTS


@pytest.mark.parametrize(
    "said",
    [
        f"rank 1 was killed by SIGABRT\n{TORCH_EXIT_ABORT}",
        "rank 1 was killed by SIGABRT as it exited, after its script ended",
    ],
    ids=["its-last-line", "our-words"],
)
def test_an_abort_after_every_rank_wrote_its_result_runs_again_from_the_folder_as_it_was(tmp_path, counts, said):
    (tmp_path / "snapshot").write_text("before")
    run, calls = aborting_run(tmp_path, ["out.0", "out.1"], aborts=1, said=said)
    results = [tmp_path / "out.0", tmp_path / "out.1"]
    assert again_after_torchs_exit_abort(run, str, tmp_path, results) == "done"
    assert calls == [["snapshot"], ["snapshot"]]
    assert counts == {"runs": 1, "again": 1}


@pytest.mark.parametrize("writes", [["out.0"], []], ids=["one-rank-unfinished", "none-finished"])
def test_an_abort_before_a_rank_finished_fails_as_it_is(tmp_path, counts, writes):
    run, calls = aborting_run(tmp_path, writes, aborts=1)
    with pytest.raises(RuntimeError, match="SIGABRT"):
        again_after_torchs_exit_abort(run, str, tmp_path, [tmp_path / "out.0", tmp_path / "out.1"])
    assert len(calls) == 1 and counts == {"runs": 1, "again": 0}


def test_a_result_left_by_an_earlier_run_does_not_count_as_finished(tmp_path, counts):
    (tmp_path / "out.0").write_text("earlier")
    (tmp_path / "out.1").write_text("earlier")
    run, calls = aborting_run(tmp_path, ["out.0"], aborts=1)
    with pytest.raises(RuntimeError, match="SIGABRT"):
        again_after_torchs_exit_abort(run, str, tmp_path, [tmp_path / "out.0", tmp_path / "out.1"])
    assert len(calls) == 1


def test_the_abort_on_every_try_fails(tmp_path, counts):
    tries = support.EXIT_ABORT_RETRIES + 1
    run, calls = aborting_run(tmp_path, ["out.0", "out.1"], aborts=tries)
    with pytest.raises(RuntimeError, match="SIGABRT"):
        again_after_torchs_exit_abort(run, str, tmp_path, [tmp_path / "out.0", tmp_path / "out.1"])
    assert len(calls) == tries and counts == {"runs": 1, "again": tries - 1}


def test_each_try_again_starts_from_the_folder_as_it_was_and_is_counted(tmp_path, counts):
    (tmp_path / "snapshot").write_text("before")
    run, calls = aborting_run(tmp_path, ["out.0", "out.1"], aborts=support.EXIT_ABORT_RETRIES)
    assert again_after_torchs_exit_abort(run, str, tmp_path, [tmp_path / "out.0", tmp_path / "out.1"]) == "done"
    assert calls == [["snapshot"]] * (support.EXIT_ABORT_RETRIES + 1)
    assert counts == {"runs": 1, "again": support.EXIT_ABORT_RETRIES}


@pytest.mark.parametrize(
    ("runs", "again", "too_many"),
    [(19, 2, False), (19, 6, False), (19, 7, True), (3, 2, False), (3, 3, True), (30, 10, False), (30, 11, True)],
)
def test_more_than_a_third_of_the_runs_again_fails_the_session(counts, runs, again, too_many):
    counts.update(runs=runs, again=again)
    assert support.too_many_exit_aborts() is too_many


@pytest.fixture
def references(tmp_path, monkeypatch):
    monkeypatch.setattr(support, "REFERENCES", tmp_path / "references")
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.py").write_text("print('hi')")
    runs = []

    def run() -> None:
        runs.append(1)
        (folder / "weights.0").write_text(f"run {len(runs)}")
        (folder / "train.py").write_text("edited by the run")

    def reference(inputs=("torch 2.14.1",), env=None) -> str:
        reference_run(run, folder, list(inputs), env or {})
        return (folder / "weights.0").read_text()

    return folder, runs, reference


def test_a_reference_is_read_back_as_the_run_left_its_folder(references):
    folder, runs, reference = references
    assert reference() == "run 1"
    (folder / "weights.0").unlink()
    (folder / "train.py").write_text("print('hi')")
    assert reference() == "run 1" and len(runs) == 1
    assert (folder / "train.py").read_text() == "edited by the run"


@pytest.mark.parametrize(
    "change",
    [
        {"inputs": ("torch 2.13.0",)},
        {"env": {"ATEN_CPU_CAPABILITY": "default"}},
        {"env": {"TF_ENABLE_ONEDNN_OPTS": "0"}},
        {"folder": "print('changed')"},
        {"fresh": True},
    ],
    ids=["version", "torch-kernels", "onednn", "folder", "fidelity-tier"],
)
def test_a_reference_runs_again_where_what_it_depends_on_changed(references, monkeypatch, change):
    folder, _, reference = references
    reference()
    # The folder as it was before the first run, but for the change.
    (folder / "weights.0").unlink()
    (folder / "train.py").write_text(change.get("folder", "print('hi')"))
    monkeypatch.setattr(support, "FRESH_REFERENCES", change.get("fresh", False))
    assert reference(change.get("inputs", ("torch 2.14.1",)), change.get("env")) == "run 2"
