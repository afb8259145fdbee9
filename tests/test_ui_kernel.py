"""The dashboard in a real kernel (jupyter_client, no widget manager, as under nbclient):
the automatic choice is the static view, and a forced live widget keeps its comm
messages within budget."""

from __future__ import annotations

import time
from queue import Empty

import pytest

pytestmark = pytest.mark.kernel

PLOTLY_MIME = "application/vnd.plotly.v1+json"
COMM_BUDGET_PER_S = 30  # the dashboard's own budget; the server drops above ~1000/s


def messages(kernel, code: str, timeout: float = 180) -> tuple[list[dict], float]:
    """Every iopub message of one cell, and the seconds it ran. What an earlier cell's
    background work published since is read first: iopub's subscriber holds at most 1000
    messages and drops what arrives beyond them, this cell's too."""
    while True:
        try:
            kernel.kc.get_iopub_msg(timeout=0.2)
        except Empty:
            break
    msg_id = kernel.submit(code)
    out, start = [], time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=1)
        except Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        out.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return out, time.monotonic() - start
    raise TimeoutError(f"the cell did not finish in {timeout}s")


def _errors(msgs):
    return [m["content"] for m in msgs if m["msg_type"] == "error"]


@pytest.fixture(scope="module")
def setup(kernel):
    reply = kernel.run("from workloads import log_many, train, fail_on")
    assert reply.error is None, reply.error
    return kernel


def test_auto_is_static_without_a_widget_manager(setup, kernel_clean):
    msgs, seconds = messages(setup, "run = nbtrain.launch(log_many, devices=2, steps=400)")
    assert not _errors(msgs), _errors(msgs)
    kinds = [m["msg_type"] for m in msgs]
    assert "comm_open" not in kinds  # no widget where nothing can render one
    shown = [m for m in msgs if m["msg_type"] == "display_data"]
    assert any("rank 0" in m["content"]["data"].get("text/html", "") for m in shown)
    final = [m["content"]["data"] for m in msgs if m["msg_type"] == "update_display_data"
             and PLOTLY_MIME in m["content"]["data"]][-1]
    assert "text/html" in final  # the last figure shows without plotly's renderer too
    # where each rank's step time went, stacked by phase beside the step time
    phases = {t.get("name") for t in final[PLOTLY_MIME]["data"] if t.get("xaxis") == "x7"}
    assert {"forward", "backward", "optimizer step"} <= phases, phases
    updates = kinds.count("update_display_data")
    assert 2 <= updates <= 2 * (seconds / 2.0 + 3), (updates, seconds)  # two handles, 0.5 Hz


def test_a_run_that_logged_no_step_leaves_its_header_and_no_empty_axes(setup, kernel_clean):
    """A function that only communicates, or a run that failed as it started: nothing to
    plot, so no figure of empty axes under the header."""
    msgs, _ = messages(setup, "run = nbtrain.launch(fail_on, 'none', devices=2); run.results")
    assert not _errors(msgs), _errors(msgs)
    outputs = [m["content"]["data"] for m in msgs
               if m["msg_type"] in ("display_data", "update_display_data")]
    assert any("rank 0: done" in d.get("text/html", "") for d in outputs)
    assert not any(PLOTLY_MIME in d for d in outputs)


# How many widgets the kernel holds (ipywidgets 8 keeps them in _instances, 7 in
# Widget.widgets).
WIDGETS_ALIVE = ("(lambda w: len(w.widgets.widget._instances "
                 "if hasattr(w.widgets.widget, '_instances') else w.Widget.widgets))"
                 "(__import__('ipywidgets'))")


def test_forced_widget_stays_within_the_message_budget(setup, kernel_clean):
    # what stays for the kernel's life: plotly.js's loader (made by a first chart) and
    # the keeper of outputs (made by a first static figure)
    assert setup.run("from nbtrain.ui.livechart import ensure_plotly; ensure_plotly()\n"
                     "from nbtrain.ui.keeper import keeper; keeper()").error is None
    before = setup.value(WIDGETS_ALIVE)
    msgs, seconds = messages(
        setup, "run = nbtrain.launch(log_many, devices=2, steps=3000, dashboard='widget')")
    assert not _errors(msgs), _errors(msgs)
    comm = [m for m in msgs if m["msg_type"] == "comm_msg"]
    opens = [m for m in msgs if m["msg_type"] == "comm_open"]
    assert opens and comm
    rate = len(comm) / seconds
    print(f"\n{len(comm)} comm messages in {seconds:.1f}s: {rate:.1f}/s, "
          f"{len(opens)} comm_open")
    assert rate <= COMM_BUDGET_PER_S, (len(comm), seconds)
    kinds = [m["msg_type"] for m in msgs]
    shown = kinds.index("display_data")
    assert "application/vnd.jupyter.widget-view+json" in msgs[shown]["content"]["data"]
    # the header is the first widget, with the run's ranks, shown before the figure's
    header = [m for m in opens if "rank 0" in str(m["content"]["data"]["state"].get("value"))]
    figure = [i for i, m in enumerate(msgs) if m["msg_type"] == "comm_open"
              and "template" in m["content"]["data"]["state"]]  # the live chart
    assert header and figure and shown < figure[0]
    last = [m["content"] for m in msgs if m["msg_type"] == "update_display_data"]
    assert PLOTLY_MIME in last[-1]["data"]  # a static figure in its place at the end
    # ... and the same outputs, slot and version, in the keeper, which brings them to a
    # page reloaded since (its display ids lost)
    shown_outputs = [m["content"] for m in msgs if m["msg_type"] == "display_data"]
    # widget, header -> figure, and a place for snapshots of a long run (none here)
    assert len(shown_outputs) == 3 and shown_outputs[2]["data"] == {"text/plain": ""}
    slots = [out["metadata"]["nbtrain"]["slot"] for out in shown_outputs[:2]]
    kept = [m["content"]["data"]["state"]["outputs"] for m in comm
            if "outputs" in m["content"]["data"].get("state", {})][-1]
    assert set(slots) <= set(kept), (slots, list(kept))
    for update in last[-2:]:
        mark = update["metadata"]["nbtrain"]
        assert kept[mark["slot"]]["data"] == update["data"]
        assert kept[mark["slot"]]["metadata"]["nbtrain"]["version"] == mark["version"] == 1
    points = setup.value("run.history.__len__() > 1000")
    assert points
    time.sleep(3)  # and the widgets are gone, a moment after their views (on ipywidgets
    # 7 the live chart and its layout stay, emptied: widgetsnbextension 3.6 throws when
    # it is closed)
    seven = setup.value("__import__('ipywidgets').__version__.startswith('7.')")
    assert setup.value(WIDGETS_ALIVE) == before + 2 * seven


def test_failure_shows_in_the_view_then_raises(setup, kernel_clean):
    msgs, _ = messages(setup, "nbtrain.launch(fail_on, 'raise', devices=2, dashboard='static')")
    errors = _errors(msgs)
    assert errors and errors[0]["ename"] == "WorkerError"
    htmls = [m["content"]["data"].get("text/html", "") for m in msgs
             if m["msg_type"] in ("display_data", "update_display_data")]
    last_error = max(i for i, m in enumerate(msgs) if m["msg_type"] == "error")
    drawn = [i for i, m in enumerate(msgs) if m["msg_type"] == "update_display_data"
             and "bad batch on purpose" in m["content"]["data"].get("text/html", "")]
    assert drawn and drawn[0] < last_error, htmls[-1:]


def test_a_run_shown_on_its_own_displays_its_summary(setup):
    msgs, _ = messages(setup, "run")
    if "execute_input" not in [m["msg_type"] for m in msgs]:
        # Twice in this project's CI (a kaggle and a colab leg, ipykernel 6.17) iopub
        # delivered this cell's busy and idle and nothing between, not even execute_input,
        # which the kernel sends before it runs any code: messages lost on the way, not a
        # display nbtrain skipped. Once more, then the same assertions.
        msgs, _ = messages(setup, "run")
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"]
    assert any(PLOTLY_MIME in d for d in shown), (_errors(msgs), [list(d) for d in shown],
                                                   [m["msg_type"] for m in msgs])
    assert any("done" in d.get("text/html", "") for d in shown)
    summary = setup.run("print(run.summary())").stdout
    assert "comm %" in summary and "where a step's" in summary, summary


def test_nothing_shows_twice_in_one_cell(setup, kernel_clean):
    """A launch, a comparison or a picker as a cell's last line shows once, not again as
    the cell's result."""
    msgs, _ = messages(setup, "r = nbtrain.launch(log_many, devices=2, steps=20)\nr")
    figures = {m["content"]["transient"]["display_id"] for m in msgs
               if m["msg_type"] == "update_display_data" and PLOTLY_MIME in m["content"]["data"]}
    plots = [m for m in msgs if m["msg_type"] == "display_data"
             and (PLOTLY_MIME in m["content"]["data"]
                  or m["content"].get("transient", {}).get("display_id") in figures)]
    assert len(plots) == 1  # the live (static) view; no second summary figure
    msgs, _ = messages(setup, "nbtrain.compare(r, run)")
    shown = [m for m in msgs if m["msg_type"] in ("display_data", "execute_result")]
    once, _ = messages(setup, "c = nbtrain.compare(r, run, display=False)\nc")
    again = [m for m in once if m["msg_type"] in ("display_data", "execute_result")]
    assert len(shown) == len(again) >= 2
    msgs, _ = messages(setup, "nbtrain.StrategyPicker(log_many, devices=2)")
    shown = [m["content"]["data"] for m in msgs if m["msg_type"] == "display_data"]
    # once: the widget, then its static twin (text, the last run's charts, the
    # comparison's figure) for when it cannot render
    assert len(shown) == 4 and "application/vnd.jupyter.widget-view+json" in shown[0]
    assert "nbtrain-twin" in shown[1]["text/html"]


def test_progress_is_one_line_updated_in_place(setup):
    msgs, _ = messages(setup, "import time\n"
                              "for i in nbtrain.progress(range(3), 'sweep'):\n"
                              "    time.sleep(0.3)")
    assert not _errors(msgs)
    shown = [m["content"]["data"]["text/plain"] for m in msgs if m["msg_type"] == "display_data"]
    updates = [m["content"]["data"]["text/plain"] for m in msgs
               if m["msg_type"] == "update_display_data"]
    assert len(shown) == 1 and shown[0].startswith("sweep: 0/3")
    assert updates and updates[-1].startswith("sweep: 3/3 done in")
    assert not [m for m in msgs if m["msg_type"] == "stream"]  # nothing printed
