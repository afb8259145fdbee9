"""What printing costs a rank: the same print loop in a real Jupyter kernel's own cell
and in ranks launched from it, alternating, each timed where it runs (the loop's own
seconds: how long printing held up the code that printed) and as the cell's wall time
(until every line reached the cell).

    python benchmarks/rank_output.py [--lines 50000] [--repeats 3]

A rank's lines travel a pipe to the kernel, which labels them and writes them to the
cell's stream. The target: a rank's print loop held up no longer than the kernel's own
(it was 15x longer while the kernel flushed its stream after each line), and every line in
the cell within a second of the loop's end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dashboard_overhead import kernel, run_cell  # noqa: E402  (a kernel; a cell, its messages)

SETUP = textwrap.dedent("""
    import time, nbtrain

    def chatty(lines):
        start = time.perf_counter()
        for i in range(lines):
            print("step", i, "loss", 0.25)
        return time.perf_counter() - start

    def ranks(ctx, lines):
        return chatty(lines)
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.lines
    cells = {
        "kernel": f"chatty({n})",
        "1 rank": f"max(nbtrain.launch(ranks, devices=1, lines={n}, dashboard=False).results)",
        "2 ranks": f"max(nbtrain.launch(ranks, devices=2, lines={n}, dashboard=False).results)",
    }
    with kernel(SETUP) as kc:
        run_cell(kc, "nbtrain.launch(ranks, devices=2, lines=10, dashboard=False); None")
        loop: dict[str, list[float]] = {name: [] for name in cells}
        wall: dict[str, list[float]] = {name: [] for name in cells}
        for _ in range(args.repeats):
            for name, code in cells.items():
                counts, result, seconds = run_cell(kc, code)
                lines = counts.get("stdout lines", 0)
                ranks = 1 if name == "kernel" else int(name[0])
                if lines != n * ranks:
                    raise RuntimeError(f"{name}: {lines} lines reached the cell, not {n * ranks}")
                loop[name].append(float(result))
                wall[name].append(seconds)
        base = statistics.median(loop["kernel"])
        print(f"{n} lines printed per rank, {args.repeats} runs each (median seconds):")
        print(f"  {'':8} {'print loop':>11} {'x kernel':>9} {'cell':>8}")
        for name in cells:
            held, cell = statistics.median(loop[name]), statistics.median(wall[name])
            print(f"  {name:8} {held:11.2f} {held / base:9.2f} {cell:8.2f}")


if __name__ == "__main__":
    main()
