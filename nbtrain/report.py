"""A self-contained HTML report of finished runs: the figures (plotly, with its
JavaScript inlined, so the file opens without a network) and each run's summary table."""

from __future__ import annotations

import html
from pathlib import Path

from .telemetry.events import Memory, Metric
from .telemetry.summary import MEMORY_ORDER

_MB = 2**20


def report_figure(runs):
    """Loss per rank, memory by category per rank, step time and communication per step."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=(
        "loss per rank", "memory per rank by category (MB)", "mean step time (ms)",
        "communication per step (MB)"), vertical_spacing=0.16)
    colors = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2"]
    for i, run in enumerate(runs):
        label = run.strategy.name
        for rank in range(run.world_size):
            points = [(e.step, e.values["loss"]) for e in run.history.events("metric", rank)
                      if isinstance(e, Metric) and "loss" in e.values]
            if points:
                fig.add_trace(go.Scatter(
                    x=[p[0] for p in points], y=[p[1] for p in points], mode="lines",
                    name=f"{label} rank {rank}", legendgroup=label,
                    line=dict(color=colors[i % len(colors)], dash="solid" if rank == 0 else "dot")),
                    row=1, col=1)
    x = [f"{run.strategy.name}<br>rank {r}" for run in runs for r in range(run.world_size)]
    for category in MEMORY_ORDER[:3]:
        y = []
        for run in runs:
            for rank in range(run.world_size):
                mem = [e.values for e in run.history.events("memory", rank) if isinstance(e, Memory)]
                y.append(max((m.get(category, 0) for m in mem), default=0) / _MB)
        fig.add_trace(go.Bar(x=x, y=y, name=category, legendgroup="memory"), row=1, col=2)
    summaries = [run.summary() for run in runs]
    names = [run.strategy.name for run in runs]
    fig.add_trace(go.Bar(x=names, y=[(s.ranks[0].step_time or 0) * 1000 for s in summaries],
                         name="step time", showlegend=False), row=2, col=1)
    ops = sorted({op for s in summaries for r in s.ranks for op in r.comm_per_step})
    for op in ops:
        fig.add_trace(go.Bar(x=names, y=[s.ranks[0].comm_per_step.get(op, {}).get("bytes", 0) / _MB
                                         for s in summaries], name=op, legendgroup="comm"),
                      row=2, col=2)
    fig.update_layout(barmode="stack", height=760, template="plotly_white",
                      title="nbtrain run report")
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="MB", row=1, col=2)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="MB per step", row=2, col=2)
    return fig


def write_report(runs, path: str | Path) -> Path:
    import plotly.io as pio

    path = Path(path)
    body = pio.to_html(report_figure(runs), include_plotlyjs=True, full_html=False)
    tables = "\n".join(
        f"<h2>{html.escape(run.strategy.name)} — {run.world_size} × {run.accelerator}, "
        f"{run.start_method}, {run.status} in {run.elapsed:.1f}s</h2>"
        f"<pre>{html.escape(str(run.summary()))}</pre>" for run in runs)
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>nbtrain report"
                    f"</title></head><body style='font-family:sans-serif'>{body}{tables}"
                    f"</body></html>")
    return path
