"""What a warm ``RankPool`` saves, as a notebook user sees it.

One real Jupyter kernel (jupyter_client, the way Jupyter drives one), 2 CPU ranks (gloo),
a 0.92M-parameter MLP with AdamW, nbtrain's defaults on (telemetry and dashboard):

  cold launch() fork / spawn:  nbtrain.launch from the call until rank 0 starts its
                               first step (workers started and ended every time)
  pool (spawn) start:          RankPool(start_method="spawn") until its process group is up
  pool.launch call->step:      the same training on the pool's warm workers (first call,
                               then the median of later ones)
  %%ranks print(rank):         a cell on both ranks, inside the kernel and as the client
                               sees it (execute request to idle)
  memory after a run:          bytes of live tensors on each rank before any run and after
                               each pool.launch (what a run made is freed)
  a stuck cell, then the next: rank 0 all-reduces alone (timeout=1), then a cell on both
                               ranks: from the timeout until that cell returns, with the
                               stuck rank freed (the pool goes on, names kept) and, side
                               by side, with freeing off (the pool is ended and the next
                               cell starts new workers: what every stuck cell cost before)

    python benchmarks/pool.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)
from launch import COMMON, NBTRAIN, value  # noqa: E402  (the same workload, cell by cell)

# The workload of benchmarks/launch.py, cell for cell: train(ctx, fail) and its helpers.
SETUP = COMMON + "import nbtrain\n" + NBTRAIN.split("def measure(fail):")[0] + """
def cold(method):
    t = time.monotonic()
    nbtrain.launch(train, False, devices=2, accelerator="cpu", start_method=method)
    return since(t)

def pooled():
    t = time.monotonic()
    pool.launch(train, False)
    return since(t)

def cell():
    t = time.monotonic()
    pool.run("print(rank)")
    return time.monotonic() - t

def tensors():
    return [row["tensor_bytes"] for row in pool.status]

def stuck_then_next(free):
    if not free:  # nobody to free it: the pool is ended, as before peers could
        pool.channel._dropper = lambda: (lambda busy: set())
    pool.run("keep = rank")
    t = time.monotonic()
    try:
        pool.run("dist.all_reduce(torch.ones(1))", ranks=0, timeout=1)
    except nbtrain.RunTimeoutError:
        pass
    kept = pool.run("print(rank)\\n'keep' in globals()") == {0: "True", 1: "True"}
    pool.channel.__dict__.pop("_dropper", None)
    return time.monotonic() - t - 1, kept
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernel = Kernel(startup=textwrap.dedent(SETUP))
    n = args.repeats
    try:
        assert kernel.run("%load_ext nbtrain").error is None
        first = {m: value(kernel, f"cold({m!r})") for m in ("fork", "spawn")}
        cold = {m: [] for m in ("fork", "spawn")}
        for _ in range(n):  # interleaved, so machine load falls on both alike
            for m in cold:
                cold[m].append(value(kernel, f"cold({m!r})"))
        start = value(kernel, """(lambda t: (globals().__setitem__("pool", nbtrain.RankPool(
            devices=2, accelerator="cpu", start_method="spawn")), time.monotonic() - t)[1])(
            time.monotonic())""")
        params = value(kernel, "sum(p.numel() for p in make_model().parameters())")
        baseline = value(kernel, "tensors()")
        first_pool = value(kernel, "pooled()")
        after = [value(kernel, "tensors()")]
        later = []
        for _ in range(n):
            later.append(value(kernel, "pooled()"))
            after.append(value(kernel, "tensors()"))
        cells_in, cells_client = [], []
        for _ in range(max(n, 10)):
            cells_in.append(value(kernel, "cell()"))
            reply = kernel.run("%%ranks\nprint(rank)")
            assert "[rank 1] 1" in reply.stdout, reply
            cells_client.append(reply.seconds)
        stuck = {True: [], False: []}
        for _ in range(n):
            for free in stuck:
                seconds, kept = value(kernel, f"stuck_then_next({free})")
                assert kept == free, (free, kept)
                stuck[free].append(seconds)
        assert kernel.run("pool.close()").error is None
    finally:
        kernel.shutdown()
    med = statistics.median
    print(f"\nIn one Jupyter kernel: 2 ranks on CPU (gloo), 0.92M-parameter MLP + AdamW, "
          f"defaults on; {os.cpu_count()} cores, torch {torch.__version__}; "
          f"median of {n} unless said")
    print(f"{'':38s} {'first':>8s} {'median':>8s}")
    for m in ("fork", "spawn"):
        print(f"{'cold launch() ' + m + ' call->step':38s} {first[m]:7.3f}s "
              f"{med(cold[m]):7.3f}s")
    print(f"{'pool (spawn) start':38s} {start:7.3f}s")
    print(f"{'pool.launch call->step':38s} {first_pool:7.3f}s {med(later):7.3f}s"
          f"   (max {max(later):.3f}s)")
    print(f"{'%%ranks print(rank), in the kernel':38s} {cells_in[0]:7.3f}s "
          f"{med(cells_in):7.3f}s   (of {len(cells_in)})")
    print(f"{'%%ranks print(rank), client round trip':38s} {cells_client[0]:7.3f}s "
          f"{med(cells_client):7.3f}s")
    print(f"speed-up of a later pool.launch: {med(cold['fork']) / med(later):.1f}x over cold "
          f"fork, {med(cold['spawn']) / med(later):.1f}x over cold spawn")
    print(f"{'a stuck cell, then the next: freed':38s} {stuck[True][0]:7.3f}s "
          f"{med(stuck[True]):7.3f}s   (past the timeout; names kept)")
    print(f"{'  the same, the pool ended (before)':38s} {stuck[False][0]:7.3f}s "
          f"{med(stuck[False]):7.3f}s   (names lost; ended/freed "
          f"{med(stuck[False]) / med(stuck[True]):.1f}x)")
    kb = [[b / 1024 for b in row] for row in [baseline, *after]]
    print("live tensor KiB per rank: before any run " +
          ", ".join(f"{v:.1f}" for v in kb[0]) + "; after each pool.launch " +
          "; ".join(", ".join(f"{v:.1f}" for v in row) for row in kb[1:]) +
          f"   (params, grads and AdamW state of the {params / 1e6:.2f}M-parameter model: "
          f"{16 * params / 2**20:.1f} MiB per rank)")


if __name__ == "__main__":
    main()
