"""Small, real training functions the launch tests run on 2 CPU ranks."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

N, D, CLASSES = 256, 16, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.head(self.body(x))


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, D, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


def train(ctx, lr=1e-2, batch_size=16, epochs=1):
    """Deterministic: the same seed and data on every rank and every strategy."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    loader = ctx.dataloader(dataset(), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            ctx.backward(loss)
            opt.step()
            opt.zero_grad()
            ctx.log(loss=loss)
    local = {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}
    return {"rank": ctx.rank, "loss": loss.item(), "full": ctx.full_state_dict(model),
            "local": local if ctx.strategy.name.startswith("ddp") else None,
            "threads": torch.get_num_threads(), "env_rank": os.environ["RANK"],
            "device": str(ctx.device), "world_size": ctx.world_size}


def train_single(lr=1e-2, batch_size=16, world_size=2, epochs=1):
    """The same training in one process: each step sees the union of the ranks' batches."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = dataset()
    step = batch_size * world_size
    for _ in range(epochs):
        for start in range(0, N, step):
            x, y = data[start:start + step]
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model.state_dict()


def fail_on(ctx, mode, rank=1, after=0.0):
    """Every rank joins a collective, then ``rank`` fails in the way ``mode`` says."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == rank:
        time.sleep(after)
        if mode == "raise":
            raise ValueError("bad batch on purpose")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)
        if mode == "hang":
            time.sleep(3600)
    dist.all_reduce(t)  # the healthy ranks wait here for the failed one
    return ctx.rank


def sleeper(ctx, seconds=3600):
    print("started", flush=True)
    time.sleep(seconds)


def chatty(ctx, lines=50):
    """Prints long lines in pieces, from every rank at once."""
    for i in range(lines):
        for piece in range(4):
            print(f"r{ctx.rank}-l{i}-p{piece}" + "x" * 50, end="|" if piece < 3 else "\n",
                  flush=True)
    import sys

    print(f"to-stderr-{ctx.rank}", file=sys.stderr, flush=True)
    print("no newline at the end", end="", flush=True)
    return lines


def unpicklable(ctx):
    return {"fine": 1, "gen": (i for i in range(3))}  # a live generator cannot be copied


def param_count() -> int:
    return sum(p.numel() for p in Net().parameters())


def log_many(ctx, steps=300):
    """Logs every step without a dataloader: optimizer steps mark the steps."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ctx.setup(model, opt)
    x = torch.randn(4, 8)
    for i in range(steps):
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss, i=i)
    return steps
