"""Where the ranks run: each engine's report of its host (:func:`report_host`, applied on the engine), the
addresses and ports chosen there, and commands run on an SSH host. The reports and the ranks' layout are plain data
in :mod:`vgpu_magic.layout`, below the frameworks. Imports no framework, no NVML and no ipyparallel."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ..inventory import nccl_version, visible_gpus
from ..layout import HostReport
from ..plans import SplitRequest

#: Seconds a cancelled batch job may take to leave the queue, and remote engines to exit.
REMOTE_STOP_TIMEOUT = 30.0


def route_address(toward: str) -> str:
    """This host's address on the route to ``toward`` (a UDP ``connect``: no packet); one-line ``ValueError``."""
    name = toward.rpartition("@")[2]
    if name in ("", "*", "0.0.0.0", "localhost") or name.startswith("127."):
        return "127.0.0.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(name, 9, proto=socket.IPPROTO_UDP)[0]
    except OSError as exc:
        raise ValueError(f"host {name!r} does not resolve ({exc.strerror}); give its address or fix its name") from None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def free_port(address: str = "") -> int:
    """A free TCP port on this host from the OS, bound on every interface (``address``: IPv4 or IPv6)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def report_host(engine_id: int, controller: str, prefixes: tuple[str, ...] = ()) -> HostReport:
    """On an engine: where it runs, and its launcher's variables (their ``prefixes``); the address it reaches
    ``controller`` from is the one the others can use."""
    address = route_address(controller)
    return HostReport(
        engine_id=engine_id,
        hostname=socket.gethostname(),
        address=address,
        pid=os.getpid(),
        gpus=visible_gpus(),
        port=free_port(address),
        launcher={name: value for name, value in os.environ.items() if prefixes and name.startswith(prefixes)},
        nccl=nccl_version(),
    )


def ssh_target(host: str) -> tuple[str, str | None]:
    """``"user@node:2222"`` -> ``("user@node", "2222")``; the port is None when not given."""
    location, _, port = host.partition(":")
    return location, port or None


#: Run on an SSH host at stop: wait for the engines, SIGKILL survivors, remove the folder, say which PIDs are left.
REMOTE_CLEANUP = (
    "pids='{pids}'; alive() {{ for p in $pids; do kill -0 $p 2>/dev/null && echo $p; done; }}; "
    'for i in $(seq 40); do [ -z "$(alive)" ] && break; sleep 0.25; done; '
    "kill -9 $(alive) 2>/dev/null && sleep 0.5; rm -rf '{folder}'; echo left: $(alive)"
)


def ssh(location: str, args: tuple[str, ...], command: str, timeout: float = REMOTE_STOP_TIMEOUT) -> tuple[bool, str]:
    """Run ``command`` on ``location`` over ssh, never asking for a password: whether it ran, its stdout or why not."""
    argv = ["ssh", "-o", "BatchMode=yes", *args, location, command]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"ssh {location}: no answer within {timeout:g} s"
    if proc.returncode == 0:
        return True, proc.stdout
    return False, last_line(proc.stderr) or f"ssh {location} exited with status {proc.returncode}"


def last_line(text: str | bytes | None) -> str:
    """The last line of ``text`` that is not blank, stripped (``""``: none)."""
    text = text.decode("utf8", "replace") if isinstance(text, bytes) else text or ""
    return ([line.strip() for line in text.splitlines() if line.strip()] or [""])[-1]


def prepare_rank(
    env: dict[str, str],
    setup: str,
    args: tuple[Any, ...],
    join: bool = False,
    devices: SplitRequest | None = None,
    after_import: str = "",
) -> str:
    """On the rank, every framework's rank setup (:class:`~vgpu_magic.layout.RankPlan`): environment, ``devices``
    split as ``%vgpu_split`` would, the framework's setup (``join``: with the join call). With ``after_import`` (the
    framework's module, e.g. ``"jax"``), devices and setup wait for the script's import of that module, so what the
    script set before it (``JAX_ENABLE_X64``) is read."""
    os.environ.update(env)
    if after_import and after_import not in sys.modules:
        sys.meta_path.insert(0, _AfterImport(after_import, lambda: prepare_rank({}, setup, args, join, devices)))
        return f"set up when the script imports {after_import}"
    if devices is not None:
        from .. import frameworks
        from ..planner import configuration_after, plan_split

        fw = frameworks.get(devices.framework)
        inventory = fw.probe_inventory()
        plan = plan_split(devices, inventory)
        fw.write_configuration(inventory.current, configuration_after(plan, inventory.current))
    if not setup:
        return "environment set"
    module, _, function = setup.partition(":")
    return getattr(importlib.import_module(module), function)(*args, join=join)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Leaves finding ``name`` to the other finders, and has its loader call ``then()`` once the module ran."""

    def __init__(self, name: str, then: Callable[[], Any]) -> None:
        self.name, self.then = name, then

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.name:
            return None
        from ..frameworks import ImportedThen

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = ImportedThen(spec.loader, self.then)
        return spec
