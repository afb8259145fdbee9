"""How fast does a launch start training, as a notebook user sees it?

Each launcher runs in a real Jupyter kernel of its own (jupyter_client, the way Jupyter
drives one), with its defaults on: nbtrain's telemetry and dashboard, Lightning's
progress bar. The workload is what a user writes: a 0.92M-parameter MLP, AdamW, a
DataLoader, on 2 CPU ranks (gloo) or on the GPUs (NCCL, up to 2; one is enough). The
kernels are alive at the same time and take turns, so load on the machine falls on every
launcher alike. Ratios are to Lightning's
``Trainer(strategy="ddp_notebook")``, the usual way to train from a notebook.

  nbtrain (default)         start_method="auto" in a fresh kernel: fork
  nbtrain after CUDA        the default once a cell has put a tensor on a GPU (on CPU,
                            simulated with a fork check that says so, as the tests do):
                            fork server
  nbtrain spawn             start_method="spawn": a new interpreter per rank (on CPU
                            only: on a GPU, benchmarks/spawn_breakdown.py takes it apart)
  nbtrain pool              a RankPool made at the first launch, then pool.launch

  import:         the library's own import (torch is imported already)
  first launch:   the kernel's first launch after the import, to rank 0's first step
  import + first launch: both, each time in a new kernel: what a user waits for in a
                  fresh kernel (a library that warms up at import pays there, nbtrain
                  pays at its first launch)
  call -> step:   later launches, from the call until rank 0 starts its first step
  call -> result: the same launches, until the call returns, the one step trained (the
                  ranks' start, the step, their teardown and the result's way back)
  call -> error:  later launches, until the call raises, the last rank having raised at once

Every figure is the median of ``--repeats`` runs with, in brackets, the lowest and the
highest (import + first launch: of ``--fresh`` new kernels; on a GPU one, to stay within
two minutes). Each launch is printed as it ends.

    python benchmarks/launch.py [--repeats 5]
    python benchmarks/launch.py --accelerator cuda     # on a GPU machine (~2 min)

Lightning and accelerate come with the dev extras (each is skipped when it is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel import Kernel  # noqa: E402  (the tests' jupyter_client driver)

COMMON = """
import json, os, tempfile, time, warnings
import torch
from torch import nn
warnings.filterwarnings("ignore")
STAMP = os.path.join(tempfile.gettempdir(), f"nbtrain-bench-{os.getpid()}.txt")

def stamp():
    with open(STAMP, "w") as f:
        f.write(repr(time.monotonic()))

def since(t):
    with open(STAMP) as f:
        return float(f.read()) - t

def make_model():  # 0.92M parameters
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                         nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))

def make_data():
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(512, 256, generator=g),
                                          torch.randint(0, 10, (512,), generator=g))
"""

NBTRAIN = """

def train(ctx, fail):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    for x, y in ctx.dataloader(make_data(), batch_size=64, shuffle=True):
        if ctx.rank == 0:
            stamp()
        if fail and ctx.rank == FAIL_RANK:
            raise ValueError("a rank fails on purpose")
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
        break
    return loss.item()

def measure(fail):
    t = time.monotonic()
    try:
        if METHOD == "pool":
            global POOL
            if POOL is None:
                POOL = nbtrain.RankPool(devices=DEVICES, accelerator=ACC)
            POOL.launch(train, fail)
        else:
            nbtrain.launch(train, fail, devices=DEVICES, accelerator=ACC,
                           start_method=METHOD)
    except nbtrain.WorkerError:
        return time.monotonic() - t
    return [since(t), time.monotonic() - t]
"""

# After a cell touched CUDA, fork is unsafe and the default starts ranks from the fork
# server. On a GPU a cell puts a tensor there; on a CPU machine the guard is told so, the
# way the tests simulate it.
CUDA_TOUCHED = {
    "cuda": "torch.zeros(1, device='cuda')\n",
    "cpu": """
from nbtrain.launch.starting import guards
guards.FORK_CHECKS.append(lambda: "CUDA was initialised in this kernel (simulated)")
""",
}

LIGHTNING = """

class Module(L.LightningModule):
    def __init__(self, fail):
        super().__init__()
        self.net, self.fail = make_model(), fail

    def training_step(self, batch, i):
        if self.global_rank == 0 and i == 0:
            stamp()
        if self.fail and self.global_rank == FAIL_RANK:
            raise ValueError("a rank fails on purpose")
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

def measure(fail):
    trainer = L.Trainer(accelerator=ACC, devices=DEVICES, strategy="ddp_notebook", max_steps=1,
                        logger=False, enable_checkpointing=False)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=64, shuffle=True)
    t = time.monotonic()
    try:
        trainer.fit(Module(fail), loader)
    except Exception:
        return time.monotonic() - t
    return [since(t), time.monotonic() - t]
"""

ACCELERATE = """

def train(fail):
    accelerator = Accelerator(cpu=ACC == "cpu")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(make_data(), batch_size=64, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for x, y in loader:
        if accelerator.process_index == 0:
            stamp()
        if fail and accelerator.process_index == FAIL_RANK:
            raise ValueError("a rank fails on purpose")
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        break

def measure(fail):
    t = time.monotonic()
    try:
        notebook_launcher(train, (fail,), num_processes=DEVICES)
    except Exception:
        return time.monotonic() - t
    return [since(t), time.monotonic() - t]
"""

BASE = "Lightning ddp_notebook"
# Each library's own import (torch is imported already), timed in its kernel.
NBTRAIN_ROWS = ("nbtrain (default)", "nbtrain after CUDA", "nbtrain spawn", "nbtrain pool")
IMPORTS = {**{name: "import nbtrain" for name in NBTRAIN_ROWS},
           BASE: "import lightning as L",
           "accelerate notebook_launcher": "from accelerate import Accelerator, notebook_launcher"}


def _available(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def contenders(accelerator: str) -> dict[str, str]:
    found = {"nbtrain (default)": "METHOD = 'auto'\n" + NBTRAIN,
             "nbtrain after CUDA": "METHOD = 'auto'\n" + CUDA_TOUCHED[accelerator] + NBTRAIN,
             "nbtrain spawn": "METHOD = 'spawn'\n" + NBTRAIN,
             "nbtrain pool": "METHOD = 'pool'; POOL = None\n" + NBTRAIN}
    if accelerator == "cuda":
        del found["nbtrain spawn"]
    if _available("lightning"):
        found[BASE] = LIGHTNING
    if _available("accelerate"):
        found["accelerate notebook_launcher"] = ACCELERATE
    return found


def value(kernel: Kernel, expr: str, timeout: float = 300, before: str = ""):
    """``expr`` evaluated in ``kernel`` (after the lines ``before``, in the same cell),
    through JSON."""
    reply = kernel.run(f"{before}print(json.dumps({expr}))", timeout=timeout)
    if reply.error:
        raise RuntimeError(f"{reply.error['ename']}: {reply.error['evalue']}\n"
                           + "\n".join(reply.error["traceback"]))
    return json.loads(reply.stdout.strip().splitlines()[-1])


def measure(kernel: Kernel, fail: bool, timeout: float) -> float:
    return value(kernel, f"measure({fail})", timeout=timeout)


class CutOff(Exception):
    """SIGTERM (``timeout`` in .ci/gpu): stop measuring, print what was measured."""


def _cut_off(signum, frame):
    raise CutOff


def median(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f}s" if values else "-"


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{median(values)} [{min(values):.3f}-{max(values):.3f}]"


def ratio(values: list[float], base: list[float]) -> str:
    if not values or not base:
        return "-"
    return f"{statistics.median(values) / statistics.median(base):5.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None,
                        help="later launches per launcher (default: 5 on CPU, 3 on a GPU)")
    parser.add_argument("--fresh", type=int, default=None,
                        help="new kernels for import + first launch (default: --repeats "
                             "on CPU, 1 on a GPU)")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--devices", type=int, default=None,
                        help="ranks (default: 2 on CPU, up to 2 GPUs on cuda)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a launch may take before it counts as hung "
                             "(default: 120 on CPU, 30 on a GPU)")
    args = parser.parse_args()
    cuda = args.accelerator == "cuda"
    args.repeats = args.repeats or (3 if cuda else 5)
    args.fresh = args.fresh or (1 if cuda else args.repeats)
    args.timeout = args.timeout or (30 if cuda else 120)
    if args.accelerator == "cuda" and not torch.cuda.device_count():  # NVML: no CUDA init
        parser.error("--accelerator cuda: this machine shows no GPU")
    n = args.devices or (2 if args.accelerator == "cpu" else min(2, torch.cuda.device_count()))
    where = f"ACC = {args.accelerator!r}; DEVICES = {n}; FAIL_RANK = {n - 1}\n"
    codes = {name: where + code for name, code in contenders(args.accelerator).items()}
    began = time.monotonic()
    signal.signal(signal.SIGTERM, _cut_off)

    def say(line: str) -> None:
        print(f"[{time.monotonic() - began:6.1f}s] {line}", file=sys.stderr, flush=True)

    # Started side by side (each imports torch: seconds on a GPU machine, one after the
    # other a third of .ci/gpu's time for this table); measured one at a time below.
    with ThreadPoolExecutor(len(codes)) as pool:
        started = {name: pool.submit(Kernel, startup=textwrap.dedent(COMMON))
                   for name in codes}
    kernels = {name: future.result() for name, future in started.items()}
    say(f"{len(kernels)} kernels started")
    # Another library's launch that never returned, or failed unasked (its ranks can abort
    # at exit: gloo's teardown): what happened. Its row says so instead of numbers.
    hung: dict[str, str] = {}

    def timed(name: str, fail: bool, kernel: Kernel | None = None):
        """call->error's seconds (``fail``), else call->step's and call->result's."""
        kernel = kernel or kernels[name]
        if name in hung:
            return None
        which = "call->error" if fail else "call->step"
        try:
            seconds = measure(kernel, fail, args.timeout)
            say(f"{name}: call->error {seconds:.3f}s" if fail else
                f"{name}: call->step {seconds[0]:.3f}s, call->result {seconds[1]:.3f}s")
            return seconds
        except TimeoutError:
            if name.startswith("nbtrain"):
                raise  # ours must never hang
            hung[name] = f"hung: a {which} launch gave no reply in {args.timeout:.0f} s"
        except RuntimeError as err:
            if name.startswith("nbtrain"):
                raise  # nor fail
            hung[name] = f"failed: a {which} launch raised {str(err).splitlines()[0][:120]}"
        kernel.shutdown()  # the kernel's process group: its ranks too
        return None

    def fresh(name: str, kernel: Kernel) -> None:
        """The import and the first launch in a new kernel, its code defined between."""
        imported[name].append(value(kernel, "time.monotonic() - _t",
                                    before=f"_t = time.monotonic()\n{IMPORTS[name]}\n"))
        reply = kernel.run(codes[name])
        if reply.error:
            raise RuntimeError(f"{name}: {reply.error['evalue']}")
        seconds = timed(name, False, kernel)
        if seconds is not None:
            first[name].append(seconds[0])
            say(f"{name}: import {imported[name][-1]:.3f}s, first launch {seconds[0]:.3f}s")

    imported = {name: [] for name in codes}
    first = {name: [] for name in codes}
    times = {name: {"step": [], "result": [], "error": []} for name in codes}
    cut = None
    try:
        try:
            for name, kernel in kernels.items():
                fresh(name, kernel)
            for _ in range(args.repeats):
                for name in kernels:
                    for fail in (False, True):
                        seconds = timed(name, fail)
                        if seconds is None:
                            continue
                        if fail:
                            times[name]["error"].append(seconds)
                        else:
                            times[name]["step"].append(seconds[0])
                            times[name]["result"].append(seconds[1])
            for name, kernel in kernels.items():
                if name not in hung:
                    kernel.shutdown()
            kernels.clear()
            # More fresh kernels, one at a time, for the median of import + first launch.
            for _ in range(args.fresh - 1):
                for name in codes:
                    if name in hung:
                        continue
                    kernels[name] = Kernel(startup=textwrap.dedent(COMMON))
                    fresh(name, kernels[name])
                    kernels.pop(name).shutdown()
        except CutOff:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the table first, then the rest
            cut = time.monotonic() - began
        table(args, n, codes, hung, imported, first, times, cut)
    finally:
        for name, kernel in kernels.items():
            if name not in hung:
                kernel.shutdown()


def table(args, n, codes, hung, imported, first, times, cut) -> None:
    for name in codes:  # a cut-off can leave an import without its first launch
        times[name]["sum"] = [i + f for i, f in zip(imported[name], first[name], strict=False)]
    base = BASE if times.get(BASE, {}).get("sum") else "nbtrain (default)"
    ranks = (f"{n} ranks on CPU (gloo)" if args.accelerator == "cpu" else
             f"{n} x {torch.cuda.get_device_name(0)} (NCCL)")
    print(f"\nIn a Jupyter kernel each: {ranks}, 0.92M-parameter MLP + AdamW, "
          f"defaults on; {os.cpu_count()} cores, torch {torch.__version__}; "
          f"median [lowest-highest] of {args.repeats} (import + first launch: of "
          f"{args.fresh}, each in a new kernel); ratios of medians to {base}")
    if cut is not None:
        print(f"(cut off after {cut:.0f} s: what was measured by then; - where nothing was)")
    print(f"{'launcher':29s} {'import':>7s} {'first':>7s} {'import + first launch':>22s} "
          f"{'ratio':>5s} {'call->step':>22s} {'ratio':>5s} {'call->result':>22s} {'ratio':>5s} "
          f"{'call->error':>22s} {'ratio':>5s}")
    for name in codes:
        if name in hung:
            print(f"{name:29s} {hung[name]} (its kernel and ranks ended; no numbers)")
            continue
        row = f"{name:29s} {median(imported[name]):>7s} {median(first[name]):>7s}"
        for kind in ("sum", "step", "result", "error"):
            row += (f" {cell(times[name][kind]):>22s} "
                    f"{ratio(times[name][kind], times[base][kind]):>5s}")
        print(row)
    if "nbtrain after CUDA" in codes and times["nbtrain after CUDA"]["step"]:
        after = ratio(times["nbtrain after CUDA"]["step"], times["nbtrain (default)"]["step"])
        print(f"after CUDA, warm call->step: {after.strip()}x the fork path")
    if base == BASE:  # issue 62's goal on a GPU: each at most 1.0x (.ci/gpu's verdict)
        paths = {"fork": "nbtrain (default)", "fork server": "nbtrain after CUDA"}
        said = [f"{path} call->step {ratio(times[row]['step'], times[base]['step']).strip()}x, "
                f"call->result {ratio(times[row]['result'], times[base]['result']).strip()}x"
                for path, row in paths.items() if row in codes and row not in hung]
        print(f"warm, to {BASE}: {'; '.join(said)}")
    if "nbtrain pool" in codes:
        print("(the pool's first launch includes starting the pool)")
    if n == 1 and "accelerate notebook_launcher" in codes:
        print("(accelerate's notebook_launcher runs a one-process launch in the kernel itself: "
              "no process starts, so its later launches cost next to nothing)")
    missing = [n for n in ("lightning", "accelerate") if not _available(n)]
    if missing:
        print(f"(not installed, skipped: {', '.join(missing)}; pip install -e \".[dev]\")")


if __name__ == "__main__":
    main()
