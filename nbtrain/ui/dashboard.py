"""The live dashboard: a header, one live plotly chart and an error panel; once the
run ends, a static figure that needs no kernel.

Shown by ``launch()`` it is two outputs in the cell, each behind a display handle: one
widget box (the header, the figure once built, errors in red) and an empty one. The
header shows at once, before any worker starts: it needs nothing heavy. The figure
chart is built on the view's own thread once a rank has logged (``prepare``): a small
widget that draws the whole figure with plotly.js, which one loader per kernel brings to
the page (``livechart.py``); the workers never wait for it. Everything live is widget state, so a page reload
re-creates the view with the current header and figure, and it goes on updating. When
the run ends, the two outputs become the static header and a static plotly figure
(plotly's mimetype, an HTML fallback and text), and the widgets are closed: a saved
notebook, nbviewer or a kernel-less viewer then show the final charts, which a widget
cannot. A page reloaded during the run gets no display update (it lost the outputs'
display ids); the kernel's keeper widget brings it the static outputs instead
(``keeper.py``), and the widgets stay for any page it could not reach.

Cheap by construction: one figure per dashboard; at most ``1 / interval`` redraws a
second, each one batched update that restyles only the traces whose data changed, each
trace at most ~``2 * max_points`` points; the header is sent only when its text changed.
A redraw sends two comm messages for the figure (plotly sets and clears its update
trait) — a few messages a second at worst, far below the Jupyter server's ~1000/s limit.
``comm_messages`` counts what this dashboard sent.

``display=False`` builds the widget form at once (``.widget``: header, figure and errors
as widgets in one box) for whoever places it (the picker) and for tests.
"""

from __future__ import annotations

import html
import threading
import time
from typing import TYPE_CHECKING

from .figures import figure_body, figure_height, figure_json, template
from .frontend import INSTALL, missing_widget_packages
from .header import error_html, header_html, header_text, twin_style
from .keeper import KeptDisplay
from .keeper import update as kept_update
from .static import figure_bundle
from .view import LiveView

if TYPE_CHECKING:
    from ..run import Run

PLACEHOLDER = ('<div style="font-family:sans-serif;font-size:12px;color:#757575">'
               "drawing the charts…</div>")
# Said under the final header of a view re-created during the run (a reload), seen
# only where the keeper could not put the static figure in its place (a frontend whose
# widget manager holds no notebook model).
RECREATED_NOTE = ('<div style="font-family:sans-serif;font-size:12px;color:#757575">'
                  "This view was re-created after the page reloaded, and this page could "
                  "not replace it with the static figure: the saved notebook keeps it as a "
                  "live widget. To keep these charts in it, show the run in a cell "
                  "(<code>run</code>, or <code>nbtrain.last_run()</code>).</div>")
EMPTY = {"text/plain": ""}
CLOSE_AFTER_S = 2.0  # after the static forms replaced the widget
# While a run is live its charts are also kept as a static snapshot this often, hidden
# under the live view: a notebook saved during the run whose kernel then restarts (or
# died: out of memory) shows the charts as of the last snapshot before the save, where
# the live view can only say "model not found" (its model lived in that kernel).
SNAPSHOT_S = 30.0
SNAPSHOT_STYLE = twin_style("nbtrain-dashboard", "nbtrain-snapshot")


def require_widgets():
    missing = missing_widget_packages()
    if missing:
        raise ImportError(f"the live dashboard needs {', '.join(missing)}: {INSTALL}")
    import ipywidgets

    return ipywidgets


class Dashboard(LiveView):
    """A run's live view. ``display=False`` builds it without showing it (tests, the
    picker, which places ``.widget`` itself)."""

    interval = 0.25
    heartbeat = 1.0
    max_points = 200
    wait_for_data = True

    def __init__(self, run: Run | None = None, *, display: bool = True, world_size: int = 1,
                 height: int | None = None):
        super().__init__(run, world_size=world_size)
        require_widgets()
        # A fixed height: a widget's plot does not follow a later change of it in every
        # container (the picker's box), so the live figure never changes its height.
        self.height = height or figure_height(2)
        self.figure = None  # the LiveChart, once built
        self.header = self.errors = self.widget = None  # the widget form (display=False)
        self.build_error: BaseException | None = None
        # (widget -> header, snapshot note -> figure, snapshot figure -> nothing) when
        # shown in a cell: the live form's outputs, and what each becomes at the end
        self._handles = None
        self._snapshots = False  # a frontend whose outputs SNAPSHOT_STYLE can hide
        self._snapshot_at = 0.0
        self.comm_messages = 0
        self._control = None  # the widget frontend's control comm when shown (see recreated)
        self._made: list = []  # every widget made here, closed with the view
        if display:
            # One widget holds the header, the figure once built, and errors: a view the
            # browser re-creates (a reload) draws their current state and goes on
            # updating. The second output is empty until the run ends: then both take
            # the static header and figure, which a saved notebook keeps, in every page
            # showing the notebook (keeper.py).
            self._box(placeholder=True)
            from .livechart import ensure_plotly

            ensure_plotly()  # the page evaluates plotly.js while the workers start
            self._control = getattr(require_widgets().Widget, "_control_comm", None)
            from .frontend import classic_notebook_server, colab

            self._snapshots = not (classic_notebook_server() or colab())
            self._snapshot_at = time.monotonic()
            self._handles = (KeptDisplay(self.widget), KeptDisplay(EMPTY, raw=True),
                             KeptDisplay(EMPTY, raw=True))
        else:
            self._build(boxed=True)
            self.draw(final=False)
            self.start()

    @property
    def recreated(self) -> bool:
        """A widget frontend connected since the view was shown (a page reload opens a
        new control comm and re-creates every view from the kernel's state)."""
        if self._handles is None:
            return False
        return getattr(require_widgets().Widget, "_control_comm", None) is not self._control

    # -- building ----------------------------------------------------------------------
    def _box(self, placeholder: bool = False) -> None:
        """The widget form: header, (placeholder or) figure, errors, in one box."""
        widgets = require_widgets()
        with self.state.lock:
            self.header = widgets.HTML(self._header_bundle()["text/html"])
        self.errors = widgets.HTML()
        middle = [widgets.HTML(PLACEHOLDER)] if placeholder else []
        self.widget = widgets.VBox([self.header, *middle, self.errors],
                                   layout=widgets.Layout(width="100%"))
        self.widget.add_class("nbtrain-dashboard")
        self._made += [self.widget, self.header, self.errors, *middle]

    def _build(self, boxed: bool) -> None:
        from .livechart import LiveChart, ensure_plotly

        ensure_plotly()
        self.figure = LiveChart(template=template())
        if boxed:
            self._box()
            self.widget.children = [self.header, self.figure, self.errors]
        self._count_messages()

    def prepare(self) -> None:
        """On the drawer thread: build the figure widget and put it in the box."""
        if self._handles is None or self.figure is not None:
            return
        try:
            self._build(boxed=False)
            self.draw(final=False)
            self.widget.children = [self.header, self.figure, self.errors]
        except Exception as err:  # header only until the end, then the static figure
            self.build_error = err
            why = html.escape(f"{type(err).__name__}: {err}")
            note = require_widgets().HTML(PLACEHOLDER.replace(
                "drawing the charts…", f"the live charts could not be shown ({why}); "
                "they will show when the run ends."))
            self._made.append(note)
            self.widget.children = [self.header, note, self.errors]

    def _header_bundle(self) -> dict:
        """Call with ``state.lock`` held."""
        return {"text/html": header_html(self.state) + error_html(self.state),
                "text/plain": header_text(self.state)}

    def _count_messages(self) -> None:
        """Count comm messages each widget sends (for the message budget)."""
        for w in (self.header, self.figure, self.errors):
            comm = getattr(w, "comm", None)
            if comm is None or getattr(comm, "_nbtrain_counted", False):
                continue
            send = comm.send

            def counting(*args, _send=send, **kwargs):
                self.comm_messages += 1
                return _send(*args, **kwargs)

            comm.send = counting
            comm._nbtrain_counted = True

    # -- drawing -----------------------------------------------------------------------
    def draw_header(self) -> None:
        with self.state.lock:
            header = header_html(self.state)
        if self.header is not None and header != self.header.value:
            self.header.value = header

    def draw(self, final: bool) -> None:
        state = self.state
        with state.lock:
            header = header_html(state)
            errors = error_html(state)
            shown = self._header_bundle()
        if self.figure is not None and self.build_error is None:
            self._draw_figure()
        if final and self.recreated:
            header += RECREATED_NOTE
        if self.header is not None and header != self.header.value:
            self.header.value = header
        if self.errors is not None and errors != self.errors.value:
            self.errors.value = errors
        if final and self._handles is not None:
            # The static forms take the outputs' places, in every page (keeper.py); a
            # static figure's height follows its rows.
            figure = figure_bundle(figure_body(state), shown["text/plain"]) \
                if state.has_data() else EMPTY  # no empty axes
            changes = [(self._handles[0], shown), (self._handles[1], figure)]
            if self._handles[2].version:  # a snapshot was shown there
                changes.append((self._handles[2], EMPTY))
            kept_update(changes)
            if not self.recreated:  # its views are gone: end its comms, a little later,
                # so no message of a view being removed reaches a closed comm. A page
                # that connected since may show a view the keeper could not replace (a
                # frontend without a notebook model): its widgets stay, with the note.
                timer = threading.Timer(CLOSE_AFTER_S, self._close_widgets)
                timer.daemon = True
                timer.start()
        elif not final:
            self._maybe_snapshot()

    def _maybe_snapshot(self) -> None:
        """Every ``SNAPSHOT_S`` of a live run, its charts as static outputs under the
        live view (hidden while it renders; see ``SNAPSHOT_STYLE``)."""
        if not self._snapshots or self._handles is None or self.figure is None:
            return
        now = time.monotonic()
        if now - self._snapshot_at < SNAPSHOT_S:
            return
        self._snapshot_at = now
        with self.state.lock:
            progress = self.state.progress_line()
            text = header_text(self.state)
        note = (f'<div class="nbtrain-snapshot" style="font-family:sans-serif;font-size:12px;'
                f'color:#757575">The charts below are a snapshot taken while the run was '
                f"live ({html.escape(progress)}): the live view needs the kernel that ran "
                f"the run, which is gone.</div>{SNAPSHOT_STYLE}")
        figure = figure_bundle(figure_body(self.state), text, html=False)
        kept_update([(self._handles[1], {"text/html": note, "text/plain": ""}),
                     (self._handles[2], figure)])

    def _close_widgets(self) -> None:
        """Close every widget this view made, with their layouts and styles (each is a
        widget of its own, with its own comm). On ipywidgets 7 the live chart is emptied
        instead: closing an anywidget whose view its replaced output already removed
        throws in widgetsnbextension 3.6 (a second remove of the view)."""
        figure = self.figure
        if figure is not None and not hasattr(require_widgets().Widget, "_repr_mimebundle_"):
            figure.data = []  # it and its layout stay: a reloaded page restores them
            figure = None
        for w in [*self._made, figure]:
            for part in (w, getattr(w, "layout", None), getattr(w, "style", None)):
                if part is not None:
                    try:
                        part.close()
                    except Exception:
                        pass

    def _draw_figure(self) -> None:
        """Send the whole figure when it changed (the state a re-created view draws)."""
        data, layout = figure_json(self.state, self.height)
        layout.pop("template", None)  # the chart has it
        if data != self.figure.data:
            self.figure.data = data
        if layout != self.figure.plot_layout:
            self.figure.plot_layout = layout

    def points(self) -> int:
        """How many points the figure holds now, all traces together."""
        if self.figure is None:
            return 0
        return sum(len(t.get("x") or ()) for t in self.figure.data)

    def _ipython_display_(self) -> None:
        from IPython.display import display as show

        if self.widget is not None:
            show(self.widget)
            return
        with self.state.lock:
            header = self._header_bundle()
        show(header, raw=True)
        show(figure_bundle(figure_body(self.state), header["text/plain"]), raw=True)
