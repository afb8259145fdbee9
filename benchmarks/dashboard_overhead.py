"""What the live dashboard costs a run: the same 2-rank CPU training in a real Jupyter
kernel with the widget dashboard live vs ``dashboard=False``, alternating, and the comm
messages per second the dashboard sends.

    python benchmarks/dashboard_overhead.py [--steps 1500] [--repeats 3]

Steps/s is rank 0's training rate (steps between its first and last step event, over
that time), so start-up and teardown are left out. The kernel has no widget frontend
(as under nbclient), so the widget is forced: everything the dashboard does in the
kernel happens, and its messages are counted on the iopub channel. The target is a
ratio >= 0.97 and a message rate far below the Jupyter server's ~1000/s.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import textwrap
import time
from queue import Empty

from jupyter_client import KernelManager

SETUP = textwrap.dedent("""
    import time, torch, nbtrain
    from torch import nn

    def train(ctx, steps=1500):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                              nn.Linear(256, 10))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model, opt = ctx.setup(model, opt)
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        for _ in range(steps):
            loss = nn.functional.cross_entropy(model(x), y)
            ctx.backward(loss)
            opt.step()
            opt.zero_grad()
            ctx.log(loss=loss)
        return steps

    def rate(run):
        steps = run.history.events("step", 0)
        return (len(steps) - 1) / (steps[-1].t - steps[0].t)
""")


def run_cell(kc, code: str, timeout: float = 600) -> tuple[dict[str, int], str, float]:
    """Counts of iopub message types (and of ``"stdout lines"``), the text result and the
    seconds the cell took."""
    msg_id = kc.execute(code)
    counts: dict[str, int] = {}
    result, error = "", None
    start = time.monotonic()
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=timeout)
        except Empty:
            raise TimeoutError(code) from None
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "stream" and msg["content"]["name"] == "stdout":
            counts["stdout lines"] = counts.get("stdout lines", 0) \
                + msg["content"]["text"].count("\n")
        if kind == "execute_result":
            result = msg["content"]["data"]["text/plain"]
        elif kind == "error":
            error = msg["content"]
        elif kind == "status" and msg["content"]["execution_state"] == "idle":
            if error:
                raise RuntimeError(f"{error['ename']}: {error['evalue']}")
            return counts, result, time.monotonic() - start


@contextlib.contextmanager
def kernel(setup: str):
    """A real kernel's client, ``setup`` run in it; the kernel is shut down after."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        run_cell(kc, setup)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with kernel(SETUP) as kc:
        run_cell(kc, "nbtrain.launch(train, devices=2, steps=50, dashboard=False); None")
        rates: dict[str, list[float]] = {"off": [], "widget": []}
        messages = []
        for _ in range(args.repeats):
            for mode in ("off", "widget"):
                arg = "False" if mode == "off" else "'widget'"
                counts, result, seconds = run_cell(
                    kc, f"run = nbtrain.launch(train, devices=2, steps={args.steps}, "
                        f"dashboard={arg}); rate(run)")
                rates[mode].append(float(result))
                if mode == "widget":
                    messages.append((counts.get("comm_msg", 0), counts.get("comm_open", 0),
                                     seconds))
        off, on = statistics.median(rates["off"]), statistics.median(rates["widget"])
        sent = sum(m[0] for m in messages)
        seconds = sum(m[2] for m in messages)
        print(f"2 ranks, CPU, {args.steps} steps, {args.repeats} runs each (median):")
        print(f"  dashboard=False    {off:8.1f} steps/s   {rates['off']}")
        print(f"  dashboard='widget' {on:8.1f} steps/s   {rates['widget']}")
        print(f"  ratio (live/off)   {on / off:8.3f}   (target >= 0.97)")
        print(f"  comm messages      {sent / seconds:8.1f} /s   ({sent} in {seconds:.1f}s, "
              f"{messages[0][1]} comm_open per run; the server drops above ~1000/s)")


if __name__ == "__main__":
    main()
