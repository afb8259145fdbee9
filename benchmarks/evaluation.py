"""What does an evaluation inside the training function cost, and does it still leak into
the training's figures?

Two CPU ranks (gloo, DDP) train a 0.92M-parameter MLP for ``--epochs`` epochs and, in
the "with" runs, evaluate a validation set a quarter of the training set's size once an
epoch (``model.eval()``, a pass over ``ctx.dataloader``, ``val.gather(losses)``); the
"without" runs train alone. Runs alternate, ``--repeats`` of each. Printed side by side:

  step ms (nbtrain):    the mean step time the summary reports, with and without the
                        evaluations, and their ratio (1.00: no evaluation in any step)
  steps counted:        steps in the history beside the training batches run
  evaluation share:     the evaluations' time beside the training steps' (the summary's
                        line), and the whole run's wall time with and without them
  gather:               one loader.gather of the per-sample losses, beside the pass that
                        computed them and beside a sum-and-count all_reduce of the same
                        losses (what a hand-written mean needs; it counts
                        DistributedSampler's repeated samples twice); medians over passes

    python benchmarks/evaluation.py [--repeats 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nbtrain

TRAIN, FEATURES, CLASSES = 4096, 512, 10


def _data(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, FEATURES, generator=g),
                                          torch.randint(0, CLASSES, (n,), generator=g))


def train(ctx, epochs: int, evaluate: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 1024), nn.ReLU(), nn.Linear(1024, 384),
                          nn.ReLU(), nn.Linear(384, CLASSES))
    model, opt = ctx.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = ctx.dataloader(_data(TRAIN, 0), batch_size=32, shuffle=True)
    val = ctx.dataloader(_data(TRAIN // 4 + 1, 1), batch_size=128)  # +1: a repeated sample
    gather_s, reduce_s, pass_s = [], [], []
    for _ in loader.epochs(epochs):
        model.train()
        for x, y in loader:
            ctx.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        if not evaluate:
            continue
        model.eval()
        dist.barrier()
        t = time.perf_counter()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x), y, reduction="none") for x, y in val]
        pass_s.append(time.perf_counter() - t)
        dist.barrier()  # neither timing waits for the slower rank's pass
        t = time.perf_counter()
        val.gather(losses).mean()
        gather_s.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        both = torch.stack([torch.cat(losses).sum(), torch.tensor(float(sum(map(len, losses))))])
        dist.all_reduce(both)
        reduce_s.append(time.perf_counter() - t)
    return {"batches": epochs * len(loader), "gather": gather_s, "reduce": reduce_s,
            "pass": pass_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    runs: dict[bool, list] = {True: [], False: []}
    for _ in range(args.repeats):
        for evaluate in (True, False):
            started = time.monotonic()
            run = nbtrain.launch(train, args.epochs, evaluate, devices=2, strategy="ddp",
                                 dashboard=False)
            runs[evaluate].append((run, time.monotonic() - started))

    def median(values):
        return statistics.median(values) if values else float("nan")

    step = {e: median([r.summary().step_time * 1000 for r, _ in runs[e]]) for e in runs}
    wall = {e: median([s for _, s in runs[e]]) for e in runs}
    first = runs[True][0][0]
    counted = len(first.history.events("step", 0))
    batches = first.result["batches"]
    shares = [re.search(r"beside .*?, (\d+)% of the time", r.summary().evaluation or "")
              for r, _ in runs[True]]
    gather = median([s * 1000 for r, _ in runs[True] for s in r.result["gather"]])
    reduce = median([s * 1000 for r, _ in runs[True] for s in r.result["reduce"]])
    print(f"2 CPU ranks, DDP, {args.epochs} epochs of {TRAIN // 64} steps a rank, "
          f"medians of {args.repeats} runs each")
    print(f"{'':22}{'with':>10}{'without':>10}{'ratio':>8}")
    print(f"{'step ms (nbtrain)':22}{step[True]:>10.2f}{step[False]:>10.2f}"
          f"{step[True] / step[False]:>8.2f}")
    print(f"{'run wall s':22}{wall[True]:>10.2f}{wall[False]:>10.2f}"
          f"{wall[True] / wall[False]:>8.2f}")
    print(f"steps counted: {counted} of {batches} training batches run (with evaluations)")
    print("evaluation share: " + ", ".join(f"{m.group(1)}%" if m else "-" for m in shares)
          + " of the time in training steps and evaluations")
    passes = median([s * 1000 for r, _ in runs[True] for s in r.result["pass"]])
    print(f"gather: {gather:.2f} ms a pass ({gather / passes:.1%} of the pass's "
          f"{passes:.1f} ms) beside {reduce:.2f} ms for a sum-and-count all_reduce")


if __name__ == "__main__":
    main()
