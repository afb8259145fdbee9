"""The dashboard's one figure: a list of traces and a layout built from a ``LiveState``.

Both views draw from ``figure_json(state)`` (``trace_specs`` and ``layout_updates`` as
plotly.js takes them): the static view makes a plotly figure of it; the live chart
(``livechart.py``) is sent it whole when it changed.

Up to seven panels — metrics by step, step time, where each rank's step time goes
(stacked by phase: data, forward, backward, optimizer, communication waited for, other;
the mean of its last steps, so a straggler or a rank waiting on the others shows),
samples/s, memory per rank stacked by category (and the plan's, ``launch(planned=)``),
communication per step by op, the CUDA allocator's figures — and only those that have
data are laid out (three a row), so a CPU run shows no CUDA panel. What keeps it readable:

- one colour per rank (``RANK_COLORS``) in every panel that has ranks, named once in the
  legend ("rank 0", ...; clicking one hides that rank everywhere); categories of memory
  and collectives have their own palettes, which share no colour with the ranks;
- legend entries carry a fixed ``legendrank`` (ranks, metric names, the warm-up mark,
  memory categories, CUDA, collectives), so the legend keeps its order while traces
  arrive;
- a rank's first step (warm-up: lazy init, allocator, first collective) is a marker,
  not a point of its curve, and drawn at most ``WARMUP_CLIP`` × the slowest other step so
  it cannot flatten the plot (its hover has the real time);
- axes of non-negative quantities start at zero (``rangemode="tozero"``); bytes are
  shown in KB, MB or GB, whichever keeps the numbers readable;
- the figure has no fixed width: it fills the output it is in.
"""

from __future__ import annotations

import functools
import html
import math
from dataclasses import dataclass, field
from typing import Any

from ..units import unit_for
from .palette import (
    CUDA_CATEGORIES,
    DASHES,
    MEMORY_CATEGORIES,
    PHASE_COLORS,
    PHASE_LABELS,
    category_label,
    category_marker,
    collective_style,
    rank_color,
)
from .series import Series
from .state import LiveState

PANELS = {  # key -> (title, x label, y label, y non-negative), in layout order
    "metrics": ("Logged metrics (ctx.log)", "step", "value", False),
    "step_time": ("Step time per rank", "step", "ms", True),
    "rate": ("Throughput per rank", "step", "samples/s", True),
    "memory": ("Model state per rank", "", "KB", True),
    "comm": ("Communication per step", "step", "KB per step", True),
    "cuda": ("CUDA allocator per rank", "", "KB", True),
    "time": ("Where the step time goes", "", "ms per step", True),
}
AXES = {key: i + 1 for i, key in enumerate(PANELS)}  # panel -> its axis pair number
LAYOUT_ORDER = ("metrics", "step_time", "time", "rate", "memory", "comm", "cuda")
WARMUP_CLIP = 1.2  # the warm-up mark is drawn at most this × the slowest other step
LEGEND_RANKS = {"rank": 100, "metric": 200, "warmup": 300, "time": 350, "memory": 400,
                "cuda": 500, "comm": 600}
H_GAP, V_GAP = 0.11, 0.16  # between panels (of the plot area): a y-axis' ticks and title
COMM_HEADROOM = 1.15  # a constant communication line is drawn below the top edge


@dataclass
class TraceSpec:
    key: str
    panel: str
    kind: str  # "line", "bar" or "marker"
    props: dict[str, Any] = field(default_factory=dict)  # name, colors: set once
    data: dict[str, Any] = field(default_factory=dict)  # x, y: updated
    version: Any = 0


def byte_units(state: LiveState) -> dict[str, tuple[str, float]]:
    """The unit of the memory and CUDA panels, from the largest bar in each, and of the
    communication panel, from its largest point."""
    units = {}
    for panel, cats in (("memory", MEMORY_CATEGORIES), ("cuda", CUDA_CATEGORIES)):
        totals = [sum(m.get(c, 0) for c in cats) if panel == "memory"
                  else max((m.get(c, 0) for c in cats), default=0) for m in state.memory.values()]
        units[panel] = unit_for(max(totals, default=0))
    units["comm"] = unit_for(max((max(s.points()[1], default=0) for s in state.comm.values()),
                                 default=0))
    return units


def _legend_entry(key: str, panel: str, name: str, rank: int, group: str, marker: dict,
                  mode: str = "lines") -> TraceSpec:
    """A trace with no points that only names something in the legend."""
    return TraceSpec(key, panel, "legend",
                     {"name": name, "legendgroup": group, "legendrank": rank,
                      "showlegend": True, "mode": mode, "hoverinfo": "skip", **marker},
                     {"x": [None], "y": [None]}, 0)


def _sparse(series: Series, x: list[float]) -> bool:
    """A metric logged now and then (a validation loss once an epoch): its points are
    marked, else one point would not show at all, and a few would read as a trend."""
    return series.count < 2 or (series.count <= 100 and x[-1] - x[0] >= 2 * (series.count - 1))


def trace_specs(state: LiveState) -> list[TraceSpec]:
    """Every trace of the dashboard's figure, in a stable order (new ones at the end of
    their group). Call with ``state.lock`` held or on a state no one updates."""
    specs: list[TraceSpec] = []
    ranks = sorted({r for _, r in state.metrics} | set(state.step_ms) | set(state.rate)
                   | set(state.warmup))
    for rank in ranks:  # the legend's names of the ranks, one colour each, everywhere
        specs.append(_legend_entry(f"legend:rank:{rank}", "step_time", f"rank {rank}",
                                   LEGEND_RANKS["rank"] + rank, f"rank {rank}",
                                   {"line": {"color": rank_color(rank), "width": 3}}))
    names = state.metric_names
    for i, name in enumerate(names):
        specs.append(_legend_entry(f"legend:metric:{name}", "metrics", name,
                                   LEGEND_RANKS["metric"] + i, f"metric {name}",
                                   {"line": {"color": "#616161", "dash": DASHES[i % len(DASHES)]}}))
        for rank in state.ranks:
            series = state.metrics.get((name, rank))
            if series is None:
                continue
            x, y = series.points()
            specs.append(TraceSpec(
                f"metric:{name}:{rank}", "metrics", "line",
                {"name": f"{name} r{rank}", "legendgroup": f"rank {rank}", "showlegend": False,
                 "line": {"color": rank_color(rank), "dash": DASHES[i % len(DASHES)]},
                 **({"mode": "lines+markers", "marker": {"size": 6}} if _sparse(series, x)
                    else {}),
                 "hovertemplate": f"rank {rank} {name}: %{{y:.4g}} at step %{{x}}<extra></extra>"},
                {"x": x, "y": y}, series.version))
    for panel, table, unit in (("step_time", state.step_ms, "ms"),
                               ("rate", state.rate, "samples/s")):
        for rank in sorted(table):
            x, y = table[rank].points()
            specs.append(TraceSpec(
                f"{panel}:{rank}", panel, "line",
                {"name": f"rank {rank}", "legendgroup": f"rank {rank}", "showlegend": False,
                 "line": {"color": rank_color(rank)},
                 "hovertemplate": f"rank {rank}: %{{y:.4g}} {unit} at step %{{x}}<extra></extra>"},
                {"x": x, "y": y}, table[rank].version))
    specs += _warmup_specs(state)
    specs += _restart_specs(state)
    specs += _phase_specs(state)
    ranks_with_memory = sorted(state.memory)
    labels = [f"rank {r}" for r in ranks_with_memory]
    units = byte_units(state)
    for panel, categories in (("memory", MEMORY_CATEGORIES), ("cuda", CUDA_CATEGORIES)):
        unit, size = units[panel]
        for i, cat in enumerate(categories):
            if not any(cat in state.memory[r] for r in ranks_with_memory):
                continue
            y = [state.memory[r].get(cat, 0) / size for r in ranks_with_memory]
            specs.append(TraceSpec(
                f"{panel}:{cat}", panel, "bar",
                {"name": cat.removeprefix("cuda_") if panel == "cuda" else category_label(cat),
                 "marker": category_marker(cat), "legendgroup": cat,
                 "legendrank": LEGEND_RANKS[panel] + i},
                {"x": labels, "y": y, "hovertemplate": f"%{{x}} {category_label(cat)}: %{{y:.3g}} {unit}"
                                                        "<extra></extra>"},
                (tuple(labels), tuple(y))))
        if panel == "memory" and state.planned is not None and labels:  # a mark across
            specs.append(TraceSpec("memory:planned", panel, "marker", {  # each rank's bar
                "name": "planned", "mode": "markers", "legendrank": LEGEND_RANKS[panel] + 99,
                "marker": {"symbol": "line-ew-open", "size": 44, "line": {"width": 2,
                                                                          "color": "#222"}}},
                {"x": labels, "y": [state.planned / size] * len(labels),
                 "hovertemplate": f"%{{x}} planned: %{{y:.3g}} {unit}<extra></extra>"},
                (tuple(labels), state.planned, unit)))
    unit, size = units["comm"]
    for i, op in enumerate(sorted(state.comm)):
        x, y = state.comm[op].points()
        specs.append(TraceSpec(
            f"comm:{op}", "comm", "line",
            {"name": op, "legendgroup": f"comm {op}", "legendrank": LEGEND_RANKS["comm"] + i,
             **collective_style(op)},
            {"x": x, "y": [v / size for v in y],
             "hovertemplate": f"{op}: %{{y:.3g}} {unit} at step %{{x}}<extra></extra>"},
            (state.comm[op].version, unit)))
    return specs


def _restart_specs(state: LiveState) -> list[TraceSpec]:
    """Each restart (``launch(max_restarts=...)``) as a dashed vertical line across the
    step-time panel at the step where its attempt ended, its cause in the hover."""
    if not state.restarts:
        return []
    steady = [v for s in state.step_ms.values() for v in s.points()[1]]
    top = max(steady, default=1.0) * WARMUP_CLIP
    specs = [_legend_entry("legend:restart", "step_time", "restart", LEGEND_RANKS["warmup"] + 1,
                           "restart", {"line": {"color": "#616161", "dash": "dash"}})]
    for e in state.restarts:
        specs.append(TraceSpec(
            f"restart:{e.attempt}", "step_time", "line",
            {"name": f"restart {e.attempt}", "legendgroup": "restart", "showlegend": False,
             "line": {"color": "#616161", "dash": "dash", "width": 1.5},
             "hovertemplate": f"restart {e.attempt} after step {e.step}: "
                              f"{html.escape(e.cause)}<extra></extra>"},
            {"x": [e.step, e.step], "y": [0, top]}, (e.attempt, top)))
    return specs


def _phase_specs(state: LiveState) -> list[TraceSpec]:
    """Each rank's step time stacked by phase (ms per step, its last steps' mean)."""
    ranks = sorted(state.phases)
    if not ranks:
        return []
    means = {r: state.phase_ms(r) for r in ranks}
    labels = [f"rank {r}" for r in ranks]
    specs = []
    for i, phase in enumerate(PHASE_COLORS):
        if not any(means[r].get(phase) for r in ranks):
            continue
        y = [round(means[r].get(phase, 0.0), 3) for r in ranks]
        shares = [f"{v / total:.0%}" if (total := sum(means[r].values())) > 0 else ""
                  for v, r in zip(y, ranks, strict=True)]
        name = PHASE_LABELS.get(phase, phase)
        specs.append(TraceSpec(
            f"time:{phase}", "time", "bar",
            {"name": name, "marker": {"color": PHASE_COLORS[phase]}, "legendgroup": phase,
             "legendrank": LEGEND_RANKS["time"] + i},
            {"x": labels, "y": y, "customdata": shares,
             "hovertemplate": f"%{{x}} {name}: %{{y:.3g}} ms per step (%{{customdata}})"
                              "<extra></extra>"},
            (tuple(labels), tuple(y))))
    return specs


def _warmup_specs(state: LiveState) -> list[TraceSpec]:
    """Each rank's first step as a marker, clipped to ``WARMUP_CLIP`` × the slowest
    steady step so it does not set the step-time axis."""
    if not state.warmup:
        return []
    steady = [v for s in state.step_ms.values() for v in s.points()[1]]
    cap = WARMUP_CLIP * max(steady) if steady else math.inf
    specs = [_legend_entry("legend:warmup", "step_time", "first step (warm-up)",
                           LEGEND_RANKS["warmup"], "warmup",
                           {"marker": {"color": "#616161", "symbol": "triangle-up", "size": 9}},
                           mode="markers")]
    for rank, (step, ms) in sorted(state.warmup.items()):
        y = min(ms, cap)
        specs.append(TraceSpec(
            f"warmup:{rank}", "step_time", "marker",
            {"name": f"rank {rank} warm-up", "legendgroup": f"rank {rank}",
             "showlegend": False, "mode": "markers",
             "marker": {"color": rank_color(rank), "symbol": "triangle-up", "size": 9}},
            {"x": [step], "y": [y],
             "hovertemplate": f"rank {rank} first step (warm-up): {ms:.4g} ms"
                              + (" (off the scale)" if y < ms else "") + "<extra></extra>"},
            (step, ms, y)))
    return specs


def visible_panels(state: LiveState) -> list[str]:
    """The panels that have something to draw, in layout order. Before any data: the
    first row, so the figure is not an empty box while workers start."""
    has = {
        "metrics": bool(state.metrics),
        "step_time": bool(state.step_ms or state.warmup),
        "rate": bool(state.rate),
        "memory": any(c in m for m in state.memory.values() for c in MEMORY_CATEGORIES),
        "comm": bool(state.comm),
        "cuda": any(c in m for m in state.memory.values() for c in CUDA_CATEGORIES),
        "time": bool(state.phases),
    }
    shown = [k for k in LAYOUT_ORDER if has[k]]
    return shown or ["metrics", "step_time", "rate"]


def _axis(n: int, name: str) -> str:
    return f"{name}axis{n if n > 1 else ''}"


def layout_updates(state: LiveState, height: int | None = None) -> dict[str, Any]:
    """The layout of the panels that have data (at most three a row, rows as even as can
    be, each panel its own axes; the others hidden) and the units that follow the data (memory: KB/MB/GB). Call with
    ``state.lock`` held or on a state no one updates."""
    shown = visible_panels(state)
    rows = math.ceil(len(shown) / 3)
    per_row = [len(shown) // rows + (r < len(shown) % rows) for r in range(rows)]
    place = {}  # panel -> (row, col, panels in its row): rows as even as can be, full width
    for r, count in enumerate(per_row):
        for c in range(count):
            place[shown[sum(per_row[:r]) + c]] = (r, c, count)
    cell_h = (1 - (rows - 1) * V_GAP) / rows
    units = byte_units(state)
    out: dict[str, Any] = {}
    for key, (_, xlabel, ylabel, _) in PANELS.items():
        n = AXES[key]
        x, y = _axis(n, "x"), _axis(n, "y")
        if key in ("memory", "cuda"):
            ylabel = units[key][0]
        elif key == "comm":
            ylabel = f"{units[key][0]} per step"
        out[f"{x}.title.text"] = xlabel
        out[f"{y}.title.text"] = ylabel
        title = f"annotations[{n - 1}]"  # each panel's title, set key by key: a live
        # figure is sent what changed, and plotly.js refuses a whole list with its items
        if key not in shown:
            out[f"{x}.visible"] = out[f"{y}.visible"] = out[f"{title}.visible"] = False
            out[f"{x}.domain"], out[f"{y}.domain"] = [0, 0.01], [0, 0.01]
            continue
        row, col, cols = place[key]
        cell_w = (1 - (cols - 1) * H_GAP) / cols
        x0 = col * (cell_w + H_GAP)
        y1 = 1 - row * (cell_h + V_GAP)
        out[f"{x}.visible"] = out[f"{y}.visible"] = True
        out[f"{x}.domain"] = [round(x0, 4), round(x0 + cell_w, 4)]
        out[f"{y}.domain"] = [round(y1 - cell_h, 4), round(y1, 4)]
        out[f"{title}.visible"] = True
        out[f"{title}.x"], out[f"{title}.y"] = round(x0 + cell_w / 2, 4), round(y1, 4)
    top = max((max(s.points()[1], default=0) for s in state.comm.values()), default=0)
    if top > 0:
        out[f"{_axis(AXES['comm'], 'y')}.range"] = [0, COMM_HEADROOM * top / units["comm"][1]]
    out["height"] = height or figure_height(rows)
    return out


def figure_height(rows: int) -> int:
    return {1: 340, 2: 600}.get(rows, 860)


def base_layout(height: int | None = None) -> dict[str, Any]:
    """The panels' axes (each its own pair, anchored to each other), as a plain dict; no
    width, so the figure fills the output it is in."""
    layout: dict[str, Any] = {
        "height": height or figure_height(2), "autosize": True, "barmode": "stack",
        "template": "plotly_white", "uirevision": "nbtrain",
        "margin": {"l": 55, "r": 20, "t": 40, "b": 45},
        "legend": {"orientation": "v", "font": {"size": 11}, "tracegroupgap": 2,
                   "traceorder": "normal"},
        "hovermode": "closest",
        "annotations": [{"text": title, "xref": "paper", "yref": "paper", "x": 0, "y": 1,
                         "xanchor": "center", "yanchor": "bottom", "showarrow": False,
                         "font": {"size": 14}, "visible": False}
                        for title, *_ in PANELS.values()],
    }
    for key, (_, _, _, nonneg) in PANELS.items():
        n = AXES[key]
        suffix = n if n > 1 else ""
        layout[_axis(n, "x")] = {"anchor": f"y{suffix}", "automargin": True}
        layout[_axis(n, "y")] = {"anchor": f"x{suffix}", "automargin": True,
                                 **({"rangemode": "tozero"} if nonneg else {})}
    return layout


def trace_json(spec: TraceSpec) -> dict[str, Any]:
    """A trace as plotly.js takes it (a plain dict; plotly.py is not needed)."""
    n = AXES[spec.panel]
    trace = {"type": "bar" if spec.kind == "bar" else "scatter",
             "xaxis": f"x{n if n > 1 else ''}", "yaxis": f"y{n if n > 1 else ''}",
             **spec.props, **{k: list(v) if isinstance(v, tuple) else v
                              for k, v in spec.data.items()}}
    if spec.kind != "bar":
        trace.setdefault("mode", "lines")
    return trace


def figure_json(state: LiveState, height: int | None = None,
                template: dict | None = None) -> tuple[list[dict], dict[str, Any]]:
    """``(data, layout)`` of ``state``'s figure as plotly.js takes them: the live chart
    draws them whole (a view re-created by a reload starts from them)."""
    with state.lock:
        specs = trace_specs(state)
        updates = layout_updates(state, height)
    layout = base_layout(height)
    if template is not None:
        layout["template"] = template
    for path, value in updates.items():
        _set_path(layout, path, value)
    return [trace_json(s) for s in specs], layout


def _set_path(target: dict, path: str, value: Any) -> None:
    """``target["a"]["b"] = value`` for ``"a.b"``, and list items for ``"a[2].b"``."""
    node: Any = target
    parts = path.split(".")
    for i, part in enumerate(parts):
        key, index = part, None
        if part.endswith("]"):
            key, index = part[:-1].split("[")
            index = int(index)
        last = i == len(parts) - 1
        if index is None:
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            items = node.setdefault(key, [])
            while len(items) <= index:
                items.append({})
            if last:
                items[index] = value
            else:
                node = items[index]


@functools.cache
def template() -> dict:
    """plotly's white template as plotly.js takes it (plotly.py resolves names; the page
    does not)."""
    import plotly.io as pio

    return pio.templates["plotly_white"].to_plotly_json()


def figure_body(state: LiveState, height: int | None = None) -> dict[str, Any]:
    """``state``'s figure as plotly's mimetype carries it, its template resolved: built
    from plain dicts, not through plotly.py's figure, whose validation cost ~0.2 s the
    first time in a kernel (a run's last figure, the call's return waiting on it) and
    ~20 ms each time after."""
    data, layout = figure_json(state, height, template=template())
    return {"data": data, "layout": layout}


def build_figure(state: LiveState, height: int | None = None):
    """A new static figure of ``state`` (what the static view shows and Run displays)."""
    import plotly.graph_objects as go

    data, layout = figure_json(state, height)
    return go.Figure(data=data, layout=layout)
