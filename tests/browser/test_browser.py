"""The dashboard and the picker in a real browser: JupyterLab headless on loopback,
Debian's Chromium driven by Playwright. A 2-rank CPU run's figure gains points while it
is live; the picker runs two strategies from its Run button and its comparison shows
both. Screenshots go to tests/browser/screenshots/."""

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


def _points(page) -> int:
    """Points in the first plotly figure on the page (the live dashboard's)."""
    return page.evaluate("""() => {
        const gd = document.querySelector('.jp-OutputArea .js-plotly-plot');
        if (!gd || !gd.data) return -1;
        return gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0);
    }""")


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
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(lab, timeout=60_000)
            page.wait_for_selector(".jp-Notebook .jp-CodeCell .cm-content", timeout=60_000)
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget &&"
                " window.jupyterapp.shell.currentWidget.sessionContext &&"
                " window.jupyterapp.shell.currentWidget.sessionContext.session &&"
                " window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                timeout=60_000)
            _run_cell(page, 0)
            _wait_idle(page, 0)
            first = page.locator(".jp-Notebook .jp-CodeCell").nth(0).inner_text()
            assert "dashboard mode: widget" in first, first

            # -- the live dashboard gains points while the run is live ------------------
            _run_cell(page, 1)
            page.wait_for_selector(".jp-OutputArea .js-plotly-plot", timeout=60_000)
            seen = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seen.append(_points(page))
                if len([p for p in set(seen) if p > 0]) >= 3:
                    break
                time.sleep(0.7)
            page.screenshot(path=str(SHOTS / "dashboard_live.png"), full_page=True)
            live = sorted(p for p in set(seen) if p > 0)
            assert len(live) >= 3, f"the figure did not gain points while live: {seen}"
            _wait_idle(page, 1)
            header = page.locator(".jp-Notebook .jp-CodeCell").nth(1).inner_text()
            assert "rank 1: done" in header, header
            page.screenshot(path=str(SHOTS / "dashboard_done.png"), full_page=True)

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
            page.screenshot(path=str(SHOTS / "picker_comparison.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    print(f"\nbrowser test took {time.monotonic() - started:.0f}s")
