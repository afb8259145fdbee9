"""How long does a rank's death cost a run with ``max_restarts``, beside torchrun's own?

Two CPU ranks (gloo) train a 0.92M-parameter MLP with AdamW, saving a checkpoint
(``ctx.checkpoint_every``, sharded) every 10 steps; rank 1 SIGKILLs itself at step 25 of
the first attempt, as the OOM killer would. Printed per start method, median [lowest-highest] of
``--repeats`` runs, on one clock (``time.monotonic``, the same in every process):

  death -> restart:    from the kill until the kernel starts the next attempt (the other
                       rank seen failing, every rank ended and reaped, the checkpoint found)
  death -> next step:  until the first step after the restart ends (new ranks started,
                       their process group up, the checkpoint loaded, one step trained)
  steps lost:          steps trained again (from the checkpoint to the death)

The same function and kill under torchrun's elastic agent (``--max-restarts 1``, its
defaults otherwise): ``torchrun`` runs a script that calls ``launch()``, ``nbtrain-run``
is ``nbtrain run benchmarks/restart.py:train``; the agent restarts both ranks, and
``checkpoint_every`` finds its own last checkpoint. They have no kernel: only death ->
next step is measured (rank 0 writes when its first step after the restart ends).

    python benchmarks/restart.py [--repeats 3] [--methods fork,forkserver,spawn,torchrun,nbtrain-run]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
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
    first = state["step"]
    for step in range(first, STEPS):
        ctx.step = step  # the boundary where checkpoint_every saves
        if step == DIE_AT and not os.path.exists(stamp) and ctx.rank == 1:
            with open(stamp, "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        if step == first and first and ctx.rank == 0:  # the first step after a restart
            with open(stamp + ".next", "w") as f:
                f.write(f"{time.monotonic()!r} {first}")
    return step


def under_torchrun(runner: str) -> tuple[float | None, float, int]:
    """The same kill under torchrun's agent, run as ``runner``."""
    here = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory() as tmp:
        path, stamp = os.path.join(tmp, "ck"), os.path.join(tmp, "died")
        restarts = ["--nproc-per-node", "2", "--max-restarts", "1"]
        if runner == "nbtrain-run":
            cmd = [sys.executable, "-m", "nbtrain", "run", f"{here}:train", f"path={path!r}",
                   f"stamp={stamp!r}", "--accelerator", "cpu", *restarts]
        else:
            script = os.path.join(tmp, "job.py")
            with open(script, "w") as f:
                f.write(f"import sys, nbtrain\nsys.path.insert(0, {os.path.dirname(here)!r})\n"
                        f"from restart import train\nnbtrain.launch(train, {path!r}, "
                        f"{stamp!r}, accelerator='cpu')\n")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *restarts,
                   script]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp)
        if done.returncode != 0:
            raise SystemExit(f"{runner} failed:\n{done.stderr[-3000:]}")
        died = float(open(stamp).read())
        when, first = open(stamp + ".next").read().split()
    return None, float(when) - died, DIE_AT - int(first)


def once(method: str) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "died")
        run = nbtrain.launch(train, os.path.join(tmp, "ck"), stamp, devices=2,
                             accelerator="cpu", start_method=method, max_restarts=1,
                             dashboard=False)
        died = float(open(stamp).read())
        when, first = open(stamp + ".next").read().split()  # as under torchrun
    restart = next(e for e in run.history.events() if e.kind == "restart")
    return restart.t - died, float(when) - died, DIE_AT - int(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="fork,forkserver,spawn,torchrun,nbtrain-run")
    args = parser.parse_args()
    print(f"2 CPU ranks, a checkpoint every {SAVE_EVERY} steps, rank 1 killed at step "
          f"{DIE_AT}; median [lowest-highest] of {args.repeats}")
    print(f"{'start method':14s} {'death -> restart':>24s} {'death -> next step':>24s} "
          f"{'steps lost':>10s}")
    for method in args.methods.split(","):
        rows = [under_torchrun(method) if method in ("torchrun", "nbtrain-run")
                else once(method) for _ in range(args.repeats)]

        def cell(values):
            if None in values:
                return "-"
            return (f"{statistics.median(values):.2f} s [{min(values):.2f}-"
                    f"{max(values):.2f}]")

        print(f"{method:14s} {cell([r[0] for r in rows]):>24s} "
              f"{cell([r[1] for r in rows]):>24s} {rows[0][2]:>10d}")


if __name__ == "__main__":
    main()
