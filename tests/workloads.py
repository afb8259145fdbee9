"""Small, real training functions the launch tests run on 2 CPU ranks."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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


def schedule(opt):
    """The LR scheduler the scheduled workloads use: halve the rate every 2 steps."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(ctx, lr=1e-2, batch_size=16, epochs=1, scheduler=False):
    """Deterministic: the same seed and data on every rank and every strategy."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    sched = schedule(opt) if scheduler else None
    loader = ctx.dataloader(dataset(), batch_size=batch_size, shuffle=False)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            ctx.backward(loss)
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
            ctx.log(loss=loss)
    local = {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}
    return {"rank": ctx.rank, "loss": loss.item(), "full": ctx.full_state_dict(model),
            "local": local if ctx.strategy.name.startswith("ddp") else None,
            "threads": torch.get_num_threads(), "env_rank": os.environ["RANK"],
            "device": str(ctx.device), "world_size": ctx.world_size,
            "skipped": ctx.skipped_steps, "lr": opt.param_groups[0]["lr"]}


def train_single(lr=1e-2, batch_size=16, world_size=2, epochs=1, precision=None,
                 device="cpu", scheduler=False):
    """The same training in one process: each step sees the union of the ranks' batches.

    With ``precision``, nbtrain's recipe: the model's forward under autocast, the loss on
    its output, and for fp16 a GradScaler, which skips a step whose gradients overflow
    (the first step here: its scaled gradients overflow fp16 at the initial scale).
    """
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    sched = schedule(opt) if scheduler else None
    data = dataset()
    step = batch_size * world_size
    for _ in range(epochs):
        for start in range(0, N, step):
            x, y = (t.to(device) for t in data[start:start + step])
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            if sched is not None:
                sched.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def on_device(ctx):
    """Something on the rank's device: 3.0 when it worked."""
    return torch.ones(3, device=ctx.device).sum().item()


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
        if mode == "segfault":  # a crash in native code
            import ctypes
            ctypes.string_at(0)
        if mode == "mismatch":  # a collective larger than the others' (gloo aborts them)
            t = torch.ones(1000)
        if mode == "alone":  # a collective the others never run
            dist.all_reduce(t)
        if mode == "loader":  # a sample a DataLoader worker cannot load
            for _ in torch.utils.data.DataLoader(Corrupt(), num_workers=1):
                pass
    dist.all_reduce(t)  # the healthy ranks wait here for the failed one
    return ctx.rank


def inner(ctx):
    return ctx.rank


def nested(ctx, what="launch"):
    """A rank that starts ranks of its own (refused)."""
    import nbtrain

    if what == "pool":
        nbtrain.RankPool(devices=2)
    return nbtrain.launch(inner, devices=2, dashboard=False).results


class Corrupt(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 2:
            raise ValueError(f"sample {i} is corrupt")
        return i


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


# -- memory techniques and checkpoints (test_techniques.py, test_checkpoint.py) -------
class Block(nn.Module):
    """A residual MLP block: the unit of activation checkpointing and FSDP wrapping."""

    def __init__(self, width=64):
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Deep(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.inp = nn.Linear(D, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def deep_param_count(width=64, depth=3) -> int:
    return sum(p.numel() for p in Deep(width, depth).parameters())


def _batches(world_size, batch_size, rank=None):
    """Per step: this rank's batch (rank given) or the union of the ranks' batches."""
    data = dataset()
    step = batch_size * world_size
    for start in range(0, N, step):
        if rank is None:
            yield data[start:start + step]
        else:  # the same split as DistributedSampler without shuffling: strided
            idx = list(range(start, start + step))[rank::world_size]
            yield data[idx]


def technique_train(ctx, accumulate=1, clip=None, init_meta=False, lr=1e-2, batch_size=16):
    """Deep + Adam with the technique asked for; returns the full state dict on rank 0."""
    torch.manual_seed(0)
    if init_meta:
        with ctx.init_module():
            model = Deep()
    else:
        model = Deep()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    initial = {k: v.clone() for k, v in ctx.full_state_dict(model).items()}
    acc = ctx.accumulate(model, accumulate)
    micro = batch_size // accumulate
    norms = []
    for x, y in _batches(ctx.world_size, batch_size, ctx.rank):
        for i in range(accumulate):
            with acc:
                xb, yb = x[i * micro:(i + 1) * micro], y[i * micro:(i + 1) * micro]
                xb, yb = xb.to(ctx.device), yb.to(ctx.device)
                loss = nn.functional.cross_entropy(model(xb), yb) / accumulate
                ctx.backward(loss)
        if clip is not None:
            norms.append(ctx.clip_grad_norm_(model, clip, optimizer=opt).item())
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss * accumulate)
    return {"full": ctx.full_state_dict(model), "initial": initial, "norms": norms}


def compile_train(ctx, where="before", backend="aot_eager", save=None):
    """technique_train's training (Deep + Adam, 8 steps) with the model torch.compile'd
    ``before`` ctx.setup (nanoGPT's order) or ``after`` it (the model ctx.setup returns,
    accelerate's order); ``where=None``: not compiled. Rank 0's full state dict, and the
    graph breaks dynamo counted in this rank; ``save``: a checkpoint's path, saved at the end."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if where == "before":
        model = torch.compile(model, backend=backend)
    model, opt = ctx.setup(model, opt)
    if where == "after":
        model = torch.compile(model, backend=backend)
    for x, y in _batches(ctx.world_size, 16, ctx.rank):
        loss = nn.functional.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
    if save:
        ctx.save(save, {"model": model, "optimizer": opt})
    breaks = {reason.split("\n")[0] + ": " + reason.split("Developer debug context:")[-1][:200]
              for reason in counters["graph_break"]}
    return {"full": ctx.full_state_dict(model), "breaks": sum(counters["graph_break"].values()),
            "reasons": sorted(breaks), "graphs": counters["stats"]["unique_graphs"]}


def technique_single(clip=None, precision=None, lr=1e-2, batch_size=16, world_size=2):
    """The same training in one process, on the union of the ranks' batches."""
    torch.manual_seed(0)
    model = Deep()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    norms = []
    for x, y in _batches(world_size, batch_size):
        if precision:
            dtype = torch.bfloat16 if precision == "bf16" else torch.float16
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
        else:
            out = model(x)
        loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
    return {"full": model.state_dict(), "initial": initial, "norms": norms}


# -- meta-device initialisation of torch's own and GPT-style models (test_techniques.py)
class TinyGPT(nn.Module):
    """GPT-style: parameters initialised again by the parent after the children were
    built (``self.apply(self._init_weights)``, a scaled residual projection), a tied
    head, a ``torch.tensor`` parameter, a computed buffer and a ``trunc_normal_``."""

    def __init__(self, vocab=40, width=32, depth=2, block=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.head.weight
        self.gain = nn.Parameter(torch.tensor([1.0, 0.5]))
        self.register_buffer("causal", torch.tril(torch.ones(block, block)))
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("linear2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * depth) ** 0.5)
        nn.init.trunc_normal_(self.wpe.weight, std=0.02)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


INIT_MODELS = {
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(32, 4, 64),
    "TransformerEncoder": lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64),
                                                        3, enable_nested_tensor=False),
    "TinyGPT": TinyGPT,
}


def init_compare(ctx, models=tuple(INIT_MODELS)):
    """Each model built under ctx.init_module() (seed set before the block, then inside
    it) and ordinarily, all set up by the strategy. On rank 0, per case: both full state
    dicts, the next random numbers after construction and whether the head stays tied."""
    out = {}
    for name in models:
        make = INIT_MODELS[name]
        torch.manual_seed(0)
        plain = make()
        plain_next = torch.rand(4)
        plain = ctx.setup(plain)
        plain_state = ctx.full_state_dict(plain)
        plain_inner = getattr(plain, "module", plain)
        for seeded in ("before", "inside"):
            torch.manual_seed(0 if seeded == "before" else 1234)
            with ctx.init_module():
                if seeded == "inside":
                    torch.manual_seed(0)
                model = make()
            meta_next = torch.rand(4)
            model = ctx.setup(model)
            inner = getattr(model, "module", model)
            out[f"{name}, seed {seeded}"] = {
                "meta": ctx.full_state_dict(model), "plain": plain_state,
                "meta_next": meta_next, "plain_next": plain_next,
                "tied": (inner.wte.weight is inner.head.weight,
                         plain_inner.wte.weight is plain_inner.head.weight)
                if name == "TinyGPT" else None}
    return out


class NeedsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.width = int(torch.randint(2, 5, ()).item())  # a value the meta device lacks
        self.fc = nn.Linear(self.width, 1)


def init_misuse(ctx, what):
    """init_module cases that cannot be replayed: they must fail early with a remedy."""
    if what == "values":
        with ctx.init_module():
            NeedsValues()
    if what == "after":
        with ctx.init_module():
            model = Net()
        nn.init.zeros_(model.head.weight)  # on the meta model, after the block
        ctx.setup(model)
    if what == "outside":
        with torch.device("meta"):
            model = Net()
        ctx.setup(model)


def zero_groups(ctx):
    """What zero1 makes of an AdamW with two param groups."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([{"params": model.body.parameters(), "lr": 1e-3},
                             {"params": model.head.parameters(), "weight_decay": 0.5}],
                            lr=2e-3, betas=(0.8, 0.9))
    model, opt = ctx.setup(model, opt)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"type": type(opt).__name__, "inner": type(opt.optim).__name__,
            "groups": groups, "sizes": [len(g["params"]) for g in opt.param_groups]}


def misuse(ctx, what):
    """Calls that must fail with a clear message inside a worker."""
    model, opt = ctx.setup(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    if what == "accumulate":
        ctx.accumulate(model, 0)
    if what == "no_sync":
        with ctx.no_backward_sync(Net()):
            pass
    if what == "clip":
        ctx.clip_grad_norm_(model, -1.0)


def ckpt_train(ctx, path=None, load_from=None, steps=8, save_every=0, stop_after=None,
               full=False, sleep=0.0, global_batch=32, die_at=None, die_by="SIGKILL",
               die_rank=1):
    """Deep + Adam on a fixed global batch, saving {model, optimizer, step} every
    ``save_every`` steps; goes on from ``load_from`` or ``ctx.resume_from`` when given.
    ``die_at``: in the first attempt only (nothing to resume from), rank ``die_rank``
    ends at that step: ``die_by`` a signal's name, "exit" (os._exit(0), no result),
    "raise" (a ValueError of the user's) or "hang" (it stops answering)."""
    torch.manual_seed(0)
    model = Deep()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt)
    state = {"model": model, "optimizer": opt, "step": -1}
    source = load_from or ctx.resume_from
    if source:
        ctx.load(source, state)
    first = state["step"] + 1
    ctx.step = first
    batches = list(_batches(ctx.world_size, global_batch // ctx.world_size, ctx.rank))
    for step in range(first, steps):
        if step == die_at and source is None and ctx.rank == die_rank:
            _die(die_by, step)
        x, y = (t.to(ctx.device) for t in batches[step % len(batches)])
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
        if save_every and (step + 1) % save_every == 0:
            state["step"] = step
            ctx.save(path, state, full=full, resume=True)
            ctx.print(f"saved {step}")
        if step == stop_after:
            break
        time.sleep(sleep)
    return {"full": ctx.full_state_dict(model), "first": first}


def every_train(ctx, path=None, epochs=3, every=6, hand=False, die_at=None,
                die_by="SIGKILL", die_rank=1, out=None, per_epoch=False, accumulate=1,
                snapshot=None, own_seeds=False):
    """ctx.checkpoint_every with a shuffled ctx.dataloader over ``epochs`` epochs (16
    steps each on 2 ranks), noise drawn from each rank's generator every step; or
    ``hand``: a loop without a loader, its batches drawn from the generator. Rank
    ``die_rank`` dies at step ``die_at`` when the run started from step 0. ``per_epoch``:
    the loop is ``loader.epochs(epochs)``, an LR scheduler (in the checkpoint) steps at
    each epoch's end, and the result lists the epochs whose end this attempt ran.
    ``accumulate``: gradients of that many batches per optimizer step (ctx.accumulate).
    ``snapshot``: the model alone is also saved there every 4 steps (ctx.save: an export,
    a best model; not a restart's point). ``own_seeds``: each rank's generator starts from a
    seed of its own (after the model is built) and the logits go through dropout."""
    torch.manual_seed(0)
    model = Deep()
    if own_seeds:
        torch.manual_seed(1000 + 17 * ctx.rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt)
    extra = {}
    if per_epoch:
        extra["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    state = ctx.checkpoint_every(every, path, model=model, optimizer=opt, note="fresh",
                                 **extra)
    first, note = state["step"], state["note"]
    acc = ctx.accumulate(model, accumulate) if accumulate > 1 else None

    def train_step(x, y):
        if ctx.step == die_at and first == 0 and ctx.rank == die_rank:  # a fresh start
            _die(die_by, ctx.step)
        with acc or contextlib.nullcontext():
            logits = model(x + 0.1 * torch.randn_like(x))
            if own_seeds:
                logits = nn.functional.dropout(logits, 0.2)
            loss = nn.functional.cross_entropy(logits, y)
            ctx.backward(loss / accumulate)
        if acc is None or acc.ready:
            opt.step()
            opt.zero_grad()
        ctx.log(loss=loss)
        if snapshot is not None and ctx.step % 4 == 3:
            ctx.save(snapshot, {"model": model})

    if hand:
        for step in range(first, epochs * 16):
            ctx.step = step
            x = torch.randn(8, D).to(ctx.device)
            train_step(x, (x[:, 0] > 0).long())
    elif per_epoch:
        ends = []
        loader = ctx.dataloader(dataset(), batch_size=8, shuffle=True)
        for epoch in loader.epochs(epochs):
            for x, y in loader:
                train_step(x, y)
            extra["scheduler"].step()
            ends.append(epoch)
    else:
        loader = ctx.dataloader(dataset(), batch_size=8, shuffle=True)
        for _ in range(epochs):
            for x, y in loader:
                train_step(x, y)
    result = {"full": ctx.full_state_dict(model), "first": first, "note": note,
              "step_at_end": state["step"]}
    if per_epoch:
        result.update(ends=ends, lr=opt.param_groups[0]["lr"])
    if out and ctx.rank == 0:  # under torchrun, where nothing comes back to a caller
        torch.save(result, out)
    return result


def hang_once(ctx, marker, hang_at=3, steps=6, timeout_s=3.0):
    """All-reduces on a gloo group whose collectives time out after ``timeout_s``; in
    the first attempt (no ``marker`` file yet) rank 1 stops answering at ``hang_at``."""
    import datetime

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    for step in range(steps):
        ctx.step = step
        if step == hang_at and ctx.rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(60)
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
    return total.item()


def _die(how: str, step: int) -> None:
    sys.stdout.flush()
    if how == "exit":
        os._exit(0)
    if how == "raise":
        raise ValueError(f"the user's own error at step {step}")
    if how == "hang":  # stops answering: the others wait in their next collective
        time.sleep(600)
    os.kill(os.getpid(), getattr(signal, how))
    time.sleep(30)  # the signal arrives


def accumulate_steps(ctx, micro=2):
    """DDP with gradient accumulation: only every ``micro``-th batch all-reduces."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt)
    acc = ctx.accumulate(model, micro)
    for x, y in ctx.dataloader(dataset(), batch_size=16):
        with acc:
            ctx.backward(nn.functional.cross_entropy(model(x), y) / micro)
        if acc.ready:
            opt.step()
            opt.zero_grad()
    return 0


# -- seeding (test_seeding.py) ----------------------------------------------------------
def draws(ctx):
    """What the generators give before the function seeds anything, and the data order."""
    import random

    import numpy

    got = {"torch": torch.randn(3), "random": random.random(),
           "numpy": float(numpy.random.rand()), "seed": ctx.seed}
    data = torch.utils.data.TensorDataset(torch.arange(16))
    (order,) = next(iter(ctx.dataloader(data, batch_size=16, shuffle=True)))
    return {**got, "order": order.tolist()}


def paced(ctx, gate, steps=20):
    """Logs once, waits until the file ``gate`` exists (the test's signal), then logs
    ``steps`` more, one every 20 ms (so the telemetry client sends several batches)."""
    ctx.log(x=0.0)
    deadline = time.monotonic() + 120
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} never appeared")
        time.sleep(0.02)
    for i in range(steps):
        ctx.log(x=float(i))
        time.sleep(0.02)
    return ctx.rank


def single_in_worker(ctx, precision=None, world_size=2):
    """``train_single`` on this rank's GPU, so the test process never touches CUDA (which
    would make every later launch in it spawn instead of fork)."""
    return train_single(world_size=world_size, precision=precision, device=str(ctx.device))


def cpu_and_gpu_collectives(ctx, directory):
    """One step with the strategy, then what a user and torch's checkpointing do beside
    the model: a CPU all-reduce, a GPU all-reduce, Python objects, a sharded save."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = ctx.setup(model, opt)
    x, y = (t[:16].to(ctx.device) for t in dataset().tensors)
    ctx.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    on_cpu = torch.full((1,), float(ctx.rank + 1))
    dist.all_reduce(on_cpu)
    on_gpu = torch.full((1,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(on_gpu)
    objects = [None] * ctx.world_size
    dist.all_gather_object(objects, {"rank": ctx.rank})
    ctx.save(directory, {"model": model, "optimizer": opt})
    return {"cpu": on_cpu.item(), "gpu": on_gpu.item(), "objects": objects,
            "device": str(ctx.device)}


def torchrun_style(scale=1.0):
    """Written for torchrun: no ctx, its own process group from the env:// defaults, DDP,
    a DistributedSampler, and destroy_process_group at the end."""
    from torch.distributed import destroy_process_group, init_process_group

    init_process_group(backend="gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(D, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = dataset()
    loader = torch.utils.data.DataLoader(
        data, batch_size=16, sampler=torch.utils.data.DistributedSampler(data, shuffle=False))
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x) * scale, y % 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = (dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"]))
    destroy_process_group()
    return out


def torchrun_style_cuda():
    """The PyTorch DDP tutorial's shape on GPUs: NCCL, LOCAL_RANK's device."""
    from torch.distributed import destroy_process_group, init_process_group

    init_process_group(backend="nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(D, 2).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, D, device="cuda")
    for _ in range(3):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = (dist.get_rank(), dist.get_world_size(), str(next(model.parameters()).device))
    destroy_process_group()
    return out


def grad_storages(ctx):
    """After one backward of ``ctx.setup``'s model: how many parameters have a gradient,
    and in how many separate storages the gradients live."""
    torch.manual_seed(0)
    model = Net()
    model, _ = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(ctx.dataloader(dataset(), batch_size=16)))
    ctx.backward(nn.functional.cross_entropy(model(x), y))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return len(grads), len({g.untyped_storage().data_ptr() for g in grads})


def out_of_memory(ctx, rank=1):
    """Trains a step (the optimizer has its state), then runs out of memory on ``rank``
    as CUDA would say it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 4))
    model, opt = ctx.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(16, 64, device=ctx.device)
    ctx.backward(model(x).pow(2).mean())
    opt.step()
    if ctx.rank == rank:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 "
                                     "has a total capacity of 14.74 GiB of which 1.12 GiB is "
                                     "free.")
    dist.barrier()
    return ctx.rank


def wait_forever(ctx, folder):
    """Writes this rank's pid into ``folder`` and waits, as a rank of a long job would."""
    path = os.path.join(folder, f"rank{ctx.rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)  # whole when it appears: the test reads it at once
    while True:
        time.sleep(0.1)


def device_bound(ctx, steps=6, width=4096, depth=8, batch=8192):
    """Steps whose time is the GPU's: large matmuls queued in microseconds, read back
    (``.item()``) only at the end of each step, in the user's own code."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    x = torch.randn(batch, width, device=ctx.device)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        loss.item()
    return steps


def collections_in_a_rank(ctx):
    """How many objects a full collection leaves alone in this rank (frozen), and what it
    collects of the function's own garbage (a list that holds itself)."""
    import gc

    frozen = gc.get_freeze_count()
    cycle: list = []
    cycle.append(cycle)
    del cycle
    return frozen, gc.collect()
