"""plotly.js on a page with RequireJS (the classic Notebook, ipywidgets 7): the loader's
module must set window.Plotly, not register an AMD module. Checked in Chromium with the
plotly.js installed here and with the UMD wrapper plotly.js 2 (plotly.py 5, Colab's and
Kaggle's) ships, which took RequireJS's path."""

from __future__ import annotations

import pytest

from nbtrain.ui import livechart

from . import lab

pytestmark = pytest.mark.browser

if lab.missing():
    pytest.skip(f"the browser test {lab.missing()}", allow_module_level=True)

# plotly.js 2's wrapper, as its bundle opens (webpack's UMD)
UMD_2 = ('!function(t,e){"object"==typeof exports&&"object"==typeof module?'
         'module.exports=e():"function"==typeof define&&define.amd?define([],e):'
         '"object"==typeof exports?exports.Plotly=e():t.Plotly=e()}'
         '(self,(function(){return {newPlot: function () { return "drawn"; }};}));\n'
         'export default {};\n')

# A page that has RequireJS's define (what the UMD check looks for), counting its calls,
# then imports a module the way anywidget does (a blob URL).
LOAD = """async (source) => {
    window.amd_calls = 0;
    window.define = function () { window.amd_calls += 1; };
    window.define.amd = {};
    delete window.Plotly;
    const url = URL.createObjectURL(new Blob([source], {type: "text/javascript"}));
    await import(url);
    return {plotly: typeof window.Plotly, amd_calls: window.amd_calls};
}"""


def test_plotly_js_sets_window_plotly_where_the_page_has_requirejs():
    with lab.browser() as page:
        page.goto("about:blank")
        assert page.evaluate(LOAD, UMD_2) == {"plotly": "undefined", "amd_calls": 1}
        assert page.evaluate(LOAD, livechart._AS_GLOBAL + UMD_2) == \
            {"plotly": "object", "amd_calls": 0}
        # the real bundle installed here, as the loader sends it
        assert page.evaluate(LOAD, livechart._plotly_source()) == \
            {"plotly": "object", "amd_calls": 0}
