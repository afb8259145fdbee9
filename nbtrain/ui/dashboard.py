"""The live dashboard: a header, one plotly ``FigureWidget`` and an error panel.

Cheap by construction: one figure per dashboard (its first display ships plotly's
JavaScript, ~5 MB, once); at most ``1 / interval`` redraws a second, each one batched
update that restyles only the traces whose data changed, each trace at most
~``2 * max_points`` points; the header is sent only when its text changed. A redraw
sends two comm messages for the figure (plotly sets and clears its update trait) and
one for the header — ~12 messages a second at worst, far below the Jupyter server's
~1000/s limit. ``comm_messages`` counts what this dashboard sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._live import LiveView
from .figures import empty_figure, figure_height, layout_updates, make_trace, trace_specs
from .frontend import INSTALL, missing_widget_packages
from .header import error_html, header_html

if TYPE_CHECKING:
    from ..run import Run


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

    def __init__(self, run: Run | None = None, *, display: bool = True, world_size: int = 1,
                 height: int | None = None):
        super().__init__(run, world_size=world_size)
        widgets = require_widgets()
        import plotly.graph_objects as go

        self.header = widgets.HTML()
        # A fixed height: a widget's plot does not follow a later change of it in every
        # container (the picker's box), so the live figure never changes its height.
        self.height = height or figure_height(2)
        self.figure = go.FigureWidget(empty_figure(self.height))
        self.errors = widgets.HTML()
        self.widget = widgets.VBox([self.header, self.figure, self.errors],
                                   layout=widgets.Layout(width="100%"))
        self.widget.add_class("nbtrain-dashboard")
        self._index: dict[str, int] = {}
        self._versions: dict[str, object] = {}
        self._layout: dict[str, object] = {}
        self.comm_messages = 0
        self._count_messages()
        self.draw(final=False)
        if display:
            from IPython.display import display as show

            show(self.widget)
        self.start()

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

    def draw(self, final: bool) -> None:
        state = self.state
        with state.lock:
            specs = trace_specs(state)
            layout = layout_updates(state, self.height)
            header = header_html(state)
            errors = error_html(state)
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
        if header != self.header.value:
            self.header.value = header
        if errors != self.errors.value:
            self.errors.value = errors

    def points(self) -> int:
        """How many points the figure holds now, all traces together."""
        return sum(len(t.x) for t in self.figure.data if t.x is not None)

    def _ipython_display_(self) -> None:
        from IPython.display import display as show

        show(self.widget)

