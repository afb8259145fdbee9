"""Which view a run gets: the live widget, a static figure, text, or none.

Detection is conservative: the widget only when the kernel is an ipykernel, the widget
packages import, and a widget frontend is there: either a widget manager has opened
ipywidgets 8's ``jupyter.widget.control`` comm on this kernel (it does when it connects,
but the kernel only hears it if ipywidgets was imported by then), or the kernel was
started by a Jupyter server for a notebook session (``JPY_SESSION_NAME``: JupyterLab,
Notebook 7) and not under VS Code, or by the classic Notebook's server (6.x, nbclassic:
it sets no session name; its widget manager is widgetsnbextension), or the kernel is
Colab's (its own frontend renders anywidget widgets on its stock ipywidgets 7; anywidget
turns on Colab's widget manager).
nbclient, nbconvert, papermill and plain kernels have none of these. Otherwise a static
plotly figure refreshed through a display handle in a kernel, or text in a terminal.
``NBTRAIN_DASHBOARD=widget|static|text|off`` overrides ``"auto"``.
"""

from __future__ import annotations

import os
import sys
import warnings

from ..run import DASHBOARDS

MODES = ("widget", "static", "text")
OFF = ("off", "false", "0", "none")  # NBTRAIN_DASHBOARD values that turn the view off
INSTALL = "pip install ipywidgets anywidget plotly"
_warned: set[str] = set()


def check_arg(dashboard) -> None:
    """Fail at ``launch()`` for a value that is not a dashboard setting."""
    if dashboard in DASHBOARDS:
        return
    raise ValueError(f"dashboard={dashboard!r}: use 'auto' (the default), True, False, "
                     f"or force one view: {', '.join(map(repr, MODES))}.")


def in_kernel() -> bool:
    """True inside an ipykernel (a notebook, nbclient, VS Code, Colab)."""
    shell = _shell()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _shell():
    if "IPython" not in sys.modules:
        return None
    try:
        from IPython import get_ipython
    except Exception:
        return None
    return get_ipython()


def missing_widget_packages() -> list[str]:
    missing = []
    for name in ("ipywidgets", "anywidget", "plotly"):
        try:
            __import__(name)
        except Exception:
            missing.append(name)
    return missing


def widget_manager_connected() -> bool:
    """A frontend widget manager opened the control comm on this kernel."""
    widgets = sys.modules.get("ipywidgets")
    if widgets is None:
        try:
            import ipywidgets as widgets
        except Exception:
            return False
    return getattr(widgets.Widget, "_control_comm", None) is not None


def jupyter_server_session() -> bool:
    """The kernel belongs to a notebook session of a Jupyter server (Lab, Notebook 7),
    not to VS Code's or Colab's own frontends, which may lack the widget extensions."""
    if not os.environ.get("JPY_SESSION_NAME"):
        return False
    vscode = any(k.startswith("VSCODE_") for k in os.environ)
    return not (vscode or colab())


CLASSIC_SERVERS = ("jupyter-notebook", "jupyter-nbclassic")


def classic_notebook_server(cmdline_path: str | None = None) -> bool:
    """The kernel was started by the classic Notebook's server (``jupyter notebook`` of
    Notebook 6, or nbclassic), read from its parent's command line. Notebook 7 has the
    same command but runs on jupyter_server, which names the session."""
    pid = os.environ.get("JPY_PARENT_PID")
    if cmdline_path is None and (not pid or os.environ.get("JPY_SESSION_NAME")):
        return False
    try:
        with open(cmdline_path or f"/proc/{pid}/cmdline", "rb") as f:
            words = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return False
    names = [os.path.basename(w) for w in words]
    modules = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"]
    return any(n in CLASSIC_SERVERS for n in names) or any(
        m in ("notebook", "nbclassic", "notebook.notebookapp") for m in modules)


def colab() -> bool:
    """The kernel is Colab's (its frontend draws anywidget widgets)."""
    return "google.colab" in sys.modules


def has_plotly() -> bool:
    try:
        import plotly  # noqa: F401
    except Exception:
        return False
    return True


def choose_mode(dashboard="auto") -> str | None:
    """``"widget"``, ``"static"``, ``"text"`` or ``None`` (no view) for ``dashboard``."""
    check_arg(dashboard)
    if dashboard is False or dashboard is None:
        return None
    if dashboard in (True, "auto"):
        forced = dashboard_forced()
        if forced in OFF:
            return None
        if forced in MODES:
            dashboard = forced
    if dashboard == "widget":
        missing = missing_widget_packages()
        if not missing:
            return "widget"
        _warn_once(f"the live dashboard needs {', '.join(missing)}: {INSTALL}. Showing a "
                   "static view instead.")
        dashboard = "static"
    if dashboard == "static":
        if has_plotly() and _shell() is not None:
            return "static"
        if not has_plotly():
            _warn_once(f"the static dashboard needs plotly: {INSTALL}. Showing text instead.")
        return "text"
    if dashboard == "text":
        return "text"
    return detect()


def dashboard_forced() -> str:
    """``NBTRAIN_DASHBOARD`` as written (lower case), "" when unset: one of ``OFF`` or
    ``MODES`` decides; any other value leaves the choice to ``detect``."""
    return os.environ.get("NBTRAIN_DASHBOARD", "").strip().lower()


def detect() -> str:
    if not in_kernel():
        return "text"
    if not has_plotly():
        _warn_once(f"nbtrain's dashboard needs plotly: {INSTALL}. Showing text progress.")
        return "text"
    if (widget_manager_connected() or jupyter_server_session() or colab()
            or classic_notebook_server()):
        missing = missing_widget_packages()
        if not missing:
            return "widget"
        _warn_once(f"the live dashboard needs {', '.join(missing)}: {INSTALL}. Showing a "
                   "static view instead.")
    return "static"


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
