"""What the rank cluster costs: start, per-cell overhead, all-reduce bandwidth.

Run by hand (``make bench``), never by the test suite::

    python benchmarks/cluster.py [--repeats 20]

(a) Cluster start (``RankCluster(n, framework).start()``: ipyparallel engines
    plus the framework's wiring) for 2 and 4 ranks, per framework, against
    one bare ``import <framework>`` in a fresh interpreter, interleaved
    ``--starts`` times (medians, and the median of the paired ratios). On CPU
    the TensorFlow wiring imports nothing (``TF_CONFIG`` only), so its start
    is ipyparallel's alone. Where the seconds go: the time until 2 engines
    have registered, with ipyparallel's default heartbeat (3 s) and with the
    one :class:`RankCluster` gives its controller (the hub accepts an engine
    only after its heart answered a ping).
(b) ``%%vgpu_run`` on a trivial cell (``pass``) on 2 torch ranks, in a real
    IPython shell, against ipyparallel's own ``view.execute(..., block=True)``
    of the same cell: the cost of streaming, liveness checks and sampling.
(c) ``dist.all_reduce`` of 64 MiB (float32) on 2 gloo ranks, as bus
    bandwidth in GB/s, next to memcpy bandwidth of the same 64 MiB
    (``torch`` ``copy_``) measured on a rank in the same run.
(d) A script launch: ``%vgpu_run`` of a small DDP script (init, one
    ``all_reduce``, destroy) on 2 ranks against ``torchrun --standalone
    --nproc-per-node 2`` of the same script, interleaved ``--launches``
    times (wall time of each, medians and the median of the paired
    ratios); the first launch after ``start`` is reported on its own, and
    launches back to back (the next spare still importing) too.
(e) A kernel's graceful shutdown, as JupyterLab's "Shut down kernel" or
    "Restart kernel" does it (``shutdown_kernel()``: the kernel exits and its
    atexit stops the ranks), with 2 torch ranks running against a kernel with
    none, and against the 2.5 s after which Jupyter SIGTERMs a kernel that has
    not exited (half its ``shutdown_wait_time``), interleaved ``--shutdowns``
    times.

Medians are reported. The ratios matter, not the absolute figures: this
machine's cores are shared.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODULES = {"torch": "torch", "tensorflow": "tensorflow", "jax": "jax"}


def bare_import(module: str) -> float:
    """Seconds for ``import module`` in a fresh interpreter (interpreter start excluded)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ)
    return float(out.stdout.strip().splitlines()[-1])


def cluster_start(framework: str, n: int, join: bool = False) -> float:
    from vgpu_magic.ranks import RankCluster

    t = time.perf_counter()
    ranks = RankCluster(n, framework, join=join).start()
    elapsed = time.perf_counter() - t
    ranks.stop()
    return elapsed


def engines_registered(controller_args: list[str]) -> float:
    """Seconds until 2 local engines have registered with a fresh controller."""
    import logging

    import ipyparallel as ipp

    t = time.perf_counter()
    cluster = ipp.Cluster(n=2, engines="local", log_level=logging.ERROR, controller_args=controller_args)
    cluster.start_cluster_sync(n=2)
    client = cluster.connect_client_sync()
    client.wait_for_engines(2, timeout=120, block=True, interactive=False)
    elapsed = time.perf_counter() - t
    client.close()
    cluster.stop_cluster_sync()
    return elapsed


def run_overhead(repeats: int) -> tuple[float, float]:
    from IPython.testing.globalipapp import get_ipython

    import vgpu_magic

    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    with contextlib.redirect_stdout(io.StringIO()):
        ip.run_line_magic("vgpu_cluster", "start 2 --framework torch --join")
    ranks = vgpu_magic.cluster()
    ours, plain = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        ip.run_cell_magic("vgpu_run", "--no-plot", "pass")
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        ranks.view.execute("pass", block=True)
        plain.append(time.perf_counter() - t)
    return statistics.median(ours), statistics.median(plain)


ALLREDUCE = """
import time, statistics, torch, torch.distributed as dist
t = torch.ones(16 * 1024 * 1024)
dist.all_reduce(t); dist.barrier()
times = []
for _ in range(5):
    dist.barrier(); s = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - s)
copies = []
dst = torch.empty_like(t)
for _ in range(5):
    s = time.perf_counter(); dst.copy_(t); copies.append(time.perf_counter() - s)
(statistics.median(times), statistics.median(copies))
"""


def allreduce() -> tuple[float, float]:
    import vgpu_magic

    ranks = vgpu_magic.cluster()
    with contextlib.redirect_stdout(io.StringIO()):
        results = ranks.run(ALLREDUCE, output=True)
    ranks.stop()
    nbytes = 64 * 1024 * 1024
    reduce_s = max(r[0] for r in results)
    copy_s = statistics.median(r[1] for r in results)
    # Bus bandwidth as nccl-tests define it: 2 (n-1)/n × size / time; for n = 2, size / time.
    return nbytes / reduce_s / 1e9, 2 * nbytes / copy_s / 1e9  # memcpy reads and writes each byte


SMALL_DDP = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * dist.get_rank()
dist.all_reduce(t)
dist.destroy_process_group()
"""


def launches(count: int) -> None:
    import tempfile

    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "vgpu_magic")
    script = Path(tempfile.mkdtemp()) / "small_ddp.py"
    script.write_text(SMALL_DDP)
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", str(script)]

    def ours() -> float:
        t = time.perf_counter()
        ip.run_line_magic("vgpu_run", f"--no-plot {script}")
        return time.perf_counter() - t

    def theirs() -> float:
        t = time.perf_counter()
        subprocess.run(torchrun, check=True, capture_output=True, env=os.environ)
        return time.perf_counter() - t

    with contextlib.redirect_stdout(io.StringIO()):
        ip.run_line_magic("vgpu_cluster", "start 2 --framework torch")
        first = ours()
        pairs = [(theirs(), ours()) for _ in range(count)]
        back_to_back = [ours() for _ in range(count)]
        ip.run_line_magic("vgpu_cluster", "stop")
    runs, ref = [p[1] for p in pairs], [p[0] for p in pairs]
    ratio = statistics.median(o / t for t, o in pairs)
    print(
        f"(d) small DDP script on 2 ranks: %vgpu_run {statistics.median(runs):.2f} s, torchrun --standalone "
        f"{statistics.median(ref):.2f} s ({ratio:.2f}x, median of {count} interleaved); first launch after start "
        f"{first:.2f} s; back to back {statistics.median(back_to_back):.2f} s"
    )


def kernel_shutdown(ranks: bool) -> float:
    """Seconds of ``shutdown_kernel()`` for a fresh kernel that started 2 torch ranks (or none)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        code = "%load_ext vgpu_magic\n" + ("%vgpu_cluster start 2 --framework torch" if ranks else "")
        kc.execute_interactive(code, timeout=180, output_hook=lambda msg: None)
    finally:
        kc.stop_channels()
        t = time.perf_counter()
        km.shutdown_kernel()
    return time.perf_counter() - t


def shutdowns(count: int) -> None:
    from jupyter_client.manager import KernelManager

    sigterm_at = KernelManager().shutdown_wait_time / 2
    with_ranks, without = [], []
    for _ in range(count):
        with_ranks.append(kernel_shutdown(True))
        without.append(kernel_shutdown(False))
    ours, bare = statistics.median(with_ranks), statistics.median(without)
    print(
        f"(e) graceful kernel shutdown, medians of {count}: with 2 torch ranks {ours:.2f} s, without {bare:.2f} s "
        f"({ours / bare:.1f}x); {ours / sigterm_at:.0%} of the {sigterm_at:g} s after which Jupyter sends SIGTERM"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--frameworks", default="torch,tensorflow,jax")
    parser.add_argument("--starts", type=int, default=3, help="interleaved repeats of each start and bare import")
    parser.add_argument("--launches", type=int, default=5, help="interleaved script launches, ours and torchrun's")
    parser.add_argument("--shutdowns", type=int, default=3, help="interleaved kernel shutdowns, with and without ranks")
    parser.add_argument("--parts", default="abcde", help="which of (a) to (e) to run")
    args = parser.parse_args()
    if "e" in args.parts:
        shutdowns(args.shutdowns)
    if "d" in args.parts:
        launches(args.launches)
    if not set(args.parts) & set("abc"):
        return
    from vgpu_magic.ranks.processes import CONTROLLER_ARGS

    print(f"(a) cluster start vs one bare framework import (fresh interpreters), medians of {args.starts}")
    registered = {"default": [], "ours": []}
    for _ in range(args.starts):
        registered["default"].append(engines_registered([]))
        registered["ours"].append(engines_registered(list(CONTROLLER_ARGS)))
    print(
        f"    2 engines registered: {statistics.median(registered['default']):.2f} s with ipyparallel's default "
        f"heartbeat, {statistics.median(registered['ours']):.2f} s with ours ({' '.join(CONTROLLER_ARGS)})"
    )
    for framework in args.frameworks.split(","):
        # --join: the ranks also import the framework and join (init_process_group, jax.distributed) at start;
        # without it that cost moves to the user's first cell, as under the real launcher.
        bases, starts = [], {(2, False): [], (4, False): [], (2, True): []}
        for _ in range(args.starts):
            bases.append(bare_import(MODULES[framework]))
            for n, join in starts:
                starts[n, join].append(cluster_start(framework, n, join))
        base = statistics.median(bases)
        cells = []
        for (n, join), times in starts.items():
            ratio = statistics.median(t / b for t, b in zip(times, bases))
            cells.append(f"{n} ranks{' --join' if join else ''} {statistics.median(times):5.2f} s ({ratio:4.1f}x)")
        print(f"    {framework:<10} import {base:5.2f} s | " + " | ".join(cells))
    ours, plain = run_overhead(args.repeats)
    print(
        f"(b) trivial cell on 2 ranks: %%vgpu_run {ours * 1e3:.1f} ms, ipyparallel view.execute {plain * 1e3:.1f} ms "
        f"(+{(ours - plain) * 1e3:.1f} ms, {ours / plain:.1f}x), median of {args.repeats}"
    )
    bus, memcpy = allreduce()
    print(
        f"(c) all_reduce 64 MiB on 2 gloo ranks: {bus:.2f} GB/s bus bandwidth; memcpy on a rank: {memcpy:.2f} GB/s "
        f"(all-reduce at {bus / memcpy:.1%} of memcpy)"
    )


if __name__ == "__main__":
    main()
