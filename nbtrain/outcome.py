"""How a run ended, as ``Run`` reads it once the ranks are done, whoever ran them: the
local ``Supervisor``, a pool operation, torchrun's ranks or a watched job (``Outcome``).
Why the ranks were ended (``Teardown``) and how a rank failed (``Ending``) are typed,
set where the kernel saw them (``launch/following/failures.py``, ``late.py``, ``watch.py``,
``supervisor.py``), and read by ``Run`` and the restart rule (``restarts.py``) without
matching names or messages.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Sequence
from typing import Any, Protocol


class Teardown(enum.Enum):
    """Why a run's ranks were ended before they all returned (an outcome's
    ``teardown_cause``; None: they returned, or ended on their own)."""

    FAILURE = "failure"  # a rank failed on its own; the others were ended because of it
    STOP = "stop"  # run.stop(), the stop button, an interrupt
    TIMEOUT = "timeout"  # the run's own timeout=
    REMOTE = "remote"  # a watched job: it goes on where it runs; only the watching ended


class Ending(enum.Enum):
    """How a rank failed, as the kernel classified it where it saw the failure."""

    RAISED = "raised"  # the function raised an exception
    COMMUNICATION = "communication"  # a communication error (mostly a peer's death, seen from afar)
    MISMATCH = "collective mismatch"  # it ran a collective the others did not, or another size
    KILLED = "killed"  # a signal from outside (the OOM killer's SIGKILL, SIGTERM, NCCL's abort)
    CRASHED = "crashed"  # a fault in native code (SIGSEGV, SIGBUS, SIGILL, SIGFPE)
    EXITED = "exited"  # the process exited without returning
    NEVER_JOINED = "never joined"  # it did not join its process group in time
    INTERRUPTED = "interrupted"  # nbtrain interrupted it (its KeyboardInterrupt)
    MALFORMED = "malformed"  # its message could not be read (two different nbtrains)


class FailureLike(Protocol):
    """How a rank failed, as ``Run`` reads it (the supervisor's ``Failure``, a remote
    job's)."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    hint: str
    ending: Ending
    secondary: bool  # not the root cause (a peer's death seen from afar, an interrupt)


@dataclasses.dataclass(frozen=True)
class Frame:
    """A line of a rank's Python stack: where it was when it was ended."""

    filename: str
    lineno: int
    name: str


class RankOutcome(Protocol):
    result: bytes | None  # a result message (P or D), once it returned
    failure: FailureLike | None  # once it failed
    exitcode: int | None  # once its process ended here (None: it ran elsewhere)
    where: Frame | None  # where its function was when nbtrain ended it, if it said


@dataclasses.dataclass
class Reported:
    """A rank's outcome as a whole, for ranks that ran elsewhere (torchrun's, a SLURM
    job's)."""

    result: bytes | None = None
    failure: FailureLike | None = None
    exitcode: int | None = None
    where: Frame | None = None


class Outcome(Protocol):
    """What ``Run`` reads from whatever ran its ranks, once ``done`` is set."""

    done: threading.Event
    workers: dict[int, RankOutcome]
    teardown_cause: Teardown | None
    timed_out_ranks: Sequence[int]  # the ranks still busy, on Teardown.TIMEOUT
    crash: BaseException | None  # nbtrain's own failure while running them
    note: str | None  # what the run says when it ends well (every rank trained alone)

    def start(self) -> None:
        """Begin following the ranks (once the run follows this; again: nothing)."""

    def root_failure(self) -> Any:
        """The failure that ended the run (the first rank's own), or None."""

    def request_stop(self, reason: str) -> None:
        """End the ranks (``run.stop()``)."""
