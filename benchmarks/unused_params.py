"""What finding unused parameters costs under FSDP: steps/s of the same training with
``find_unused_parameters=True`` (the default: one all-reduce of a byte per parameter
tensor before each optimizer step, so parameters no rank used get no gradient) and
``False`` (every parameter reduced, unused ones get zeros), on 2 CPU ranks over gloo,
in rounds that alternate the two; the ratio is taken per round.

The model: the tests' mixture of experts (tokens routed by id; each step leaves some
experts without a token on one rank or on every rank), made wider with ``--width``.

    python benchmarks/unused_params.py [--steps 40] [--rounds 5] [--width 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import models  # noqa: E402  (the tests' models)
import torch  # noqa: E402

import nbtrain  # noqa: E402


def train(ctx, steps: int, width: int) -> float:
    torch.manual_seed(0)
    model = models.MoE(width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    for step in range(steps + 1):
        if step == 1:  # the first step warms up
            start = time.perf_counter()
        ids = models.batch("moe", step, ctx.rank, ctx.world_size)["input_ids"]
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
    return steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for find in ((True, False) if r % 2 == 0 else (False, True)):
            run = nbtrain.launch(train, args.steps, args.width, devices=2,
                                 accelerator="cpu", strategy="fsdp", dashboard=False,
                                 telemetry=False, find_unused_parameters=find)
            rates[find].append(min(run.results))  # the slower rank sets the pace
    ratios = [a / b for a, b in zip(rates[True], rates[False], strict=True)]
    print(f"\nfsdp, 2 CPU ranks, MoE width {args.width}, {args.steps} steps x "
          f"{args.rounds} rounds; steps/s (median)")
    print(f"  find_unused_parameters=True   {statistics.median(rates[True]):8.1f}")
    print(f"  find_unused_parameters=False  {statistics.median(rates[False]):8.1f}")
    print(f"  ratio True/False per round: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
