"""Is ``nbtrain.scaling``'s verdict stable and possible?

The cases issue 63 found unstable or impossible, each measured ``--repeats`` times in one
process, one after the other (machines are shared: side by side is what compares):

  mlp loader:  a 512-wide MLP through ``ctx.dataloader``, batch 4 per rank
  mlp hand:    the same MLP in a hand-written loop that says its samples (``ctx.log``)
  07 win:      notebook 07's first case (16 layers of 32, batch 2048 per rank)
  07 lose:     notebook 07's second (four 1024-wide layers, batch 8 per rank)

Printed per case: each repeat's speed-up on two ranks (and in how many rounds
``scaling()`` measured it: a short function is run again, one rank and two alternately),
the spread between the repeats (largest ÷ smallest - 1), whether any was flagged
superlinear, and the verdict's first words. Goals: speed-ups ≤ 2.1 on two CPU ranks (or
flagged and explained), a spread within 25 %.

    python benchmarks/scaling.py [--repeats 2] [--steps 30] [--cases mlp-loader,...]
"""

from __future__ import annotations

import argparse
import contextlib
import io

import torch
from torch import nn

import nbtrain

CASES = {
    "mlp-loader": dict(width=512, depth=3, batch=4, hand=False),
    "mlp-hand": dict(width=512, depth=3, batch=4, hand=True),
    "07-win": dict(width=32, depth=16, batch=2048, hand=False),
    "07-lose": dict(width=1024, depth=4, batch=8, hand=False),
}


def train(ctx, width: int, depth: int, batch: int, hand: bool, steps: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(ctx.rank)
    data = torch.randn(batch * steps, width, generator=g)
    if hand:
        for i in range(steps):
            x = data[i * batch:(i + 1) * batch].to(ctx.device)
            ctx.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()
            ctx.log(samples=batch)
    else:
        loader = ctx.dataloader(torch.utils.data.TensorDataset(data.repeat(ctx.world_size, 1)),
                                batch_size=batch)
        for (x,) in loader:
            ctx.backward(model(x).pow(2).mean())
            opt.step()
            opt.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"--cases: {unknown} unknown; choose from {list(CASES)}")
    print(f"{'case':11s} {'speed-ups/rounds':24s} {'spread':>7s} {'flagged':>8s}  verdict")
    for name in names:
        speedups, rounds, flagged, said = [], [], False, ""
        for _ in range(args.repeats):
            with contextlib.redirect_stdout(io.StringIO()):  # (its "measuring again")
                run = nbtrain.scaling(train, devices=2, accelerator="cpu", dashboard=False,
                                      steps=args.steps, **CASES[name])
            scaling = run.summary().scaling
            speedups.append(scaling.speedup)
            rounds.append(getattr(scaling, "rounds", 1))  # (before rounds: one)
            flagged |= getattr(scaling, "superlinear", False)  # (before it existed: never)
            said = run.summary().verdict or ""
        spread = max(speedups) / min(speedups) - 1
        shown = " ".join(f"{s:.2f}×/{n}" for s, n in zip(speedups, rounds, strict=True))
        print(f"{name:11s} {shown:24s} {spread:7.0%} {str(flagged):>8s}  {said[:70]}")


if __name__ == "__main__":
    main()
