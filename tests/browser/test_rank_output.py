"""What ranks show, as JupyterLab shows it (headless on loopback, Chromium driven by
Playwright): a tqdm bar on each of two forked ranks is one live line (a display updated
in place) while they run and leaves one line per rank in the stream, beside the
dashboard; an HTML display a rank updates by its display id shows its last state. Screenshots go to tests/browser/screenshots/."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from . import lab

pytestmark = pytest.mark.browser

if lab.missing():
    pytest.skip(f"the browser test {lab.missing()}", allow_module_level=True)

SHOTS = Path(__file__).parent / "screenshots"
CELLS = [
    "import time, torch, nbtrain\n"
    "from tqdm import tqdm\n"
    "from IPython.display import display, HTML\n"
    "def bars(ctx, n=40):\n"
    "    shown = display(HTML(f'<b>rank {ctx.rank} starting</b>'), display_id=True)\n"
    "    for _ in tqdm(range(n), desc=f'rank{ctx.rank}'):\n"
    "        time.sleep(0.1)\n"
    "    shown.update(HTML(f'<b>rank {ctx.rank} finished</b>'))\n"
    "    return ctx.rank",
    "run = nbtrain.launch(bars, devices=2, start_method='fork')",
]


def _text(page, index: int) -> dict:
    return page.evaluate("""(i) => {
        const cell = window.jupyterapp.shell.currentWidget.content.widgets[i].node;
        const pick = (sel) => [...cell.querySelectorAll(sel)].map(e => e.innerText).join('\\n');
        return {err: pick('[data-mime-type="application/vnd.jupyter.stderr"]'),
                live: pick('.jp-OutputArea-output[data-mime-type="text/plain"]'),
                html: pick('.jp-RenderedHTMLCommon b')};
    }""", index)


def test_bars_show_live_in_one_display_and_displays_update_in_jupyterlab(no_leftovers, tmp_path):
    lab.write_notebook(tmp_path / "bars.ipynb", CELLS)
    with lab.server(tmp_path, "bars.ipynb") as url, lab.browser() as page:
        lab.open_notebook(page, url)
        lab.run_cell(page, 0)
        lab.wait_idle(page, 0)
        lab.run_cell(page, 1)
        deadline, live = time.monotonic() + 60, None
        while time.monotonic() < deadline:  # mid-run: one display holds both ranks' bars
            seen = _text(page, 1)
            if "rank0:" in seen["live"] and "rank1:" in seen["live"]:
                live = seen
                break
            time.sleep(0.2)
        assert live is not None, _text(page, 1)
        bar_lines = [line for line in live["live"].splitlines() if "%|" in line]
        assert [line.split(":")[0] for line in bar_lines] == \
            ["[rank 0] rank0", "[rank 1] rank1"], live  # a line each, in one display
        assert "%|" not in live["err"], live  # the stream holds no redraw
        assert "rank 0 starting" in live["html"] or "rank 0 finished" in live["html"], live
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / "rank_bars_live.png"))
        lab.wait_idle(page, 1)
        done = _text(page, 1)
        assert "%|" not in done["live"], done  # the live line is gone once the bars end
        ends = [line.strip() for line in done["err"].splitlines() if "%|" in line]
        assert len(ends) == 2 and all("100%|" in e for e in ends), done["err"]
        assert sorted(e.split(":")[0] for e in ends) == ["[rank 0] rank0", "[rank 1] rank1"]
        shown = sorted(t for t in done["html"].split("\n") if t.startswith("rank "))
        assert shown == ["rank 0 finished", "rank 1 finished"], done
        page.screenshot(path=str(SHOTS / "rank_bars_done.png"))
