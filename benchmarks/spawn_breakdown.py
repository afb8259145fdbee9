"""Where do a spawned launch's seconds go, and which of them are nbtrain's?

A spawned worker is a new interpreter: it imports torch again, then nbtrain, joins the
process group, and only then runs the user's function, whose first optimizer imports
``torch._dynamo``. This benchmark launches the same training function with fork and with
spawn from a real Jupyter kernel (jupyter_client; telemetry and dashboard on), times each
phase on rank 0 on one clock (CLOCK_MONOTONIC; a process's start time comes from
``/proc/self/stat``), and sets beside them what the imports cost in a plain
``python -c``: torch alone, and what nbtrain's worker side adds to it.

  kernel: call -> worker exists       nbtrain in the kernel: arguments, store, telemetry
                                      server, starting the processes
  worker: start -> function called    interpreter, imports, unpickling, process group
                                      (and on a GPU the CUDA context and NCCL)
  first optimizer                     torch._dynamo's import (a fork inherits it warm)
  ctx.setup                           moving and wrapping the model
  first step                          forward, backward, optimizer step (synchronised)
  function end -> call returns        results back, workers reaped, teardown

    python benchmarks/spawn_breakdown.py [--repeats 3] [--accelerator cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)

CELL = """
import json, os, time
import torch
from torch import nn
import nbtrain

def started_at():
    \"\"\"This process's start, on time.monotonic()'s clock.\"\"\"
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    boot = ticks / os.sysconf("SC_CLK_TCK")  # CLOCK_BOOTTIME at the start
    return time.monotonic() - (time.clock_gettime(time.CLOCK_BOOTTIME) - boot)

def train(ctx):
    t = {"worker_start": started_at(), "fn": time.monotonic()}
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t["optimizer"] = time.monotonic()
    model, opt = ctx.setup(model, opt)
    t["setup"] = time.monotonic()
    x = torch.randn(64, 256, device=ctx.device)
    y = torch.randint(0, 10, (64,), device=ctx.device)
    loss = nn.functional.cross_entropy(model(x), y)
    ctx.backward(loss)
    opt.step()
    opt.zero_grad()
    ctx.log(loss=loss)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    t["step"] = time.monotonic()
    return t

def measure(method):
    call = time.monotonic()
    run = nbtrain.launch(train, devices=DEVICES, accelerator=ACC, start_method=method)
    t = dict(run.results[0], call=call, returned=time.monotonic())
    return {
        "kernel: call -> worker exists": t["worker_start"] - t["call"],
        "worker: start -> function called": t["fn"] - t["worker_start"],
        "first optimizer": t["optimizer"] - t["fn"],
        "ctx.setup": t["setup"] - t["optimizer"],
        "first step": t["step"] - t["setup"],
        "function end -> call returns": t["returned"] - t["step"],
        "total": t["returned"] - t["call"],
    }
"""

# What a spawned worker imports, stage by stage, timed inside one new interpreter.
IMPORTS = """
import json, time
stages = [("torch", "import torch"),
          ("multiprocess and dill (spawn's machinery)", "import multiprocess, dill"),
          ("nbtrain (worker side)", "import nbtrain.rank.worker, nbtrain.context"),
          ("torch._dynamo (a fork's first launch imports it in the kernel)",
           "import torch._dynamo")]
seconds = {}
for name, code in stages:
    start = time.perf_counter()
    exec(code)
    seconds[name] = time.perf_counter() - start
print(json.dumps(seconds))
"""


def import_seconds(repeats: int) -> dict[str, float]:
    runs = [json.loads(subprocess.run([sys.executable, "-c", IMPORTS], check=True,
                                      capture_output=True, text=True).stdout)
            for _ in range(repeats)]
    return {name: statistics.median(r[name] for r in runs) for name in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--methods", nargs="+", choices=("fork", "spawn"),
                        default=["fork", "spawn"], help="start methods to time (on a GPU "
                        "a spawned launch takes seconds: --methods fork to leave it out)")
    parser.add_argument("--devices", type=int, default=None,
                        help="ranks (default: 2 on CPU, up to 2 GPUs on cuda)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        parser.error("reads process start times from /proc: Linux only")
    if args.accelerator == "cuda" and not torch.cuda.device_count():  # NVML: no CUDA init
        parser.error("--accelerator cuda: this machine shows no GPU")
    n = args.devices or (2 if args.accelerator == "cpu" else min(2, torch.cuda.device_count()))
    kernel = Kernel(startup=f"ACC = {args.accelerator!r}; DEVICES = {n}")
    phases: dict[str, dict[str, list[float]]] = {m: {} for m in args.methods}
    first: dict[str, dict[str, float]] = {}

    def measure(method: str) -> dict[str, float]:
        reply = kernel.run(f"print(json.dumps(measure({method!r})))", timeout=600)
        if reply.error:
            raise RuntimeError(f"{method}: {reply.error['ename']}: {reply.error['evalue']}")
        return json.loads(reply.stdout.strip().splitlines()[-1])

    try:
        reply = kernel.run(textwrap.dedent(CELL))
        if reply.error:
            raise RuntimeError(f"{reply.error['ename']}: {reply.error['evalue']}")
        for method in phases:  # a kernel's first launch of each kind pays once: shown apart
            first[method] = measure(method)
        for _ in range(args.repeats):
            for method, rows in phases.items():
                for name, seconds in measure(method).items():
                    rows.setdefault(name, []).append(seconds)
    finally:
        kernel.shutdown()
    imports = import_seconds(args.repeats)
    ranks = (f"{n} ranks on CPU (gloo)" if args.accelerator == "cpu" else
             f"{n} x {torch.cuda.get_device_name(0)} (NCCL)")
    print(f"\nIn a Jupyter kernel: {ranks}, 0.92M-parameter MLP + AdamW, defaults on; "
          f"{os.cpu_count()} cores, torch {torch.__version__}; rank 0, median of "
          f"{args.repeats} later launches")
    heads = [f"first {m}" for m in phases] + list(phases)
    both = len(phases) == 2
    print(f"{'phase':36s} " + " ".join(f"{h:>11s}" for h in heads)
          + (f" {'spawn - fork':>13s}" if both else ""))
    for name in first[args.methods[0]]:
        values = [first[m][name] for m in phases]
        values += [statistics.median(phases[m][name]) for m in phases]
        row = f"{name:36s} " + " ".join(f"{v:10.3f}s" for v in values)
        if both:
            row += f" {values[-1] - values[-2]:12.3f}s"
        print(row)
    print("(first: the kernel's first launch of that kind, in a new kernel; the others: "
          "the median of the later launches)")
    print(f"\nThe imports alone, in a new interpreter, one after the other (median of "
          f"{args.repeats}; in a launch every worker imports at once):")
    for name, seconds in imports.items():
        print(f"  {name:44s} {seconds:6.3f}s")

if __name__ == "__main__":
    main()
