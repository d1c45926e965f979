"""Training that resumes from its checkpoint, as scripts written for ``torchrun --max-restarts`` do: rank 0 saves
after every step (atomically), every rank loads it at start. ``python resume_train.py OUT [EXIT_AT] [PAUSE]``: rank 1
exits with status 3 before step EXIT_AT of the first attempt (-1: never), which pauses PAUSE seconds between steps.
A SIGTERM (a preemption) is noted, and at the next step's start, once every rank agrees (an all-reduce of the note: a
collective must not be left by one rank alone), each writes ``OUT.sigterm.RANK`` and exits 0, its last checkpoint
saved. Rank 0 writes the weights and the attempt (``TORCHELASTIC_RESTART_COUNT``) that finished to ``OUT``."""

import json
import os
import signal
import sys
import time

out = sys.argv[1]
exit_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
checkpoint = out + ".ckpt"
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])


preempted = []
# First: a preemption may come while torch is imported.
signal.signal(signal.SIGTERM, lambda signum, frame: preempted.append(signum))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if os.path.exists(checkpoint):
    state = torch.load(checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    start = state["step"]
for step in range(start, 12):
    stop = torch.tensor([float(bool(preempted))])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        with open(f"{out}.sigterm.{rank}", "w") as said:
            said.write(str(attempt))
        dist.destroy_process_group()
        sys.exit(0)
    if rank == 1 and attempt == 0 and step == exit_at:
        dist.destroy_process_group()
        sys.exit(3)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2
    opt.step()
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)
    time.sleep(pause if attempt == 0 else 0.0)
if rank == 0:
    with open(out, "w") as done:
        json.dump({"weights": [p.tolist() for p in model.parameters()], "attempt": attempt}, done)
dist.destroy_process_group()
