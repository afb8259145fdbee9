"""The UI's pieces that need no browser: downsampling, throttling, the theory, figures
built from recorded events and histories, the views' fallbacks, and the comparison of
real 2-rank runs."""

from __future__ import annotations

import io
import os
import sys

import pytest
from workloads import fail_on, param_count, train

import nbtrain
from nbtrain.telemetry.events import Comm, Lifecycle, Memory, Metric, Step
from nbtrain.ui import compare, frontend
from nbtrain.ui.dashboard import Dashboard
from nbtrain.ui.figures import build_figure, trace_json, trace_specs
from nbtrain.ui.series import Series, Throttle, downsample
from nbtrain.ui.state import LiveState
from nbtrain.ui.static import PLOTLY_MIME, StaticView, TextView, figure_bundle
from nbtrain.ui.theory import n_params_from_memory, theoretical_bytes

EVERY_STEP = nbtrain.Telemetry(memory_every=1)


def recorded(steps=50, ranks=2, fail_rank=None):
    """Events as two ranks of a small DDP run send them (hand-written, no launcher)."""
    events = []
    for rank in range(ranks):
        events.append(Lifecycle(rank, 0, 0.0, "started"))
        for step in range(steps):
            t = 0.01 * step
            events.append(Step(rank, step, t, duration=0.01, samples=16))
            events.append(Metric(rank, step, t, {"loss": 1.0 / (step + 1), "acc": step / steps}))
            events.append(Comm(rank, step, t, {"all_reduce": 1}, {"all_reduce": 4096}))
            if step % 10 == 0:
                events.append(Memory(rank, step, t, {"params": 4000, "grads": 4000,
                                                     "optimizer": 8000}))
        if rank == fail_rank:
            events.append(Lifecycle(rank, steps, 1.0, "failed",
                                    "Traceback ...\nValueError: bad batch on purpose"))
        else:
            events.append(Lifecycle(rank, steps, 1.0, "finished"))
    return events


# -- throttling and downsampling -------------------------------------------------------
def test_byte_counts_read_in_one_unit():
    from nbtrain.units import format_bytes, unit_for

    assert format_bytes(100) == "100 B" and format_bytes(512 * 2**20) == "512 MB"
    assert format_bytes(7.85 * 2**30) == "7.85 GB" and format_bytes(1536) == "1.5 KB"
    assert format_bytes(1000 * 2**10) == "1000 KB"  # not "1e+03 KB"
    assert unit_for(0) == ("KB", 1024) and unit_for(3 * 2**30) == ("GB", 2**30)


def test_downsample_keeps_ends_and_bound():
    xs = list(range(10_000))
    x, y = downsample(xs, [v * 2 for v in xs], 100)
    assert len(x) <= 100 and x[0] == 0 and x[-1] == 9_999 and y[-1] == 19_998
    assert downsample([1, 2], [3, 4], 100) == ([1, 2], [3, 4])
    with pytest.raises(ValueError, match="max_points"):
        downsample(xs, xs, 1)


def test_series_stays_bounded_and_shows_the_newest_point():
    s = Series(max_points=50)
    for i in range(100_000):
        s.append(i, float(i))
        assert len(s.x) < 100
    x, y = s.points()
    assert len(x) <= 101 and x[0] == 0 and x[-1] == 99_999 and s.count == 100_000
    assert x == sorted(x) and len(set(x)) == len(x)
    gaps = {b - a for a, b in zip(x[:-2], x[1:-1], strict=True)}
    assert len(gaps) == 1  # evenly thinned


def test_throttle_allows_one_draw_per_interval():
    now = [0.0]
    t = Throttle(0.1, clock=lambda: now[0])
    allowed = 0
    for _ in range(1000):  # 1 s in 1 ms ticks
        allowed += t.ready()
        now[0] += 0.001
    assert 9 <= allowed <= 11
    with pytest.raises(ValueError, match="seconds"):
        Throttle(-1)


# -- theory ----------------------------------------------------------------------------
def test_theory_follows_the_zero_table():
    n, w = 1000, 4
    assert theoretical_bytes("ddp", n, w) == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert theoretical_bytes("zero1", n, w) == {"params": 4000, "grads": 4000, "optimizer": 2000}
    assert theoretical_bytes("fsdp_grad_op", n, w) == {"params": 4000, "grads": 1000,
                                                       "optimizer": 2000}
    assert theoretical_bytes("fsdp", n, w) == {"params": 1000, "grads": 1000, "optimizer": 2000}
    assert theoretical_bytes("fsdp_hybrid", n, w) == {"params": 2000, "grads": 2000,
                                                      "optimizer": 4000}  # shard groups of 2
    assert theoretical_bytes("fsdp_hybrid", n, 8, shard_size=8)["params"] == 500
    assert sum(theoretical_bytes("fsdp_offload", n, w).values()) == 0
    assert theoretical_bytes("ddp", n, 1, optimizer="sgd")["optimizer"] == 0
    assert theoretical_bytes("ddp", n, 1, precision="bf16")["params"] == 2000
    with pytest.raises(ValueError, match="known"):
        theoretical_bytes("pipeline", n, w)
    with pytest.raises(TypeError, match="n_params"):
        theoretical_bytes("ddp", 1.5, w)
    with pytest.raises(ValueError, match="shard_size"):
        theoretical_bytes("fsdp_hybrid", n, 6, shard_size=4)


def test_parameter_count_from_measured_bytes():
    assert n_params_from_memory("ddp", [4000, 4000]) == 1000
    assert n_params_from_memory("fsdp", [2000, 2004]) == 1001  # padding: a little high
    assert n_params_from_memory("fsdp_hybrid", [2000, 2000]) is None
    assert n_params_from_memory("unknown", [4000]) is None


# -- figures from recorded events --------------------------------------------------------
def test_figure_contents_from_events():
    state = LiveState(2)
    state.update(recorded(steps=50))
    specs = {s.key: s for s in trace_specs(state)}
    assert {"metric:loss:0", "metric:loss:1", "metric:acc:0", "step_time:0", "rate:1",
            "memory:params", "memory:grads", "memory:optimizer", "comm:all_reduce"} <= set(specs)
    assert "cuda:cuda_allocated" not in specs  # nothing CUDA on CPU
    loss = specs["metric:loss:0"].data
    assert loss["x"][0] == 0 and loss["y"][0] == 1.0 and loss["x"][-1] == 49
    assert specs["memory:params"].data["x"] == ["rank 0", "rank 1"]
    assert specs["memory:params"].data["y"] == [4000 / 2**10] * 2  # 16 KB a rank: in KB
    assert len(specs["step_time:0"].data["x"]) == 49  # the warm-up step is left out
    assert specs["step_time:0"].data["y"][0] == pytest.approx(10.0)
    fig = build_figure(state)
    assert fig.layout.barmode == "stack"
    assert fig.layout.yaxis4.title.text == "KB"
    titles = {a.text for a in fig.layout.annotations if a.visible}
    assert {"Logged metrics (ctx.log)", "Model state per rank", "Communication per step"} <= titles
    assert state.status == {0: "done", 1: "done"}
    assert state.samples_per_s(0) == pytest.approx(1600)


# -- the figure's readability rules -----------------------------------------------------
def as_figure(dash):
    """The live chart's figure (plain plotly.js dicts) as a plotly figure."""
    import plotly.graph_objects as go

    return go.Figure(data=dash.figure.data)


def legend_order(fig) -> list[str]:
    """The legend's entries as plotly orders them: by legendrank, then trace order."""
    shown = [(t.legendrank if t.legendrank is not None else 1000, i, t.name)
             for i, t in enumerate(fig.data) if t.showlegend is not False]
    return [name for _, _, name in sorted(shown)]


def colors_by_rank(fig) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for t in fig.data:
        if t.legendgroup and t.legendgroup.startswith("rank "):
            color = t.line.color if t.mode and "lines" in t.mode else t.marker.color
            out.setdefault(t.legendgroup, set()).add(color)
    return out


def test_one_colour_per_rank_in_every_panel():
    state = LiveState(3)
    state.update(recorded(steps=30, ranks=3))
    fig = build_figure(state)
    panels = {(t.legendgroup, t.yaxis) for t in fig.data if t.legendgroup == "rank 2"}
    assert {a for _, a in panels} >= {"y", "y2", "y3"}  # metrics, step time, throughput
    colors = colors_by_rank(fig)
    assert set(colors) == {"rank 0", "rank 1", "rank 2"}
    assert all(len(c) == 1 for c in colors.values()), colors  # the same in every panel
    assert len(set().union(*colors.values())) == 3  # and a different one per rank
    assert legend_order(fig)[:3] == ["rank 0", "rank 1", "rank 2"]  # named in the legend


def test_categories_and_collectives_have_their_own_palette():
    from nbtrain.ui.palette import (
        CATEGORY_COLORS,
        COLLECTIVE_COLORS,
        PHASE_COLORS,
        RANK_COLORS,
    )

    assert not set(CATEGORY_COLORS.values()) & set(RANK_COLORS)
    assert not set(COLLECTIVE_COLORS) & set(RANK_COLORS)
    assert not set(PHASE_COLORS.values()) & (set(RANK_COLORS) | set(CATEGORY_COLORS.values())
                                             | set(COLLECTIVE_COLORS))
    state = LiveState(2)
    events = recorded(steps=12)
    events += [Comm(0, s, 0.0, {"all_gather": 1}, {"all_gather": 8192}) for s in range(12)]
    state.update(events)
    fig = build_figure(state)
    rank_colors = set().union(*colors_by_rank(fig).values())
    bars = {t.name: t.marker.color for t in fig.data if t.type == "bar"}
    lines = {t.name: t.line.color for t in fig.data if t.yaxis == "y5"}
    assert set(bars) == {"params", "grads", "optimizer"} and set(lines) == {"all_gather",
                                                                            "all_reduce"}
    assert len(set(bars.values())) == 3 and len(set(lines.values())) == 2
    assert not (set(bars.values()) | set(lines.values())) & rank_colors


def drawn_by_its_thread(view, events, timeout=10.0):
    """Give ``view`` events and wait until its drawer has drawn them."""
    import time

    before = view.draws
    view.on_events(events)
    deadline = time.monotonic() + timeout
    while view.draws < before + 2 and time.monotonic() < deadline:  # one may have begun
        time.sleep(0.02)


def test_legend_order_stays_put_while_traces_arrive():
    events = recorded(steps=30)
    early = [e for e in events if e.step < 1 and not isinstance(e, (Memory, Comm))]
    dash = Dashboard(display=False, world_size=2)
    drawn_by_its_thread(dash, early)  # metrics and first steps first, as a run sends them
    first = legend_order(as_figure(dash))
    drawn_by_its_thread(dash, [e for e in events if e not in early])
    dash.close(None)
    later = legend_order(as_figure(dash))
    assert later == ["rank 0", "rank 1", "loss", "acc", "first step (warm-up)", "params",
                     "grads", "optimizer", "all_reduce"]
    assert [n for n in later if n in first] == first  # nothing moved, new ones slotted in
    state = LiveState(2)
    state.update(events)
    assert legend_order(build_figure(state)) == later  # the static figure: the same


def test_a_metric_logged_now_and_then_is_marked_and_one_logged_every_step_is_a_line():
    """A validation loss logged once an epoch: its first point shows at once (a line of
    one point draws nothing) and its few points read as points, not as a trend."""
    state = LiveState(1)
    state.update([Metric(0, step, 0.0, {"loss": 1.0}) for step in range(8)]
                 + [Metric(0, 7, 0.0, {"val_loss": 0.9})])

    def modes() -> dict[str, str]:
        return {name: trace_json(spec).get("mode") for name, spec in
                ((s.key.split(":")[1], s) for s in trace_specs(state) if s.key.startswith("metric:"))}

    assert modes() == {"loss": "lines", "val_loss": "lines+markers"}
    state.update([Metric(0, step, 0.0, {"loss": 1.0}) for step in range(8, 16)]
                 + [Metric(0, 15, 0.0, {"val_loss": 0.8})])
    assert modes() == {"loss": "lines", "val_loss": "lines+markers"}
    state.update([Metric(0, 16 + k, 0.0, {"val_loss": 0.7}) for k in range(200)])
    assert modes()["val_loss"] == "lines"  # many points: a line like any other
    first = LiveState(1)
    first.update([Metric(0, 0, 0.0, {"loss": 1.0})])
    assert {trace_json(s).get("mode") for s in trace_specs(first)
            if s.key == "metric:loss:0"} == {"lines+markers"}  # the first point shows


def test_warmup_step_is_marked_and_does_not_set_the_axis():
    state = LiveState(2)
    events = [Step(r, s, 0.0, duration=0.5 if s == 0 else 0.010 + 0.001 * r, samples=8)
              for r in range(2) for s in range(20)]
    state.update(events)
    specs = {s.key: s for s in trace_specs(state)}
    assert specs["step_time:0"].data["x"][0] == 1  # not a point of the curve
    for rank in range(2):
        mark = specs[f"warmup:{rank}"].data
        assert mark["x"] == [0]
        assert "warm-up): 500 ms (off the scale)" in mark["hovertemplate"]
    step_panel = [y for s in specs.values() if s.panel == "step_time"
                  for y in s.data["y"] if y is not None]
    assert max(step_panel) <= 1.2 * 11.0 + 1e-9  # the slowest steady step sets the scale
    assert "first step (warm-up)" in {s.props.get("name") for s in specs.values()}
    one = LiveState(1)  # only the warm-up so far: drawn as it is
    one.update([Step(0, 0, 0.0, duration=0.3, samples=8)])
    assert [s.data["y"] for s in trace_specs(one) if s.key == "warmup:0"] == [[300.0]]


def test_panels_without_data_are_hidden():
    state = LiveState(2)
    events = [e for e in recorded(steps=20) if not isinstance(e, Step)]  # no throughput
    state.update(events)
    fig = build_figure(state)
    titles = [a.text for a in fig.layout.annotations if a.visible]
    assert titles == ["Logged metrics (ctx.log)", "Model state per rank",
                      "Communication per step"]  # no empty throughput or CUDA panel
    assert fig.layout.yaxis6.visible is False and fig.layout.yaxis3.visible is False
    domains = sorted(tuple(fig.layout[f"xaxis{n}"].domain) for n in ("", 4, 5))
    assert domains[0][0] == 0 and domains[-1][1] == pytest.approx(1)  # the full width
    assert all(a[1] < b[0] for a, b in zip(domains, domains[1:], strict=False))  # one row
    assert fig.layout.width is None  # no fixed width: it fills the output
    state.update([Memory(0, 20, 0.0, {"cuda_allocated": 2**20, "cuda_peak": 2**21})])
    fig = build_figure(state)
    titles = [a.text for a in fig.layout.annotations if a.visible]
    assert "CUDA allocator per rank" in titles and len(titles) == 4
    assert sorted(tuple(fig.layout[f"xaxis{n}"].domain) for n in ("", 4)) == \
        sorted(tuple(fig.layout[f"xaxis{n}"].domain) for n in (5, 6))  # two rows of two


def test_comm_axis_never_goes_below_zero():
    state = LiveState(2)
    state.update(recorded(steps=20))  # a constant 4 KB all-reduce per step
    fig = build_figure(state)
    comm = [t for t in fig.data if t.name == "all_reduce"][0]
    assert comm.yaxis == "y5" and set(comm.y) == {4.0}  # in KB, not 0.0039 MB
    assert fig.layout.yaxis5.rangemode == "tozero" and fig.layout.yaxis5.title.text == \
        "KB per step"
    assert fig.layout.yaxis5.range == (0, pytest.approx(4.6))  # the line below the top edge
    for n in (2, 3, 4, 5, 6):  # every panel of non-negative figures
        assert fig.layout[f"yaxis{n}"].rangemode == "tozero"


def test_long_runs_send_bounded_traces():
    state = LiveState(2, max_points=100)
    state.update(recorded(steps=5000))
    for spec in trace_specs(state):
        assert len(spec.data["x"]) <= 201, spec.key


def test_dashboard_without_display_draws_batched_and_shows_failure():
    dash = Dashboard(display=False, world_size=2)
    dash.on_events(recorded(steps=30, fail_rank=1))
    dash.close(None)
    names = {t["name"] for t in dash.figure.data}
    assert {"loss r0", "loss r1", "params", "all_reduce"} <= names
    assert 0 < dash.points() <= 1000
    assert "rank 1: failed" in dash.header.value and "#e53935" in dash.header.value
    assert "bad batch on purpose" in dash.errors.value
    assert "failed" in repr(dash)
    before = dash.comm_messages
    dash.draw(final=True)  # nothing changed: nothing is sent
    assert dash.comm_messages == before


def test_dashboard_redraws_at_most_every_interval():
    import time

    dash = Dashboard(display=False, world_size=2)
    events = recorded(steps=400)
    start = time.monotonic()
    for i in range(0, len(events), 20):  # many small batches, as a busy run sends them
        dash.on_events(events[i:i + 20])
        time.sleep(0.002)
    elapsed = time.monotonic() - start
    dash.close(None)
    assert dash.draws <= elapsed / Dashboard.interval + 3, (dash.draws, elapsed)


def test_text_view_writes_progress_lines():
    out = io.StringIO()
    view = TextView(display=False, world_size=2, stream=out)
    view.on_events(recorded(steps=20))
    view.close(None)
    text = out.getvalue()
    assert "step 20" in text and "loss" in text and "done" in text


def test_static_view_bundle_has_plotly_mimetype():
    view = StaticView(display=False, world_size=2)
    view.on_events(recorded(steps=10))
    view.close(None)
    header, fig = view.bundles()
    assert "rank 0: done" in header["text/html"] and "step 10" in header["text/plain"]
    assert fig[PLOTLY_MIME]["data"] and "text/plain" in fig
    assert figure_bundle(build_figure(view.state), "x")["text/plain"] == "x"


def test_a_view_of_a_run_with_nothing_to_plot_has_no_figure():
    view = StaticView(display=False, world_size=2)
    view.close(None)
    header, fig = view.bundles()
    assert "rank 0" in header["text/html"] and fig == {"text/plain": ""}


# -- choosing a view -----------------------------------------------------------------------
def test_fallback_selection(monkeypatch):
    monkeypatch.delenv("NBTRAIN_DASHBOARD", raising=False)
    assert frontend.choose_mode(False) is None
    assert frontend.choose_mode("text") == "text"
    assert frontend.choose_mode("auto") == "text"  # no kernel here: a terminal
    assert frontend.choose_mode("static") == "text"  # no IPython to display into
    assert frontend.choose_mode("widget") == "widget"  # forced, and the packages are here
    monkeypatch.setenv("NBTRAIN_DASHBOARD", "off")
    assert frontend.choose_mode("auto") is None
    assert frontend.choose_mode("text") == "text"  # explicit beats the environment
    with pytest.raises(ValueError, match="'static'"):
        frontend.choose_mode("fancy")


def test_a_kernel_gets_the_live_widget_where_a_frontend_draws_it(monkeypatch):
    """In a kernel: the widget in Lab and Notebook 7 (a Jupyter server's session), in
    Colab (its own frontend draws anywidget widgets on ipywidgets 7), not under VS Code
    or nbclient (static figures there)."""
    import types

    monkeypatch.delenv("NBTRAIN_DASHBOARD", raising=False)
    for name in [k for k in os.environ if k.startswith(("VSCODE_", "JPY_SESSION"))]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(frontend, "in_kernel", lambda: True)
    monkeypatch.setattr(frontend, "widget_manager_connected", lambda: False)
    assert frontend.detect() == "static"  # nbclient, papermill: no frontend
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/train.ipynb")
    assert frontend.detect() == "widget"  # JupyterLab, Notebook 7
    monkeypatch.setenv("VSCODE_PID", "1")
    assert frontend.detect() == "static"
    monkeypatch.delenv("VSCODE_PID")
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert frontend.detect() == "widget"  # Colab


def test_plotly_js_goes_ahead_only_to_a_jupyter_servers_notebook(monkeypatch):
    """``ui.preload`` (between cells after ``import nbtrain``) brings plotly.js to the page
    only where the first dashboard will be the widget one in JupyterLab or Notebook 7; in
    Colab, VS Code, a plain client, or with the dashboard turned off, nothing is sent."""
    import types

    from nbtrain import ui
    from nbtrain.ui import livechart

    made = []
    monkeypatch.setattr(livechart, "ensure_plotly", lambda: made.append(1))
    monkeypatch.delenv("NBTRAIN_DASHBOARD", raising=False)
    for name in [k for k in os.environ if k.startswith(("VSCODE_", "JPY_SESSION"))]:
        monkeypatch.delenv(name)
    assert ui.preload() is False  # nbclient, papermill, a plain client
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setenv("JPY_SESSION_NAME", "/work/train.ipynb")
    assert ui.preload() is False  # Colab: its widget manager gets it with the dashboard
    monkeypatch.delitem(sys.modules, "google.colab")
    monkeypatch.setenv("VSCODE_PID", "1")
    assert ui.preload() is False
    monkeypatch.delenv("VSCODE_PID")
    for off in ("off", "none", "static", "text"):
        monkeypatch.setenv("NBTRAIN_DASHBOARD", off)
        assert ui.preload() is False
    assert made == []
    monkeypatch.setenv("NBTRAIN_DASHBOARD", "widget")
    assert ui.preload() is True and made == [1]
    monkeypatch.delenv("NBTRAIN_DASHBOARD")
    assert ui.preload() is True and made == [1, 1]  # JupyterLab, Notebook 7


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(frontend, "missing_widget_packages", lambda: ["anywidget"])
    frontend._warned.clear()
    with pytest.warns(UserWarning, match="pip install"):
        assert frontend.choose_mode("widget") == "text"


def test_launch_rejects_a_bad_dashboard_value():
    with pytest.raises(ValueError, match="dashboard="):
        nbtrain.launch(train, devices=2, dashboard="fancy")


# -- progress over loops of runs ------------------------------------------------------------
def test_progress_prints_a_line_now_and_then_and_one_at_the_end(monkeypatch):
    from types import SimpleNamespace

    progress_module = sys.modules["nbtrain.ui.progress"]  # the module; the name is the function
    clock = [0.0]
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    out = io.StringIO()
    seen = []
    for item in nbtrain.progress([10, 20, 30, 40], "sweep", stream=out):
        seen.append(item)
        clock[0] += 3.0
    assert seen == [10, 20, 30, 40]
    assert out.getvalue().splitlines() == ["sweep: 0/4 · 10 · 0 s",
                                           "sweep: 2/4 · 30 · 6 s, ~6 s left",
                                           "sweep: 4/4 done in 12.0 s"]
    quiet = io.StringIO()  # a loop shorter than delay= shows nothing
    assert list(nbtrain.progress(range(3), "quick", delay=1.0, stream=quiet)) == [0, 1, 2]
    assert quiet.getvalue() == ""
    unsized = nbtrain.progress((i for i in range(2)), "gen", stream=io.StringIO())
    assert list(unsized) == [0, 1] and unsized.lines[-1].startswith("gen: 2 done in")
    with pytest.raises(ValueError, match="total=-1"):
        nbtrain.progress([], total=-1)
    with pytest.raises(TypeError, match="label="):
        nbtrain.progress([], 3)


# -- the comparison's sentence -----------------------------------------------------------
def row(label, mb, rate=None, ranks=2, status="done"):
    from nbtrain.ui.compare import Row

    memory = [{"params": mb * 2**20 / 4, "grads": mb * 2**20 / 4, "optimizer": mb * 2**20 / 2}]
    return Row(label, label, ranks, memory * ranks, 0.01, rate, status=status)


def test_takeaway_names_ties_as_ties_and_each_run_the_same_way():
    from nbtrain.ui.compare import takeaway

    # the case: fsdp held what fsdp_grad_op held, and was the slow one
    rows = [row("ddp", 27.9, 2430), row("fsdp_grad_op", 14.0, 1500), row("fsdp", 14.02, 1000)]
    assert takeaway(rows) == ("fsdp_grad_op and fsdp hold 2.0× less model state per rank than "
                              "ddp (14 MB vs 27.9 MB); ddp is the fastest, 2.43× the throughput "
                              "of fsdp.")
    # ties at both ends, and a middle run named in neither
    rows = [row("ddp", 28, 2000), row("zero1", 20, 1980), row("fsdp_grad_op", 14, 1000),
            row("fsdp", 14, 990)]
    assert takeaway(rows) == ("fsdp_grad_op and fsdp hold 2.0× less model state per rank than "
                              "ddp (14 MB vs 28 MB); ddp and zero1 are the fastest, 2.02× the "
                              "throughput of fsdp_grad_op and fsdp.")
    # everything equal: said so, no ratio of 1.0
    rows = [row("fsdp", 14, 1000), row("fsdp (mixed_precision=bf16)", 14.1, 1020)]
    assert takeaway(rows) == ("fsdp and fsdp (mixed_precision=bf16) hold the same model state "
                              "per rank (14 MB); fsdp and fsdp (mixed_precision=bf16) run at the "
                              "same throughput (within 5%).")


def test_takeaway_compares_like_with_like():
    from nbtrain.ui.compare import takeaway

    # per-rank memory on different rank counts: the counts are named
    rows = [row("ddp", 28, 1000, ranks=2), row("fsdp", 7, 1500, ranks=4)]
    assert takeaway(rows) == ("fsdp on 4 ranks holds 4.0× less model state per rank than ddp "
                              "on 2 ranks (7 MB vs 28 MB); fsdp on 4 ranks is the fastest, "
                              "1.50× the throughput of ddp on 2 ranks.")
    # a stopped run's throughput (warm-up only) is not compared
    rows = [row("ddp", 28, 1000), row("fsdp", 14, 50, status="stopped")]
    assert takeaway(rows) == "fsdp holds 2.0× less model state per rank than ddp (14 MB vs 28 MB)."
    assert takeaway([row("ddp", 28, 1000)]) == "ddp: 28 MB of model state per rank, 1,000 samples/s."
    assert takeaway([row("ddp", 0)]).startswith("No memory was measured")


# -- real runs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    return {s: nbtrain.launch(train, devices=2, strategy=s, telemetry=EVERY_STEP,
                              dashboard=False) for s in ("ddp", "fsdp")}


@pytest.mark.usefixtures("no_leftovers")
def test_compare_real_runs_beside_theory(runs):
    c = compare(runs["ddp"], runs["fsdp"], display=False)
    assert c.n_params == param_count()  # from DDP's parameter bytes
    ddp, fsdp = c.rows
    assert ddp.theory == {"params": 4 * c.n_params, "grads": 4 * c.n_params,
                          "optimizer": 8 * c.n_params}
    assert ddp.memory[0]["params"] == ddp.theory["params"]
    assert fsdp.memory[1]["optimizer"] == pytest.approx(fsdp.theory["optimizer"], rel=0.02)
    assert "fsdp holds 2.0× less model state per rank than ddp" in c.takeaway()
    fig = c.figure()
    bars = [t for t in fig.data if t.name == "params"][0]
    assert list(bars.x[1]) == ["rank 0", "rank 1", "theory"] * 2
    assert {"ddp", "fsdp"} == set(bars.x[0])
    assert "KB" in fig.layout.yaxis.title.text
    assert "all_reduce" in {t.name for t in fig.data}
    assert "theory/rank" in str(c)
    # what both runs logged, last values side by side: the same training, sharded or not
    names = c.metric_names()
    assert names and set(names) <= set(runs["ddp"].history.metric_names)
    header, _, *rows = c.table().splitlines()
    assert header.split()[-len(names):] == names
    for row, run in zip(rows, (runs["ddp"], runs["fsdp"]), strict=True):
        last = run.history.metric(names[0], 0)[-1][1]
        assert row.split()[-len(names)] == f"{last:.4g}"
    with pytest.raises(ValueError, match="at least one"):
        compare(display=False)


def test_summary_dashboard_from_a_recorded_history(runs):
    state = LiveState.from_run(runs["fsdp"])
    assert state.outcome == "done" and state.info["strategy"] == "fsdp"
    keys = {s.key for s in trace_specs(state)}
    assert "comm:all_gather" in keys or any(k.startswith("comm:") for k in keys)


@pytest.mark.usefixtures("no_leftovers")
def test_failure_is_drawn_before_the_error_reaches_the_caller():
    dash = Dashboard(display=False)
    with pytest.raises(nbtrain.WorkerError):
        nbtrain.launch(fail_on, "raise", devices=2, dashboard=False, sinks=[dash])
    assert dash.closed
    assert "rank 1: failed" in dash.header.value
    assert "bad batch on purpose" in dash.errors.value


def test_picker_offers_what_runs_on_the_accelerator(monkeypatch):
    from nbtrain import strategies
    from nbtrain.deviceplan import DevicePlan
    from nbtrain.strategies import deepspeed

    cpu = nbtrain.StrategyPicker(train, devices=2, accelerator="cpu", display=False)
    assert "fsdp_offload" not in cpu.dropdown.options
    # Lightning's other spellings are not offered; DeepSpeed's names are where it is
    missing = {"fsdp_offload"} | ({n for n in strategies.names(aliases=False)
                                   if n.startswith("deepspeed")}
                                  if not deepspeed.available() else set())
    assert set(cpu.dropdown.options) == set(strategies.names(aliases=False)) - missing
    assert set(cpu.not_offered) == missing
    assert "fsdp_offload" in cpu.unavailable.value and "nothing to offload" in cpu.unavailable.value
    with pytest.raises(ValueError, match="'fsdp_offload' cannot run here: .*nothing to offload"):
        cpu.start("fsdp_offload")
    assert cpu.runs == []
    with pytest.raises(ValueError, match="none of the strategies asked for can run on 2×cpu"):
        nbtrain.StrategyPicker(train, devices=2, accelerator="cpu", display=False,
                               strategies_shown=["fsdp_offload"])
    # on CUDA (the plan as parse_devices gives it on a 2-GPU machine) everything is offered
    monkeypatch.setattr(sys.modules["nbtrain.launch.starting.devices"], "parse_devices",
                        lambda devices, accelerator: DevicePlan("cuda", (0, 1)))
    gpu = nbtrain.StrategyPicker(train, devices=2, accelerator="cuda", display=False)
    offered = [n for n in strategies.names(aliases=False)
               if deepspeed.available() or not n.startswith("deepspeed")]
    assert list(gpu.dropdown.options) == offered
    assert set(gpu.not_offered) == missing - {"fsdp_offload"}
    assert (gpu.unavailable.value == "") == deepspeed.available()
    gpu.dropdown.value = "fsdp"
    assert not gpu.offload.disabled
    gpu.offload.value = True
    assert gpu._options("fsdp") == {"offload": True}
    gpu.dropdown.value = "ddp"
    assert gpu.offload.disabled and gpu._options("ddp") == {}


@pytest.mark.usefixtures("no_leftovers")
def test_picker_runs_two_strategies_and_compares_them():
    picker = nbtrain.StrategyPicker(train, devices=2, display=False)
    assert picker.dropdown.options[:2] == ("ddp", "ddp_notebook")
    picker.dropdown.value = "fsdp"
    assert "1/N" in picker.description.value
    assert picker.offload.disabled and "nothing to offload" in picker.offload.tooltip  # CPU
    picker.dropdown.value = "ddp"
    assert picker.offload.disabled
    first = picker.start()
    picker.dropdown.value = "fsdp"  # changing the dropdown does not touch the live run
    with pytest.raises(RuntimeError, match="Stop"):
        picker.start()
    picker.wait(60)
    assert first.strategy.name == "ddp" and first.status == "done"
    picker.start()
    picker.wait(60)
    assert [r.strategy.name for r in picker.runs] == ["ddp", "fsdp"]
    assert "fsdp holds" in picker.comparison_text.value
    assert len(picker.comparison_figure.outputs) == 1
    assert "rank 1: done" in picker.dashboard.header.value


def test_header_shows_epoch_progress_and_eta():
    from nbtrain.ui.header import progress_parts

    state = LiveState(world_size=1)
    events = [Step(0, s, 0.1 * s, duration=0.1, samples=8, epoch=s // 10, epoch_steps=10)
              for s in range(14)]
    state.update(events)
    text = " · ".join(progress_parts(state))
    assert "epoch 2 (4/10)" in text and "ETA" not in text  # no total: no ETA
    state = LiveState(world_size=1)
    state.update([Step(0, s, 0.1 * s, duration=10.0, samples=8, total_steps=100)
                  for s in range(10)])
    text = " · ".join(progress_parts(state))
    assert "step 10/100" in text and "ETA 15m00s" in text  # 90 steps × 10 s


def test_steps_carry_the_plan_from_the_worker():
    def planned(ctx):
        ctx.total_steps = 12
        data = torch.utils.data.TensorDataset(torch.randn(24, 4))
        loader = ctx.dataloader(data, batch_size=4)
        for _ in range(2):
            for _ in loader:
                pass
        return len(loader)

    import torch

    run = nbtrain.launch(planned, devices=2, dashboard=False)
    steps = run.history.events("step", 0)
    assert [(e.epoch, e.epoch_steps, e.total_steps) for e in steps] == \
        [(0, 3, 12)] * 3 + [(1, 3, 12)] * 3


class OffloadedRun:
    """A finished GPU run whose model state lived in host memory (as fsdp_offload's
    does): a hand-written stand-in, since CI has no GPU."""

    def __init__(self):
        from nbtrain.telemetry.history import History

        self.strategy = nbtrain.strategies.get("fsdp_offload")
        self.world_size, self.status, self.history = 2, "done", History()
        for rank in (0, 1):
            self.history.append(Memory(rank, 1, 0.0, {
                "params": 0, "grads": 0, "optimizer": 0, "params_host": 2**20,
                "grads_host": 2**20, "optimizer_host": 2**21, "cuda_allocated": 2**19}))

    def summary(self):
        from nbtrain.telemetry.summary import summarize

        return summarize(self.history, self.world_size)


def test_host_memory_is_drawn_apart_and_named():
    run = OffloadedRun()
    state = LiveState(2)
    state.update(run.history.events())
    bars = {t.name: t for t in build_figure(state).data if t.type == "bar"}
    assert {"params (host)", "grads (host)", "optimizer (host)"} <= set(bars)
    assert bars["params (host)"].marker.pattern.shape == "/"  # hatched: not on the device
    assert "params" not in bars or not any(bars["params"].y)
    table = compare(run, n_params=2**19).table()
    assert "in host memory" in table and "4 MB" in table


def test_the_keeper_holds_the_last_output_of_each_recent_slot():
    from nbtrain.ui import keeper

    def output(slot, text, version=1):
        return {slot: {"output_type": "display_data", "data": {"text/plain": text},
                       "metadata": {keeper.KEY: {"slot": slot, "version": version}}}}

    sent = []

    def seen(change):
        sent.append(change["new"])

    keeper.keeper().observe(seen, names="outputs")
    try:
        for i in range(keeper.KEEP + 6):
            keeper.keep(output(f"slot{i}", str(i)))
        keeper.keep({**output("slot10", "again", 2), **output("new", "new")})  # one message
    finally:
        keeper.keeper().unobserve(seen, names="outputs")
    held = keeper.keeper().outputs
    assert len(sent) == keeper.KEEP + 7 and sent[-1] == held
    assert len(held) == keeper.KEEP  # bounded: every reloaded page receives all of it
    assert "slot0" not in held and f"slot{keeper.KEEP + 5}" in held
    assert held["slot10"]["data"]["text/plain"] == "again"  # the newest version, kept longest
    assert list(held)[-2:] == ["slot10", "new"]


def test_the_classic_notebook_server_is_told_by_the_kernels_parent(tmp_path, monkeypatch):
    cmdline = tmp_path / "cmdline"
    for words, classic in [
            (["/usr/bin/python3", "/venv/bin/jupyter-notebook", "--no-browser"], True),
            (["python", "-m", "nbclassic"], True), (["python", "-m", "notebook"], True),
            (["/venv/bin/python", "/venv/bin/jupyter-lab"], False),
            (["python", "-m", "pytest", "tests"], False)]:  # nbclient's kernels
        cmdline.write_bytes(b"\0".join(w.encode() for w in words) + b"\0")
        assert frontend.classic_notebook_server(str(cmdline)) is classic, words
    monkeypatch.delenv("JPY_PARENT_PID", raising=False)
    assert not frontend.classic_notebook_server()  # a kernel no server started


def test_the_html_twin_draws_without_requirejs_and_inlines_plotly_once_under_classic(
        monkeypatch):
    import json as jsonlib

    import plotly.graph_objects as go

    from nbtrain.ui import static

    body = jsonlib.loads(go.Figure(go.Scatter(y=[1, 3, 2], name="</script>")).to_json())
    monkeypatch.setattr(static, "_inlined", False)
    monkeypatch.setattr(frontend, "classic_notebook_server", lambda: False)
    html = static.figure_html(body)
    assert "nbtrain-plotlyjs\">" not in html and "require(" not in html
    assert html.count("</script>") == 1  # the figure's own text cannot end the script
    assert "window.Plotly.newPlot" in html and "cdn.plot.ly/plotly-" in html
    monkeypatch.setattr(frontend, "classic_notebook_server", lambda: True)
    first, second = static.figure_html(body), static.figure_html(body)
    assert first.count('id="nbtrain-plotlyjs"') == 1 and len(first) > 1_000_000
    assert "nbtrain-plotlyjs\">" not in second  # once per kernel


def test_the_text_view_names_where_a_timed_out_rank_was():
    """A failure with no traceback of its own (a timeout) reads as what happened and the
    line the rank was at, not the hint's last line."""
    from nbtrain.ui.header import header_text

    with pytest.raises(nbtrain.RunTimeoutError):
        nbtrain.launch(fail_on, "hang", devices=2, accelerator="cpu", timeout=2,
                       dashboard=False)
    run = nbtrain.last_run()
    state = LiveState(2)
    state.finish(run)
    lines = header_text(state).splitlines()
    assert any(line.startswith("  rank 0 failed: Timeout: the run passed timeout=2s")
               and "; at " in line and "in fail_on: " in line for line in lines), lines


def test_a_blocking_cell_reads_busy_from_the_moment_it_blocks(monkeypatch):
    """busy_while_blocking says "busy" for the cell as it begins (a request the frontend
    made between the cell's start and the block's was answered "idle", and the status bar
    read Idle for a whole run in CI), and after each "idle" for another request inside."""
    from nbtrain import cells

    cell = {"header": {"msg_id": "cell"}}
    other = {"header": {"msg_id": "widget"}}
    said = []

    class Kernel:
        def get_parent(self, channel):
            return cell

        def _publish_status(self, status, channel, parent=None):
            said.append((status, (parent or cell)["header"]["msg_id"]))

    kernel = Kernel()
    monkeypatch.setattr(cells, "current_kernel", lambda: kernel)
    with cells.busy_while_blocking():
        assert said == [("busy", "cell")]
        kernel._publish_status("busy", "shell", other)
        kernel._publish_status("idle", "shell", other)
    assert said[1:] == [("busy", "widget"), ("idle", "widget"), ("busy", "cell")]
    kernel._publish_status("idle", "shell", other)  # after the block: as ipykernel says
    assert said[-1] == ("idle", "widget")
