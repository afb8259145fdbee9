"""What users see of a run: the live dashboard, its static and text fallbacks, the
strategy picker and the comparison of finished runs.

``launch(dashboard=...)`` calls ``attach_dashboard``; a ``Run`` shown on its own calls
``show_run``. Nothing here may break or slow a run: a view that cannot be built is
skipped with a warning, and a view that fails to draw stops drawing.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from .compare import Comparison, compare
from .frontend import choose_mode
from .picker import StrategyPicker
from .progress import Progress, progress

if TYPE_CHECKING:
    from ..run import Run

__all__ = ["Comparison", "Progress", "StrategyPicker", "attach_dashboard", "compare",
           "make_view", "progress", "show_run"]


def _cell() -> int | None:
    """The number of the cell running now, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return getattr(shell, "execution_count", None) if shell is not None else None


def mark_shown(obj) -> None:
    """``obj`` has shown itself in the cell running now."""
    obj._nbtrain_shown_in = _cell()


def shown_here(obj) -> bool:
    """Did ``obj`` already show itself in this cell? Then, as the cell's last line, it
    must not show a second time (``nbtrain.compare(a, b)``, a picker, a launch)."""
    cell = _cell()
    return cell is not None and getattr(obj, "_nbtrain_shown_in", None) == cell


def make_view(run: Run | None, mode: str, display: bool = True):
    """A view of ``mode`` (``"widget"``, ``"static"``, ``"text"``) for ``run``."""
    if mode == "widget":
        from .dashboard import Dashboard

        return Dashboard(run, display=display)
    if mode == "static":
        from .fallback import StaticView

        return StaticView(run, display=display)
    if mode == "text":
        from .fallback import TextView

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


def show_run(run: Run) -> None:
    """Display a run's summary: header, the dashboard's figure from its history, and
    ``run.summary()`` as text. Used when a ``Run`` is the last line of a cell."""
    from IPython.display import display

    from .fallback import figure_bundle
    from .figures import build_figure
    from .header import error_html, header_html
    from .state import LiveState

    state = LiveState.from_run(run, max_points=300)
    with state.lock:
        header = {"text/html": header_html(state) + error_html(state), "text/plain": repr(run)}
    display(header, raw=True)
    if len(run.history):
        try:
            display(figure_bundle(build_figure(state), str(run.summary())), raw=True)
        except ImportError:
            display({"text/plain": str(run.summary())}, raw=True)

