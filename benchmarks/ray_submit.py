"""From the call to the first step: ``submit(engine=nbtrain.Ray())`` beside ``launch()``.

Two CPU ranks train the same small MLP; each repeat times, on this process's clock
(events come back moved onto it), the call until the first step either rank starts (a
``step`` event's time less its duration) and the call until it returns its results.
``launch()`` is measured warm (the kernel's first launch pays its imports, once); Ray's
cluster is started once, before the first submit, and timed on its own: joining or
starting a cluster is paid once per kernel, each submit pays its actors (new worker
processes that import torch and nbtrain), the placement group and the process group.

    python benchmarks/ray_submit.py [--repeats 3] [--nodes 1]

``--nodes 2``: a two-node cluster on this machine (``ray.cluster_utils.Cluster``), one
rank on each (STRICT_SPREAD), as across machines. Needs ``nbtrain[ray]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import nbtrain


def train(ctx, steps: int = 20):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(steps):
        ctx.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return ctx.rank


def timed(start) -> tuple[float, float]:
    """(call -> first step, call -> results) of one run ``start()`` makes."""
    began = time.monotonic()
    run = start()
    run.wait()
    returned = time.monotonic()
    first = min(e.t - e.duration for e in run.history.events("step"))
    return first - began, returned - began


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f} [{min(values):.3f}-{max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()
    try:
        import ray
    except ImportError:
        raise SystemExit("ray_submit.py needs Ray: pip install 'nbtrain[ray]'") from None

    launch = lambda: nbtrain.launch(train, devices=2, accelerator="cpu",  # noqa: E731
                                    dashboard=False, background=True)
    timed(launch)  # the kernel's first launch: its imports, once
    cluster = None
    began = time.monotonic()
    if args.nodes == 2:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False))
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        engine = nbtrain.Ray(cluster.address, placement="STRICT_SPREAD")
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        engine = nbtrain.Ray()
    joined = time.monotonic() - began
    submit = lambda: nbtrain.submit(train, devices=2, engine=engine,  # noqa: E731
                                    dashboard=False)
    rows = {"launch()": ([], []), "submit(Ray)": ([], [])}
    try:
        for _ in range(args.repeats):  # one after the other: a shared machine's drift
            for name, start in (("launch()", launch), ("submit(Ray)", submit)):
                step, done = timed(start)
                rows[name][0].append(step)
                rows[name][1].append(done)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    print(f"Ray cluster of {args.nodes} node(s) started and joined once: {joined:.2f} s")
    print(f"{'seconds, median [range]':24s} {'call -> first step':>24s} "
          f"{'call -> results':>24s}")
    for name, (steps, dones) in rows.items():
        print(f"{name:24s} {cell(steps):>24s} {cell(dones):>24s}")
    ratio = statistics.median(rows["submit(Ray)"][0]) / statistics.median(rows["launch()"][0])
    print(f"submit(Ray) / launch(), call -> first step: {ratio:.1f}x")


if __name__ == "__main__":
    main()
