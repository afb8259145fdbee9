"""Views for where widgets cannot render: a static figure through display handles, or
text progress.

``StaticView`` (nbclient/nbconvert, VS Code or Colab without a widget manager) shows an
HTML header and one plotly figure (plotly's own mimetype, which JupyterLab, VS Code and
nbconvert's HTML know) and replaces both every couple of seconds through their display
handles. ``TextView`` shows one progress line: through a display handle in a kernel, or
on stderr in a terminal, at most every ``terminal_every`` seconds.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from ._live import LiveView
from .figures import build_figure
from .header import error_html, header_html, header_text

if TYPE_CHECKING:
    from ..run import Run

PLOTLY_MIME = "application/vnd.plotly.v1+json"


def figure_bundle(fig, text: str) -> dict:
    """A display bundle of a plotly figure: plotly's mimetype plus a text twin."""
    body = json.loads(fig.to_json())
    body.setdefault("config", {"displaylogo": False, "responsive": True})
    return {PLOTLY_MIME: body, "text/plain": text}


class StaticView(LiveView):
    interval = 2.0
    heartbeat = 2.0
    max_points = 200

    def __init__(self, run: Run | None = None, *, display: bool = True, world_size: int = 1):
        super().__init__(run, world_size=world_size)
        self._handles = None
        if display:
            from IPython.display import display as show

            header, fig = self.bundles()
            self._handles = (show(header, raw=True, display_id=True),
                             show(fig, raw=True, display_id=True))
        self.start()

    def bundles(self) -> tuple[dict, dict]:
        state = self.state
        with state.lock:
            header = {"text/html": header_html(state) + error_html(state),
                      "text/plain": header_text(state)}
            text = state.progress_line()
        return header, figure_bundle(build_figure(state), text)

    def draw(self, final: bool) -> None:
        header, fig = self.bundles()
        if self._handles is not None:
            self._handles[0].update(header, raw=True)
            self._handles[1].update(fig, raw=True)


class TextView(LiveView):
    interval = 1.0
    heartbeat = 1.0
    terminal_every = 10.0  # seconds between lines on a terminal

    def __init__(self, run: Run | None = None, *, display: bool = True, world_size: int = 1,
                 stream=None):
        super().__init__(run, world_size=world_size)
        self._handle = None
        self._stream = stream
        self._printed_at = 0.0
        self.lines: list[str] = []  # what went to the terminal, for tests
        if display and stream is None:
            from .frontend import in_kernel

            if in_kernel():
                from IPython.display import display as show

                self._handle = show({"text/plain": self.text()}, raw=True, display_id=True)
            else:
                self._stream = sys.stderr
        self.start()

    def text(self) -> str:
        with self.state.lock:
            return header_text(self.state)

    def draw(self, final: bool) -> None:
        text = self.text()
        if self._handle is not None:
            self._handle.update({"text/plain": text}, raw=True)
            return
        now = time.monotonic()
        if self._stream is not None and (final or now - self._printed_at >= self.terminal_every):
            self._printed_at = now
            self.lines.append(text)
            self._stream.write(text + "\n")
            self._stream.flush()
