"""``python -m nbtrain demo [options]`` (see ``--help``)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m nbtrain demo [--help] [options]\n\n"
              "commands:\n  demo    train the quickstart model with DDP and FSDP on 2 CPU "
              "ranks and write an HTML report")
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    print(f"unknown command {argv[0]!r}; try: python -m nbtrain demo --help", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
