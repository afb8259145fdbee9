"""A self-contained HTML report of finished runs: each run's dashboard figure and header
(the same builders the live dashboard uses), the comparison of the runs beside the ZeRO
formulas, and each run's summary table. plotly's JavaScript is inlined once, so the file
opens without a network."""

from __future__ import annotations

import html
from pathlib import Path


def write_report(runs, path: str | Path) -> Path:
    """``runs`` (finished, one or several) as one HTML file at ``path``; returns the path."""
    import plotly.io as pio

    from .compare import compare
    from .figures import build_figure
    from .header import error_html, header_html
    from .state import LiveState

    path = Path(path)
    parts = []
    if len(runs) > 1:
        comparison = compare(*runs, display=False)
        parts += ["<h1>Comparison</h1>", comparison.html(),
                  pio.to_html(comparison.figure(), include_plotlyjs=True, full_html=False)]
    for i, run in enumerate(runs):
        state = LiveState.from_run(run, max_points=1000)
        with state.lock:
            head = header_html(state) + error_html(state)
        figure = build_figure(state)  # no title: the heading and the header above name it
        parts += [f"<h1>{html.escape(run.strategy.name)}</h1>", head,
                  pio.to_html(figure, include_plotlyjs=(i == 0 and len(runs) == 1),
                              full_html=False),
                  run.summary()._repr_html_()]
    path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>nbtrain report"
                    "</title></head><body style='font-family:sans-serif;margin:2em'>"
                    + "\n".join(parts) + "</body></html>")
    return path
