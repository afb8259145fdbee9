"""What does telemetry cost a training step?

The same 2-rank CPU training (~1M-parameter MLP, a few hundred steps, DDP and FSDP)
with telemetry off, with the defaults (metrics, step times, memory every 10 steps,
communication per step), with communication counting alone off, and with every probe
on every step. Rounds are interleaved; each run's steps/s is measured inside rank 0's
loop (launch and teardown excluded). Prints medians and ratios to "off".

    python benchmarks/telemetry_overhead.py [--steps 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import nbtrain

MODES = {
    "off": False,
    "default": True,
    "default, no comm count": nbtrain.Telemetry(comm=False),
    "memory every step + comm": nbtrain.Telemetry(memory_every=1, comm=True),
}


def train(ctx, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 10))  # ~1.06M parameters
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32 * steps * ctx.world_size, 512,
                                                      generator=g),
                                          torch.randint(0, 10, (32 * steps * ctx.world_size,),
                                                        generator=g))
    loader = ctx.dataloader(data, batch_size=32)
    start = None
    for i, (x, y) in enumerate(loader):
        if i == 10:  # leave the warm-up steps out
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
    return (steps - 10) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--strategies", default="ddp,fsdp")
    args = parser.parse_args()
    for strategy in args.strategies.split(","):
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for _ in range(args.rounds):
            for mode, telemetry in MODES.items():
                run = nbtrain.launch(train, args.steps, devices=2, accelerator="cpu",
                                     strategy=strategy, telemetry=telemetry)
                rates[mode].append(run.result)
        base = statistics.median(rates["off"])
        print(f"\n{strategy}: 2 CPU ranks, {args.steps} steps, median of {args.rounds} rounds")
        print(f"{'telemetry':28s} {'steps/s':>9s} {'ratio to off':>13s} {'paired':>7s}   "
              "(all rounds)")
        for mode, values in rates.items():
            med = statistics.median(values)
            # The machine drifts between rounds; each round's ratio to its own "off" run
            # cancels most of that drift.
            paired = statistics.median(v / off for v, off in zip(values, rates["off"],
                                                                  strict=True))
            print(f"{mode:28s} {med:9.1f} {med / base:13.3f} {paired:7.3f}   "
                  + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
