"""Fork launcher (Lightning's ``ddp_notebook`` way): workers are copies of the kernel.

Fast to start (torch is already imported) and every object defined in a cell is simply
there. Unsafe once CUDA is initialised in the kernel; ``guards`` decides.
"""

from __future__ import annotations

from typing import Any

from ...spec import WorkerSpec
from .guards import fork_threads
from .launcher import WorkerHandle, start_with_context, unflushed
from .warm import warm_kernel


class ForkLauncher:
    name = "fork"

    def __init__(self):
        self._context = unflushed("multiprocessing", "fork", "popen_fork")

    def threads(self, wanted: int | None) -> int | None:
        """One thread per worker when the kernel's OpenMP pool would hang a fork."""
        return fork_threads(wanted)

    def warm(self) -> None:
        warm_kernel()

    def prepare(self, fn, args: tuple, kwargs: dict, strategy) -> Any:
        return (fn, args, kwargs, strategy)  # by reference: a forked rank has them all

    def start(self, spec: WorkerSpec, payload: Any) -> WorkerHandle:
        # What every worker would import, once per kernel (about 1 s the first time): here,
        # after the run's header is on the page, not before it. (A pool's workers get no
        # payload; the pool warms the kernel itself.)
        if payload is not None:
            _fn, _args, _kwargs, strategy = payload
            warm_kernel(strategy.warm_imports_for(spec.accelerator))
        return start_with_context(self._context, spec, payload)

    def close(self) -> None:
        pass
