"""How soon does a launch show itself in the browser? JupyterLab (or Notebook 7) headless
in Debian's Chromium, driven by Playwright, the README's example on 2 CPU ranks:

  header live:   from asking to run the cell until the header reads "rank 1: running"
  first chart:   until the live figure holds a line with points
  busy all along: whether the kernel's status stayed "busy" until the cell ended

cold: the kernel's first launch (torch and nbtrain imported in an earlier cell, as in a
notebook, the kernel then idle ``--pause`` seconds: a user writing the launch cell; 0 is
"Run All"); warm: the next launches. Needs the dev extras and Chromium (apt-get install
chromium).

    python benchmarks/browser.py [--repeats 3] [--app lab|notebook]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "browser"))
import lab  # noqa: E402  (the browser test's helpers)

SETUP = """import os, sys, time, torch
from torch import nn
import nbtrain

class Net(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

dataset = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))

def train(ctx, lr=1e-3):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    for x, y in ctx.dataloader(dataset, batch_size=64, shuffle=True):
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step(); opt.zero_grad()
        ctx.log(loss=loss)
        time.sleep(0.05)
    return loss.item()
"""
LAUNCH = "run = nbtrain.launch(train, devices=2)"
MARKS = {
    "header": "out.innerText.includes('rank 1: running')",
    "stepped": "/step [1-9]/.test(out.innerText)",
    "figure": "out.querySelector('.js-plotly-plot') !== null",
    "chart": "[...out.querySelectorAll('.js-plotly-plot')].some(gd => gd.data && "
             "gd.data.some(t => t.x && t.x.length > 1))",
}


def measure(page, index: int) -> dict:
    statuses = []
    lab.watch_cell(page, index, MARKS)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        statuses.append(lab.kernel_status(page))
        prompt = page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(
            ".jp-InputPrompt").inner_text().strip()
        if prompt.startswith("[") and "*" not in prompt and prompt != "[ ]:" and \
                len(statuses) > 3:
            break
        time.sleep(0.1)
    seen = page.evaluate("() => { window.__nbtrainStop(); return window.__nbtrainSeen; }")
    busy = all(s == "busy" for s in statuses[2:-3])  # the first and last polls may straddle
    return {"header": seen.get("header"), "chart": seen.get("chart"), "busy": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="warm launches (default 3)")
    parser.add_argument("--app", choices=("lab", "notebook"), default="lab")
    parser.add_argument("--pause", type=float, default=2.0,
                        help="seconds idle between the import cell and the first launch")
    args = parser.parse_args()
    why = lab.missing()
    if why:
        parser.error(f"the browser benchmark {why}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lab.write_notebook(root / "bench.ipynb", [SETUP, LAUNCH])
        with lab.server(root, "bench.ipynb", args.app) as url, lab.browser() as page:
            lab.open_notebook(page, url)
            lab.run_cell(page, 0)
            lab.wait_idle(page, 0, timeout=120)
            time.sleep(args.pause)
            cold = measure(page, 1)
            warm = [measure(page, 1) for _ in range(args.repeats)]
    print(f"\n{args.app}, Chromium headless, 2 CPU ranks, the README's model; "
          f"{os.cpu_count()} cores; ms from asking to run the cell; cold: {args.pause:g} s "
          "idle after the import cell")
    print(f"{'':6s} {'header live':>12s} {'first chart':>12s} {'busy all along':>15s}")

    def fmt(v):
        return f"{v:10.0f}ms" if v is not None else f"{'never':>12s}"

    print(f"{'cold':6s} {fmt(cold['header'])} {fmt(cold['chart'])} {str(cold['busy']):>15s}")
    for name in ("header", "chart"):
        values = [w[name] for w in warm if w[name] is not None]
        warm_med = statistics.median(values) if values else None
        if name == "header":
            header = warm_med
        else:
            chart = warm_med
    print(f"{'warm':6s} {fmt(header)} {fmt(chart)} {str(all(w['busy'] for w in warm)):>15s}"
          f"   (median of {len(warm)})")


if __name__ == "__main__":
    main()
