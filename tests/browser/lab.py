"""JupyterLab (or Notebook 7) headless on loopback and Debian's Chromium driven by
Playwright: what the browser test and ``benchmarks/browser.py`` share."""

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
from contextlib import contextmanager
from pathlib import Path

import psutil

TESTS = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def missing() -> str | None:
    """Why the browser cannot run here, or None."""
    try:
        import jupyterlab  # noqa: F401
        import playwright.sync_api  # noqa: F401
    except ImportError as err:
        return f"needs jupyterlab and playwright ({err}): pip install jupyterlab playwright"
    if CHROMIUM is None:
        return "needs Chromium: apt-get install -y chromium"
    return None


STACK = ("jupyterlab", "notebook", "jupyter_server", "ipykernel", "ipywidgets",
         "jupyterlab_widgets", "widgetsnbextension", "anywidget", "jupyter_client", "pyzmq",
         "tornado", "playwright")


def versions() -> str:
    """The browser and the Jupyter stack this test drives: what a failure names."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in STACK:
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    browser = "no Chromium"
    if CHROMIUM:
        try:
            browser = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True,
                                     timeout=30).stdout.strip() or browser
        except (OSError, subprocess.SubprocessError) as err:
            browser = f"{CHROMIUM}: {err}"
    return f"{browser}; " + ", ".join(found)


def write_notebook(path: Path, cells: list[str]) -> None:
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": src, "outputs": [],
                     "execution_count": None} for src in cells],
          "nbformat": 4, "nbformat_minor": 5,
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                      "language": "python"}}}
    path.write_text(json.dumps(nb))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(root: Path, notebook: str, app: str = "lab"):
    """A Jupyter server of ``app`` ("lab", "notebook": Notebook 7, or "classic": the
    Notebook 6.5 Colab's stack pins, with ipywidgets 7) on loopback; yields the URL of
    ``notebook`` in it. The server and every kernel it started are gone afterwards."""
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "NBTRAIN_TESTS": str(TESTS), "JUPYTER_CONFIG_DIR": str(root / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(root / "rt")}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("NBTRAIN_DASHBOARD", None)
    log = open(root / f"{app}.log", "w")
    if app == "classic":  # Notebook 6: its own server and option names
        options = [f"--NotebookApp.token={token}", f"--NotebookApp.notebook_dir={root}"]
    else:
        options = [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"] + (
            ["--LabApp.news_url=", "--LabApp.check_for_updates_class="
             "jupyterlab.NeverCheckForUpdate", "--LabApp.expose_app_in_browser=True"]
            if app == "lab" else ["--JupyterNotebookApp.expose_app_in_browser=True"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "notebook" if app == "classic" else app,
         "--no-browser", "--ip=127.0.0.1", f"--port={port}", *options]
        + (["--allow-root"] if os.geteuid() == 0 else []),
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{app} did not start: "
                                       + (root / f"{app}.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        where = "lab/tree" if app == "lab" else "notebooks"
        yield f"{url}/{where}/{notebook}?token={token}"
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


@contextmanager
def browser(width: int = 1400, height: int = 900):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=CHROMIUM_ARGS)
        try:
            yield chromium.new_page(viewport={"width": width, "height": height})
        finally:
            chromium.close()


APP = "window.jupyterapp"  # both apps expose themselves under this name


def open_notebook(page, url: str) -> None:
    page.goto(url, timeout=60_000)
    page.wait_for_selector(".jp-Notebook .jp-CodeCell :is(.cm-content, .CodeMirror)", timeout=60_000)
    page.wait_for_function(
        f"() => {APP} && {APP}.shell.currentWidget && "
        f"{APP}.shell.currentWidget.sessionContext && "
        f"{APP}.shell.currentWidget.sessionContext.session && "
        f"{APP}.shell.currentWidget.sessionContext.session.kernel", timeout=60_000)


def run_cell(page, index: int) -> None:
    """Run one cell through the app's own command (not awaited: it ends with the cell)."""
    page.evaluate(f"""async (i) => {{
        const app = {APP};
        const panel = app.shell.currentWidget;
        await panel.sessionContext.ready;
        panel.content.activeCellIndex = i;
        app.commands.execute('notebook:run-cell');
    }}""", index)


def watch_cell(page, index: int, marks: dict[str, str]) -> None:
    """Run cell ``index`` and note in ``window.__nbtrainSeen[name]`` the milliseconds
    from asking to run it until the JavaScript condition ``marks[name]`` (on ``out``,
    the cell's output node) first holds, and in ``window.__nbtrainCheck[name]`` which
    look at the page (the n-th) first saw it: the order, without a clock."""
    conditions = ",".join(f"{json.dumps(k)}: (out) => ({v})" for k, v in marks.items())
    page.evaluate(f"""async (i) => {{
        const app = {APP};
        const panel = app.shell.currentWidget;
        await panel.sessionContext.ready;
        const cell = panel.content.widgets[i];
        cell.model.outputs.clear();  // what a previous run left must not count
        const marks = {{{conditions}}};
        window.__nbtrainSeen = {{}};
        window.__nbtrainCheck = {{}};
        const t0 = performance.now();
        let looks = 0;
        const check = () => {{
            const out = cell.node.querySelector('.jp-OutputArea');
            looks += 1;
            for (const [name, test] of Object.entries(marks)) {{
                if (!(name in window.__nbtrainSeen) && out && test(out)) {{
                    window.__nbtrainSeen[name] = performance.now() - t0;
                    window.__nbtrainCheck[name] = looks;
                }}
            }}
        }};
        const observer = new MutationObserver(check);
        observer.observe(cell.node, {{childList: true, subtree: true, characterData: true,
                                      attributes: true}});
        const poll = setInterval(check, 50);
        window.__nbtrainStop = () => {{ observer.disconnect(); clearInterval(poll); }};
        panel.content.activeCellIndex = i;
        app.commands.execute('notebook:run-cell');
    }}""", index)


def wait_idle(page, index: int, timeout: float = 90) -> None:
    prompt = page.locator(".jp-Notebook .jp-CodeCell").nth(index).locator(".jp-InputPrompt")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = prompt.inner_text().strip()
        if text.startswith("[") and "*" not in text and text != "[ ]:":
            return
        time.sleep(0.3)
    raise TimeoutError(f"cell {index} still running after {timeout}s")


def kernel_status(page) -> str:
    return page.evaluate(f"() => {APP}.shell.currentWidget.sessionContext.session.kernel.status")
