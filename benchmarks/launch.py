"""How fast does a launch start training, and how fast does a failing rank come back?

Side by side, in one process, interleaved: nbtrain fork, nbtrain spawn and, when they are
installed (``pip install -e ".[bench]"``), Lightning's ``Trainer(strategy="ddp_notebook")``
and accelerate's ``notebook_launcher`` on the same 2-rank CPU workload. Prints medians
and ratios to nbtrain fork.

  call -> first step: from the launching call until rank 0 starts its first training step
  call -> error:      from the launching call until the launcher raises, rank 1 having
                      raised at the start of its first step

    python benchmarks/launch.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

import nbtrain

STAMP = os.path.join(tempfile.gettempdir(), f"nbtrain-bench-{os.getpid()}.txt")


def _stamp() -> None:
    with open(STAMP, "w") as f:
        f.write(repr(time.monotonic()))


def _read_stamp() -> float:
    with open(STAMP) as f:
        return float(f.read())


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g),
                                          torch.randint(0, 2, (256,), generator=g))


# -- nbtrain -----------------------------------------------------------------------------
def nbtrain_step(ctx, fail: bool):
    model = _model()
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in ctx.dataloader(_data(), batch_size=32):
        if ctx.rank == 0:
            _stamp()
        if fail and ctx.rank == 1:
            raise ValueError("rank 1 fails on purpose")
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        break
    return 0


def run_nbtrain(method: str, fail: bool) -> float:
    t = time.monotonic()
    try:
        nbtrain.launch(nbtrain_step, fail, devices=2, accelerator="cpu", start_method=method,
                       telemetry=False)
    except nbtrain.WorkerError:
        return time.monotonic() - t
    return _read_stamp() - t


# -- Lightning ---------------------------------------------------------------------------
def run_lightning(fail: bool) -> float:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, i):
            if self.global_rank == 0 and i == 0:
                _stamp()
            if fail and self.global_rank == 1:
                raise ValueError("rank 1 fails on purpose")
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(_data(), batch_size=32)
    t = time.monotonic()
    try:
        trainer.fit(Module(), loader)
    except Exception:
        return time.monotonic() - t
    return _read_stamp() - t


# -- accelerate --------------------------------------------------------------------------
def _accelerate_fn(fail: bool):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=32)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        if accelerator.process_index == 0:
            _stamp()
        if fail and accelerator.process_index == 1:
            raise ValueError("rank 1 fails on purpose")
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        break


def run_accelerate(fail: bool) -> float:
    from accelerate import notebook_launcher

    t = time.monotonic()
    try:
        notebook_launcher(_accelerate_fn, (fail,), num_processes=2)
    except Exception:
        return time.monotonic() - t
    return _read_stamp() - t


def _available(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    contenders = {"nbtrain fork": lambda fail: run_nbtrain("fork", fail),
                  "nbtrain spawn": lambda fail: run_nbtrain("spawn", fail)}
    if _available("lightning"):
        contenders["Lightning ddp_notebook"] = run_lightning
    if _available("accelerate"):
        contenders["accelerate notebook_launcher"] = run_accelerate
    skipped = [n for n in ("lightning", "accelerate") if not _available(n)]
    times: dict[str, dict[str, list[float]]] = {n: {"step": [], "error": []} for n in contenders}
    warnings.filterwarnings("ignore")
    for fn in contenders.values():  # warm-up: first imports are not launch cost
        fn(False)
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            times[name]["step"].append(fn(False))
            times[name]["error"].append(fn(True))
    base = {k: statistics.median(times["nbtrain fork"][k]) for k in ("step", "error")}
    print(f"\n2 ranks on CPU (gloo), {os.cpu_count()} cores, torch {torch.__version__}, "
          f"median of {args.repeats}")
    print(f"{'launcher':30s} {'call->first step':>17s} {'ratio':>6s} {'call->error':>12s} "
          f"{'ratio':>6s}")
    for name, t in times.items():
        step, error = statistics.median(t["step"]), statistics.median(t["error"])
        print(f"{name:30s} {step:16.3f}s {step / base['step']:6.2f} {error:11.3f}s "
              f"{error / base['error']:6.2f}")
    if skipped:
        print(f"(not installed, skipped: {', '.join(skipped)}; pip install -e \".[bench]\")")
    if os.path.exists(STAMP):
        os.remove(STAMP)


if __name__ == "__main__":
    main()
