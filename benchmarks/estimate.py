"""What an estimate costs: a 1.0 B-parameter transformer on 64 ranks.

Run by hand, never by the test suite::

    python benchmarks/estimate.py [--ranks 64]

The model: 20 x ``TransformerEncoderLayer(2048, 16, 8192)`` (1.0 B parameters),
Adam, one training step on a batch of 4 x 512 tokens, written for ``cuda``.
Each estimate (FSDP2 with ``fully_shard`` per layer; DDP) runs in a fresh
interpreter, as in a new kernel, and reports the seconds of the cell's
``import torch`` and the ``vgpu_magic.estimate()`` call (wall clock, of it the
import, and the process's CPU time, which other work on the machine does not
inflate) and the process's peak RSS (``ru_maxrss``, torch's import included)
against the goals: 10 s and 1 GiB. The cores of this machine are shared, so the
times are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = """
import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, device="cuda")
                              for _ in range(20)])
{wrap}
opt = torch.optim.Adam(model.parameters())
x = torch.randn(4, 512, 2048, device="cuda")
model(x).sum().backward()
opt.step()
"""
WRAPS = {
    "FSDP2": "for layer in model:\n    fully_shard(layer)\nfully_shard(model)",
    "DDP": "model = DistributedDataParallel(model)",
}
ONE = """
import json, resource, sys, time
import vgpu_magic
cell = sys.stdin.read()
start, cpu = time.perf_counter(), time.process_time()
import torch  # the cell's first line; a kernel that trains has usually done it already
imported = time.perf_counter() - start
found = vgpu_magic.estimate(cell, ranks={ranks}, gpu="H100")
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"seconds": seconds, "imported": imported, "cpu": cpu, "rss": rss, "peak": found.peak_bytes,
                  "verdict": found.verdict, "parts": found.ranks[0].categories}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    print(f"1.0 B-parameter transformer (20 x TransformerEncoderLayer(2048, 16, 8192)), {args.ranks} ranks, Adam")
    for name, wrap in WRAPS.items():
        proc = subprocess.run([sys.executable, "-c", ONE.format(ranks=args.ranks)], input=MODEL.format(wrap=wrap),
                              capture_output=True, text=True, env=env, timeout=600, check=True)  # fmt: skip
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {name:5}  estimate {r['seconds']:5.1f} s ({r['seconds'] / 10:.2f} x the 10 s goal; "
              f"{r['cpu']:.1f} s of CPU; {r['imported']:.1f} s of it importing torch), "
              f"peak RSS {r['rss'] / 2**30:.2f} GiB ({r['rss'] / 2**30:.2f} x the 1 GiB goal); "
              f"rank 0 peak {r['peak'] / 2**30:.2f} GiB, on an H100: {r['verdict']}")  # fmt: skip


if __name__ == "__main__":
    main()
