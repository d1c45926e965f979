"""Ranks on two hosts, started by ipyparallel's SSH launcher: this host and a
second one in a network namespace of its own (the session's ``two_hosts``
fixture, :mod:`hosts`), each with an sshd. The collectives cross the hosts,
and the wiring carries the hosts' real addresses, never ``localhost``:
``MASTER_ADDR`` is rank 0's, ``TF_CONFIG`` lists each worker at its own host,
JAX's coordinator runs on rank 0's host. Afterwards no process is left on
either host, nor the cluster's folder. Skipped with the reason where the
hosts cannot be made (not root on Linux, no iproute2/openssh-server)."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest

from support import TF_ALL_REDUCE, left_running, no_warm_spares, our_processes, processes_of, without_kept_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: Seconds a cell may run on the ranks (a collective that cannot connect fails instead of hanging).
RUN_TIMEOUT = 120


@contextlib.contextmanager
def ranks_on_two_hosts(two_hosts, framework: str, spares: bool = False, **options):
    """Rank 0 on this host, rank 1 on the second, started over SSH, with warm spares where ``spares`` (no test here
    runs a script); afterwards nothing left."""
    from vgpu_magic.ranks import RankCluster

    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    if os.environ.get("PYTHONPATH"):
        # The engines import vgpu_magic from the same tree as this test run.
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    launcher_options = {
        "hosts": [two_hosts.first.target, two_hosts.second.target],
        "ssh_args": two_hosts.ssh_args,
        "environment": env,
    }
    before = our_processes()
    ranks = RankCluster(2, framework, launcher="ssh", launcher_options=launcher_options, join=True, **options)
    with contextlib.nullcontext() if spares else no_warm_spares():
        ranks.start()
    cluster_id = ranks.cluster_id
    try:
        yield ranks
    finally:
        ranks.stop()
    deadline = time.monotonic() + 20
    while (processes_of(cluster_id) or our_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(cluster_id) == []
    assert our_processes() <= before
    for host in (two_hosts.first, two_hosts.second):
        assert two_hosts.ssh(host, f"ls -d /tmp/vgpu_magic-{cluster_id} 2>/dev/null || echo gone").strip() == "gone"


def quiet_run(ranks, code: str):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return ranks.run(code, output=True, timeout=RUN_TIMEOUT)


@pytest.fixture(scope="class")
def torch_ranks(two_hosts):
    """One torch cluster across the hosts for a class's tests; stopped after them. The one with warm spares: that
    none is left on either host is checked at its stop."""
    with ranks_on_two_hosts(two_hosts, "torch", spares=True) as ranks:
        yield ranks


class TestTorchOnTwoHosts:
    """The torch tests share one cluster: the second breaks it last."""

    def test_torch_ddp_across_two_hosts(self, two_hosts, torch_ranks):
        """One engine per host, each started over SSH on its host and reaching the controller;
        status names each rank's host; a gloo all-reduce crosses the hosts, wired with
        rank 0's host's real address."""
        lines = torch_ranks.describe()
        found = quiet_run(
            torch_ranks,
            "import os, socket, torch, torch.distributed as dist\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "(dist.get_rank(), socket.gethostname(), os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], t.item())",
        )
        hosts = [f[1] for f in found]
        assert sorted(hosts) == sorted([two_hosts.first.hostname, two_hosts.second.hostname])
        assert "ipyparallel engines started over SSH" in lines[0]
        for rank, host in enumerate(hosts):
            assert any(line.startswith(f"  rank {rank}: pid ") and f" on {host}, alive" in line for line in lines), (
                lines
            )
        leader = two_hosts.host(hosts[0])
        # MASTER_ADDR is rank 0's host's real address on both; each rank is local rank 0 on its host.
        assert [(f[0], f[2], f[3], f[4]) for f in found] == [
            (0, leader.address, "0", 3.0),
            (1, leader.address, "0", 3.0),
        ]

    def test_a_launched_script_has_the_ssh_variables_ssh_gives_a_command(self, two_hosts, torch_ranks, tmp_path):
        """Issue 46: what the engine's own launch gave it reaches a script it launches on every host: on the
        kernel's host too, where the launch starts from the kernel's environment (``SSH_*`` were lost there). The
        names are those ``ssh HOST env`` gives a command on that host."""
        import json
        import socket

        script = tmp_path / "dump.py"
        script.write_text(
            "import json, os, socket\n"
            "given = sorted(k for k in os.environ if k.startswith('SSH_'))\n"
            f"json.dump(given, open(os.path.join({str(tmp_path)!r}, socket.gethostname() + '.json'), 'w'))\n"
        )
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch_ranks.run_script(str(script), timeout=RUN_TIMEOUT)
        for host in (two_hosts.first, two_hosts.second):
            by_ssh = sorted(
                line.split("=")[0] for line in two_hosts.ssh(host, "env").splitlines() if line[:4] == "SSH_"
            )
            assert json.loads((tmp_path / f"{host.hostname}.json").read_text()) == by_ssh and by_ssh
        assert two_hosts.first.hostname == socket.gethostname()

    def test_a_hang_across_two_hosts_is_reported_with_each_ranks_line(self, two_hosts, torch_ranks, tmp_path):
        """Issue 42: the hang doctor asked only the ranks on the kernel's host (Unix sockets), so a rank on another
        host read as "not answering". Its engine relays the ask over TCP: the rank there is named with its line."""
        from vgpu_magic.ranks.run import RankRunError

        script = tmp_path / "hang.py"
        script.write_text(
            "import socket, time\nimport torch, torch.distributed as dist\ndist.init_process_group()\n"
            "t = torch.ones(16)\ndist.all_reduce(t)\n"
            f"if socket.gethostname() != {two_hosts.second.hostname!r}:\n    dist.all_reduce(t)\ntime.sleep(60)\n"
        )
        there = quiet_run(torch_ranks, "import socket\nsocket.gethostname()").index(two_hosts.second.hostname)
        err = io.StringIO()
        quiet = contextlib.redirect_stdout(io.StringIO())
        with pytest.raises(RankRunError) as info, quiet, contextlib.redirect_stderr(err):
            torch_ranks.run_script(str(script), hang_after=3, timeout=30)
        said = (
            f"rank {there} never called all_reduce #2 that rank {1 - there} waits in (hang.py:7); "
            f"rank {there} is at hang.py:8, idle"
        )
        assert said in err.getvalue(), err.getvalue()
        assert f"rank {there} was idle, at hang.py:8" in info.value.headline(), info.value.headline()
        assert quiet_run(torch_ranks, "'back'") == ["back", "back"]

    def test_a_rank_on_the_second_host_is_interrupted_and_reported_through_its_engine(self, two_hosts, torch_ranks):
        """The second host has process IDs of its own, as a real one has: the PID its rank reports names
        nothing (or another process) here. The fault policy reaches that rank through its engine: a
        timeout interrupts it (through the engine's nanny) and it comes back, so the cluster stays usable;
        when it dies, the run says so at once, naming its host."""
        import socket

        from vgpu_magic.ranks.run import RankRunError

        hosts = quiet_run(torch_ranks, "import socket\nsocket.gethostname()")
        there = hosts.index(two_hosts.second.hostname)
        assert hosts[1 - there] == socket.gethostname()
        with pytest.raises(RankRunError) as info, contextlib.redirect_stderr(io.StringIO()):
            torch_ranks.run("import time\ntime.sleep(60)", timeout=3)
        assert info.value.failure.kind == "timeout"
        assert sorted(info.value.interrupted) == [0, 1] and info.value.killed == []
        assert quiet_run(torch_ranks, "'back'") == ["back", "back"]

        pid = torch_ranks.pids[there]
        with pytest.raises(RankRunError) as info, contextlib.redirect_stderr(io.StringIO()):
            # Within RUN_TIMEOUT, or the failure would be a timeout: the nanny tells the controller at once.
            torch_ranks.run(
                f"import os, socket, time\nif socket.gethostname() == {hosts[there]!r}:\n"
                "    os._exit(3)\ntime.sleep(60)",
                timeout=RUN_TIMEOUT,
            )
        failure = info.value.failure
        assert (failure.rank, failure.kind) == (there, "died")
        assert (
            without_kept_log(failure.summary)
            == f"died (exit status unknown) (pid {pid} on {two_hosts.second.hostname})"
        )
        assert torch_ranks.must_restart


def test_tensorflow_multiworker_across_two_hosts(two_hosts):
    with ranks_on_two_hosts(two_hosts, "tensorflow") as ranks:
        found = quiet_run(
            ranks,
            "import json, os, socket\n"
            + TF_ALL_REDUCE
            + "(task, socket.gethostname(), json.loads(os.environ['TF_CONFIG'])['cluster']['worker'], float(total))",
        )
    # Each worker is listed at its own host's real address, in rank order, the same list on both.
    workers = [w.rsplit(":", 1)[0] for w in found[0][2]]
    assert workers == [two_hosts.host(f[1]).address for f in found]
    assert found[0][2] == found[1][2]
    assert [(f[0], f[3]) for f in found] == [(0, 3.0), (1, 3.0)]
    assert {f[1] for f in found} == {two_hosts.first.hostname, two_hosts.second.hostname}


def test_jax_distributed_across_two_hosts(two_hosts):
    with ranks_on_two_hosts(two_hosts, "jax") as ranks:
        found = quiet_run(
            ranks,
            "import socket, jax, jax.numpy as jnp\nfrom jax.experimental import multihost_utils\n"
            "from jax._src import distributed\n"
            "gathered = multihost_utils.process_allgather(jnp.array([jax.process_index() + 10]))\n"
            "(jax.process_index(), socket.gethostname(), distributed.global_state.coordinator_address, "
            "gathered.ravel().tolist())",
        )
    leader = two_hosts.host(found[0][1])
    # The coordinator runs on rank 0's host, at its real address.
    assert [f[2].rsplit(":", 1)[0] for f in found] == [leader.address, leader.address]
    assert [(f[0], f[3]) for f in found] == [(0, [10, 11]), (1, [10, 11])]
    assert {f[1] for f in found} == {two_hosts.first.hostname, two_hosts.second.hostname}


def test_a_host_that_refuses_the_key_is_named_with_sshs_own_reason(two_hosts, tmp_path):
    """Issue 25, row 2: a start that fails says why in one line, in ssh's words (here: authentication)."""
    import subprocess

    from vgpu_magic.ranks import ClusterStartError, RankCluster

    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
    key = str(two_hosts.folder / "id_ed25519")
    options = {
        "hosts": [two_hosts.second.target],
        "ssh_args": [str(stranger) if a == key else a for a in two_hosts.ssh_args],
    }
    before = our_processes()
    with pytest.raises(ClusterStartError) as info:
        RankCluster(1, "torch", launcher="ssh", launcher_options=options).start()
    assert without_kept_log(str(info.value)) == (
        f"the ranks could not start: root@{two_hosts.second.address}: Permission denied (publickey); "
        "nothing was left running"
    )
    assert left_running(before) == []
