"""Spawn launcher through ``multiprocess``: fresh interpreters, safe whatever the kernel did.

The user's function, its arguments and the strategy are serialised by value with dill's
``recurse`` setting, so a function defined in a cell travels together with the cell
globals it uses (classes, helpers, constants). Starting costs a few seconds: each worker
imports torch again.
"""

from __future__ import annotations

from typing import Any

from .launcher import WorkerHandle, start_with_context
from .worker import WorkerSpec


class SpawnLauncher:
    name = "spawn"
    is_interactive_compatible = True

    def __init__(self):
        import multiprocess

        self._context = multiprocess.get_context("spawn")

    def prepare(self, fn, args: tuple, kwargs: dict, strategy) -> bytes:
        import dill

        try:
            return dill.dumps((fn, args, kwargs, strategy), recurse=True)
        except Exception as err:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"cannot send {name}() and its arguments to spawned workers: {err}. Objects "
                "that hold open resources (files, sockets, locks, CUDA tensors) cannot be "
                "copied into a new process; create them inside the function, or use "
                "start_method='fork'.") from err

    def start(self, spec: WorkerSpec, payload: Any) -> WorkerHandle:
        return start_with_context(self._context, spec, payload)
