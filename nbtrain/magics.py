"""``%%ranks``: run a notebook cell on every rank of the active ``RankPool``.

    %load_ext nbtrain
    pool = nbtrain.RankPool(devices=2, accelerator="cpu")

    %%ranks                 # every rank; %%ranks 0 or %%ranks 0,1 for some
    x = torch.ones(2) * rank
    dist.all_reduce(x)
    x                       # shown per rank, as [rank N] tensor([1., 1.])

Each rank keeps its own namespace across cells, with ``rank``, ``world_size``,
``device``, ``dist`` and ``torch`` defined. ``--timeout S`` ends a cell that runs longer
(a hung collective) and names the ranks still in it. The workers never import IPython.
"""

from __future__ import annotations

import shlex

from IPython.core.magic import Magics, cell_magic, magics_class

from .errors import WorkerError
from .launch.pool import active_pool

USAGE = "usage: %%ranks [RANKS] [--timeout SECONDS]   (RANKS: all, 0, or 0,1,...)"


class PerRank(dict):
    """Each rank's repr of a cell's last value; shows as ``[rank N] value`` lines."""

    def __repr__(self) -> str:
        lines = []
        for rank, text in sorted(self.items()):
            if text is None:
                continue
            body = text.splitlines() or [""]
            lines.append(f"[rank {rank}] {body[0]}")
            pad = " " * len(f"[rank {rank}] ")
            lines += [pad + line for line in body[1:]]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(repr(self))


def parse_line(line: str) -> tuple[list[int] | None, float | None]:
    """``"0,1 --timeout 5"`` -> ``([0, 1], 5.0)``; ranks None means every rank."""
    ranks = None
    timeout = None
    words = shlex.split(line)
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("--timeout", "-t"):
            if i + 1 == len(words):
                raise ValueError(f"--timeout needs a number of seconds. {USAGE}")
            try:
                timeout = float(words[i + 1])
            except ValueError:
                raise ValueError(f"--timeout {words[i + 1]!r} is not a number. {USAGE}") from None
            i += 2
            continue
        if word.startswith("--timeout="):
            return parse_line(" ".join([*words[:i], "--timeout", word.split("=", 1)[1],
                                        *words[i + 1:]]))
        if ranks is not None:
            raise ValueError(f"unexpected {word!r}. {USAGE}")
        if word != "all":
            try:
                ranks = [int(r) for r in word.split(",") if r.strip()]
            except ValueError:
                raise ValueError(f"{word!r} is not a rank list. {USAGE}") from None
        i += 1
    return ranks, timeout


@magics_class
class RankMagics(Magics):
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run the cell on the ranks of the active RankPool (all, or those named)."""
        ranks, timeout = parse_line(line)
        try:
            values = active_pool().run(cell, ranks=ranks, timeout=timeout)
        except WorkerError as err:  # the ranks' tracebacks, not the kernel's plumbing
            raise err.with_traceback(None) from None
        if any(v is not None for v in values.values()):
            return PerRank(values)
        return None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(RankMagics)
