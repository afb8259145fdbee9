"""``%%ranks``: run a notebook cell on every rank of the active ``RankPool``.

    %load_ext nbtrain
    pool = nbtrain.RankPool(devices=2, accelerator="cpu")

    %%ranks                 # every rank; %%ranks 0 or %%ranks 0,1 for some
    x = torch.ones(2) * rank
    dist.all_reduce(x)
    x                       # shown per rank, as [rank N] tensor([1., 1.])

Each rank keeps its own namespace across cells, with ``rank``, ``world_size``,
``device``, ``dist`` and ``torch`` defined. ``--timeout S`` ends a cell that runs longer
(a hung collective) and names the ranks still in it; a CPU rank stuck in a collective is
freed by the others and the pool goes on. The workers never import IPython.
"""

from __future__ import annotations

import traceback

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cells import RANKS_CELL
from .cells import current as current_cell
from .errors import WorkerError, cell_names
from .launch.pool.ranks import active_pool

USAGE = "usage: %%ranks [RANKS] [--timeout SECONDS]   (RANKS: all, 0, or 0,1,...)"


class CellSyntaxError(Exception):
    """A ``%%ranks`` cell that does not parse, shown as IPython shows a cell's own syntax
    error (its cell, line and caret): IPython shows a ``SyntaxError`` raised while code
    runs with the whole stack, here its own frames and the magic's. ``error``: the
    ``SyntaxError``."""

    def __init__(self, error: SyntaxError):
        super().__init__(f"{error.msg} ({error.filename}, line {error.lineno})")
        self.error = error

    def _render_traceback_(self) -> list[str]:
        text = "".join(traceback.format_exception_only(type(self.error), self.error))
        return cell_names(text).splitlines()


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


@magics_class
class RankMagics(Magics):
    @magic_arguments()
    @argument("ranks", nargs="?", default="all",
              help="the ranks to run the cell on: all (the default), 0, or 0,1,...")
    @argument("-t", "--timeout", type=float, default=None, metavar="SECONDS",
              help="end the cell after this long and name the ranks still in it (a hung "
                   "collective: on CPU ranks the others free it, and the names stay)")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run the cell on the ranks of the active RankPool (nbtrain.RankPool).

        Each rank keeps its own names across cells, with rank, world_size, device, dist
        and torch defined; the value of the cell's last expression is shown per rank.
        """
        ranks, timeout = parse_line(line)
        number, filename = current_cell(), None
        if number is not None:  # tracebacks say "Cell In[n], line L", L counted as the cell's
            cell, filename = "\n" + cell, RANKS_CELL.format(number)
        try:
            values = active_pool().run(cell, ranks=ranks, timeout=timeout, filename=filename)
        except WorkerError as err:  # the ranks' tracebacks, not the kernel's plumbing
            raise err.with_traceback(None) from None
        except SyntaxError as err:  # no rank ran it
            raise CellSyntaxError(err) from None
        if any(v is not None for v in values.values()):
            return PerRank(values)
        return None


def parse_line(line: str) -> tuple[list[int] | None, float | None]:
    """``"0,1 --timeout 5"`` -> ``([0, 1], 5.0)``; ranks None means every rank. Read by
    IPython's own argument parser, which also gives ``%%ranks?`` its help."""
    try:
        args = parse_argstring(RankMagics.ranks, line)
    except UsageError as err:
        raise ValueError(f"{err}. {USAGE}") from None
    if args.ranks == "all":
        return None, args.timeout
    try:
        return [int(r) for r in args.ranks.split(",") if r.strip()], args.timeout
    except ValueError:
        raise ValueError(f"{args.ranks!r} is not a rank list. {USAGE}") from None


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(RankMagics)
