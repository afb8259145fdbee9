"""Do 4-rank starts ever hang? Many starts in one real Jupyter kernel, counted.

A forked rank used to wait forever on a glibc lock it inherited held from the kernel
(the kernel's rendezvous store formatted a peer's address with ``getnameinfo`` while the
kernel forked the next rank): about 1 start in 150 with 4 ranks in a kernel, never in a
plain process. This counts starts in a kernel (jupyter_client, the way Jupyter drives
one), each under a deadline, alternating the ways a user starts ranks:

  pool:    nbtrain.RankPool(devices=4, accelerator="cpu") then pool.close()
  launch:  nbtrain.launch(train, devices=4, accelerator="cpu") (dashboard on), one step
  bg:      two background launches of 2 ranks started back to back (the second forks
           while the first's ranks join), then both waited for
  fs:      nbtrain.launch(train, ...) with start_method="forkserver" (the default once a
           cell has touched CUDA)
  quick:   a background launch of a function with no collective (``return ctx.rank``):
           a rank that returns at once must not fail a peer still joining the group

``--busy N`` keeps N processes spinning meanwhile: hosted notebooks are seldom idle.

A start that misses its deadline is counted as a hang, its stacks (kernel and forked
workers, Python and native) are printed, and the kernel is interrupted.

    python benchmarks/start_stress.py [--starts 300] [--kinds pool,launch,bg,fs,quick]
                                      [--deadline 40] [--busy 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)

SETUP = """
import time, torch
from torch import nn
import nbtrain

def train(ctx):
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    loss = model(torch.randn(4, 8, device=ctx.device)).square().mean()
    ctx.backward(loss)
    opt.step()
    ctx.log(loss=loss)
    return ctx.rank

def quick(ctx):
    return ctx.rank
"""

CELLS = {
    "pool": "pool = nbtrain.RankPool(devices={n}, accelerator='cpu'); pool.close()",
    "launch": "assert nbtrain.launch(train, devices={n}, accelerator='cpu').results == "
              "list(range({n}))",
    "bg": "a = nbtrain.launch(train, devices=2, accelerator='cpu', background=True)\n"
          "b = nbtrain.launch(train, devices=2, accelerator='cpu', background=True)\n"
          "a.wait(); b.wait(); assert a.results == b.results == [0, 1]",
    "fs": "assert nbtrain.launch(train, devices={n}, accelerator='cpu', "
          "start_method='forkserver').results == list(range({n}))",
    "quick": "q = nbtrain.launch(quick, devices={n}, accelerator='cpu', background=True)\n"
             "q.wait(); assert q.results == list(range({n}))",
}


def count(kernel: Kernel, starts: int, kinds: list[str], devices: int = 4,
          deadline: float = 40.0, say=print) -> dict[str, dict]:
    """Run ``starts`` starts in ``kernel`` (SETUP already run there), the ``kinds`` in
    turn; per kind: starts, hung, failed and the seconds of those that ended."""
    counts = {k: {"starts": 0, "hung": 0, "failed": 0, "seconds": 0.0} for k in kinds}
    for i in range(starts):
        kind = kinds[i % len(kinds)]
        c = counts[kind]
        c["starts"] += 1
        msg = kernel.submit(CELLS[kind].format(n=devices))
        try:
            reply = kernel.collect(msg, timeout=deadline)
        except TimeoutError as hang:
            c["hung"] += 1
            say(f"start {i + 1} ({kind}) HUNG past {deadline:g}s:\n{str(hang)[-12000:]}")
            kernel.interrupt_group()
            kernel.collect(msg, timeout=120)
            continue
        c["seconds"] += reply.seconds
        if reply.error:
            c["failed"] += 1
            say(f"start {i + 1} ({kind}) failed: {reply.error['ename']}: "
                f"{reply.error['evalue'][:2000]}")
        if (i + 1) % 50 == 0:
            say(f"... {i + 1} starts, {sum(v['hung'] for v in counts.values())} hung")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=300, help="starts in all (default 300)")
    parser.add_argument("--kinds", default="pool,launch,bg,fs,quick",
                        help=f"comma-separated, of {', '.join(CELLS)} (taken in turn)")
    parser.add_argument("--devices", type=int, default=4, help="ranks per start (pool, launch)")
    parser.add_argument("--deadline", type=float, default=40.0,
                        help="seconds a start may take before it counts as a hang")
    parser.add_argument("--busy", type=int, default=0,
                        help="processes spinning on the CPU meanwhile (a loaded machine)")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in CELLS]
    if unknown or not kinds:
        parser.error(f"--kinds: unknown {unknown}; choose from {', '.join(CELLS)}")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    kernel = Kernel(startup=textwrap.dedent(SETUP))
    began = time.monotonic()
    try:
        counts = count(kernel, args.starts, kinds, args.devices, args.deadline,
                       say=lambda text: print(text, flush=True))
    finally:
        kernel.shutdown()
        for p in busy:
            p.kill()
            p.wait()
    total = sum(c["starts"] for c in counts.values())
    hung = sum(c["hung"] for c in counts.values())
    print(f"\nIn one Jupyter kernel: {total} starts in {time.monotonic() - began:.0f} s, "
          f"{os.cpu_count()} cores ({args.busy} kept busy), torch {torch.__version__}, "
          f"deadline {args.deadline:g} s")
    print(f"{'kind':8s} {'starts':>7s} {'hung':>5s} {'failed':>7s} {'mean s':>7s}")
    for kind, c in counts.items():
        done = c["starts"] - c["hung"]
        mean = c["seconds"] / done if done else float("nan")
        print(f"{kind:8s} {c['starts']:7d} {c['hung']:5d} {c['failed']:7d} {mean:7.2f}")
    print(f"hung: {hung} of {total}")
    if hung or any(c["failed"] for c in counts.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
