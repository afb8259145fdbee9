"""The classic Notebook (6.5) with ipywidgets 7.7.1 and widgetsnbextension 3.6, the widget
stack Colab ships, in Debian's Chromium: a launch draws its live chart, a background run
drawn live goes on across a page reload and ends as the static figure in the reloaded
page, and after a kernel restart the reopened notebook shows both static figures with
their lines. Runs on the Colab leg (`.ci/stack colab`), where that stack is installed;
elsewhere it skips."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from nbtrain.ui.dashboard import CLOSE_AFTER_S

from . import lab

pytestmark = pytest.mark.browser


def _missing() -> str | None:
    try:
        import notebook
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        return f"needs the classic Notebook and playwright ({err}): .ci/stack colab"
    if not notebook.__version__.startswith("6.") or importlib.util.find_spec(
            "widgetsnbextension") is None:
        return f"needs the classic Notebook 6 with ipywidgets 7 (.ci/stack colab); this is {notebook.__version__}"
    if lab.CHROMIUM is None:
        return "needs Chromium: apt-get install -y chromium"
    return None


if _missing():
    pytest.skip(f"the classic Notebook test {_missing()}", allow_module_level=True)

SHOTS = Path(__file__).parent / "screenshots"
# ``until``: a file whose existence ends the run (the reload must find it still live)
FLAG = "stop-background-run"
SLOW = ("import os, time, torch, nbtrain\n"
        "def slow(ctx, steps=60, pause=0.1, until=None):\n"
        "    torch.manual_seed(0)\n"
        "    model = torch.nn.Linear(8, 8)\n"
        "    opt = torch.optim.Adam(model.parameters())\n"
        "    model, opt = ctx.setup(model, opt)\n"
        "    ctx.total_steps = steps\n"
        "    for _ in range(steps):\n"
        "        loss = model(torch.randn(4, 8)).pow(2).mean()\n"
        "        ctx.backward(loss)\n"
        "        opt.step(); opt.zero_grad()\n"
        "        ctx.log(loss=loss)\n"
        "        time.sleep(pause)\n"
        "        if until and os.path.exists(until):\n"
        "            return\n")
CELLS = [SLOW,
         "run = nbtrain.launch(slow, devices=2, accelerator='cpu', steps=40)",
         "bg = nbtrain.launch(slow, devices=2, accelerator='cpu', steps=3000, "
         f"until={FLAG!r}, background=True)"]
READY = ("() => window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && "
         "Jupyter.notebook.kernel.is_connected()")
# What a cell's output holds: its plotly figures, the traces with data of the first, whether
# that is the live chart (inside a widget view), and the text.
CHARTS = """(i) => {
    const cell = Jupyter.notebook.get_cell(i).element[0];
    const gds = [...cell.querySelectorAll('.output_area .js-plotly-plot')];
    const gd = gds[0];
    const traces = gd && gd.data ? gd.data.filter(t => t.x && t.x.length && t.x[0] !== null) : [];
    return {figures: gds.length, traces: traces.length,
            points: traces.reduce((n, t) => n + t.x.length, 0),
            live: !!(gd && gd.closest('.widget-subarea, .jupyter-widgets')),
            text: (cell.querySelector('.output_wrapper') || {innerText: ''}).innerText};
}"""
# widgetsnbextension 3.6's own message when a model's update arrives while a reloaded
# page is still restoring the models from the kernel (it then asks for the state and
# draws it); nothing of nbtrain's.
KNOWN = ("Comm promise not found for comm id",)


def _no_prompt(page) -> None:
    """Live outputs may mark the saved notebook changed again: no "leave the page?"."""
    page.evaluate("() => { window.onbeforeunload = null; }")


def _open(page, url: str) -> None:
    _no_prompt(page)
    page.goto(url, timeout=60_000)
    page.wait_for_function(READY, timeout=60_000)


def _wait_for(page, index: int, test, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        charts = page.evaluate(CHARTS, index)
        if test(charts) or time.monotonic() > deadline:
            return charts
        time.sleep(0.3)


def _save(page) -> None:
    page.evaluate("() => Jupyter.notebook.save_notebook()")
    page.wait_for_function("() => !Jupyter.notebook.dirty", timeout=30_000)


def test_the_classic_notebook_with_ipywidgets_7(no_leftovers, tmp_path):
    lab.write_notebook(tmp_path / "classic.ipynb", CELLS)
    console: list[str] = []
    with lab.server(tmp_path, "classic.ipynb", app="classic") as url, lab.browser() as page:
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        _open(page, url)
        page.evaluate("() => { Jupyter.notebook.get_cell(0).execute(); "
                      "Jupyter.notebook.get_cell(1).execute(); }")
        live = _wait_for(page, 1, lambda c: c["live"] and c["points"] > 0)
        assert live["live"] and live["traces"] > 0, live  # the live chart draws
        later = _wait_for(page, 1, lambda c: c["points"] > live["points"])
        assert later["points"] > live["points"], (live, later)  # ... and gains points
        done = _wait_for(page, 1, lambda c: "rank 1: done" in c["text"] and not c["live"]
                         and c["traces"] > 0)
        assert done["figures"] == 1 and done["traces"] > 0 and not done["live"], done

        # the blocking cell has ended and closed its widgets before the next cell runs
        # (under load, a widget view displayed while widgetsnbextension 3.6 disposes the
        # closed ones' views was seen to stay undrawn: noted on issue 33)
        page.wait_for_function(
            "() => !Jupyter.notebook.get_cell(1).element[0].classList.contains('running')",
            timeout=60_000)
        time.sleep(CLOSE_AFTER_S + 1)
        page.evaluate("() => Jupyter.notebook.get_cell(2).execute()")
        before = _wait_for(page, 2, lambda c: c["live"] and c["points"] > 20)
        assert before["live"], before
        _save(page)
        _no_prompt(page)
        page.reload()
        _open(page, url)
        # the reloaded page draws the run live again, and it goes on
        again = _wait_for(page, 2, lambda c: c["live"] and c["points"] > before["points"])
        assert again["live"] and again["points"] > before["points"], (before, again)
        assert "rank 1: running" in again["text"]
        page.screenshot(path=str(SHOTS / "classic_reloaded_live.png"), full_page=True)
        (tmp_path / FLAG).touch()  # the run ends
        # at its end, the static figure takes its place in the reloaded page too
        ended = _wait_for(page, 2, lambda c: "rank 1: done" in c["text"] and not c["live"],
                          timeout=90)
        assert not ended["live"] and ended["traces"] > 0, ended
        assert "rank 1: running" not in ended["text"]

        _save(page)
        page.evaluate("() => Jupyter.notebook.kernel.restart()")
        time.sleep(3)
        _open(page, url)
        for index in (1, 2):  # no kernel state: the saved static figures, with lines
            after = _wait_for(page, index, lambda c: c["traces"] > 0)
            assert after["figures"] == 1 and after["traces"] > 0 and not after["live"], after
            assert "could not be displayed" not in after["text"]
        page.screenshot(path=str(SHOTS / "classic_after_restart.png"), full_page=True)
    errors = [m for m in console if m.startswith(("error", "pageerror"))
              and not any(k in m for k in KNOWN)]
    assert not errors, errors
