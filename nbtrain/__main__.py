"""``nbtrain demo [options]`` and ``nbtrain run FILE.py:FUNCTION ...`` (see ``--help``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: nbtrain demo [--help] [options]\n"
              "       nbtrain run FILE.py:FUNCTION [ARGS] [--strategy S] [--attach ADDRESS] "
              "[torchrun's options: --nproc-per-node M --nnodes N --rdzv-endpoint HOST:PORT "
              "--max-restarts K ...]\n\n"
              "commands:\n  demo    train the quickstart model with DDP and FSDP on 2 CPU "
              "ranks and write an HTML report\n"
              "  run     run a function on every rank torchrun starts (see run --help)")
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    if argv[0] == "run":
        from .scaleout.command import main as run

        return run(argv[1:])
    if argv[0] == "_rank":  # one process torchrun started for `nbtrain run`
        from .scaleout.command import rank_main

        return rank_main(argv[1:])
    print(f"unknown command {argv[0]!r}; try: nbtrain --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
