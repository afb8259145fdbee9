"""What users see of a run: the live dashboard, its static and text fallbacks, the
strategy picker and the comparison of finished runs.

The UI attaches itself to runs: importing this package registers ``attach_dashboard``
as the view ``launch(dashboard=...)`` asks a ``Run`` for (``Run.open_view``), and
``show_run`` as how a ``Run`` shown on its own displays (``Run`` itself knows no UI).
Nothing here may break or slow a run: a view that cannot be built is skipped with a
warning, and a view that fails to draw stops drawing.

Modules: ``view`` (what every live view shares: a sink, a drawer thread), ``dashboard``
(the widget view), ``static`` (views where widgets cannot render: a figure through
display handles, text), ``series`` (bounded series and the redraw rate limit),
``state``, ``figures``, ``header``, ``keeper``, ``livechart``, ``frontend``, ``picker``,
``compare``, ``progress``, ``theory``, ``report`` (finished runs as one HTML file).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .. import run as _run
from ..cells import mark_shown, shown_here
from .compare import Comparison, compare
from .frontend import (
    MODES,
    OFF,
    choose_mode,
    dashboard_forced,
    jupyter_server_session,
    missing_widget_packages,
)
from .picker import StrategyPicker
from .progress import Progress, progress
from .report import write_report

if TYPE_CHECKING:
    from ..run import Run

__all__ = ["Comparison", "Progress", "StrategyPicker", "attach_dashboard", "compare",
           "make_view", "preload", "progress", "show_run"]


def make_view(run: Run | None, mode: str, display: bool = True):
    """A view of ``mode`` (``"widget"``, ``"static"``, ``"text"``) for ``run``."""
    if mode == "widget":
        from .dashboard import Dashboard

        return Dashboard(run, display=display)
    if mode == "static":
        from .static import StaticView

        return StaticView(run, display=display)
    if mode == "text":
        from .static import TextView

        return TextView(run, display=display)
    raise ValueError(f"mode={mode!r}: one of 'widget', 'static', 'text'.")


def attach_dashboard(run: Run, dashboard="auto"):
    """Show ``run``'s live view (as ``dashboard`` asks) and send it the run's events.
    Returns the view, or None when there is none (never raises for the UI's sake)."""
    mode = choose_mode(dashboard)
    if mode is None:
        return None
    try:
        view = make_view(run, mode)
    except Exception as err:
        if mode == "widget":
            try:
                view = make_view(run, "static" if choose_mode("static") == "static" else "text")
            except Exception:
                view = None
        else:
            view = None
        warnings.warn(f"nbtrain could not show its {mode} dashboard ({type(err).__name__}: "
                      f"{err}); the run goes on without it.", stacklevel=3)
        if view is None:
            return None
    run.add_sink(view)
    if mode != "text":
        mark_shown(run)
    return view


def preload() -> bool:
    """Between cells after ``import nbtrain`` (``launch.warm.when_idle``): bring plotly.js
    to the page before the first dashboard needs it, where the dashboard will be the
    widget one in a Jupyter server's notebook (JupyterLab, Notebook 7), so a fresh
    kernel's first chart does not wait for the browser to receive and evaluate 5 MB.
    Elsewhere (Colab, the classic Notebook, VS Code, a plain client) the first dashboard
    brings it, as before. Returns whether it did."""
    forced = dashboard_forced()  # read as choose_mode reads it
    if forced in OFF or (forced in MODES and forced != "widget"):
        return False
    if not jupyter_server_session() or missing_widget_packages():
        return False
    from .livechart import ensure_plotly  # anywidget: only where widgets will draw

    ensure_plotly()
    return True


def show_run(run: Run) -> None:
    """Display a run's summary: header, the dashboard's figure from its history, and
    ``run.summary()`` as text. Used when a ``Run`` is the last line of a cell."""
    from IPython.display import display

    from .figures import figure_body
    from .header import error_html, header_html
    from .state import LiveState
    from .static import figure_bundle

    state = LiveState.from_run(run, max_points=300)
    with state.lock:
        header = {"text/html": header_html(state) + error_html(state), "text/plain": repr(run)}
    display(header, raw=True)
    if len(run.history):
        try:
            display(figure_bundle(figure_body(state), str(run.summary())), raw=True)
        except ImportError:
            display({"text/plain": str(run.summary())}, raw=True)


def _display(run: Run) -> None:
    if not shown_here(run):  # its live dashboard is already in this cell
        show_run(run)


_run.register_views(attach=attach_dashboard, display=_display, report=write_report)
