"""What the hang doctor costs a run that does not hang (issue 42: at most 1.05×).

Run by hand, never by the test suite::

    python benchmarks/hang_doctor.py [--pairs 7] [--steps 3000] [--hang-after 3]

One 2-rank torch cluster runs the same script, ``--steps`` small ``all_reduce`` s timed inside the script (rank 0's
loop, after a first ``all_reduce`` that waits for both ranks), in pairs: with the doctor (``--hang-after``; a short
one, so that the kernel asks the ranks during the loop too) and without (``--hang-after 0``), the order alternating.
It prints each pair, then the median of the pairs' ratios (doctor on / off). The ratio matters, not the times: the
machine's cores are shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(16)
dist.all_reduce(t)
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    dist.all_reduce(t)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as out:
        json.dump(time.perf_counter() - start, out)
dist.destroy_process_group()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--hang-after", type=float, default=3.0)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from vgpu_magic.ranks import RankCluster

    folder = Path(tempfile.mkdtemp(prefix="hang-doctor-bench-"))
    script, seconds = folder / "loop.py", folder / "seconds.json"
    script.write_text(SCRIPT)
    ranks = RankCluster(2, "torch").start()
    try:

        def run(hang_after: float) -> float:
            ranks.run_script(str(script), [str(seconds), str(args.steps)], hang_after=hang_after)
            return json.loads(seconds.read_text())

        run(0)  # the spares' first imports
        ratios = []
        for pair in range(args.pairs):
            order = (args.hang_after, 0.0) if pair % 2 else (0.0, args.hang_after)
            times = dict(zip(order, (run(h) for h in order)))
            ratios.append(times[args.hang_after] / times[0.0])
            print(f"pair {pair + 1}: doctor {times[args.hang_after]:.2f} s, none {times[0.0]:.2f} s: {ratios[-1]:.3f}×")
        print(f"{args.steps} all_reduces on 2 ranks, doctor on / off: median {statistics.median(ratios):.3f}×")
    finally:
        ranks.stop()


if __name__ == "__main__":
    main()
