"""``launch(..., max_restarts=N)``: which endings of an attempt a restart may cure, and
what a run remembers of its attempts.

Retried: a rank killed from outside (the OOM killer's SIGKILL, a preempted process's
SIGTERM, NCCL's watchdog abort), a rank that exited without returning, a rank that never
joined its process group, and an attempt whose only failures are communication errors
(a collective that timed out, a peer's death seen from afar). Not retried: an exception
raised by the user's code (it would raise again), a crash in native code (SIGSEGV,
SIGBUS, SIGILL, SIGFPE: the rank's own code faulted, and a restart replays the same
steps on the same data with the same random streams, so a crash of the code recurs where
it was; a flaky driver's is the rare exception, and a retry would triple the wait for
the traceback), ranks that ran different collectives (a native abort on a collective
mismatch, a collective that outlived its peers' return: the code would do it again),
``run.stop()`` or an interrupt, the run's own ``timeout=`` (it bounds the whole run,
restarts included), and a failure of nbtrain itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .outcome import Ending, Outcome, Teardown
from .wire import first_line

# the endings a restart may cure: the rank's own code did not cause them (the docstring)
RETRIED = frozenset({Ending.KILLED, Ending.EXITED, Ending.NEVER_JOINED,
                     Ending.COMMUNICATION, Ending.INTERRUPTED})


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


@dataclass
class Restarts:
    """A run's restarts: ``start(points, announce)`` starts the next attempt (the launch's
    backend, again), at most ``most`` times; ``points`` are the checkpoints a restart may
    go on from, oldest first (``checkpoint_every``'s, ``ctx.save(..., resume=True)``'s)."""

    start: Callable | None = None
    most: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    points: list[str] = field(default_factory=list)

    def next(self, outcome: Outcome, deadline: float | None,
             announce: Callable[[str, str | None], None]):
        """The next attempt's ``(outcome, cleanup)``, started, when this one's ending is
        one a restart may cure, restarts are left and ``deadline`` (``timeout=``, which
        bounds the whole run) has not passed; else None. ``announce(cause, resume)``
        before its ranks start."""
        if self.start is None or len(self.attempts) >= self.most:
            return None
        if deadline is not None and time.monotonic() >= deadline:
            return None
        cause = retry_cause(outcome)
        if cause is None:
            return None
        return self.start(list(self.points), lambda resume: announce(cause, resume))

    def record(self, cause: str, step: int | None, resume: str | None) -> Attempt:
        attempt = Attempt(len(self.attempts) + 1, cause, step, resume)
        self.attempts.append(attempt)
        return attempt


def collective_timeout(timeout: float | None, max_restarts: int) -> float:
    """Seconds a rank's collective may wait before its process group ends it (the
    group's timeout). 600 s (torch's NCCL default) with no ``timeout=``; within one, a
    share that leaves the restarts their time: ``timeout / (max_restarts + 1)``, at least
    60 s (a first collective behind a slow model build or an evaluation on rank 0 is not
    a hang) and at most 600 s. Without restarts, ``timeout=`` itself (at least 60 s): the
    run's own timeout then says where each rank was."""
    if not timeout:
        return 600.0
    if not max_restarts:
        return max(60.0, timeout)
    return min(600.0, max(60.0, timeout / (max_restarts + 1)))


def retry_cause(outcome: Outcome) -> str | None:
    """Why the attempt's ranks ended, when a restart may cure it; None otherwise."""
    if outcome.crash is not None or outcome.teardown_cause not in (None, Teardown.FAILURE):
        return None  # stopped, timed out (timeout= bounds the whole run), or watched only
    root = outcome.root_failure()
    if root is None or root.ending not in RETRIED:
        return None
    said = first_line(root.message)  # rank first, once
    return said if said.startswith(f"rank {root.rank} ") else f"rank {root.rank}: {said}"


def history_text(attempts: list[Attempt]) -> str:
    """The attempts before the last, for the run's error and summary."""
    if not attempts:
        return ""
    n = len(attempts)
    return (f"The run was restarted {n} time{'s' if n > 1 else ''}:\n"
            + "\n".join(f"  {a}" for a in attempts))
