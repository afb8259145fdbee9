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
"""

from __future__ import annotations

import importlib
import sys

# What every training function pays for: building an optimizer imports torch._dynamo;
# seeding a rank (seeding.py) imports numpy.random, lazily loaded by numpy (5 ms); a rank's
# hosting and ctx.setup import two modules of nbtrain's own.
COMMON = ("torch._dynamo", "numpy.random", "nbtrain.telemetry.active",
          "nbtrain.strategies.meta_init")


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
