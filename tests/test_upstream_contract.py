"""The contract between vgpu_magic.ranks.upstream and the installed ipyparallel and ipykernel: each private or
undocumented member it uses, with the shape and behaviour it relies on. A new release that changes one fails here,
by name, rather than in a rank; pyproject.toml's upper bounds are raised once these pass on the new version."""

from __future__ import annotations

import inspect
import logging
import subprocess
import sys
import time
import types
from collections import defaultdict

import pytest

pytest.importorskip("ipyparallel")
pytest.importorskip("ipykernel")

from ipykernel.kernelbase import Kernel
from ipyparallel.client.asyncresult import AsyncResult
from ipyparallel.client.client import Client, Metadata
from ipyparallel.cluster.cluster import Cluster, ClusterManager
from ipyparallel.cluster.launcher import LocalProcessLauncher, SlurmEngineSetLauncher
from ipyparallel.engine.kernel import IPythonParallelKernel
from jupyter_client.session import Session

from vgpu_magic.ranks import upstream


def _params(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def _calls(function, *calls: str) -> None:
    """``function``'s source makes each of ``calls``."""
    source = inspect.getsource(function)
    missing = [call for call in calls if call not in source]
    assert not missing, f"{function.__qualname__} no longer calls {missing}: vgpu_magic.ranks.upstream relies on it"


class ClientShape(types.SimpleNamespace):
    """What ipyparallel's ``Client`` methods under test read of their client, without a controller."""

    def __init__(self) -> None:
        super().__init__(
            session=Session(),
            metadata=defaultdict(Metadata),
            _engines={},
            _futures={},
            _output_futures={},
            debug=False,
            log=logging.getLogger("test_upstream_contract"),
        )
        self.create_message_futures = types.MethodType(Client.create_message_futures, self)

    def iopub(self, msg_id: str, msg_type: str, content: dict, buffers: list | None = None) -> None:
        """An IOPub message of request ``msg_id``, as the client's socket receives it."""
        import zmq

        parent = {"msg_id": msg_id, "session": self.session.session, "msg_type": "execute_request"}
        msg = self.session.msg(msg_type, content=content, parent=parent)
        parts = self.session.serialize(msg)[1:] + list(buffers or [])  # frames after the delimiter...
        Client._dispatch_iopub(self, [zmq.Frame(b"<IDS|MSG>"), *(zmq.Frame(p) for p in parts)])


def _request(client: ClientShape, msg_id: str = "m1") -> list:
    return client.create_message_futures(msg_id, {"msg_type": "execute_request"}, async_result=True)


def test_a_requests_futures_are_made_by_create_message_futures_before_it_is_sent():
    _calls(Client._send, "self.create_message_futures(")
    assert _params(Client.create_message_futures)[:3] == ["self", "msg_id", "header"]


def test_watch_requests_sees_each_iopub_message_of_each_request_as_it_arrives():
    client, seen = ClientShape(), []
    upstream.watch_requests(client, lambda msg_id, future: lambda msg: seen.append((msg_id, future, msg)))
    [future, output] = _request(client)
    client.iopub("m1", "stream", {"name": "stdout", "text": "hi\n"})
    assert [(m, f, msg["content"]["text"]) for m, f, msg in seen] == [("m1", future, "hi\n")]
    assert isinstance(future.iopub_callbacks, list) and client.metadata["m1"]["stdout"] == "hi\n"
    assert future.output is output and not output.done()
    client.iopub("m1", "status", {"execution_state": "idle"})
    assert output.done()  # what run._settled reads of a rank whose reply an interrupt lost


def test_message_futures_are_an_async_results_children():
    client = ClientShape()
    [future, _] = _request(client)
    ar = AsyncResult(client, future)
    assert isinstance(ar._children, list), "AsyncResult._children is gone"
    assert upstream.message_futures(ar) == [future]
    assert upstream.message_futures(types.SimpleNamespace()) == []


def test_a_local_engines_exit_status_is_kept_by_the_wait_that_reaps_it(tmp_path):
    _calls(LocalProcessLauncher.start, "self.process = psutil.Process(", "self._start_waiting()")
    _calls(LocalProcessLauncher._wait, "self.process.wait(")
    launcher = upstream.ExitRecordingEngineLauncher(
        work_dir=str(tmp_path),
        profile_dir=str(tmp_path),
        cluster_id="contract",
        engine_cmd=[sys.executable, "-c", "raise SystemExit(3)"],
        engine_args=[],
        output_file=str(tmp_path / "engine.log"),
    )
    launcher.start()
    deadline = time.monotonic() + 60
    while launcher.process.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launcher.process.exit_code == 3


def test_sbatch_and_scancel_run_through_run_command_and_a_failure_keeps_its_stderr(tmp_path):
    _calls(SlurmEngineSetLauncher.start, "self._run_command(self.args")
    _calls(SlurmEngineSetLauncher.stop, "self._run_command(")
    assert _params(SlurmEngineSetLauncher._run_command) == ["self", "command", "kwargs"]
    launcher = upstream.ReasonedSlurmEngineSetLauncher(
        work_dir=str(tmp_path),
        profile_dir=str(tmp_path),
        cluster_id="contract",
        submit_command=[sys.executable, "-c", "import sys; sys.stderr.write('no such partition'); sys.exit(1)"],
        batch_file_name=str(tmp_path / "job.sbatch"),
    )
    with pytest.raises(subprocess.CalledProcessError) as failed:
        launcher.start(1)
    assert failed.value.stderr == b"no such partition"


def test_a_clusters_stop_callbacks_and_its_managers_key():
    _calls(Cluster.start_controller, "on_stop(self._controller_stopped)")
    _calls(Cluster.start_engines, "partial(self._engines_stopped, engine_set_id)")
    assert _params(Cluster._controller_stopped) == ["self", "stop_data"]
    assert _params(Cluster._engines_stopped) == ["self", "engine_set_id", "stop_data"]
    assert _params(Cluster._is_running) == ["self"]
    cluster = types.SimpleNamespace(profile_dir="/nowhere/profile_default", cluster_id="c1")
    assert ClusterManager._cluster_key(cluster).endswith(":c1")
    _calls(ClusterManager.load_clusters, "self._cluster_key(")


def test_the_kernel_calls_its_handler_hooks_around_each_request_without_arguments():
    _calls(Kernel.dispatch_shell, "self.pre_handler_hook()", "self.post_handler_hook()")
    assert "pre_handler_hook" not in Kernel.class_trait_names()  # an instance attribute replaces it
    for hook in ("pre_handler_hook", "post_handler_hook"):
        assert getattr(IPythonParallelKernel, hook) is getattr(Kernel, hook), f"ipyparallel overrides {hook}"
    kernel = types.SimpleNamespace()
    upstream.set_handler_hooks(kernel, pre := lambda: None, post := lambda: None)
    assert (kernel.pre_handler_hook, kernel.post_handler_hook) == (pre, post)


def test_a_failed_cell_aborts_the_queue_through_abort_queues():
    _calls(Kernel.execute_request, "self._abort_queues(")
    assert callable(Kernel._abort_queues)
    assert "_abort_queues" not in vars(IPythonParallelKernel), "ipyparallel's kernel overrides _abort_queues"
    kernel = types.SimpleNamespace()
    upstream.no_abort_after_an_error(kernel)
    assert kernel._abort_queues("subshell") is None
