"""The interface every launch mechanism shares, and the handle of one started worker."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...spec import WorkerSpec


@dataclass
class WorkerHandle:
    """The kernel's end of one worker: its process and the read ends of its pipes."""

    rank: int
    process: Any  # multiprocessing.Process or multiprocess.Process
    control: Any  # Connection: result or failure
    out: Any  # Connection wrapping the worker's stdout pipe
    err: Any  # Connection wrapping the worker's stderr pipe
    commands: Any = None  # the write end of its command pipe (the store's port; a pool's commands)
    # What an exit with code 1 and no report usually means for this way of starting
    # (the launcher says; a spawned worker failing at import, say)
    exit_hint: str = ""
    # Kept from the start: the process object refuses even .pid once a supervisor closed
    # it after reaping, and teardown still names the process group by it.
    pid: int = field(init=False)

    def __post_init__(self) -> None:
        self.pid = self.process.pid


class Launcher(Protocol):
    name: str

    def threads(self, wanted: int | None) -> int | None:
        """The torch threads each worker may use, given ``wanted`` (None: torch's own
        choice): what this way of starting allows."""

    def warm(self) -> None:
        """Before a pool's workers start: what the launcher does once in the kernel."""

    def prepare(self, fn, args: tuple, kwargs: dict, strategy) -> Any:
        """What each worker receives as the user's function (checked before any start)."""

    def start(self, spec: WorkerSpec, payload: Any) -> WorkerHandle:
        """Start one worker; return at once."""

    def close(self) -> None:
        """Release what the launcher holds, once the run's workers are gone."""


@functools.cache
def unflushed(package: str, method: str, popen: str, keeps_fds: bool = False):
    """A context of ``package`` (``multiprocessing``, or ``multiprocess`` for the fork
    server and spawn) for ``method`` whose processes start without the flush of
    ``sys.stdout`` and ``sys.stderr`` that ``package.popen.Popen`` makes first (so a fork
    writes no buffered line twice); ``keeps_fds``: that ``Popen`` lists the fds it
    passes. In a kernel each flush is a round trip to ipykernel's IOPub thread, queued
    behind what it has to send: 0.2-3.9 ms, two a rank. No rank writes what the
    kernel's streams hold: it takes fds 1 and 2 and new streams as it starts and ends
    with ``os._exit``; the run's header display flushed what the cell printed."""
    base_context = type(importlib.import_module(package).get_context(method))
    base_process = base_context.Process
    base_popen = importlib.import_module(f"{package}.{popen}").Popen

    class Popen(base_popen):
        def __init__(self, process_obj):  # the stdlib's (3.7-3.13), multiprocess's, less
            if keeps_fds:  # the flush
                self._fds = []
            self.returncode = None
            self.finalizer = None
            self._launch(process_obj)

    class Process(base_process):
        @staticmethod
        def _Popen(process_obj):
            return Popen(process_obj)

        def __reduce_ex__(self, protocol):
            # what a spawned or fork-server child unpickles is the package's own class: it
            # never imports this (kernel-side) module
            return object.__new__, (base_process,), self.__dict__

    return type(f"Unflushed{base_context.__name__}", (base_context,), {"Process": Process})()


def start_with_context(mp_context, spec: WorkerSpec, payload: Any) -> WorkerHandle:
    """Start ``worker.main`` (``pool_worker.main`` for a pool's worker) with pipes from
    ``mp_context`` (a fork or a spawn context)."""
    from ...rank import pool_worker, worker
    from .guards import fork_quietly

    control_r, control_w = mp_context.Pipe(duplex=False)
    out_r, out_w = mp_context.Pipe(duplex=False)
    err_r, err_w = mp_context.Pipe(duplex=False)
    # kernel -> worker: where rank 0's store is, then (a pool worker) its commands
    cmd_r, cmd_w = mp_context.Pipe(duplex=False)
    args = (spec, payload, control_w, out_w, err_w, cmd_r)
    entry = pool_worker.main if spec.pool else worker.main
    process = mp_context.Process(target=entry, name=f"nbtrain-rank-{spec.rank}", args=args)
    try:
        with fork_quietly():  # Python 3.12+'s warning at a fork from a threaded kernel
            process.start()
    except BaseException:
        cmd_w.close()
        raise
    finally:
        # The parent keeps only its ends, so later workers do not inherit the worker's
        # and end-of-file means this worker is gone.
        for end in (control_w, out_w, err_w, cmd_r):
            end.close()
    try:  # the worker does the same; doing it here too closes the race
        os.setpgid(process.pid, process.pid)
    except OSError:
        pass
    return WorkerHandle(spec.rank, process, control_r, out_r, err_r, cmd_w)


@contextlib.contextmanager
def interrupts_deferred():
    """An interrupt (SIGINT) that arrives inside the block is raised when it ends.

    Starting a worker and recording its handle must not be cut in two: an interrupt
    between the child's creation and ``handles.append`` left a process nobody ended
    or reaped. Only the main thread receives KeyboardInterrupt; elsewhere this does
    nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            if callable(previous):
                previous(signal.SIGINT, held[-1])  # Python's: raises KeyboardInterrupt
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt
