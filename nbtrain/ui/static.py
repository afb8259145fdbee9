"""Views for where widgets cannot render: a static figure through display handles, or
text progress.

``StaticView`` (nbclient/nbconvert, VS Code or Colab without a widget manager) shows an
HTML header and one plotly figure (plotly's own mimetype, which JupyterLab, VS Code and
nbconvert's HTML know) and replaces both every couple of seconds through their display
handles. Its header shows at once; the figure comes with the first draw, on the view's
own thread, so the workers never wait for plotly. A final figure also carries an HTML
twin, which pages and viewers without plotly's renderer show (the classic Notebook,
nbviewer, nbconvert's HTML): it draws with the page's plotly.js (the live chart's loader
brought it), else with a copy inlined in the notebook (``inline_plotly``: the classic
Notebook, which has no plotly renderer, once per kernel), else from plotly's CDN; never
through RequireJS, which plotly.js's UMD wrapper would take. ``TextView`` shows one progress line: through a display handle in a kernel, or
on stderr in a terminal, at most every ``terminal_every`` seconds.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING

from .figures import figure_body
from .header import error_html, header_html, header_text
from .view import LiveView

if TYPE_CHECKING:
    from ..run import Run

PLOTLY_MIME = "application/vnd.plotly.v1+json"


CONFIG = {"displaylogo": False, "responsive": True}


def figure_bundle(fig, text: str, html: bool = True) -> dict:
    """A display bundle of a plotly figure (plotly.py's, or ``figures.figure_body``'s
    dict): plotly's mimetype, an HTML twin for viewers without plotly's renderer
    (``html=False`` leaves it out) and a text twin."""
    if isinstance(fig, dict):  # NaN and numbers of numpy's made JSON as plotly.py makes them
        from plotly.io.json import to_json_plotly

        body = json.loads(to_json_plotly(fig))
    else:
        body = json.loads(fig.to_json())
    body.setdefault("config", CONFIG)
    bundle = {PLOTLY_MIME: body, "text/plain": text}
    if html:
        bundle["text/html"] = figure_html(body)
    return bundle


# Draws a figure with window.Plotly: the page's (the live chart's loader), else the copy
# an earlier output inlined, else plotly.js from its CDN, evaluated with RequireJS's
# define hidden where the page has it (plotly.js's UMD wrapper would register an AMD
# module instead of setting window.Plotly).
_DRAW = """<div id="%(id)s" class="plotly-graph-div" style="height:%(height)dpx; width:100%%;"></div>
<script type="text/javascript">
(function () {
  var fig = %(fig)s;
  var el = document.getElementById("%(id)s");
  var draw = function () { window.Plotly.newPlot(el, fig.data, fig.layout, fig.config); };
  var evaluate = function (source) {
    new Function("define", "module", "exports", source)(undefined, undefined, undefined);
  };
  var fail = function () { el.textContent = "(plotly.js could not be loaded to draw this chart)"; };
  var start = Date.now();
  var wait = function () {
    if (window.Plotly) return draw();
    var inline = document.getElementById("nbtrain-plotlyjs");
    if (inline) { evaluate(inline.textContent.split("<\\\\/script").join("</script")); return draw(); }
    if (Date.now() - start < 3000) return setTimeout(wait, 50);
    if (typeof window.define === "function" && window.define.amd) {
      fetch("%(cdn)s").then(function (r) { return r.text(); })
        .then(function (source) { evaluate(source); draw(); }).catch(fail);
    } else {
      var script = document.createElement("script");
      script.src = "%(cdn)s";
      script.onload = draw;
      script.onerror = fail;
      document.head.appendChild(script);
    }
  };
  wait();
})();
</script>"""

_inlined = False


def figure_html(body: dict) -> str:
    """The HTML twin of a figure (``fig.to_plotly_json()`` with its config)."""
    import uuid

    from plotly.offline import get_plotlyjs_version

    html = _DRAW % {
        "id": f"nbtrain-{uuid.uuid4().hex}",
        "height": int((body.get("layout") or {}).get("height") or 450),
        "fig": json.dumps(body).replace("</", "<\\/"),
        "cdn": f"https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js",
    }
    return inline_plotly() + html


def inline_plotly() -> str:
    """plotly.js itself, for the first HTML twin of a kernel under the classic Notebook
    (no plotly renderer there; after a kernel restart nothing else would bring it):
    ``""`` elsewhere and after the first."""
    global _inlined
    from .frontend import classic_notebook_server

    if _inlined or not classic_notebook_server():
        return ""
    _inlined = True
    from plotly.offline import get_plotlyjs

    source = get_plotlyjs().replace("</script", "<\\/script")
    return f'<script type="text/plain" id="nbtrain-plotlyjs">{source}</script>\n'


class StaticView(LiveView):
    interval = 2.0
    heartbeat = 2.0
    max_points = 200
    wait_for_data = True

    def __init__(self, run: Run | None = None, *, display: bool = True, world_size: int = 1):
        super().__init__(run, world_size=world_size)
        self._handles = None
        self._shown_header: dict | None = None
        if display:
            from IPython.display import display as show

            self._shown_header = self.header()
            self._handles = (show(self._shown_header, raw=True, display_id=True),
                             show({"text/plain": ""}, raw=True, display_id=True))
        else:
            self.start()

    def header(self) -> dict:
        with self.state.lock:
            return {"text/html": header_html(self.state) + error_html(self.state),
                    "text/plain": header_text(self.state)}

    def bundles(self, final: bool = True) -> tuple[dict, dict]:
        """The header, and the figure: nothing where no rank logged a step or a metric
        (a run that failed as it started, a function that only communicates), where it
        would show empty axes."""
        header = self.header()
        if not self.state.has_data():
            return header, {"text/plain": ""}
        with self.state.lock:
            text = self.state.progress_line()
        return header, figure_bundle(figure_body(self.state), text, html=final)

    def draw_header(self) -> None:
        header = self.header()
        if self._handles is not None and header != self._shown_header:
            self._handles[0].update(header, raw=True)
            self._shown_header = header

    def draw(self, final: bool) -> None:
        header, fig = self.bundles(final)
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
        if not display:
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
