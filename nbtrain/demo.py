"""``python -m nbtrain demo``: the quickstart model trained with each strategy on 2 CPU
ranks, a per-rank table for each, and a self-contained HTML report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import strategies
from .examples.charlm import train_charlm
from .launch import launch
from .ui.report import write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m nbtrain demo",
        description="Train a small character-level transformer with each strategy on "
                    "2 ranks (CPU processes with gloo by default), print per-rank loss, "
                    "step time and memory by category, and write an HTML report.")
    p.add_argument("--strategies", default="ddp,fsdp",
                   help=f"comma-separated, from: {', '.join(strategies.names())} "
                        "(default: ddp,fsdp)")
    p.add_argument("--devices", type=int, default=2, help="ranks per run (default: 2)")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda", "auto"],
                   help="cpu (default), cuda, or auto")
    p.add_argument("--steps", type=int, default=60, help="training steps per run (default: 60)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default: 32)")
    p.add_argument("--output", default="nbtrain-report.html",
                   help="HTML report path (default: nbtrain-report.html); '' for none")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for name in names:
        if name not in strategies.names():
            p.error(f"unknown strategy {name!r}; known: {', '.join(strategies.names())}")
    if args.steps < 1 or args.devices < 1:
        p.error("--steps and --devices must be at least 1")
    args.strategies = names
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    for name in args.strategies:
        print(f"\n== {name} on {args.devices} × {args.accelerator}: "
              f"{strategies.describe(aliases=True)[name]}", flush=True)
        t = time.monotonic()
        run = launch(train_charlm, devices=args.devices, accelerator=args.accelerator,
                     strategy=name, steps=args.steps, batch_size=args.batch_size)
        losses = run.result["losses"]
        print(f"done in {time.monotonic() - t:.1f}s ({run.start_method}); rank 0 loss "
              f"{losses[0]:.3f} -> {losses[-1]:.3f}")
        print(run.summary())
        runs.append(run)
    if args.output:
        path = write_report(runs, Path(args.output))
        print(f"\nreport: {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
