"""The ZeRO ladder measured: one model, each rung, 2 ranks.

DDP, ZeRO-1 (ZeroRedundancyOptimizer), SHARD_GRAD_OP (fsdp_grad_op), FULL_SHARD (fsdp)
and, on CUDA, FULL_SHARD + CPU offload — each with and without activation
checkpointing of the model's blocks; DeepSpeed's stages 1-3 beside them where it is
installed (``nbtrain[deepspeed]``). For every rung: the bytes rank 0 holds per category
after an optimizer step (params, grads, optimizer state, measured from the tensors;
activations saved for backward by one forward, from ``Telemetry(profile_memory=True)``)
beside the ZeRO formula (``nbtrain.ui.theory``), and the median step time relative to
DDP's. On CPU that is the guide's table on the machine you have; on CUDA add the
allocator's peak.

    python benchmarks/memory_ladder.py [--steps 30] [--width 512] [--depth 4] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import nbtrain
from nbtrain.ui.theory import theoretical_bytes


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(ctx, steps: int, width: int, depth: int, batch: int):
    torch.manual_seed(0)
    with ctx.init_module():
        model = Model(width, depth)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, opt = ctx.setup(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(batch * 16, width, generator=g).to(ctx.device)  # 16 tokens per sample
    y = torch.randint(0, 10, (batch * 16,), generator=g).to(ctx.device)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
    return sum(p.numel() for p in Model(width, depth).parameters())


def rungs(cuda: bool) -> list[str]:
    from nbtrain.strategies.deepspeed import available

    deepspeed = ["deepspeed_stage_1", "deepspeed", "deepspeed_stage_3"] if available() else []
    return (["ddp", "zero1", "fsdp_grad_op", "fsdp"] + (["fsdp_offload"] if cuda else [])
            + deepspeed)


def measure(name: str, checkpointing: bool, args, accelerator: str) -> dict:
    strategy = nbtrain.strategies.get(name, activation_checkpointing=(Block,) if checkpointing
                                      else None)
    run = nbtrain.launch(train, args.steps, args.width, args.depth, args.batch, devices=2,
                         accelerator=accelerator, strategy=strategy, dashboard=False,
                         telemetry=nbtrain.Telemetry(memory_every=5, profile_memory=True))
    memory = [e for e in run.history.events("memory", 0)][-1].values
    steps = [e.duration for e in run.history.events("step", 0)][3:]  # after warm-up
    return {"n": run.result, "memory": memory, "step_s": statistics.median(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if args.steps < 5:
        parser.error(f"--steps {args.steps}: give at least 5 (the first 3 are warm-up, left "
                     "out of the step time)")
    accelerators = ["cpu"] + (["cuda"] if torch.cuda.device_count() >= 2 else [])
    mb = 2 ** 20
    for accelerator in accelerators:
        print(f"\n{accelerator}, 2 ranks, rank 0; MB measured (formula)")
        header = (f"{'strategy':<19}{'AC':<4}{'params':>16}{'grads':>16}{'optimizer':>16}"
                  f"{'activations':>13}{'peak':>9}{'step vs ddp':>13}")
        if accelerator == "cuda":
            header += f"{'cuda_peak':>11}"
        print(header)
        base = None
        for name in rungs(accelerator == "cuda"):
            for checkpointing in (False, True):
                m = measure(name, checkpointing, args, accelerator)
                theory = theoretical_bytes(name, m["n"], 2)
                base = base or m["step_s"]
                mem = m["memory"]
                cells = "".join(f"{mem[c] / mb:>8.2f} ({theory[c] / mb:>5.2f})"
                                for c in ("params", "grads", "optimizer"))
                line = (f"{name:<19}{'on' if checkpointing else 'off':<4}{cells}"
                        f"{mem['activations'] / mb:>13.2f}{mem['peak'] / mb:>9.2f}"
                        f"{m['step_s'] / base:>12.2f}x")
                if accelerator == "cuda":
                    line += f"{mem.get('cuda_peak', 0) / mb:>11.2f}"
                print(line, flush=True)
        print(f"Ψ = {m['n']:,} parameters; Adam, fp32. Formula: 4Ψ/4Ψ/8Ψ, what is sharded / 2"
              + ("; DeepSpeed adds its fp32 master partition, 4Ψ/2, to the optimizer."
                 if any(n.startswith("deepspeed") for n in rungs(False)) else "."))


if __name__ == "__main__":
    main()
