"""The dashboard's one figure, described as a list of traces built from a ``LiveState``.

Both views draw from ``trace_specs(state)``: the static view builds a new plotly figure
from it; the live widget adds the traces it lacks and restyles, in one batched update,
only those whose data changed (``TraceSpec.version``). Six panels: metrics by step, step
time, samples/s, memory per rank stacked by category, communication per step by op,
and the CUDA allocator's figures (empty on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .state import LiveState

PANELS = {  # key -> (row, col, title, x label, y label)
    "metrics": (1, 1, "Logged metrics (ctx.log)", "step", "value"),
    "step_time": (1, 2, "Step time per rank", "step", "ms"),
    "rate": (1, 3, "Throughput per rank", "step", "samples/s"),
    "memory": (2, 1, "Model state per rank", "", "KB"),
    "comm": (2, 2, "Communication per step", "step", "MB per step"),
    "cuda": (2, 3, "CUDA allocator per rank", "", "KB"),
}
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations")
CUDA_CATEGORIES = ("cuda_allocated", "cuda_reserved", "cuda_peak")
CATEGORY_COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B",
                   "activations": "#B279A2", "cuda_allocated": "#4C78A8",
                   "cuda_reserved": "#9D755D", "cuda_peak": "#E45756"}
RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
               "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
DASHES = ("solid", "dot", "dash", "dashdot", "longdash")


@dataclass
class TraceSpec:
    key: str
    panel: str
    kind: str  # "line" or "bar"
    props: dict[str, Any] = field(default_factory=dict)  # name, colors: set once
    data: dict[str, Any] = field(default_factory=dict)  # x, y: updated
    version: Any = 0


def unit_for(nbytes: float) -> tuple[str, float]:
    """The unit (KB, MB or GB; powers of 1024) that keeps ``nbytes`` readable."""
    for name, size in (("GB", 2**30), ("MB", 2**20)):
        if nbytes >= size:
            return name, size
    return "KB", 2**10


def memory_units(state: LiveState) -> dict[str, tuple[str, float]]:
    """The unit of the memory and CUDA panels, from the largest bar in each."""
    units = {}
    for panel, cats in (("memory", MEMORY_CATEGORIES), ("cuda", CUDA_CATEGORIES)):
        totals = [sum(m.get(c, 0) for c in cats) if panel == "memory"
                  else max((m.get(c, 0) for c in cats), default=0) for m in state.memory.values()]
        units[panel] = unit_for(max(totals, default=0))
    return units


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def trace_specs(state: LiveState) -> list[TraceSpec]:
    """Every trace of the dashboard's figure, in a stable order (new ones at the end of
    their group). Call with ``state.lock`` held or on a state no one updates."""
    specs: list[TraceSpec] = []
    for i, name in enumerate(state.metric_names):
        for rank in state.ranks:
            series = state.metrics.get((name, rank))
            if series is None:
                continue
            x, y = series.points()
            specs.append(TraceSpec(
                f"metric:{name}:{rank}", "metrics", "line",
                {"name": f"{name} r{rank}", "legendgroup": name,
                 "line": {"color": rank_color(rank), "dash": DASHES[i % len(DASHES)]}},
                {"x": x, "y": y}, series.version))
    for panel, table, unit in (("step_time", state.step_ms, "ms"), ("rate", state.rate, "/s")):
        for rank in sorted(table):
            x, y = table[rank].points()
            specs.append(TraceSpec(
                f"{panel}:{rank}", panel, "line",
                {"name": f"r{rank} {unit}", "showlegend": False,
                 "line": {"color": rank_color(rank)}},
                {"x": x, "y": y}, table[rank].version))
    ranks_with_memory = sorted(state.memory)
    labels = [f"rank {r}" for r in ranks_with_memory]
    units = memory_units(state)
    for panel, categories in (("memory", MEMORY_CATEGORIES), ("cuda", CUDA_CATEGORIES)):
        unit, size = units[panel]
        for cat in categories:
            if not any(cat in state.memory[r] for r in ranks_with_memory):
                continue
            y = [state.memory[r].get(cat, 0) / size for r in ranks_with_memory]
            specs.append(TraceSpec(
                f"{panel}:{cat}", panel, "bar",
                {"name": cat, "marker": {"color": CATEGORY_COLORS[cat]},
                 "legendgroup": panel, "showlegend": panel == "memory"},
                {"x": labels, "y": y, "hovertemplate": f"%{{x}} {cat}: %{{y:.3g}} {unit}"
                                                        "<extra></extra>"},
                (tuple(labels), tuple(y))))
    for op in sorted(state.comm):
        x, y = state.comm[op].points()
        specs.append(TraceSpec(
            f"comm:{op}", "comm", "line", {"name": op, "legendgroup": "comm"},
            {"x": x, "y": y}, state.comm[op].version))
    return specs


def make_trace(spec: TraceSpec):
    import plotly.graph_objects as go

    if spec.kind == "bar":
        return go.Bar(**spec.props, **spec.data)
    return go.Scatter(mode="lines", **spec.props, **spec.data)


def empty_figure(height: int = 560):
    """The six panels with their titles and axis labels, and no traces."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=3, subplot_titles=[p[2] for p in PANELS.values()],
                        horizontal_spacing=0.11, vertical_spacing=0.16)
    for row, col, _, xlabel, ylabel in PANELS.values():
        fig.update_xaxes(title_text=xlabel, row=row, col=col)
        fig.update_yaxes(title_text=ylabel, row=row, col=col)
    fig.update_layout(height=height, barmode="stack", margin={"l": 50, "r": 20, "t": 40, "b": 40},
                      legend={"orientation": "v", "font": {"size": 10}},
                      template="plotly_white", uirevision="nbtrain")
    return fig


def add_spec(fig, spec: TraceSpec) -> None:
    row, col = PANELS[spec.panel][:2]
    fig.add_trace(make_trace(spec), row=row, col=col)


def axis_titles(state: LiveState) -> dict[str, str]:
    """Layout updates for the panels whose unit follows the data (memory: KB/MB/GB)."""
    units = memory_units(state)
    return {"yaxis4.title.text": units["memory"][0], "yaxis6.title.text": units["cuda"][0]}


def build_figure(state: LiveState, height: int = 560):
    """A new static figure of ``state`` (what the static view shows and Run displays)."""
    fig = empty_figure(height)
    with state.lock:
        specs = trace_specs(state)
        titles = axis_titles(state)
    for spec in specs:
        add_spec(fig, spec)
    fig.update_layout(titles)
    return fig
