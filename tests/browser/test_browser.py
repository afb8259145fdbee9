"""The dashboard and the picker in a real browser: JupyterLab headless on loopback,
Debian's Chromium driven by Playwright, at the 1400×900 of the issue reports. A 2-rank
CPU run's header shows within a second of the cell starting; its figure gains points
while it is live; once it ended, the charts still hold their traces after the notebook
is saved and the page reloaded (kernel alive), and again after the kernel is shut down
and the notebook reopened; the picker runs two strategies from its Run button and its
comparison shows both. Screenshots go to tests/browser/screenshots/."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.browser

HERE = Path(__file__).parent
TESTS = HERE.parent
SHOTS = HERE / "screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]

try:
    import jupyterlab  # noqa: F401
    from playwright.sync_api import sync_playwright
except ImportError as err:
    pytest.skip(f"the browser test needs jupyterlab and playwright ({err}): "
                "pip install jupyterlab playwright", allow_module_level=True)
if CHROMIUM is None:
    pytest.skip("the browser test needs Chromium: apt-get install -y chromium",
                allow_module_level=True)

CELLS = [
    # 1: setup; says whether a widget manager is connected (it should be, in Lab)
    "import os, sys, time, torch\n"
    "sys.path.insert(0, os.environ['NBTRAIN_TESTS'])\n"
    "import nbtrain\nfrom workloads import train\n"
    "time.sleep(1)\n"
    "print('dashboard mode:', nbtrain.ui.frontend.choose_mode())",
    # 2: a slow 2-rank run with the default (auto) dashboard
    "def slow(ctx, steps=120):\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Linear(8, 8)\n"
    "    opt = torch.optim.Adam(model.parameters())\n"
    "    model, opt = ctx.setup(model, opt)\n"
    "    for i in range(steps):\n"
    "        loss = model(torch.randn(4, 8)).pow(2).mean()\n"
    "        ctx.backward(loss)\n"
    "        opt.step(); opt.zero_grad()\n"
    "        ctx.log(loss=loss)\n"
    "        time.sleep(0.1)\n"
    "    return steps\n"
    "run = nbtrain.launch(slow, devices=2)",
    # 3: the picker
    "picker = nbtrain.StrategyPicker(train, devices=2)",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(path: Path) -> None:
    cells = [{"cell_type": "code", "metadata": {}, "source": src, "outputs": [],
              "execution_count": None} for src in CELLS]
    nb = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}}}
    path.write_text(json.dumps(nb))


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on loopback; it and every kernel it started are gone afterwards."""
    port, token = _free_port(), secrets.token_hex(16)
    _notebook(tmp_path / "ui.ipynb")
    env = {**os.environ, "NBTRAIN_TESTS": str(TESTS), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("NBTRAIN_DASHBOARD", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
         f"--port={port}", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.news_url=",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.expose_app_in_browser=True"]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("JupyterLab did not start: "
                                       + (tmp_path / "lab.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        yield f"{url}/lab/tree/ui.ipynb?token={token}"
    finally:
        kids = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        for p in kids:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(kids, timeout=5)
        log.close()


PLOTLY_MIME = "application/vnd.plotly.v1+json"
HEADER_WITHIN_S = 1.0  # from asking to run the cell to the dashboard's header on screen


def _points(page) -> int:
    """Points in the first plotly figure on the page (the live dashboard's)."""
    return page.evaluate("""() => {
        const gd = document.querySelector('.jp-OutputArea .js-plotly-plot');
        if (!gd || !gd.data) return -1;
        return gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
    }""")


def _charts(page, index: int) -> dict:
    """What the plotly figure in cell ``index``'s output holds: traces with data,
    points, and whether it is the live widget (which needs the kernel's state)."""
    return page.evaluate("""(i) => {
        const panel = window.jupyterapp.shell.currentWidget;
        const cell = panel && panel.content && panel.content.widgets[i] &&
                     panel.content.widgets[i].node;
        const area = cell && cell.querySelector('.jp-OutputArea');
        if (area) area.scrollIntoView();  // outputs below the fold may wait to be drawn
        const gd = area && area.querySelector('.js-plotly-plot');
        if (!gd || !gd.data) return {traces: 0, points: 0, widget: false,
                                     text: area ? area.innerText : ''};
        const withData = gd.data.filter(t => t.x && t.x.length > 0 && t.x[0] !== null);
        const png = area.querySelector('.jp-RenderedPlotly img.plot-img');
        return {traces: withData.length,
                points: withData.reduce((n, t) => n + t.x.length, 0),
                widget: !gd.closest('.jp-RenderedPlotly'),  // else plotly's static renderer
                width: gd.getBoundingClientRect().width,
                area: area.getBoundingClientRect().width, text: area.innerText,
                snapshot: !!(png && png.naturalWidth > 0),
                comm_axis: gd._fullLayout.yaxis5 ? gd._fullLayout.yaxis5.range : null};
    }""", index)


def _wait_charts(page, index: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        area = page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(".jp-OutputArea")
        area.scroll_into_view_if_needed()
        # A saved plotly output opens as the PNG snapshot Lab's plotly renderer stored in
        # it; the interactive chart is drawn when the pointer comes over it.
        snapshot = area.locator(".jp-RenderedPlotly img.plot-img")
        if snapshot.count() and snapshot.first.is_visible():
            snapshot.first.dispatch_event("mouseenter")
        charts = _charts(page, index)
        if charts["traces"] or time.monotonic() > deadline:
            return charts
        time.sleep(0.5)


def _open(page, url: str) -> None:
    page.goto(url, timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-CodeCell .cm-content", timeout=60_000)
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget &&"
        " window.jupyterapp.shell.currentWidget.sessionContext &&"
        " window.jupyterapp.shell.currentWidget.sessionContext.session &&"
        " window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
        timeout=60_000)


def _save(page) -> None:
    page.evaluate("""async () => {
        const panel = window.jupyterapp.shell.currentWidget;
        await panel.context.save();
    }""")


def _shot(page, index: int, name: str) -> None:
    """A screenshot of cell ``index``'s output (the dashboard), as a reader sees it."""
    area = page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(".jp-OutputArea")
    area.scroll_into_view_if_needed()
    area.screenshot(path=str(SHOTS / name))


def _run_cell_timed(page, index: int, text: str) -> None:
    """Run a cell and note (in ``window.__nbtrainSeen``) the milliseconds from asking to
    run it until ``text`` shows in its output."""
    page.evaluate("""async ([i, text]) => {
        const app = window.jupyterapp;
        const panel = app.shell.currentWidget;
        await panel.sessionContext.ready;
        const cell = panel.content.widgets[i];
        window.__nbtrainSeen = null;
        const t0 = performance.now();
        const check = () => {
            const out = cell.node.querySelector('.jp-OutputArea');
            if (window.__nbtrainSeen === null && out && out.innerText.includes(text)) {
                window.__nbtrainSeen = performance.now() - t0;
                observer.disconnect();
            }
        };
        const observer = new MutationObserver(check);
        observer.observe(cell.node, {childList: true, subtree: true, characterData: true});
        panel.content.activeCellIndex = i;
        app.commands.execute('notebook:run-cell');
    }""", [index, text])


def _run_cell(page, index: int) -> None:
    """Run one cell through JupyterLab's own command (the app is exposed for the test)."""
    page.evaluate("""async (i) => {
        const app = window.jupyterapp;
        const panel = app.shell.currentWidget;
        await panel.sessionContext.ready;
        panel.content.activeCellIndex = i;
        app.commands.execute('notebook:run-cell');  // not awaited: it ends with the cell
    }""", index)


def _wait_idle(page, index: int, timeout: float = 90) -> None:
    prompt = page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = prompt.inner_text().strip()
        if text.startswith("[") and "*" not in text and text != "[ ]:":
            return
        time.sleep(0.3)
    page.screenshot(path=str(SHOTS / f"cell_{index}_timeout.png"), full_page=True)
    raise TimeoutError(f"cell {index} still running after {timeout}s")


def test_dashboard_and_picker_in_jupyterlab(no_leftovers, lab):
    SHOTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            console = []
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            _open(page, lab)
            _run_cell(page, 0)
            _wait_idle(page, 0)
            first = page.locator(".jp-Notebook .jp-CodeCell").nth(0).inner_text()
            assert "dashboard mode: widget" in first, first

            # -- the header at once; the live figure gains points while the run is live --
            _run_cell_timed(page, 1, "rank 1:")
            page.wait_for_function("() => window.__nbtrainSeen !== null", timeout=30_000)
            header_ms = page.evaluate("() => window.__nbtrainSeen")
            print(f"\nheader shown {header_ms:.0f} ms after the cell was run")
            assert header_ms <= HEADER_WITHIN_S * 1000, header_ms
            page.wait_for_selector(".jp-OutputArea .js-plotly-plot", timeout=60_000)
            seen = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seen.append(_points(page))
                if len([p for p in set(seen) if p > 0]) >= 3:
                    break
                time.sleep(0.7)
            _shot(page, 1, "dashboard_live.png")
            live = sorted(p for p in set(seen) if p > 0)
            assert len(live) >= 3, f"the figure did not gain points while live: {seen}"
            widget = _charts(page, 1)
            assert widget["widget"] and widget["width"] >= 0.9 * widget["area"], widget
            _wait_idle(page, 1)
            done = _wait_charts(page, 1)
            assert "rank 1: done" in done["text"], done["text"]
            assert done["traces"] >= 4 and not done["widget"], done  # static, in its place
            assert done["width"] >= 0.9 * done["area"], done  # fills the output's width
            assert done["comm_axis"][0] >= 0, done  # a constant line: no axis below zero
            _shot(page, 1, "dashboard_done.png")

            # -- a reload (the kernel still alive) keeps the final charts ----------------
            _save(page)
            _open(page, lab)
            reloaded = _wait_charts(page, 1)
            _shot(page, 1, "dashboard_reloaded.png")
            assert "rank 1: done" in reloaded["text"], reloaded["text"]
            assert reloaded["traces"] == done["traces"], (reloaded, done)
            assert reloaded["points"] == done["points"], (reloaded, done)
            assert reloaded["snapshot"], reloaded  # the PNG Lab stored, for kernel-less viewers
            assert not [m for m in console if "model not found" in m], console
            saved = page.evaluate("""async () => {
                const m = await window.jupyterapp.serviceManager.contents.get('ui.ipynb');
                return m.content.cells[1].outputs.map(o => Object.keys(o.data || {}));
            }""")
            figure = [set(keys) for keys in saved if PLOTLY_MIME in keys]
            assert figure and {"image/png", "text/html"} <= figure[0], saved  # other viewers

            # -- the picker: two strategies from its Run button, compared ---------------
            _run_cell(page, 2)
            picker = page.locator(".nbtrain-picker")
            picker.wait_for(timeout=30_000)
            for name in ("ddp", "fsdp"):
                picker.locator("select").first.select_option(name)
                picker.locator("button.mod-success").click()  # Run
                page.wait_for_function(
                    """(name) => {
                        const p = document.querySelector('.nbtrain-picker');
                        return p && p.innerText.includes('Comparison') &&
                               [...p.querySelectorAll('pre')].some(e =>
                                   e.innerText.split('\\n').some(l => l.startsWith(name + ' ')));
                    }""", arg=name, timeout=60_000)
            text = picker.inner_text()
            assert "less model state per rank" in text, text
            picker.locator(".js-plotly-plot").last.wait_for(timeout=30_000)
            page.locator(".nbtrain-picker").scroll_into_view_if_needed()
            page.locator(".nbtrain-picker").screenshot(path=str(SHOTS / "picker_comparison.png"))

            # -- saved, the kernel gone, reopened: the charts are still there -----------
            _save(page)
            page.evaluate("""async () => {
                const app = window.jupyterapp;
                const panel = app.shell.currentWidget;
                await panel.sessionContext.shutdown();
                await panel.close();
            }""")
            page.evaluate("""async () => {
                await window.jupyterapp.commands.execute('docmanager:open',
                                                         {path: 'ui.ipynb'});
            }""")
            page.wait_for_selector(".jp-Notebook .jp-CodeCell .cm-content", timeout=60_000)
            reopened = _wait_charts(page, 1)
            _shot(page, 1, "dashboard_reopened.png")
            assert "rank 1: done" in reopened["text"], reopened["text"]
            assert reopened["traces"] == done["traces"], (reopened, done)
            assert reopened["points"] == done["points"], (reopened, done)
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure.png"), full_page=True)
            raise
        finally:
            print("\n".join(m for m in console if m.startswith(("error", "pageerror"))))
            browser.close()
    print(f"\nbrowser test took {time.monotonic() - started:.0f}s")
