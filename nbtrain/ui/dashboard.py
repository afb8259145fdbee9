"""The live dashboard: a header, one plotly ``FigureWidget`` and an error panel; once the
run ends, a static figure that needs no kernel.

Shown by ``launch()`` it is two outputs in the cell, each behind a display handle: the
header (HTML, errors in red below it) and the figure. The header shows at once, before
any worker starts: it needs nothing heavy. The figure widget is built on the view's own
thread (``prepare``), which ``launch()`` starts once the workers are started; its first
build in a kernel takes ~1.5 s (plotly's 5 MB JavaScript is read and shipped once), and
the workers never wait for it. When the run ends, the header gets its final text and the
widget's output is replaced by a static plotly figure (plotly's mimetype, an HTML
fallback and text), and the widget is closed: a page reload, a saved notebook, nbviewer
or a kernel-less viewer then show the final charts, which a widget cannot (its state
lives in the kernel and the browser's widget manager, not in the notebook).

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
from typing import TYPE_CHECKING

from ._live import LiveView
from .fallback import figure_bundle
from .figures import (
    build_figure,
    empty_figure,
    figure_height,
    layout_updates,
    make_trace,
    trace_specs,
)
from .frontend import INSTALL, missing_widget_packages
from .header import error_html, header_html, header_text

if TYPE_CHECKING:
    from ..run import Run

PLACEHOLDER = ('<div style="font-family:sans-serif;font-size:12px;color:#757575">'
               "drawing the charts…</div>")


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
        self.figure = None  # the FigureWidget, once built
        self.header = self.errors = self.widget = None  # the widget form (display=False)
        self.build_error: BaseException | None = None
        self._handles = None  # (header, figure) display handles when shown in a cell
        self._shown_header: str | None = None
        self._index: dict[str, int] = {}
        self._versions: dict[str, object] = {}
        self._layout: dict[str, object] = {}
        self.comm_messages = 0
        if display:
            from IPython.display import display as show

            with self.state.lock:
                header = self._header_bundle()
            self._shown_header = header["text/html"]
            self._handles = (show(header, raw=True, display_id=True),
                             show({"text/html": PLACEHOLDER, "text/plain": ""}, raw=True,
                                  display_id=True))
        else:
            self._build(boxed=True)
            self.draw(final=False)
            self.start()

    # -- building ----------------------------------------------------------------------
    def _build(self, boxed: bool) -> None:
        widgets = require_widgets()
        import plotly.graph_objects as go

        self.figure = go.FigureWidget(empty_figure(self.height))
        if boxed:
            self.header = widgets.HTML()
            self.errors = widgets.HTML()
            self.widget = widgets.VBox([self.header, self.figure, self.errors],
                                       layout=widgets.Layout(width="100%"))
            self.widget.add_class("nbtrain-dashboard")
        self._count_messages()

    def prepare(self) -> None:
        """On the drawer thread: build the figure widget and show it in the cell."""
        if self._handles is None or self.figure is not None:
            return
        try:
            self._build(boxed=False)
            self.draw(final=False)
            self._handles[1].update(self._widget_bundle(), raw=True)
        except Exception as err:  # header only until the end, then the static figure
            self.build_error = err
            why = html.escape(f"{type(err).__name__}: {err}")
            self._handles[1].update({
                "text/html": PLACEHOLDER.replace(
                    "drawing the charts…", f"the live charts could not be shown ({why}); "
                    "they will show when the run ends."),
                "text/plain": ""}, raw=True)

    def _widget_bundle(self) -> dict:
        bundle = dict(self.figure._repr_mimebundle_())  # also syncs the widget's state
        bundle["text/plain"] = "nbtrain live figure (a widget; replaced by a static " \
                               "figure when the run ends)"
        return bundle

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
            shown = self._header_bundle() if self._handles is not None else None
            header = header_html(self.state)
        if self.header is not None and header != self.header.value:
            self.header.value = header
        if shown is not None and shown["text/html"] != self._shown_header:
            self._handles[0].update(shown, raw=True)
            self._shown_header = shown["text/html"]

    def draw(self, final: bool) -> None:
        state = self.state
        with state.lock:
            specs = trace_specs(state) if self.figure is not None else []
            layout = layout_updates(state, self.height) if self.figure is not None else {}
            header = header_html(state)
            errors = error_html(state)
            shown = self._header_bundle() if self._handles is not None else None
        if self.figure is not None and self.build_error is None and not (
                final and self._handles is not None):  # the static figure replaces it
            self._draw_figure(specs, layout)
        if self.header is not None and header != self.header.value:
            self.header.value = header
        if self.errors is not None and errors != self.errors.value:
            self.errors.value = errors
        if self._handles is None:
            return
        if shown["text/html"] != self._shown_header:
            self._handles[0].update(shown, raw=True)
            self._shown_header = shown["text/html"]
        if final:
            self._handles[1].update(  # a static figure's height follows its rows
                figure_bundle(build_figure(state), shown["text/plain"]), raw=True)
            if self.figure is not None:
                self.figure.close()  # the static figure took its place

    def _draw_figure(self, specs, layout) -> None:
        fig = self.figure
        new = [s for s in specs if s.key not in self._index]
        if new:
            fig.add_traces([make_trace(s) for s in new])
            for i, s in enumerate(new):
                self._index[s.key] = len(fig.data) - len(new) + i
                self._versions[s.key] = s.version
        changed = [s for s in specs if self._versions.get(s.key) != s.version]
        layout = {k: v for k, v in layout.items() if self._layout.get(k) != v}
        if changed or layout:
            with fig.batch_update():
                if layout:
                    fig.update_layout(layout)
                    self._layout.update(layout)
                for s in changed:
                    trace = fig.data[self._index[s.key]]
                    for name, value in s.data.items():
                        setattr(trace, name, value)
                    self._versions[s.key] = s.version

    def points(self) -> int:
        """How many points the figure holds now, all traces together."""
        if self.figure is None:
            return 0
        return sum(len(t.x) for t in self.figure.data if t.x is not None)

    def _ipython_display_(self) -> None:
        from IPython.display import display as show

        if self.widget is not None:
            show(self.widget)
            return
        with self.state.lock:
            header = self._header_bundle()
        show(header, raw=True)
        show(figure_bundle(build_figure(self.state), header["text/plain"]), raw=True)
