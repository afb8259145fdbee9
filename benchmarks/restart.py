"""How long does a rank's death cost a run with ``max_restarts``?

Two CPU ranks (gloo) train a 0.92M-parameter MLP with AdamW, saving a checkpoint
(``ctx.checkpoint_every``, sharded) every 10 steps; rank 1 SIGKILLs itself at step 25 of
the first attempt, as the OOM killer would. Printed per start method, median [lowest-highest] of
``--repeats`` runs, on one clock (``time.monotonic``, the same in every process):

  death -> restart:    from the kill until the kernel starts the next attempt (the other
                       rank seen failing, every rank ended and reaped, the checkpoint found)
  death -> next step:  until the first step after the restart ends (new ranks started,
                       their process group up, the checkpoint loaded, one step trained)
  steps lost:          steps trained again (from the checkpoint to the death)

    python benchmarks/restart.py [--repeats 3] [--methods fork,forkserver,spawn]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import torch
from torch import nn

import nbtrain

DIE_AT, STEPS, SAVE_EVERY = 25, 40, 10


def train(ctx, path: str, stamp: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 384),
                          nn.ReLU(), nn.Linear(384, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    state = ctx.checkpoint_every(SAVE_EVERY, path, model=model, optimizer=opt)
    x, y = torch.randn(32, 512), torch.randint(0, 10, (32,))
    for step in range(state["step"], STEPS):
        ctx.step = step  # the boundary where checkpoint_every saves
        if step == DIE_AT and not ctx.resume_from and ctx.rank == 1:
            with open(stamp, "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
    return step


def once(method: str) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "died")
        run = nbtrain.launch(train, os.path.join(tmp, "ck"), stamp, devices=2,
                             accelerator="cpu", start_method=method, max_restarts=1,
                             dashboard=False)
        died = float(open(stamp).read())
    events = run.history.events()
    restart = next(e for e in events if e.kind == "restart")
    after = events[events.index(restart):]
    first = next(e for e in after if e.kind == "step")
    resumed_at = next(e.step for e in after if e.kind == "step")
    return restart.t - died, first.t - died, DIE_AT - resumed_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="fork,forkserver,spawn")
    args = parser.parse_args()
    print(f"2 CPU ranks, a checkpoint every {SAVE_EVERY} steps, rank 1 killed at step "
          f"{DIE_AT}; median [lowest-highest] of {args.repeats}")
    print(f"{'start method':14s} {'death -> restart':>24s} {'death -> next step':>24s} "
          f"{'steps lost':>10s}")
    for method in args.methods.split(","):
        rows = [once(method) for _ in range(args.repeats)]

        def cell(values):
            return (f"{statistics.median(values):.2f} s [{min(values):.2f}-"
                    f"{max(values):.2f}]")

        print(f"{method:14s} {cell([r[0] for r in rows]):>24s} "
              f"{cell([r[1] for r in rows]):>24s} {rows[0][2]:>10d}")


if __name__ == "__main__":
    main()
