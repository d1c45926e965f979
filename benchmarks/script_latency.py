"""Where a script launch's time goes, ours against torchrun's (issue 37, row 13; issue 44).

Run by hand, never by the test suite::

    python benchmarks/script_latency.py [--runs 5]

The same 2-rank torch script (``init_process_group``, one ``all_reduce``, ``destroy_process_group``), which notes
the time of its first line and, in ``atexit``, of its last, is launched ``--runs`` times each

- by ``%vgpu_run`` in a real Jupyter kernel (2 torch ranks started before; the times are taken in the kernel's cell,
  around the magic), and
- by ``torchrun --standalone --nproc-per-node 2`` from this machine (the times around ``subprocess.run``),

in three ways: *edit-run*, ours and torchrun's interleaved (a pause before each of ours, as a user who edits gives);
*back to back*, ``--runs`` launches in one cell's loop with no pause (as a sweep runs them), then torchrun's in a
loop; and the same back to back with a script that sets ``OMP_NUM_THREADS`` before ``import torch``, which launches
cold (no spare: its own settings must reach torch's import).

It prints, medians of the runs: (a) run start -> the script's first line (the later rank's), (b) the script's last
line (the later rank's ``atexit``) -> the run returns, and the run's whole wall time; and the ratios ours /
torchrun's. The first launch after the start (the spares still importing) is left out. The ratios matter, not the
absolute figures: this machine's cores are shared.
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
#: The same, setting its own environment before ``import torch`` (as a script that pins its threads does).
SETS_ENVIRONMENT = SCRIPT.replace("import torch\n", 'os.environ["OMP_NUM_THREADS"] = "1"\nimport torch\n', 1)
#: Launches of ``{script}`` in one cell, no pause: the times around each, as JSON.
LOOP = """import json, time
_times = []
for _stem in {stems!r}:
    _times.append(time.time())
    %vgpu_run --no-plot {script} $_stem
    _times.append(time.time())
print(json.dumps(_times))
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


def phases(start: float, end: float, stem: Path) -> tuple[float, float, float]:
    """(a) start -> the later rank's first line, (b) the later rank's last line -> end, and end - start."""
    times = [json.loads(Path(f"{stem}-{rank}.json").read_text()) for rank in (0, 1)]
    return max(t[0] for t in times) - start, end - max(t[1] for t in times), end - start


def report(case: str, ours: list, theirs: list) -> None:
    """One line per phase: the medians of ``ours`` and ``theirs`` and their ratio."""
    print(f"{case}, medians of {len(ours)}:")
    for index, name in enumerate(("(a) run start -> first line", "(b) last line -> run returns", "wall time")):
        mine, ref = statistics.median(o[index] for o in ours), statistics.median(t[index] for t in theirs)
        print(f"  {name}: %vgpu_run {mine:.2f} s, torchrun --standalone {ref:.2f} s ({mine / ref:.2f}x)")


def main() -> None:
    from jupyter_client.manager import start_new_kernel

    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="vgpu-script-latency-"))
    scripts = {"edit": folder / "script.py", "cold": folder / "sets_environment.py"}
    scripts["edit"].write_text(SCRIPT)
    scripts["cold"].write_text(SETS_ENVIRONMENT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IPYTHONDIR": str(folder / "ipython")}
    km, kc = start_new_kernel(kernel_name="python3", env=env)

    def theirs(script: Path, stem: Path) -> tuple[float, float, float]:
        start = time.time()
        subprocess.run([*torchrun, str(script), str(stem)], check=True, capture_output=True, env=os.environ)
        return phases(start, time.time(), stem)

    def ours(script: Path, stems: list[Path]) -> list:
        """Launch ``script`` once per stem, all in one cell."""
        times = json.loads(run_in_kernel(kc, LOOP.format(stems=list(map(str, stems)), script=script)).splitlines()[-1])
        return [phases(times[2 * i], times[2 * i + 1], stem) for i, stem in enumerate(stems)]

    try:
        run_in_kernel(kc, "%load_ext vgpu_magic\n%vgpu_cluster start 2 --framework torch")
        ours(scripts["edit"], [folder / "warm"])
        edit: tuple[list, list] = ([], [])
        for run in range(args.runs):
            edit[1].append(theirs(scripts["edit"], folder / f"theirs{run}"))
            edit[0].extend(ours(scripts["edit"], [folder / f"ours{run}"]))
        loops = {}
        for case, script in scripts.items():
            loops[case] = (
                ours(script, [folder / f"ours-{case}-{run}" for run in range(args.runs)]),
                [theirs(script, folder / f"theirs-{case}-{run}") for run in range(args.runs)],
            )
        run_in_kernel(kc, "%vgpu_cluster stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
        shutil.rmtree(folder, ignore_errors=True)
    report("edit-run (interleaved with torchrun)", *edit)
    report(f"back to back ({args.runs} in one cell)", *loops["edit"])
    report("back to back, a script that sets OMP_NUM_THREADS before import torch (launches cold)", *loops["cold"])


if __name__ == "__main__":
    main()
