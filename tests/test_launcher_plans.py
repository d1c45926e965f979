"""The launcher plans (``--launcher local|mpi|slurm|ssh``) as data: what each
launcher accepts, its one-line refusals before anything starts, the batch
script ipyparallel writes for SLURM with the user's options, and the SSH
engines per host; and a launcher added as one class, starting real ranks
(the real SLURM and the second host are in ``test_launcher_slurm.py`` and
``test_launcher_ssh.py``)."""

from __future__ import annotations

import shutil
from typing import ClassVar

import pytest
from IPython.core.error import UsageError

from support import refused_changing_nothing
from vgpu_magic.ranks.hosts import route_address, ssh_target
from vgpu_magic.ranks.launchers import plan_launcher


@pytest.fixture
def slurm_on_path(monkeypatch):
    """``sbatch`` and friends on PATH, whether or not this machine has SLURM."""
    real = shutil.which
    monkeypatch.setattr(
        shutil,
        "which",
        lambda name, *a, **k: (
            f"/usr/bin/{name}" if name in {"sbatch", "srun", "scancel", "squeue"} else real(name, *a, **k)
        ),
    )


def batch_script(plan, tmp_path, n=2) -> str:
    """The script the plan's engine launcher (ipyparallel's SlurmEngineSetLauncher) writes from its configuration."""
    from traitlets.config import Config
    from traitlets.utils.importstring import import_item

    launcher = import_item(plan.engines)(
        work_dir=str(tmp_path), config=Config(plan.config), profile_dir=str(tmp_path), cluster_id="c1"
    )
    launcher.write_batch_script(n)
    return (tmp_path / "slurm_engine.sbatch").read_text()


def test_slurm_options_become_sbatch_lines_around_ipyparallels_srun(slurm_on_path, tmp_path):
    plan = plan_launcher(
        "slurm",
        2,
        {
            "partition": "gpu",
            "account": "proj1",
            "time": "01:00:00",
            "sbatch": ["--mem=4G", "#SBATCH --gres=gpu:1"],
            "srun": ["--cpu-bind=none"],
            "environment": {"NCCL_DEBUG": "INFO {x}"},
        },
    )
    script = batch_script(plan, tmp_path)
    lines = script.splitlines()
    for line in (
        "#SBATCH --export=ALL",
        "#SBATCH --ntasks=2",
        "#SBATCH --job-name=ipengine-c1",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj1",
        "#SBATCH --time=01:00:00",
        "#SBATCH --mem=4G",
        "#SBATCH --gres=gpu:1",
    ):
        assert line in lines
    # The job gets sbatch's environment (--export=ALL): ipyparallel runs sbatch with the launcher's.
    assert plan.config["SlurmEngineSetLauncher"]["environment"] == {"NCCL_DEBUG": "INFO {x}"}
    assert lines[-1].startswith("srun --cpu-bind=none ") and "ipyparallel.engine" in lines[-1]
    # The engines are told to reach the controller by this host's name; it listens on every interface.
    assert plan.controller_ip == "*" and plan.controller_location
    assert plan.description == "ipyparallel engines in one SLURM job (sbatch + srun)"


def test_without_options_the_script_is_ipyparallels_own(slurm_on_path, tmp_path):
    script = batch_script(plan_launcher("slurm", 3), tmp_path, n=3)
    sbatch = sorted(line for line in script.splitlines() if line.startswith("#SBATCH"))
    assert sbatch[:3] == ["#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-c1", "#SBATCH --ntasks=3"]
    assert len(sbatch) == 4 and sbatch[3].startswith("#SBATCH --output=")
    assert script.splitlines()[-1].startswith("srun ") and "ipyparallel.engine" in script


def test_ssh_hosts_are_spread_in_blocks_with_their_own_ports():
    plan = plan_launcher("ssh", 3, {"hosts": ["root@127.0.0.1:2222", "127.0.0.1"], "ssh_args": ["-i", "key"]}, "c9")
    engines = plan.config["SSHEngineSetLauncher"]["engines"]
    assert engines == {
        "root@127.0.0.1": {"n": 2, "ssh_args": ["-i", "key", "-p", "2222"], "scp_args": ["-i", "key", "-P", "2222"]},
        "127.0.0.1": {"n": 1, "ssh_args": ["-i", "key"], "scp_args": ["-i", "key"]},
    }
    assert plan.ssh_hosts == (("root@127.0.0.1", ("-i", "key", "-p", "2222")), ("127.0.0.1", ("-i", "key")))
    assert plan.config["SSHEngineSetLauncher"]["remote_profile_dir"] == "/tmp/vgpu_magic-c9"
    # This host's address on the route to the first host (here: loopback to loopback).
    assert (plan.controller_ip, plan.controller_location) == ("*", "127.0.0.1")


def test_ssh_host_counts_and_the_engines_environment():
    from vgpu_magic.ranks.spec import ClusterSpec

    options = {"hosts": {"127.0.0.1": 3}, "python": "/opt/py/bin/python", "environment": {"A": "1"}}
    plan = plan_launcher("ssh", 3, options)
    # The options as a spec holds them (read-only mappings) plan the same: a spec can start its cluster again.
    assert plan == plan_launcher(
        "ssh", 3, ClusterSpec(3, "jax", launcher="ssh", launcher_options=options).launcher_options
    )
    assert plan.config["SSHEngineSetLauncher"]["engines"]["127.0.0.1"]["n"] == 3
    assert plan.config["SSHEngineSetLauncher"]["engine_cmd"] == [
        "env",
        "A=1",
        "/opt/py/bin/python",
        "-m",
        "ipyparallel.engine",
    ]
    assert ssh_target("me@node:22") == ("me@node", "22") and ssh_target("node") == ("node", None)
    assert route_address("someone@127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize(
    ("name", "n", "options", "match"),
    [
        ("pbs", 2, {}, "launcher 'pbs' is not supported; use local, mpi, slurm, ssh"),
        ("local", 2, {"hosts": ["a"]}, "the local launcher has no option 'hosts'; it takes: none"),
        ("slurm", 2, {"queue": "x"}, "the slurm launcher has no option 'queue'; it takes: partition, account"),
        ("slurm", 2, {"partition": "a b"}, "slurm partition='a b' is not one word; e.g. --partition=gpu"),
        ("slurm", 2, {"sbatch": ["mem=4G"]}, "sbatch line 'mem=4G' is neither '#SBATCH ...' nor an option"),
        ("slurm", 2, {"sbatch": ["--ntasks=8"]}, "sets what the launcher sets itself"),
        ("slurm", 2, {"srun": [1]}, "srun \\[1\\] must be a list of strings"),
        ("ssh", 2, {}, "the ssh launcher needs hosts, e.g. --hosts node1,node2"),
        # Only separators: no host (a division by the hosts' number failed before).
        ("ssh", 2, {"hosts": ","}, "the ssh launcher needs hosts, e.g. --hosts node1,node2"),
        ("ssh", 2, {"hosts": [" "]}, "the ssh launcher needs hosts, e.g. --hosts node1,node2"),
        ("ssh", 2, {"hosts": 3}, "the ssh launcher needs hosts, e.g. --hosts node1,node2"),
        ("ssh", 1, {"hosts": ["a", "b"]}, "2 hosts for 1 rank; give at most 1 or start more ranks"),
        ("ssh", 2, {"hosts": ["a", "a"]}, "names a host twice"),
        ("ssh", 2, {"hosts": {"a": 1}}, "hold 1 ranks, not 2; make the counts add up to 2"),
        ("ssh", 2, {"hosts": {"a": 0, "b": 2}}, "needs a positive rank count"),
        ("ssh", 1, {"hosts": ["no-such-host.invalid"]}, "ssh host 'no-such-host.invalid' does not resolve"),
        ("ssh", 1, {"hosts": ["a"], "environment": {"1A": "x"}, "controller_address": "10.0.0.1"}, "environment"),
    ],
)
def test_refusals_say_what_would_work(slurm_on_path, name, n, options, match):
    with pytest.raises(ValueError, match=match):
        plan_launcher(name, n, options)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_launcher_is_one_class_that_starts_real_ranks(monkeypatch, tmp_path, capsys):
    """Issue 41: one class is a launcher: found by its name, its options checked, its engines started by
    ``subprocess`` (in reverse), numbered by a variable of its own that a script run keeps, and all stopped."""
    import os
    import subprocess
    import sys
    from dataclasses import dataclass

    from support import left_running, our_processes
    from vgpu_magic.layout import LaunchedAs
    from vgpu_magic.ranks import RankCluster, launchers, lifetime

    monkeypatch.setattr(launchers, "LAUNCHERS", dict(launchers.LAUNCHERS))

    @dataclass
    class SpawnLauncher(launchers.Launcher):
        name, description = "spawn", "engines started by subprocess"
        options: ClassVar = {"python": None}
        task_variables = ("SPAWN_",)
        python: str = sys.executable

        @classmethod
        def plan(cls, n, options, cluster_id):
            return cls(python=options.get("python", sys.executable))

        @classmethod
        def launched(cls, variables):
            return LaunchedAs(int(variables["SPAWN_RANK"]))

        def start(self, n):
            self.cluster.start_controller_sync()
            where = {"IPP_CLUSTER_ID": self.cluster.cluster_id, "IPP_PROFILE_DIR": self.cluster.profile_dir}
            self.spawned = [
                subprocess.Popen(
                    [self.python, *lifetime.watched_command("ipyparallel.engine")[1:]],
                    env={**os.environ, **self.marks, **where, "SPAWN_RANK": str(rank)},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for rank in reversed(range(n))
            ]

    assert list(launchers.LAUNCHERS) == ["local", "mpi", "slurm", "ssh", "spawn"]
    with pytest.raises(ValueError, match=r"^the spawn launcher has no option 'hosts'; it takes: python$"):
        RankCluster(2, "torch", launcher="spawn", launcher_options={"hosts": ["a"]})
    (tmp_path / "where.py").write_text("import os\nprint('rank', os.environ['RANK'], os.environ['SPAWN_RANK'])\n")
    before = our_processes()
    ranks = RankCluster(2, "torch", launcher="spawn", spares=False)
    try:
        ranks.start()
        assert type(ranks.launcher) is SpawnLauncher and "ranks on engines started by subprocess" in ranks.describe()[0]
        # Rank r is the engine the launcher numbered r: the one it started (n - 1 - r)th.
        assert ranks.pids == [proc.pid for proc in reversed(ranks.launcher.spawned)]
        assert ranks.run("import os\n(os.environ['RANK'], os.environ['SPAWN_RANK'])", output=True) == [
            ("0", "0"),
            ("1", "1"),
        ]
        capsys.readouterr()
        ranks.run_script(str(tmp_path / "where.py"), timeout=120)
        said = capsys.readouterr().out
        assert "[rank 0] rank 0 0" in said and "[rank 1] rank 1 1" in said, said
    finally:
        ranks.stop()
    assert not left_running(before)


def test_the_magics_help_has_each_launchers_flags_in_its_own_group(shell):
    from vgpu_magic.ranks.launchers import LAUNCHERS

    help_text = shell.find_line_magic("vgpu_cluster").__doc__
    groups = dict(part.split(":\n", 1) for part in help_text.split("\n\n--launcher ")[1:])
    assert list(groups) == ["slurm", "ssh"]
    for launcher in LAUNCHERS.values():
        for key, flag in launcher.options.items():
            # Each flag in one group, a shared one in the first launcher's, saying which launchers take it.
            assert (flag is not None) == (f"--{key.replace('_', '-')}" in help_text), key
    assert "--partition" in groups["slurm"] and "--hosts" in groups["ssh"]
    assert "--controller-address" in groups["slurm"] and "(slurm or ssh)" in " ".join(groups["slurm"].split())


def test_slurm_without_sbatch_says_where_to_run(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(ValueError, match="the slurm launcher needs sbatch on PATH"):
        plan_launcher("slurm", 2)


@pytest.fixture(scope="module")
def shell():
    from IPython.testing.globalipapp import get_ipython

    from vgpu_magic.ranks.magics import ClusterMagics

    ip = get_ipython()
    ip.register_magics(ClusterMagics)
    return ip


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("start 2 --framework torch --launcher ssh", "the ssh launcher needs hosts"),
        ("start 2 --framework torch --partition gpu", "--partition goes with --launcher slurm, not local"),
        ("start 2 --framework torch --launcher ssh --hosts a --time 5", "--time goes with --launcher slurm, not ssh"),
        (
            "start 2 --framework torch --launcher mpi --controller-address x",
            "--controller-address goes with --launcher slurm or ssh",
        ),
        ("status --hosts a,b", "'--hosts' only goes with start"),
    ],
)
def test_bad_launcher_lines_change_nothing(shell, line, match):
    refused_changing_nothing(shell, "vgpu_cluster", line, match)


def test_the_magic_passes_the_launcher_flags_through(shell, monkeypatch, slurm_on_path):
    from vgpu_magic.ranks import rank_cluster

    seen = {}

    def record(self):
        seen.update(launcher=self.spec.launcher, options=self.spec.launcher_options, plan=self.launcher)
        raise rank_cluster.ClusterStartError("recorded")

    monkeypatch.setattr(rank_cluster.RankCluster, "start", record)
    with pytest.raises(UsageError, match="recorded"):
        shell.run_line_magic(
            "vgpu_cluster",
            "start 2 --framework torch --launcher slurm --partition gpu --account p1 --time 30 "
            "--sbatch=--mem=4G --sbatch=--gres=gpu:1 --controller-address 10.1.2.3",
        )
    assert seen["launcher"] == "slurm"
    assert seen["options"] == {
        "partition": "gpu",
        "account": "p1",
        "time": "30",
        "sbatch": ("--mem=4G", "--gres=gpu:1"),
        "controller_address": "10.1.2.3",
    }
    assert seen["plan"].controller_location == "10.1.2.3"
    with pytest.raises(UsageError, match="recorded"):
        shell.run_line_magic("vgpu_cluster", "start 2 --framework torch --launcher ssh --hosts 127.0.0.1,localhost")
    assert seen["options"] == {"hosts": "127.0.0.1,localhost"}
    assert list(seen["plan"].config["SSHEngineSetLauncher"]["engines"]) == ["127.0.0.1", "localhost"]
