"""On a rank: what the hang doctor (:mod:`.doctor`) asks it, answered by a thread of its own that sleeps in
``accept()`` until asked (no wake-ups, nothing written): where its main thread is in Python, and the collectives torch's
Flight Recorder holds. A rank whose main thread holds the GIL (a C extension) cannot answer; the kernel says so."""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import socket
import sys
import threading
import time
from typing import Any

__all__ = ["answer", "main_thread_cpu", "main_thread_use", "relay", "serve"]

#: The user's frames kept of the main thread's stack, from the innermost.
DEPTH = 40
#: futex(2)'s number, the system call a thread waiting on a lock in C code is in.
_FUTEX = {"x86_64": "202", "aarch64": "98"}.get(os.uname().machine, "futex")
#: Where code that is not the user's lives: Python's and the packages' folders, vgpu_magic, frozen modules.
_THEIRS = (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.abspath(os.path.join(__file__, "../..")), "<frozen")


def serve(address: str) -> None:
    """Listen at the Unix socket ``address`` (the last launch's left there goes); each connection gets
    :func:`answer` as JSON, then closes."""
    if not address.startswith("\0"):  # an abstract socket (:func:`relay`) leaves nothing on disk
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()

    def loop() -> None:
        while True:
            connection, _ = listener.accept()
            with connection, contextlib.suppress(OSError):
                connection.sendall(json.dumps(answer()).encode())

    threading.Thread(target=loop, name="vgpu-doctor", daemon=True).start()


def relay(name: str) -> int:
    """On an engine on another host than the kernel's, whose Unix sockets the kernel cannot reach: answer the hang
    doctor over TCP. A connection names what it asks: ``NAME-cell`` (this engine's cell) or ``NAME`` (the process it
    launched, which listens at the abstract Unix socket ``\\0NAME``, whose answer is passed on). The port."""
    listener = socket.create_server(("", 0))

    def loop() -> None:
        while True:
            connection, _ = listener.accept()
            with connection, contextlib.suppress(OSError):
                connection.settimeout(5.0)
                with connection.makefile("rb") as asking:
                    asked = asking.readline(256).decode(errors="replace").strip()
                if asked == f"{name}-cell":
                    connection.sendall(json.dumps(answer()).encode())
                elif asked == name:
                    with socket.socket(socket.AF_UNIX) as launched:
                        launched.settimeout(5.0)
                        launched.connect(f"\0{name}")
                        connection.sendall(b"".join(iter(lambda: launched.recv(65536), b"")))

    threading.Thread(target=loop, name="vgpu-doctor", daemon=True).start()
    return listener.getsockname()[1]


def answer() -> dict:
    """The main thread's frames in the user's code (``[file, line, function, source]``, innermost last), whether it
    is in torch's code now (``in_torch``: a collective's wait, a backward) or JAX's (``in_jax``: JAX records no
    collective: its Python code, or a C call from the user's line, a jitted function's, waiting on a lock), the Flight
    Recorder's entries, and its CPU time (the kernel tells a loop from a wait by two answers)."""
    import psutil

    frame, stack = sys._current_frames().get(threading.main_thread().ident), []
    inner = frame.f_code.co_filename if frame is not None else ""
    in_torch = os.sep + "torch" + os.sep in inner
    users = bool(inner) and not inner.startswith(_THEIRS)
    in_jax = "jax" in sys.modules and (
        _syscall() == _FUTEX if users else any(os.sep + name + os.sep in inner for name in ("jax", "jaxlib"))
    )
    while frame is not None and len(stack) < DEPTH:
        code = frame.f_code
        if not code.co_filename.startswith(_THEIRS):
            source = linecache.getline(code.co_filename, frame.f_lineno, frame.f_globals).strip()
            stack.append([code.co_filename, frame.f_lineno, code.co_name, source])
        frame = frame.f_back
    at = {"pid": os.getpid(), "stack": stack[::-1], "in_torch": in_torch, "in_jax": in_jax}
    at |= {"cpu": main_thread_cpu(psutil.Process()), "at": time.time()}
    # A first answer imports torch's stack symbolizer (900 modules): beside a main thread that holds the GIL (a loop),
    # each of the import's reads waited the switch interval (5 ms) to take it back, 15 s in all, so asks timed out.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH))
    try:
        return {**at, **_recorded()}
    finally:
        sys.setswitchinterval(interval)


def main_thread_cpu(process: Any) -> float:
    """``process``'s (a ``psutil.Process``) main thread's CPU seconds where the system lists its threads by the
    process's id (Linux), else the whole process's: a rank asleep or waiting in a collective spends none there,
    though its runtime threads (gloo's, the one answering here) spend some. The kernel reads it too (:mod:`.doctor`)."""
    main = [t for t in process.threads() if t.id == process.pid]
    return sum(main[0][1:3]) if main else sum(process.cpu_times()[:2])


def main_thread_use(process: Any) -> tuple[float, int]:
    """``process``'s main thread's CPU seconds (:func:`main_thread_cpu`) and how many times it was switched out
    (Linux's ``/proc``; 0 elsewhere): whether it runs (:func:`.doctor.idled`). A loop of small collectives, whose main
    thread only waits for gloo's threads, switches about a thousand times a second on 3 % of a core; one waiting in a
    hung collective, or asleep, none."""
    wakes = 0
    with contextlib.suppress(OSError), open(f"/proc/{process.pid}/task/{process.pid}/status") as status:
        wakes = sum(int(line.split(":")[1]) for line in status if "ctxt_switches" in line)
    return main_thread_cpu(process), wakes


def _syscall() -> str:
    """The system call the main thread is in (its number as ``/proc`` gives it; ``""``: not known): a jitted
    function's wait is a futex's, a ``time.sleep`` is not. Its id is the process's (Linux), which Python's record does
    not follow into a forked process (a launch)."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/self/task/{os.getpid()}/syscall") as call:
        return call.read().split()[0]
    return ""


#: Seconds the main thread may hold the GIL from this one while it answers (:func:`sys.setswitchinterval`).
SWITCH = 1e-4


def _recorded() -> dict:
    """Where torch.distributed is in use, the Flight Recorder's collectives still open (torch ≥ 2.13 records gloo's
    too), their frames cut to the user's (its line, also when DDP's reducer made the call), and the last collective
    each process group entered. Only the open ones: symbolizing every entry's stack on each ask slowed a loop of
    small all_reduces 1.6-2.4× (benchmarks/hang_doctor.py)."""
    if "torch.distributed" not in sys.modules:
        return {}
    import pickle

    import torch

    try:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, True))
    except Exception:  # noqa: BLE001 - no process group yet, or a torch without it: no collectives to show
        return {}
    for entry in dump.get("entries", ()):
        entry["frames"] = [f for f in entry.get("frames", ()) if not f["filename"].startswith(_THEIRS)]
    entered = {pg: status.get("last_enqueued_collective", 0) for pg, status in dump.get("pg_status", {}).items()}
    return {"entries": dump.get("entries", []), "entered": entered}
