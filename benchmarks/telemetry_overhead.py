"""What does telemetry cost a training step?

The same 2-rank CPU training (~1M-parameter MLP, a few hundred steps, DDP and FSDP)
with telemetry off, with the defaults (metrics, step times and where they go, memory
every 10 steps, communication per step), with communication counting alone off, with the
time breakdown alone off, and with every probe on every step, all on the same two warm
ranks of a ``RankPool`` (no dashboard: ``dashboard_overhead.py`` measures the kernel's
view). Rounds are interleaved, in an order that alternates between rounds; each run's
steps/s is measured inside rank 0's loop (launch and teardown excluded).

On a shared 2-core machine one run's speed wanders by ±10 %, so a ratio of two runs says
little. Each round's ratio to its own "off" run cancels the drift between rounds; the
median of those paired ratios comes with a 90 % bootstrap interval: a cost of 2 % or more
shows as an interval that lies below 0.98; noise, as a wide one around 1. Fresh launches,
which this measure used before, moved DDP's ratio between invocations by more than its
interval (0.92 to 0.99): each placed its ranks' threads anew. Even on warm ranks a
2 % cost is near what 30 rounds resolve, so a second measure follows that noise cannot
hide: the microseconds
telemetry adds to a step, from a 1-rank run of a tiny model whose step takes a few
hundred microseconds (launch and the first 50 steps excluded), all runs on one warm rank
of a ``RankPool`` (separate launches differed by up to 300 µs a step between themselves
on this machine; the same rank's runs by ~20). At a step time T the ratio is then
T / (T + added). Split into the loop thread's CPU, the telemetry sender's (it encodes the
events, holding the GIL) and the kernel's (it parses them; on 2 cores it takes one from a
rank whose second OpenMP thread spins between parallel regions). Beside it: the same with
every step timed (``timing="every step"``; the default times a sample of steps under 5
ms), and telemetry off with no-op hooks at the points the time breakdown hooks
(``hooked_as_telemetry_hooks``): what torch charges for a hook's being there.

``--compile before`` compiles the model before ``ctx.setup`` (the wrapper's hooks stay
outside the compiled code), ``--compile after`` the model ``ctx.setup`` returns (the
forward's timing hooks are then inside it, and run between its graphs: no graph break for
them since stop 60, two before): torch's inductor, the launches' first steps (the
compile) left out.

    python benchmarks/telemetry_overhead.py [--steps 100] [--rounds 30] [--modes default]
    python benchmarks/telemetry_overhead.py --steps 20 --rounds 1 --tiny-rounds 1 --tiny-steps 100  # smoke
    python benchmarks/telemetry_overhead.py --compile after --modes default --tiny-rounds 0
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import torch
from torch import nn

import nbtrain

MODES = {
    "off": False,
    "default": True,
    "default without comm count": nbtrain.Telemetry(comm=False),
    "default without time breakdown": nbtrain.Telemetry(timing=False),
    "memory every step + comm": nbtrain.Telemetry(memory_every=1, comm=True),
}


def train(ctx, steps: int, compile: str | None = None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 10))  # ~1.06M parameters
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if compile:  # a warm rank compiles afresh each run, as a launch did (no cache limit met)
        torch._dynamo.reset()
    if compile == "before":
        model = torch.compile(model)
    model, opt = ctx.setup(model, opt)
    if compile == "after":
        model = torch.compile(model)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32 * steps * ctx.world_size, 512,
                                                      generator=g),
                                          torch.randint(0, 10, (32 * steps * ctx.world_size,),
                                                        generator=g))
    loader = ctx.dataloader(data, batch_size=32)
    start = None
    for i, (x, y) in enumerate(loader):
        if i == 10:  # leave the warm-up steps out
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
    return (steps - 10) / (time.perf_counter() - start)


def hooked_as_telemetry_hooks(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Hooks of the kinds default telemetry's time breakdown registers, doing nothing:
    a forward pre- and post-hook (the post-hook hooks the output's gradient, whose hook
    queues two of autograd's final callbacks), an optimizer step pre- and post-hook, each
    through ``torch.compiler.disable`` as telemetry's are. What they add to a step is
    torch's price of being hooked at those points, whatever the hooks do."""
    engine = torch.autograd.Variable._execution_engine

    def backward_starts(grad):
        engine.queue_callback(lambda: engine.queue_callback(lambda: None))

    def forward_ends(module, args, output):
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(backward_starts)

    model.register_forward_pre_hook(torch.compiler.disable(lambda module, args: None))
    model.register_forward_hook(torch.compiler.disable(forward_ends))
    opt.register_step_pre_hook(torch.compiler.disable(lambda opt, args, kwargs: None))
    opt.register_step_post_hook(torch.compiler.disable(lambda opt, args, kwargs: None))


def tiny(ctx, steps: int, bare_hooks: bool = False):
    """A step of a few hundred microseconds, so what telemetry adds is most of the difference.
    ``bare_hooks``: with ``hooked_as_telemetry_hooks`` (run with telemetry off). Returns
    seconds per step of the wall clock, of the loop thread's CPU and of the telemetry
    sender thread's CPU (0 without one)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    if bare_hooks:
        hooked_as_telemetry_hooks(model, opt)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8),
                                          torch.randint(0, 2, (4 * steps,)))
    sender = next((time.pthread_getcpuclockid(t.ident) for t in threading.enumerate()
                   if t.name == "nbtrain-telemetry-send"), None)
    start = cpu = sent = None
    for i, (x, y) in enumerate(ctx.dataloader(data, batch_size=4)):
        if i == 50:
            start, cpu = time.perf_counter(), time.thread_time()
            sent = time.clock_gettime(sender) if sender is not None else 0.0
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
    n = steps - 50
    return ((time.perf_counter() - start) / n, (time.thread_time() - cpu) / n,
            ((time.clock_gettime(sender) if sender is not None else 0.0) - sent) / n)


TINY = {"off": (False, False), "default": (True, False), "bare hooks": (False, True),
        "every step timed": (nbtrain.Telemetry(timing="every step"), False)}
FIGURES = ("wall", "loop thread's CPU", "sender thread's CPU", "kernel's CPU")


def added_per_step(strategy: str, rounds: int = 10, steps: int = 1500
                   ) -> tuple[float, dict[str, dict[str, tuple[float, float, float]]]]:
    """Seconds a tiny step takes with telemetry off (median), and what each other kind in
    ``TINY`` adds to it: for each figure
    of ``FIGURES``, the median and quartiles of the rounds' paired differences, in
    seconds. One warm rank (a ``RankPool``) runs every kind, in rounds whose order
    alternates: separate launches differ by more than telemetry costs on a shared 2-core
    machine (one process's threads land on the cores better than the next one's), the
    same process's runs a few seconds apart do not."""
    figures: dict[str, list[tuple[float, ...]]] = {kind: [] for kind in TINY}
    with nbtrain.RankPool(devices=1, accelerator="cpu") as pool:
        for i in range(rounds):
            for kind in (list(TINY) if i % 2 == 0 else list(reversed(TINY))):
                telemetry, bare = TINY[kind]
                kernel = time.process_time()
                run = pool.launch(tiny, steps, bare, strategy=strategy, telemetry=telemetry,
                                  dashboard=False)
                figures[kind].append((*run.result, (time.process_time() - kernel) / steps))
    out = {}
    for kind in list(TINY)[1:]:
        out[kind] = {}
        for j, name in enumerate(FIGURES):
            d = sorted(a[j] - b[j] for a, b in zip(figures[kind], figures["off"], strict=True))
            out[kind][name] = (statistics.median(d), d[len(d) // 4], d[(3 * len(d)) // 4])
    return statistics.median(f[0] for f in figures["off"]), out


def realistic(strategy: str, modes: list[str], rounds: int, steps: int,
              compile: str | None = None) -> dict[str, list[float]]:
    """Steps/s of ``train`` on two warm ranks (a ``RankPool``) for each of ``modes``, in
    ``rounds`` rounds whose order alternates. Fresh launches placed their ranks' threads
    on the cores differently each time, and one launch's speed differed from the next by
    more than telemetry costs; the same two processes' runs differ by their neighbours'
    noise alone, which the pairing and the alternation cancel."""
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    with nbtrain.RankPool(devices=2, accelerator="cpu") as pool:
        for i in range(rounds):
            for mode in modes if i % 2 == 0 else list(reversed(modes)):
                run = pool.launch(train, steps, compile, strategy=strategy,
                                  telemetry=MODES[mode], dashboard=False)
                rates[mode].append(run.result)
    return rates


def paired_interval(values: list[float], base: list[float], draws: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """Median of the per-round ratios, and a 90 % bootstrap interval around it."""
    ratios = [v / b for v, b in zip(values, base, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(draws))
    return statistics.median(ratios), medians[int(0.05 * draws)], medians[int(0.95 * draws)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--tiny-rounds", type=int, default=10,
                        help="rounds of the 1-rank tiny-model measure (0: none)")
    parser.add_argument("--compile", choices=("before", "after"),
                        help="torch.compile the model before ctx.setup, or the one it returns")
    parser.add_argument("--tiny-steps", type=int, default=1500)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"a comma-separated subset of: {', '.join(MODES)} ('off' is "
                             "always measured)")
    args = parser.parse_args()
    if args.steps <= 10 or (args.tiny_rounds and args.tiny_steps <= 50):
        parser.error("--steps must be over 10 and --tiny-steps over 50 (warm-up steps are "
                     "left out)")
    modes = ["off"] + [m.strip() for m in args.modes.split(",") if m.strip() != "off"]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    for strategy in args.strategies.split(",") if args.rounds > 0 else ():
        rates = realistic(strategy, modes, args.rounds, args.steps, args.compile)
        compiled = f", compiled {args.compile} ctx.setup" if args.compile else ""
        print(f"\n{strategy}: 2 warm CPU ranks, {args.steps} steps a run, {args.rounds} rounds"
              f"{compiled}")
        print(f"{'telemetry':28s} {'steps/s':>9s} {'paired ratio to off':>20s} "
              f"{'90% interval':>15s}")
        for mode, values in rates.items():
            med, low, high = paired_interval(values, rates["off"])
            print(f"{mode:28s} {statistics.median(values):9.1f} {med:20.3f} "
                  f"{low:7.3f}-{high:.3f}")
    if args.tiny_rounds < 1:
        return
    print(f"\nWhat telemetry adds to a tiny step (1 warm rank, {args.tiny_steps} steps a run, "
          f"median of {args.tiny_rounds} rounds' paired differences [quartiles]):")
    for strategy in args.strategies.split(","):
        off, added = added_per_step(strategy, args.tiny_rounds, args.tiny_steps)
        print(f"  {strategy}: a step takes {off * 1e6:.0f} us with telemetry off")
        for kind, figures in added.items():
            cells = "  ".join(f"{name} {m * 1e6:+4.0f} [{lo * 1e6:+.0f}, {hi * 1e6:+.0f}]"
                              for name, (m, lo, hi) in figures.items())
            print(f"    {kind:17s} {cells}")
        wall = added["default"]["wall"][0]
        print(f"    default: ratio >= 0.97 for steps of {wall * 32e3:.1f} ms and longer. The "
              "wall figure less the loop thread's CPU is waiting: for the GIL the sender "
              "holds while it encodes, and for a core the kernel's listener shares")


if __name__ == "__main__":
    main()
