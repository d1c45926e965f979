"""Run a cell on a real gloo rank (under torchrun) and print its peak, measured by
the estimate's own tracker in real mode: ``MEASURED {"rank": ..., "peak_bytes": ...}``."""

import json
import os
import sys

import torch.distributed as dist

from vgpu_magic.frameworks.torch.fake_rank import PeakTracker

dist.init_process_group("gloo")
with open(sys.argv[1]) as f:
    cell = f.read()
with PeakTracker() as tracker:
    exec(compile(cell, sys.argv[1], "exec"), {"__name__": "__main__"})
# One write, shorter than a pipe's atomic size: the ranks' lines never interleave.
os.write(1, f"MEASURED {json.dumps({'rank': dist.get_rank(), **tracker.result()})}\n".encode())
dist.destroy_process_group()
