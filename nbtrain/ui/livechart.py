"""The live chart: a small widget that draws a whole plotly figure (its ``data`` and
``layout``) with plotly.js, and draws it again when either changes.

plotly's ``FigureWidget`` carries plotly.js (5 MB) in every figure it makes: the
browser received and evaluated it for each run's dashboard (~1.7 s from a run's first
step to its first chart, ~4.8 s in a fresh kernel), and a view re-created by a page
reload started from the state the figure had when first shown. Here one ``PlotlyJS``
widget per kernel brings plotly.js to the page once (never shown: the browser evaluates
a widget's module when its model arrives, a reload included), and each ``LiveChart``
holds the whole current figure (``data``, ``plot_layout``) as widget state, a few
kilobytes, so a re-created view draws what is current. ``layout.uirevision`` keeps the user's zoom across redraws.
"""

from __future__ import annotations

import functools
import pathlib

import anywidget
import traitlets

# Waits for plotly.js (the loader's module may still be evaluating), then draws.
_CHART_ESM = """
function plotly() {
  return new Promise((resolve) => {
    const ready = () => (window.Plotly ? resolve(window.Plotly) : setTimeout(ready, 30));
    ready();
  });
}
export default {
  async render({ model, el }) {
    const Plotly = await plotly();
    const div = document.createElement("div");
    div.style.width = "100%";
    el.appendChild(div);
    const config = { responsive: true, displaylogo: false };
    const draw = () => Plotly.react(div, model.get("data"),
      { ...model.get("plot_layout"), template: model.get("template") }, config);
    await draw();
    model.on("change:data", draw);
    model.on("change:plot_layout", draw);
    model.on("change:template", draw);
    return () => Plotly.purge(div);
  },
};
"""


class LiveChart(anywidget.AnyWidget):
    _esm = _CHART_ESM
    data = traitlets.List().tag(sync=True)
    # not "layout": that name is the widget's own CSS layout (a Layout widget)
    plot_layout = traitlets.Dict().tag(sync=True)
    template = traitlets.Dict().tag(sync=True)  # sent once: plotly.js takes no names


class PlotlyJS(anywidget.AnyWidget):
    """plotly.js for the page (it sets ``window.Plotly``); one per kernel, never shown."""

    _esm = traitlets.Unicode().tag(sync=True)


# plotly.js is a UMD bundle: where the page has RequireJS (the classic Notebook, with
# ipywidgets 7) it would register itself as an AMD module (and break RequireJS for every
# later widget: "Mismatched anonymous define()") instead of setting window.Plotly. Hidden
# module-scoped names make it take its global path on every page.
_AS_GLOBAL = "const define = undefined, exports = undefined, module = undefined;\n"


@functools.cache
def _plotly_source() -> str:
    import plotly

    path = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return _AS_GLOBAL + path.read_text(encoding="utf-8") + "\nexport default {};\n"


_LOADER: PlotlyJS | None = None


def ensure_plotly() -> None:
    """Bring plotly.js to the page, once per kernel (and again after a reload, by
    itself: the loader's model is sent with every other)."""
    global _LOADER
    if _LOADER is None:
        _LOADER = PlotlyJS(_esm=_plotly_source())



