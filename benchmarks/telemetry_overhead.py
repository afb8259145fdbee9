"""What does telemetry cost a training step?

The same 2-rank CPU training (~1M-parameter MLP, a few hundred steps, DDP and FSDP)
with telemetry off, with the defaults (metrics, step times and where they go, memory
every 10 steps, communication per step), with communication counting alone off, with the
time breakdown alone off, and with every probe on every step. Rounds are interleaved, in an order that alternates between rounds; each
run's steps/s is measured inside rank 0's loop (launch and teardown excluded).

On a shared 2-core machine one run's speed wanders by ±10 %, so a ratio of two runs says
little. Each round's ratio to its own "off" run cancels the drift between rounds; the
median of those paired ratios comes with a 90 % bootstrap interval: a cost of 3 % or more
shows as an interval that lies below 0.97; noise, as a wide one around 1. Even so, on a
shared 2-core machine DDP's ratio has moved between invocations by more than its interval
(0.92 to 0.99). So a second measure follows that noise cannot hide: the microseconds
telemetry adds to a step, from a 1-rank run of a tiny model whose step takes a few
hundred microseconds (launch and the first 50 steps excluded). At a step time T the
ratio is then T / (T + added). Beside it, the same tiny run with telemetry off and no-op
hooks at the points the time breakdown hooks (``hooked_as_telemetry_hooks``): what torch
charges for a hook's being there, apart from what telemetry's hooks do.

``--compile before`` compiles the model before ``ctx.setup`` (the wrapper's hooks stay
outside the compiled code), ``--compile after`` the model ``ctx.setup`` returns (the
forward's timing hooks are then inside it, and run between its graphs: no graph break for
them since stop 60, two before): torch's inductor, the launches' first steps (the
compile) left out.

    python benchmarks/telemetry_overhead.py [--steps 200] [--rounds 12] [--modes default]
    python benchmarks/telemetry_overhead.py --steps 20 --rounds 1 --tiny-rounds 1 --tiny-steps 100  # smoke
    python benchmarks/telemetry_overhead.py --compile after --modes default --tiny-rounds 0
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    ``bare_hooks``: with ``hooked_as_telemetry_hooks`` (run with telemetry off)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    if bare_hooks:
        hooked_as_telemetry_hooks(model, opt)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8),
                                          torch.randint(0, 2, (4 * steps,)))
    start = cpu = None
    for i, (x, y) in enumerate(ctx.dataloader(data, batch_size=4)):
        if i == 50:
            start, cpu = time.perf_counter(), time.thread_time()
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
    return ((time.perf_counter() - start) / (steps - 50),
            (time.thread_time() - cpu) / (steps - 50))


TINY = {"off": (False, False), "default": (True, False), "bare hooks": (False, True)}


def added_per_step(strategy: str, rounds: int = 6, steps: int = 3000
                   ) -> dict[str, tuple[float, float]]:
    """Median seconds per step, of the wall clock and of the training loop's own thread's
    CPU, with telemetry off, on (the default), and off with ``hooked_as_telemetry_hooks``'
    hooks; 1 rank, interleaved rounds."""
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in TINY}
    for i in range(rounds):
        for kind in (list(TINY) if i % 2 == 0 else list(reversed(TINY))):
            telemetry, bare = TINY[kind]
            times[kind].append(nbtrain.launch(tiny, steps, bare, devices=1, accelerator="cpu",
                                              strategy=strategy, telemetry=telemetry,
                                              dashboard=False).result)
    return {kind: (statistics.median(v[0] for v in values),
                   statistics.median(v[1] for v in values)) for kind, values in times.items()}


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
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--tiny-rounds", type=int, default=6,
                        help="rounds of the 1-rank tiny-model measure (0: none)")
    parser.add_argument("--compile", choices=("before", "after"),
                        help="torch.compile the model before ctx.setup, or the one it returns")
    parser.add_argument("--tiny-steps", type=int, default=3000)
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
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for i in range(args.rounds):
            order = modes if i % 2 == 0 else list(reversed(modes))
            for mode in order:
                run = nbtrain.launch(train, args.steps, args.compile, devices=2,
                                     accelerator="cpu", strategy=strategy,
                                     telemetry=MODES[mode])
                rates[mode].append(run.result)
        compiled = f", compiled {args.compile} ctx.setup" if args.compile else ""
        print(f"\n{strategy}: 2 CPU ranks, {args.steps} steps a run, {args.rounds} rounds"
              f"{compiled}")
        print(f"{'telemetry':28s} {'steps/s':>9s} {'paired ratio to off':>20s} "
              f"{'90% interval':>15s}")
        for mode, values in rates.items():
            med, low, high = paired_interval(values, rates["off"])
            print(f"{mode:28s} {statistics.median(values):9.1f} {med:20.3f} "
                  f"{low:7.3f}-{high:.3f}")
    if args.tiny_rounds < 1:
        return
    print(f"\nWhat default telemetry adds to a step (1 rank, a tiny model, median of "
          f"{args.tiny_rounds} rounds):")
    for strategy in args.strategies.split(","):
        median = added_per_step(strategy, args.tiny_rounds, args.tiny_steps)
        (off, off_cpu), (on, on_cpu) = median["off"], median["default"]
        added, hooked = on - off, median["bare hooks"][0] - off
        print(f"  {strategy:14s} {off * 1e6:6.0f} us/step off, {on * 1e6:6.0f} on: adds "
              f"{added * 1e6:4.0f} us; ratio >= 0.97 for steps of {added * 32e3:.1f} ms and "
              "longer")
        print(f"  {'':14s} of it, the loop's own thread's CPU: {(on_cpu - off_cpu) * 1e6:4.0f} us "
              "(the rest: waiting, for the GIL or a core the kernel's listener shares)")
        print(f"  {'':14s} the same hooks doing nothing add {hooked * 1e6:4.0f} us (torch's "
              f"price of being hooked there); telemetry's own work {(added - hooked) * 1e6:4.0f} us")


if __name__ == "__main__":
    main()
