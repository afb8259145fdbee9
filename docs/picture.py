"""Draw the README's picture (docs/dashboard.png) again, from a real run.

A character-level transformer (``nbtrain.examples.charlm``: 4 blocks of 256, 3.2M
parameters, built from its config, trained on the text nbtrain ships) on two ranks with
DDP, launched from a cell of JupyterLab in Chromium; the cell's dashboard is taken once
the run has ended: loss, step time, where each rank's step goes (forward, backward,
optimizer, communication waited for), model state in MB and the bytes each step
all-reduces. Needs the dev extras and Chromium (as the browser tests do).

    python docs/picture.py [--out docs/dashboard.png] [--steps 80] [--strategy ddp]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CELL = """\
import nbtrain
from nbtrain.examples.charlm import Config, Vocab, load_text, train_charlm

cfg = Config(vocab=len(Vocab(load_text())), block=64, dim=256, heads=8, layers=4)
run = nbtrain.launch(train_charlm, devices=2, accelerator="cpu", strategy={strategy!r},
                     steps={steps}, batch_size=16, cfg=cfg)"""


def _lab():
    spec = importlib.util.spec_from_file_location("lab", ROOT / "tests" / "browser" / "lab.py")
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    return lab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    lab = _lab()
    missing = lab.missing()
    if missing:
        raise SystemExit(f"docs/picture.py {missing}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lab.write_notebook(root / "picture.ipynb",
                           [CELL.format(strategy=args.strategy, steps=args.steps)])
        with lab.server(root, "picture.ipynb") as url, lab.browser() as page:
            lab.open_notebook(page, url)
            began = time.monotonic()
            lab.run_cell(page, 0)
            lab.wait_idle(page, 0, timeout=600)
            area = page.locator(".jp-Notebook .jp-CodeCell").nth(0).locator(".jp-OutputArea")
            text = area.inner_text()
            if "done" not in text:
                raise SystemExit(f"the run did not end well:\n{text[-2000:]}")
            page.wait_for_selector(".jp-OutputArea .js-plotly-plot", timeout=30_000)
            time.sleep(1.0)  # the last redraw
            page.add_style_tag(content=".Toastify { display: none !important; }")  # news
            area.scroll_into_view_if_needed()
            area.screenshot(path=args.out)
    print(f"{args.out}: {args.strategy} on 2 CPU ranks, {args.steps} steps, "
          f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
