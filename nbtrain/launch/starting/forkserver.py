"""Fork-server launcher: workers forked from a clean, warm process instead of the kernel.

A fork of the kernel is fast but unsafe once CUDA is initialised there; a spawn is safe
but pays a new interpreter and torch's import in every rank, on every launch. The fork
server is Python's answer (``multiprocessing``'s ``forkserver`` start method, here
``multiprocess``'s, so cell-defined functions travel by value with dill, as they do to
spawned workers): one process, started from a fresh interpreter the first time it is
needed, that imports torch and nbtrain's worker side once, never touches CUDA, and
forks each later worker from itself.

It lives as long as the kernel: it leaves when the kernel's end of its "alive" pipe
closes (the kernel exiting, however it exits), and ``ensure_running`` starts a new one
when it was killed. Its workers are its children, so they die with it (``spec.parent_pid``
is the server's pid) and it dies with the kernel.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Any

from ...cells import current_kernel
from ...spec import WorkerSpec
from .launcher import WorkerHandle, start_with_context, unflushed
from .spawn import SpawnLauncher, with_exit_hint
from .warm import COMMON

# What every worker imports before the user's function runs, imported once in the server:
# with IPython's shell, which a rank launched from a kernel takes (rank/displays.own_shell:
# its import was 35-75 ms of each rank's start, more than half of what the fork server's
# warm launch paid over fork's).
PRELOAD = ("torch", "torch.distributed", *COMMON, "dill", "nbtrain.rank.worker",
           "nbtrain.rank.pool_worker", "nbtrain.context", "nbtrain.telemetry.channel",
           "IPython.core.interactiveshell", "traitlets.config")
# A kernel's server also makes that shell before it forks (35-45 ms more of each rank's
# start); a script's ranks have none, as its own process has none.
KERNEL_PRELOAD = ("nbtrain.rank.server_shell",)

_lock = threading.Lock()


def _server():
    from multiprocess import forkserver

    return forkserver._forkserver


def ensure_running(extra: tuple[str, ...] = ()) -> int:
    """Start the fork server unless it runs; its pid. ``extra`` modules are preloaded too
    when this call starts it."""
    from multiprocess import resource_tracker

    server = _server()
    with _lock:
        # The resource tracker first: its start unblocks SIGINT on its way out.
        resource_tracker.ensure_running()
        # The new interpreter is in the kernel's process group and imports torch for a
        # few seconds before it ignores SIGINT: it starts with SIGINT blocked (the mask
        # survives exec, and its children, the workers, unblock it once they ignore it).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            shell = KERNEL_PRELOAD if current_kernel() is not None else ()
            server.set_forkserver_preload(list(dict.fromkeys((*PRELOAD, *shell, *extra))))
            server.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        return server._forkserver_pid


def running_pid() -> int | None:
    """The fork server's pid when it is running, else None (nothing is started)."""
    try:
        server = _server()
    except ImportError:
        return None
    pid = server._forkserver_pid
    if pid is None:
        return None
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return None if done else pid


def stop() -> None:
    """End the fork server now (the next launch that needs it starts a new one)."""
    if running_pid() is not None:
        _server()._stop()


class ForkServerLauncher(SpawnLauncher):
    """Spawn's payload (the function by value) and resource-tracker bookkeeping; each
    worker forked by the server instead of a new interpreter."""

    name = "forkserver"

    def __init__(self):
        super().__init__()
        self._context = unflushed("multiprocess", "forkserver", "popen_forkserver",
                                  keeps_fds=True)
        self._warm: tuple[str, ...] = ()  # the strategy's own imports, preloaded too

    def prepare(self, fn, args: tuple, kwargs: dict, strategy) -> bytes:
        self._warm = strategy.warm_imports_for("cpu")
        return super().prepare(fn, args, kwargs, strategy)

    def start(self, spec: WorkerSpec, payload: Any) -> WorkerHandle:
        self._count()
        pid = ensure_running(self._warm)
        # The server's environment is the kernel's at the server's start; a worker takes
        # the kernel's of now, as a spawned one would. Its parent is the server.
        spec = dataclasses.replace(spec, parent_pid=pid, environ_of_kernel=dict(os.environ))
        return with_exit_hint(start_with_context(self._context, spec, payload))
