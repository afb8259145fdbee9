"""How close is ``nbtrain.plan()`` to what a run measures?

For models users bring (GPT-2, Llama, a ViT, a ResNet with BatchNorm, built from configs:
``tests/models.py``), at two batch sizes, under ddp, fsdp, fsdp_grad_op and fsdp with
activation checkpointing: the plan's per-rank parameters, gradients, optimizer state and
activations beside a 2-rank CPU run's (``Telemetry(profile_memory=True)``, the fullest
rank's last memory event), as planned / measured. On CPU ranks a run measures no
allocator peak: its "peak" is the sum of the four, which the last column compares; the
plan's own peak (temporaries included, what a GPU's allocator sees) is printed beside it
for a GPU run to check (``torch.cuda.max_memory_allocated``). Also how long each plan
took. ``--precision bf16``: the same with mixed precision (autocast under ddp, FSDP's
``param_dtype``), planned as the run casts (``nbtrain/halfmeta.py``).

    python benchmarks/plan_accuracy.py [--models gpt2,llama,vit,cnn] [--batches 4,16]
        [--precision bf16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from models import LMS, SEQ, VOCAB, loss_of, make  # noqa: E402

import nbtrain  # noqa: E402

CASES = {"ddp": ("ddp", False), "fsdp": ("fsdp", False), "fsdp_grad_op": ("fsdp_grad_op", False),
         "fsdp + checkpointing": ("fsdp", True)}
CATEGORIES = ("params", "grads", "optimizer", "activations")


def train(ctx, kind: str, batch: int, steps: int = 3):
    torch.manual_seed(0)
    model = make(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = ctx.setup(model, opt)
    n = batch * steps * ctx.world_size
    if kind in LMS:
        data = torch.utils.data.TensorDataset(torch.randint(1, VOCAB, (n, SEQ)))
    else:
        data = torch.utils.data.TensorDataset(torch.randn(n, 3, 16, 16),
                                              torch.randint(0, 10, (n,)))
    for b in ctx.dataloader(data, batch_size=batch):
        named = {"input_ids": b[0]} if kind in LMS else {"x": b[0], "y": b[1]}
        ctx.backward(loss_of(kind, model, named))
        opt.step()
        opt.zero_grad()


def measured(kind: str, batch: int, strategy: str, checkpointing: bool,
             precision: str | None = None) -> dict[str, float]:
    extra = {"activation_checkpointing": "auto"} if checkpointing else {}
    if precision:
        extra["mixed_precision"] = precision
    run = nbtrain.launch(train, kind, batch, devices=2, accelerator="cpu", strategy=strategy,
                         dashboard=False, **extra,
                         telemetry=nbtrain.Telemetry(profile_memory=True, memory_every=1))
    last = [list(run.history.events("memory", rank))[-1].values for rank in (0, 1)]
    return {k: max(v.get(k, 0) for v in last) for k in CATEGORIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama,vit,cnn")
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--precision", default=None, choices=("bf16", "fp16"),
                        help="mixed precision, planned and run (fp32 by default)")
    args = parser.parse_args()
    worst = {k: 1.0 for k in (*CATEGORIES, "sum")}
    print(f"{'model':6s} {'batch':>5s} {'strategy':21s} "
          + " ".join(f"{k:>11s}" for k in (*CATEGORIES, "sum"))
          + f" {'plan peak':>10s} {'plan s':>7s}")
    for kind in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            started = time.perf_counter()
            plan = nbtrain.plan(train, kind, batch, devices=2, accelerator="cpu",
                                strategies=("ddp", "fsdp", "fsdp_grad_op"),
                                mixed_precision=args.precision)
            took = time.perf_counter() - started
            for label, (strategy, checkpointing) in CASES.items():
                row = plan.row(strategy, checkpointing)
                got = measured(kind, batch, strategy, checkpointing, args.precision)
                planned = {k: getattr(row, k) for k in CATEGORIES}
                planned["sum"], got["sum"] = sum(planned.values()), sum(got.values())
                ratios = {k: planned[k] / got[k] if got[k] else float(planned[k] == 0)
                          for k in planned}
                for k, r in ratios.items():
                    if abs(r - 1) > abs(worst[k] - 1):
                        worst[k] = r
                print(f"{kind:6s} {batch:5d} {label:21s} "
                      + " ".join(f"{ratios[k]:11.3f}" for k in ratios)
                      + f" {row.peak / 2**20:8.1f}MB {took:7.1f}")
    print("\nplanned / measured, farthest from 1: "
          + ", ".join(f"{k} {r:.3f}" for k, r in worst.items())
          + " (the bounds: model state within 2 %, activations and the sum within 10 %)")


if __name__ == "__main__":
    main()
