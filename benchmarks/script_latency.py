"""Where a script launch's time goes, ours against torchrun's (issue 37, row 13).

Run by hand, never by the test suite::

    python benchmarks/script_latency.py [--runs 5]

The same 2-rank torch script (``init_process_group``, one ``all_reduce``, ``destroy_process_group``), which notes
the time of its first line and, in ``atexit``, of its last, is launched ``--runs`` times each, interleaved:

- by ``%vgpu_run`` in a real Jupyter kernel (2 torch ranks started before; the times are taken in the kernel's cell,
  around the magic), and
- by ``torchrun --standalone --nproc-per-node 2`` from this machine (the times around ``subprocess.run``).

It prints, medians of the runs: (a) run start -> the script's first line (the later rank's), and (b) the script's
last line (the later rank's ``atexit``) -> the run returns; and the ratios ours / torchrun's. The first launch after
the start (the spares still importing) is left out. The ratios matter, not the absolute figures: this machine's
cores are shared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import time
first = time.time()
import atexit, json, os, sys
import torch
import torch.distributed as dist


def last():
    with open(f"{sys.argv[1]}-{os.environ['RANK']}.json", "w") as out:
        json.dump([first, time.time()], out)


atexit.register(last)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def run_in_kernel(kc, code: str) -> str:
    """Run ``code`` in the kernel: what it printed; an error fails the benchmark."""
    printed: list[str] = []

    def hook(msg: dict) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))

    kc.execute_interactive(code, timeout=600, output_hook=hook)
    return "".join(printed)


def phases(start: float, end: float, stem: Path) -> tuple[float, float]:
    """(a) start -> the later rank's first line, (b) the later rank's last line -> end."""
    times = [json.loads(Path(f"{stem}-{rank}.json").read_text()) for rank in (0, 1)]
    return max(t[0] for t in times) - start, end - max(t[1] for t in times)


def main() -> None:
    from jupyter_client.manager import start_new_kernel

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="vgpu-script-latency-"))
    script = folder / "script.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IPYTHONDIR": str(folder / "ipython")}
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    ours, theirs = [], []
    try:
        run_in_kernel(kc, "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework torch")
        launch = f"import time\n_t0 = time.time()\n%vgpu_run --no-plot {script} {{stem}}\nprint(_t0, time.time())"
        run_in_kernel(kc, launch.format(stem=folder / "warm"))
        for run in range(args.runs):
            stem = folder / f"theirs{run}"
            start = time.time()
            subprocess.run([*torchrun, str(stem)], check=True, capture_output=True, env=os.environ)
            theirs.append(phases(start, time.time(), stem))
            stem = folder / f"ours{run}"
            start, end = map(float, run_in_kernel(kc, launch.format(stem=stem)).split()[-2:])
            ours.append(phases(start, end, stem))
        run_in_kernel(kc, "%vgpu_cluster stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
        shutil.rmtree(folder, ignore_errors=True)
    for index, name in enumerate(("(a) run start -> first line", "(b) last line -> run returns")):
        mine, ref = statistics.median(o[index] for o in ours), statistics.median(t[index] for t in theirs)
        print(
            f"{name}: %vgpu_run {mine:.2f} s, torchrun --standalone {ref:.2f} s ({mine / ref:.2f}x), "
            f"medians of {args.runs}"
        )


if __name__ == "__main__":
    main()
