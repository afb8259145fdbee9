"""Where does a launch's start-up go? One launch, from the cell's start to its return,
on one clock.

A real Jupyter kernel (jupyter_client, as Jupyter drives one) with nbtrain's defaults
(telemetry, the time breakdown, the dashboard: static here, no widget manager), and the
workload ``benchmarks/launch.py`` times: a 0.92M-parameter MLP, AdamW, a DataLoader, 2
CPU ranks. Before the launch, a cell wraps the functions a launch passes through; the
kernel's marks are kept in the kernel, the ranks' (forked: they inherit the wraps) are
appended to a file; every mark is ``time.monotonic()``, one clock for every process on
the host. Printed: each mark's time since the request to run the cell was sent (Shift+Enter;
median of ``--repeats``
launches, each in a new kernel: the first launch of a kernel, what a user waits for
first; with ``--warm``, the second launch of each kernel), and the step from the mark
before, so the next regression shows where it came from. The kernel sits idle
``--pause`` seconds after the cell that imported nbtrain (a user writing the launch cell;
0: "Run All", where the launch cell waits for whatever the kernel does between cells).

    python benchmarks/timeline.py [--repeats 5] [--warm] [--start-method fork] [--pause 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)

WORKLOAD = """
import torch
from torch import nn

def train(ctx, steps=20):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 384),
                          nn.ReLU(), nn.Linear(384, 10))
    model, opt = ctx.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    data = torch.utils.data.TensorDataset(torch.randn(64 * steps, 512),
                                          torch.randint(0, 10, (64 * steps,)))
    for x, y in ctx.dataloader(data, batch_size=32):
        ctx.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
"""

# Wrap what a launch passes through: the kernel's marks in MARKS, a rank's in the file.
PROBES = """
import os, time, functools
MARKS, SEEN, FILE = [], set(), {file!r}

KERNEL = os.getpid()

def mark(name, rank=None):
    if os.getpid() != KERNEL:  # a rank (forked: it has these wraps too)
        rank = os.environ.get("RANK", "?") if rank is None else rank
        with open(FILE, "a") as f:
            f.write(f"{{rank}} {{name}} {{time.monotonic()!r}}\\n")
    else:
        MARKS.append((name, time.monotonic()))

def probe(owner, attr, before=None, after=None, once=True):
    if not hasattr(owner, attr):  # (an older nbtrain's path)
        return
    inner = getattr(owner, attr)
    key = (owner, attr)
    @functools.wraps(inner)
    def wrapped(*args, **kwargs):
        first = key not in SEEN
        SEEN.add(key)
        if before and (first or not once):
            spec = args[0] if args and hasattr(args[0], "rank") else None
            mark(before, spec.rank if spec is not None else None)
        out = inner(*args, **kwargs)
        if after and (first or not once):
            mark(after)
        return out
    setattr(owner, attr, wrapped)

import nbtrain
from nbtrain.launch import start
from nbtrain.launch.starting import devices
from nbtrain.rank import worker
from nbtrain import run as run_module
from nbtrain.telemetry import channel
import torch.distributed as dist
probe(start, "execute", "kernel: launch's path begins")
probe(start, "open_run", after="kernel: run and view open (header shown)")
probe(start, "start_ranks", "kernel: starting ranks", "kernel: ranks started")
probe(run_module.Run, "follow", "kernel: following the ranks")
probe(worker, "main", "rank: process alive")
probe(dist, "init_process_group", "rank: process group init", "rank: process group up")
probe(worker, "execute", "rank: telemetry, ctx, seeds")
probe(run_module.Run, "receive", "kernel: first event received")
from nbtrain.ui import static
probe(static.StaticView, "draw", after="kernel: first figure drawn")
"""

LAUNCH = """
mark("cell begins")
run = nbtrain.launch(train, devices=2, accelerator="cpu", start_method={method!r})
mark("launch returned")
first = min(e.t for e in run.history.events("step", 0))
started = min(e.t for e in run.history.events("lifecycle", 0))
ended = max(e.t for e in run.history.events("lifecycle", 0))
MARKS += [("rank 0: function starts", started), ("rank 0: first step ends", first),
          ("rank 0: function ends", ended)]
import json
print("MARKS", json.dumps(MARKS))
"""


def one(method: str, warm: bool, pause: float) -> dict[str, float]:
    """The marks of one launch in a new kernel, as seconds since its cell began."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ranks.txt")
        kernel = Kernel(startup="import torch")
        try:
            for code in (WORKLOAD, PROBES.format(file=path)):  # PROBES imports nbtrain
                reply = kernel.run(code)
                if reply.error:
                    raise SystemExit(reply.error)
            if warm:
                kernel.run(LAUNCH.format(method=method))
                open(path, "w").close()
                kernel.run("MARKS.clear(); SEEN.clear()")
            time.sleep(pause)
            sent = time.monotonic()
            reply = kernel.run(LAUNCH.format(method=method))
            if reply.error:
                raise SystemExit(reply.error)
        finally:
            kernel.shutdown()
        line = next(x for x in reply.stdout.splitlines() if x.startswith("MARKS "))
        marks = json.loads(line[6:])
        for row in open(path).read().splitlines():
            rank, rest = row.split(" ", 1)
            name, t = rest.rsplit(" ", 1)
            marks.append((name.replace("rank:", f"rank {rank}:"), float(t)))
    marks.append(("Shift+Enter (request sent)", sent))
    begin = sent
    out: dict[str, float] = {}
    for name, t in marks:
        out.setdefault(name, t - begin)  # the first of each
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm", action="store_true",
                        help="time each kernel's second launch instead of its first")
    parser.add_argument("--start-method", default="auto")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="seconds the kernel is idle before the launch cell (default 2)")
    args = parser.parse_args()
    runs = [one(args.start_method, args.warm, args.pause) for _ in range(args.repeats)]
    names = sorted({n for r in runs for n in r}, key=lambda n: statistics.median(
        r[n] for r in runs if n in r))
    print(f"{'first' if not args.warm else 'second'} launch of a kernel, start_method="
          f"{args.start_method!r}, 2 CPU ranks, {args.pause:g} s idle before it; median of "
          f"{args.repeats} (seconds since the request to run the cell)")
    print(f"{'mark':44s} {'at':>8s} {'step':>8s}")
    before = 0.0
    for name in names:
        at = statistics.median(r[name] for r in runs if name in r)
        print(f"{name:44s} {at:8.3f} {at - before:+8.3f}")
        before = at


if __name__ == "__main__":
    main()
