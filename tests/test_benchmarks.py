"""Every benchmark the guide (docs/guide.md) lists runs as pasted, once, with its smallest arguments:
it starts, finishes and prints its table (CI never measures with them; people do)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "guide.md").read_text()
BLOCK = re.search(r"^## Benchmarks\n.*?^```bash\n(.*?)^```", GUIDE, re.S | re.M).group(1)
LINES = {re.match(r"python benchmarks/(\S+\.py)", line).group(1): re.sub(r"\s*#.*$", "", line)
         for line in BLOCK.splitlines() if line.strip()}

# The smallest arguments each takes, and a line of the table it prints.
SMALL = {
    "launch.py": ("--repeats 1", "warm, to Lightning ddp_notebook: fork call->step"),
    "spawn_breakdown.py": ("--repeats 1", "first optimizer"),
    "telemetry_overhead.py": ("--steps 20 --rounds 1 --tiny-rounds 1 --tiny-steps 100 "
                              "--strategies ddp", "every step timed"),
    # two of its seven rows: each row is one launch of the same code with another strategy
    "gpu_table.py": ("--accelerator cpu --width 64 --depth 1 --batch 2 --seq 16 --steps 3 "
                     "--rows DDP 'FULL_SHARD + AC'", "FULL_SHARD + AC"),
    "dashboard_overhead.py": ("--steps 60 --repeats 1", "ratio (live/off)"),
    "memory_ladder.py": ("--steps 5 --width 64 --depth 1 --batch 8", "fsdp_grad_op"),
    "pool.py": ("--repeats 1", "pool.launch call->step"),
    "start_stress.py": ("--starts 6 --deadline 120", "hung: 0 of 6"),
    "browser.py": ("--repeats 1", "first chart"),
    "unused_params.py": ("--steps 3 --rounds 1 --width 16", "ratio True/False"),
    "restart.py": ("--repeats 1 --methods fork", "death -> next step"),
    "scaling.py": ("--repeats 1 --steps 5 --cases mlp-hand", "mlp-hand"),
    "timeline.py": ("--repeats 1", "launch returned"),
    "evaluation.py": ("--repeats 1 --epochs 1", "steps counted: 64 of 64"),
    "rank_output.py": ("--repeats 1 --lines 200", "2 ranks"),
    "plan_accuracy.py": ("--models cnn --batches 4", "farthest from 1"),
    "ray_submit.py": ("--repeats 1", "submit(Ray) / launch()"),
}
NEEDS = {"browser.py": "tests/browser/lab.py"}  # what a benchmark needs beyond the extras


def test_the_readme_lists_every_benchmark():
    on_disk = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert set(LINES) == on_disk, "list every benchmark in docs/guide.md's Benchmarks block"
    assert set(SMALL) == on_disk, "give every benchmark its smallest arguments here"


@pytest.mark.parametrize("name", sorted(SMALL))
def test_benchmark_runs_with_its_smallest_arguments(name, no_leftovers):
    args, expected = SMALL[name]
    if name == "ray_submit.py":
        pytest.importorskip("ray", reason="nbtrain[ray] is an extra")
    if name in NEEDS:
        spec = importlib.util.spec_from_file_location("lab", ROOT / NEEDS[name])
        helpers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(helpers)
        if helpers.missing():
            pytest.skip(f"{name} {helpers.missing()}")
    command = f"{LINES[name]} {args}"
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          executable="/bin/bash")
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert expected in done.stdout, done.stdout[-3000:]


def test_a_launch_table_cut_off_by_its_time_cap_still_prints_what_was_measured(no_leftovers):
    """`.ci/gpu all` runs launch.py under `timeout`: at its SIGTERM the benchmark prints the
    rows it has (a dash where nothing was measured), ends its kernels and their ranks."""
    command = f"timeout -s TERM 25 {LINES['launch.py']} --repeats 50"
    done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          executable="/bin/bash")
    assert done.returncode == 124, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert re.search(r"^\(cut off after \d+ s", done.stdout, re.M), done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("nbtrain (default)")]
    assert len(rows) == 1 and re.search(r"\d\.\d{3}s", rows[0]), done.stdout


def test_the_gpu_verdict_reads_each_launch_path_against_lightning(tmp_path):
    """`.ci/gpu all`'s one line is what a GPU session reads: issue 62's goal, fork and the
    fork server at most 1.0x Lightning for call->step and call->result, from the table
    launch.py prints (its own printer, given times)."""
    spec = importlib.util.spec_from_file_location("launch_bench", ROOT / "benchmarks" / "launch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    given = {"nbtrain (default)": (0.05, 0.10), "nbtrain after CUDA": (0.08, 0.15),
             bench.BASE: (0.10, 0.20)}
    times = {name: {"step": [step] * 2, "result": [result] * 2, "error": [0.1] * 2}
             for name, (step, result) in given.items()}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.table(SimpleNamespace(accelerator="cpu", repeats=2, fresh=1), 2,
                    dict.fromkeys(given, ""), {}, {n: [1.0] for n in given},
                    {n: [0.5] for n in given}, times, None)
    (tmp_path / "launch.txt").write_text(printed.getvalue())
    (tmp_path / "gpu.txt").write_text("name, driver_version, memory.total [MiB]\n"
                                      "NVIDIA H200, 570.1, 143771 MiB\n")
    (tmp_path / "pytest-gpu.txt").write_text("61 passed in 250.12s (0:04:10)\n")
    done = subprocess.run(["bash", ".ci/gpu", "verdict", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"gpu verdict (NVIDIA H200, read again from {tmp_path}): tests: 61 passed in 250.12s "
        "(0:04:10); gpu_table: no DDP row (cut off or failed); warm, to Lightning: fork "
        "call->step 0.50x, call->result 0.50x; fork server call->step 0.80x, call->result "
        "0.75x")
