"""Spawn launcher through ``multiprocess``: fresh interpreters, safe whatever the kernel did.

The user's function, its arguments and the strategy are serialised by value with dill's
``recurse`` setting, so a function defined in a cell travels together with the cell
globals it uses (classes, helpers, constants). Starting costs a few seconds: each worker
imports torch again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

from ...spec import WorkerSpec
from .launcher import WorkerHandle, start_with_context, unflushed


class SpawnLauncher:
    name = "spawn"

    # multiprocess starts a resource-tracker process on the first spawn. When nbtrain
    # started it, nbtrain stops it once its last spawn run is over, so the kernel keeps
    # no helper process between runs.
    _lock = threading.Lock()
    _active = 0
    _owns_tracker = False

    def __init__(self):
        from multiprocess import resource_tracker

        self._context = unflushed("multiprocess", "spawn", "popen_spawn_posix",
                                  keeps_fds=True)
        self._tracker = resource_tracker._resource_tracker
        self._counted = False

    def close(self) -> None:
        """Called once the run's workers are gone."""
        with SpawnLauncher._lock:
            if not self._counted:
                return
            self._counted = False
            SpawnLauncher._active -= 1
            if SpawnLauncher._active == 0 and SpawnLauncher._owns_tracker:
                _stop_tracker(self._tracker)

    def threads(self, wanted: int | None) -> int | None:
        return wanted  # a new interpreter starts its own thread pool

    def warm(self) -> None:
        pass

    def prepare(self, fn, args: tuple, kwargs: dict, strategy) -> bytes:
        return serialize(fn, args, kwargs, strategy, "spawned workers",
                         "or use start_method='fork'")

    def _count(self) -> None:
        """This launcher's runs keep the tracker alive until ``close``."""
        with SpawnLauncher._lock:
            if not self._counted:
                if SpawnLauncher._active == 0:
                    SpawnLauncher._owns_tracker = getattr(self._tracker, "_pid", 0) is None
                SpawnLauncher._active += 1
                self._counted = True

    def start(self, spec: WorkerSpec, payload: Any) -> WorkerHandle:
        self._count()
        # The new interpreter is in the kernel's process group until nbtrain's code runs
        # in it, so Jupyter's interrupt would reach it mid-import (a stray traceback in
        # the cell). It starts with SIGINT blocked, a mask that survives exec; the worker
        # ignores SIGINT and then unblocks it. (multiprocess's resource tracker does the
        # same.) The mask is this thread's: the kernel still gets its interrupt. The
        # tracker starts first: starting it unblocks SIGINT on its way out.
        self._tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return with_exit_hint(start_with_context(self._context, spec, payload))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _stop_tracker(tracker, timeout: float = 5.0) -> None:
    """Stop multiprocess's resource tracker, never waiting on it for long.

    The tracker exits when every copy of its pipe's write end is closed; ``_stop()``
    closes the kernel's and then waits for it without a limit, so one spawned worker
    left alive would hang the kernel there. Here a tracker still running after
    ``timeout`` is killed.
    """
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        if fd is None:
            return
        tracker._fd = tracker._pid = None
        with contextlib.suppress(OSError):
            os.close(fd)
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
    except ChildProcessError:
        pass


def serialize(fn, args: tuple, kwargs: dict, strategy, where: str, remedy: str) -> bytes:
    """The function, its arguments and the strategy by value (dill, ``recurse``)."""
    import dill

    try:
        return dill.dumps((fn, args, kwargs, strategy), recurse=True)
    except Exception as err:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"cannot send {name}() and its arguments to {where}: {err}. Objects "
            "that hold open resources (files, sockets, locks, CUDA tensors) cannot be "
            "copied into a new process; create them inside the function, "
            f"{remedy}.") from err


# A new interpreter that exits with code 1 before it reports failed while starting.
EXIT_HINT = ("A spawned worker that exits with code 1 and no report usually failed while "
             "starting, before your function ran; its own traceback is printed above. In a "
             "script, the common cause is launching at import: put the launch under "
             "`if __name__ == \"__main__\":`.")


def with_exit_hint(handle: WorkerHandle) -> WorkerHandle:
    handle.exit_hint = EXIT_HINT
    return handle
