"""Exceptions a launch raises in the notebook cell.

A worker cannot send its exception object back safely (its class may not exist in the
kernel, and the kernel never unpickles telemetry), so a failure crosses the process
boundary as plain data: the rank, the original type and message, and the traceback text.
"""

from __future__ import annotations

import signal


class WorkerError(RuntimeError):
    """A rank failed: it raised, was killed by a signal, or exited without returning.

    Attributes:
        rank: the rank that failed first (the root cause when several did).
        exc_type: the original exception's type name, e.g. ``"ValueError"``; for a
            signal death ``"SIGKILL"`` and so on.
        message: the original exception's message (or what happened to the process).
        traceback: the worker's formatted traceback, each line labelled with the rank.
        others: one line per other rank that did not finish normally.
    """

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str = "",
                 others: list[str] | None = None, hint: str = ""):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.others = list(others or [])
        self.hint = hint
        super().__init__(self._text())

    def _text(self) -> str:
        lines = [f"rank {self.rank} failed with {self.exc_type}: {self.message}"]
        if self.traceback:
            lines += ["", self.traceback.rstrip()]
        if self.others:
            lines += ["", "other ranks:"] + [f"  {line}" for line in self.others]
        if self.hint:
            lines += ["", self.hint]
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.message, self.traceback,
                             self.others, self.hint))


class RunTimeoutError(WorkerError):
    """The run passed its ``timeout=``; ``.ranks`` are the ranks that were still running."""

    def __init__(self, timeout: float, ranks: list[int], finished: list[int]):
        self.timeout = timeout
        self.ranks = list(ranks)
        still = ", ".join(map(str, ranks)) or "none"
        done = ", ".join(map(str, finished)) or "none"
        super().__init__(
            ranks[0] if ranks else 0, "Timeout",
            f"the run passed timeout={timeout:g}s; ranks still running: {still} "
            f"(finished: {done})",
            hint="A rank that never reaches a collective the others wait in (a barrier, an "
                 "all-reduce, a forward pass skipped on one rank) hangs them all. Check that "
                 "every rank runs the same number of steps, or raise timeout= if the work "
                 "is just long.")

    def __reduce__(self):
        return (_rebuild_timeout, (self.timeout, self.ranks, self.others))


def _rebuild_timeout(timeout, ranks, others):
    return RunTimeoutError(timeout, ranks, [])


class RunStoppedError(RuntimeError):
    """Results were asked of a run that was stopped (``run.stop()`` or an interrupt)."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def signal_hint(signum: int) -> str:
    if signum == signal.SIGKILL:
        return ("SIGKILL with no traceback usually means the operating system's out-of-memory "
                "killer ended the process: check free memory (or `dmesg`), lower the batch "
                "size, or pick a sharded strategy such as 'fsdp'.")
    if signum == signal.SIGSEGV:
        return ("A segmentation fault is a crash in native code (a CUDA/NCCL driver, a C "
                "extension); run on 1 device to see whether it is distributed-only.")
    if signum == signal.SIGBUS:
        return ("SIGBUS often means shared memory (/dev/shm) ran out; DataLoader workers use "
                "it. Lower num_workers or enlarge /dev/shm.")
    return "The process was ended by a signal from outside nbtrain."
