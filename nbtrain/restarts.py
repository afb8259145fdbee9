"""``launch(..., max_restarts=N)``: which endings of an attempt a restart may cure, and
what a run remembers of its attempts.

Retried: a rank killed by a signal (the OOM killer's SIGKILL, a preempted process), a
rank that exited without returning, a rank that never joined its process group, and an
attempt whose only failures are communication errors (a collective that timed out, a
peer's death seen from afar). Not retried: an exception raised by the user's code (it
would raise again), ranks that ran different collectives (a native abort on a collective
mismatch, a collective that outlived its peers' return: the code would do it again),
``run.stop()`` or an interrupt, the run's own ``timeout=``, and a failure of nbtrain
itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import COLLECTIVE_MISMATCH
from .wire import Outcome, first_line

RETRIED_TYPES = ("WorkerExit", "StartTimeout")


@dataclass(frozen=True)
class Attempt:
    """One attempt that ended and was followed by another."""

    number: int  # 1: the first
    cause: str  # why its ranks ended, rank first
    step: int | None  # the last step a rank reported
    resume: str | None  # the checkpoint the next attempt went on from (None: step 0)

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        then = f"restarted from {self.resume}" if self.resume else "restarted from the start"
        return f"attempt {self.number} ended{at}: {self.cause}; {then}"


def retry_cause(outcome: Outcome) -> str | None:
    """Why the attempt's ranks ended, when a restart may cure it; None otherwise."""
    if outcome.crash is not None or outcome.teardown_cause in ("stop", "timeout", "remote"):
        return None
    root = outcome.root_failure()
    if root is None or COLLECTIVE_MISMATCH.search(root.message):
        return None
    if root.exc_type.startswith("SIG") or root.exc_type in RETRIED_TYPES or root.secondary:
        said = first_line(root.message)  # rank first, once
        return said if said.startswith(f"rank {root.rank} ") else f"rank {root.rank}: {said}"
    return None


def history_text(attempts: list[Attempt]) -> str:
    """The attempts before the last, for the run's error and summary."""
    if not attempts:
        return ""
    n = len(attempts)
    return (f"The run was restarted {n} time{'s' if n > 1 else ''}:\n"
            + "\n".join(f"  {a}" for a in attempts))
