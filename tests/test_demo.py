"""The README's first command, run as a user runs it."""

import subprocess
import sys

import pytest


def test_demo_runs_and_writes_a_self_contained_report(tmp_path, no_leftovers):
    report = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "nbtrain", "demo", "--steps", "12",
                           "--output", str(report)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for text in ("== ddp on 2 × cpu", "== fsdp on 2 × cpu", "params MB", "optimizer MB",
                 "all_reduce/step", "reduce_scatter/step", "step ms"):
        assert text in out
    page = report.read_text()
    assert "<script src=\"http" not in page  # plotly's JavaScript is inlined
    for text in ("<h1>Comparison</h1>", "<h1>ddp</h1>", "<h1>fsdp</h1>",  # one figure each
                 "Model state per rank", "Communication per step", "Step time per rank",
                 "Logged metrics", "theory", "rank 1", "class='nbtrain-summary'"):
        assert text in page, text
    # comparison + one dashboard per run, each drawn (plotly.js 2's own text also
    # spells Plotly.newPlot once)
    assert page.count('class="plotly-graph-div"') == 3
    assert page.count("Plotly.newPlot(") >= 3


def test_demo_help_lists_its_options():
    done = subprocess.run([sys.executable, "-m", "nbtrain", "demo", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for option in ("--strategies", "--devices", "--steps", "--output"):
        assert option in done.stdout
    bad = subprocess.run([sys.executable, "-m", "nbtrain", "demo", "--strategies", "zero9"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown strategy 'zero9'" in bad.stderr


def test_a_run_saves_its_own_report(tmp_path, no_leftovers):
    from workloads import paced, train

    import nbtrain

    run = nbtrain.launch(train, devices=2, accelerator="cpu", dashboard=False)
    path = run.save_report(tmp_path / "ddp.html")
    page = path.read_text()
    assert page.count('class="plotly-graph-div"') == 1 and "<script src=\"http" not in page
    assert "class='nbtrain-summary'" in page and "rank 1" in page
    gate = tmp_path / "gate"
    going = nbtrain.launch(paced, str(gate), devices=2, accelerator="cpu", background=True,
                           dashboard=False)
    try:
        with pytest.raises(RuntimeError, match="still going"):
            going.save_report(tmp_path / "early.html")
    finally:
        going.stop()
