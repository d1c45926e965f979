"""Real launchers on one machine, for the launcher tests: a single-node SLURM
cluster (:class:`~local_slurm.LocalSlurm`) and a second
"host" (a network namespace of its own, with its own address and host name,
and an sshd in it).

Both need root on Linux and Debian's ``slurm-wlm``, ``munge``,
``openssh-server`` and ``iproute2`` (``make system-deps`` installs them);
:func:`why_not_slurm` / :func:`why_not_hosts` give the one-line reason a test
is skipped otherwise. The fixtures that use them live in ``conftest.py``.

The second host: a veth pair between the root namespace and a new one, with
two addresses of a /30 the fixture picks (no other address is ever used), an
sshd in the new namespace under ``unshare --uts --pid`` (host name
``vgpu-host2``, and process IDs of its own, as a real second host has)
and a second sshd in the root namespace bound to the root side's address
only, so ranks on "this host" are started over SSH too. Each sshd runs in a
mount namespace of its own with an ``/etc/hosts`` naming both hosts (as a
cluster's DNS would: gloo and JAX look up their own address by host name);
the machine's own ``/etc/hosts`` is not changed. Host keys, the client
key, ``authorized_keys`` and ``known_hosts`` live in a temporary folder; the
machine's ``~/.ssh`` is never read or written (``-F /dev/null``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SECOND_HOSTNAME = "vgpu-host2"
_SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def why_not_slurm() -> str | None:
    """Why a local SLURM cluster cannot run here, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "a local SLURM cluster needs root on Linux"
    from local_slurm import missing_commands

    missing = missing_commands()
    return f"no {', '.join(missing)} (apt-get install slurm-wlm munge)" if missing else None


def why_not_hosts() -> str | None:
    """Why a second host (network namespace + sshd) cannot be made here, or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "a second host (network namespace) needs root on Linux"
    missing = [
        c
        for c in ("ip", "unshare", "nsenter", "sshd", "ssh", "scp", "ssh-keygen")
        if shutil.which(c, path=_SBIN) is None
    ]
    if missing:
        return f"no {', '.join(missing)} (apt-get install iproute2 openssh-server openssh-client)"
    return None


def _run(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _pick_subnet() -> ipaddress.IPv4Network:
    """A /30 in 10.0.0.0/8 that no interface of this machine is on."""
    used = [
        ipaddress.ip_interface(a).network
        for a in _run("ip", "-4", "-o", "addr", "show").split()
        if "/" in a and a[0].isdigit()
    ]
    for _ in range(100):
        net = ipaddress.ip_network(
            f"10.{random.randint(128, 254)}.{random.randint(0, 255)}.{4 * random.randint(0, 63)}/30"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free /30 in 10.128.0.0/9 for the test's veth pair")


@dataclass
class SSHHost:
    """One host reachable over SSH: where to ssh to, and its name."""

    address: str
    port: int
    hostname: str

    @property
    def target(self) -> str:
        """``root@address:port``, as ``launcher_options["hosts"]`` takes it."""
        return f"root@{self.address}:{self.port}"


@dataclass
class TwoHosts:
    """This host and a second one in a network namespace, each with an sshd."""

    folder: Path
    namespace: str
    veth: str
    first: SSHHost
    second: SSHHost
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ssh_args(self) -> list[str]:
        """ssh arguments that reach both hosts with the test's key only."""
        return [
            "-F",
            "/dev/null",
            "-i",
            str(self.folder / "id_ed25519"),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            f"UserKnownHostsFile={self.folder / 'known_hosts'}",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
        ]

    def ssh(self, host: SSHHost, command: str) -> str:
        """Run ``command`` on ``host``; its stdout."""
        return _run("ssh", *self.ssh_args, "-p", str(host.port), f"root@{host.address}", command)

    @classmethod
    def start(cls) -> TwoHosts:
        folder = Path(tempfile.mkdtemp(prefix="vgpu-hosts-"))
        tag = uuid.uuid4().hex[:6]
        net = _pick_subnet()
        root_side, ns_side = (str(a) for a in list(net.hosts())[:2])
        hosts = cls(
            folder,
            f"vgpu-{tag}",
            f"vg{tag}a",
            SSHHost(root_side, 0, socket.gethostname()),
            SSHHost(ns_side, 0, SECOND_HOSTNAME),
        )
        try:
            hosts._make_namespace(tag, net.prefixlen)
            hosts._make_keys()
            hosts._write_hosts_file()
            hosts._start_sshd(hosts.first)
            hosts._start_sshd(hosts.second)
            for host in (hosts.first, hosts.second):
                hosts._wait_ssh(host)
        except BaseException:
            hosts.stop()
            raise
        return hosts

    def _make_namespace(self, tag: str, prefix: int) -> None:
        peer = f"vg{tag}b"
        _run("ip", "netns", "add", self.namespace)
        _run("ip", "link", "add", self.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", self.namespace)
        _run("ip", "addr", "add", f"{self.first.address}/{prefix}", "dev", self.veth)
        _run("ip", "link", "set", self.veth, "up")
        inside = ("ip", "netns", "exec", self.namespace)
        _run(*inside, "ip", "addr", "add", f"{self.second.address}/{prefix}", "dev", peer)
        _run(*inside, "ip", "link", "set", peer, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")

    def _make_keys(self) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "host_ed25519"))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.folder / "id_ed25519"))
        shutil.copy(self.folder / "id_ed25519.pub", self.folder / "authorized_keys")
        # sshd's privilege-separation directory, which Debian's service creates at boot. It stays (an empty
        # directory the package expects): another test run's sshd may be using it.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)

    def _write_hosts_file(self) -> None:
        """The two hosts' names and addresses, as a cluster's DNS would give them (gloo and
        JAX find their own address from the host name)."""
        (self.folder / "hosts").write_text(
            f"127.0.0.1 localhost\n{self.first.address} {self.first.hostname}\n"
            f"{self.second.address} {self.second.hostname}\n"
        )

    def prefix(self, host: SSHHost) -> list[str]:
        """Command words that run a command as on ``host``: in its network namespace, under its
        host name, with the fake cluster's ``/etc/hosts`` (in a mount namespace of its own, so
        the machine's own file is not changed)."""
        # nsenter rather than `ip netns exec`, which mounts a sysfs of its own over /sys and so hides
        # /sys/fs/cgroup, which slurmd needs.
        if host is self.second:
            # Its own network, and its own process IDs (as on a real second host: a PID its
            # processes report names nothing, or something else, here); its own /proc to match.
            netns = ["nsenter", f"--net=/run/netns/{self.namespace}"]
            pids = ["--pid", "--fork", "--kill-child", "--mount-proc"]
        else:
            netns, pids = [], []
        script = f'mount --bind "$0" /etc/hosts && hostname {host.hostname} && exec "$@"'
        return [*netns, "unshare", "--uts", "--mount", *pids, "sh", "-c", script, str(self.folder / "hosts")]

    def _start_sshd(self, host: SSHHost) -> None:
        host.port = free_port(host.address, self.namespace if host is self.second else None)
        config = self.folder / f"sshd_{host.address}.conf"
        config.write_text(
            "\n".join(
                [
                    f"Port {host.port}",
                    f"ListenAddress {host.address}",
                    f"HostKey {self.folder / 'host_ed25519'}",
                    f"AuthorizedKeysFile {self.folder / 'authorized_keys'}",
                    f"PidFile {self.folder / ('sshd_' + host.address + '.pid')}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "PrintMotd no",
                    "Subsystem sftp /usr/lib/openssh/sftp-server",
                ]
            )
            + "\n"
        )
        sshd = shutil.which("sshd", path=_SBIN)
        # SIGINT back to its default for what the sshd starts (a background test run ignores it).
        argv = ["env", "--default-signal=INT", *self.prefix(host), sshd, "-D", "-e", "-f", str(config)]
        with open(self.folder / f"sshd_{host.address}.log", "wb") as log:
            self.processes.append(
                subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
                )
            )

    def _wait_ssh(self, host: SSHHost) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                name = self.ssh(host, "hostname").strip()
            except RuntimeError:
                if time.monotonic() > deadline:
                    log = (self.folder / f"sshd_{host.address}.log").read_text(errors="replace")
                    raise RuntimeError(f"sshd on {host.address}:{host.port} did not answer: {log[-500:]}") from None
                time.sleep(0.2)
                continue
            if name != host.hostname:
                raise RuntimeError(f"{host.address} calls itself {name!r}, not {host.hostname!r}")
            return

    def stop(self) -> None:
        """Stop the sshds and everything they started, remove the namespace, the veth and the folder."""
        import psutil

        procs = []
        for proc in self.processes:
            try:
                procs.append(psutil.Process(proc.pid))
                procs.extend(psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=5)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        for proc in self.processes:
            proc.wait(timeout=5)
        self.processes = []
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, timeout=30, check=False)
        # Deleting the namespace removes its end of the pair, and with it this one; make sure.
        subprocess.run(["ip", "link", "del", self.veth], capture_output=True, timeout=30, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)

    def host(self, hostname: str) -> SSHHost:
        """The host named ``hostname``."""
        return {self.first.hostname: self.first, self.second.hostname: self.second}[hostname]

    def slurm_nodes(self) -> list:
        """The two hosts as SLURM compute nodes, each slurmd started as on its host."""
        from local_slurm import SlurmNode

        return [SlurmNode(h.hostname, h.address, tuple(self.prefix(h))) for h in (self.first, self.second)]


def free_port(address: str, namespace: str | None = None) -> int:
    """A port free on ``address``, chosen by the OS where the address lives."""
    if namespace is None:
        with socket.socket() as sock:
            sock.bind((address, 0))
            return sock.getsockname()[1]
    code = f"import socket; s = socket.socket(); s.bind(({address!r}, 0)); print(s.getsockname()[1])"
    return int(_run("ip", "netns", "exec", namespace, sys.executable, "-c", code).strip())
