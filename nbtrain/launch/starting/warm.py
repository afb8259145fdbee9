"""The imports a forked worker would pay for on every launch, paid once in the kernel.

Fork's point is a warm interpreter: workers start as copies of the kernel, so whatever
the kernel has imported is free for them. The kernel rarely builds an optimizer, but
every training function does, and the first optimizer a process builds imports
``torch._dynamo`` and ~800 modules with it (about 1.2–2.5 s on a 2-core machine; more on
a GPU machine). Paid in each worker, that cost came back on every launch; paid here, the
first launch costs what it did and every later one starts warm.

Measured with ``set(sys.modules)`` in a forked worker of a 1M-parameter MLP with AdamW
under ddp and fsdp: ``torch._dynamo`` brings ~820 of the ~845 modules a worker imported.
The rest cost little, except a strategy's own (zero1's ``torch.distributed.optim``
compiles TorchScript on import, 1.3 s): a strategy lists them in ``warm_imports``.

In a Jupyter kernel the common part is paid earlier still, while the kernel waits for the
user's next cell (``when_idle``, at ``import nbtrain``): the launch cell's header and first
chart then show without it. The kernel's event loop runs it on the main thread between
cells, so no import races a cell's and no thread is alive at a fork; a cell that arrives
meanwhile waits for it (at most what its launch would have paid), and an interrupt
between cells is ignored by ipykernel, as always.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import warnings

# What every training function pays for: building an optimizer imports torch._dynamo;
# seeding a rank (seeding.py) imports numpy.random, lazily loaded by numpy (5 ms); every
# rank runs its function inside integrations.hosting (4 ms to compile where no bytecode
# is written, PYTHONDONTWRITEBYTECODE as in CI), and ctx.setup imports two modules of
# nbtrain's own.
COMMON = ("torch._dynamo", "numpy.random", "nbtrain.integrations.hosting",
          "nbtrain.telemetry.active", "nbtrain.strategies.meta_init")


def _first_record_function() -> None:
    """torch's first ``record_function`` in a process looks for an optional profiler
    module (an import attempt, a few ms); optimizer steps use it."""
    import torch

    with torch.autograd.profiler.record_function("nbtrain-warm"):
        pass


_warmed_calls = False


def warm_kernel(extra: tuple[str, ...] = ()) -> list[str]:
    """Import what forked workers would otherwise import each time; returns what was new."""
    global _warmed_calls
    if not _warmed_calls:
        _warmed_calls = True
        _first_record_function()
    new = [name for name in (*COMMON, *extra) if name not in sys.modules]
    for name in new:
        try:
            importlib.import_module(name)
        except ImportError:  # numpy is optional for seeding; a strategy's own must import
            if name in extra:
                raise
    return [name for name in new if name in sys.modules]


# After the cell that imported nbtrain has had its reply sent and the kernel shows idle.
IDLE_DELAY = 0.5


def when_idle(*tasks, delay: float = IDLE_DELAY) -> bool:
    """In a Jupyter kernel, run ``tasks`` once the kernel is between cells; returns whether they were scheduled (outside a kernel's event loop
    there is nothing to do: a script's first launch pays at the launch)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no loop running on this thread: not a kernel's cell
        return False
    loop.call_later(delay, _quietly, tasks)
    return True


def _quietly(tasks) -> None:
    for task in tasks:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                task()
        except Exception:  # the launch does it again and reports what fails there
            pass
