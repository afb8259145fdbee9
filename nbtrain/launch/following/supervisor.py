"""The thread that follows a run's ranks and what ``Run`` reads as its outcome:
``Follower``, around a ``Watch`` (``watch.py``, what arrives from the ranks). Its kinds
say when and how ranks are ended: a one-shot run's ``Supervisor`` here (the first failure
ends every rank, SIGTERM then SIGKILL, and everything started is reaped) and a pool
command's ``PoolOp`` (``pool_op.py``: busy ranks are interrupted; only ranks that do not
answer end the pool)."""

from __future__ import annotations

import signal
import threading
import time

from ...outcome import Teardown
from ...wire import Activity
from ..starting.launcher import WorkerHandle
from .failures import Failure, exit_failure
from .watch import RankState, Watch

FAILURE_GRACE_S = 0.25  # after a first failure, wait this long for the root cause to report
TERM_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long
DRAIN_S = 1.0  # after exits, how long to wait for the last output lines
STACKS_S = 0.5  # at most this long for the ranks still running to write their stacks


class Follower:
    """A thread that follows a ``Watch`` until its ranks are done: what ``Run`` reads as
    the outcome (``outcome.Outcome``). Its kinds say, in ``follow()``, when ranks end."""

    thread_name = "nbtrain-follower"
    owns_ranks = True  # ends, reaps and closes the ranks when done

    def __init__(self, handles: list[WorkerHandle], emit, deadline: float | None, join: bool):
        self.watch = Watch(handles, emit, join)
        self.deadline = deadline
        self.teardown_cause: Teardown | None = None  # FAILURE, STOP or TIMEOUT
        self.stop_reason: str | None = None
        self.timed_out_ranks: list[int] = []
        self.crash: BaseException | None = None
        self.stop_requested: str | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._main, name=self.thread_name, daemon=True)

    @property
    def workers(self) -> dict[int, RankState]:
        return self.watch.workers

    @property
    def failures(self) -> list[Failure]:
        return self.watch.failures

    def root_failure(self) -> Failure | None:
        return self.watch.root_failure()

    @property
    def note(self) -> str | None:
        """What the run should say when it ends well (each rank trained alone)."""
        activities = {r: w.activity for r, w in self.workers.items() if w.activity is not None}
        return trained_alone(activities, len(self.workers))

    def start(self) -> None:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def request_stop(self, reason: str) -> None:
        self.stop_requested = reason
        self.watch.wake()

    def follow(self) -> None:
        raise NotImplementedError

    def _main(self) -> None:
        try:
            self.follow()
        except BaseException as err:  # a bug here must still end the workers and the wait
            self.crash = err
            raise
        finally:
            self.watch.close(end_ranks=self.owns_ranks)
            self.done.set()

    def notice(self, now: float) -> None:
        """Name ranks that do not join or lag behind (not once ranks are being ended)."""
        if self.teardown_cause is None:
            self.watch.notice(now)

    def teardown_due(self, now: float, failed: bool) -> bool:
        """Decide (once) whether to end now: a stop asked for, the deadline passed, or
        ``failed``; sets ``teardown_cause`` and returns True when so."""
        if self.stop_requested:
            self.teardown_cause, self.stop_reason = Teardown.STOP, self.stop_requested
        elif self.deadline is not None and now >= self.deadline:
            self.teardown_cause = Teardown.TIMEOUT
            self.timed_out_ranks = [w.rank for w in self.watch.busy()]
        elif failed:
            self.teardown_cause = Teardown.FAILURE
        return self.teardown_cause is not None

    def timeout(self, now: float) -> float:
        """How long the next ``watch.wait`` may take."""
        timeout = 0.05 if (self.teardown_cause or self.watch.failures) else 0.5
        if self.deadline is not None and self.teardown_cause is None:
            timeout = max(0.0, min(timeout, self.deadline - now))
        return timeout


class Supervisor(Follower):
    """Follows a launcher's ranks until all have exited; ``Run`` reads the outcome when
    ``done`` is set."""

    thread_name = "nbtrain-supervisor"

    def __init__(self, handles: list[WorkerHandle], emit, deadline: float | None,
                 join: bool = True):
        super().__init__(handles, emit, deadline, join)

    def follow(self) -> None:
        watch = self.watch
        term_sent_at: float | None = None
        stacks_asked_at: float | None = None
        while watch.alive():
            now = time.monotonic()
            self.notice(now)
            if self.teardown_cause is None:
                self.teardown_due(now, self._failed(now))
            if self.teardown_cause is not None and term_sent_at is None:
                if stacks_asked_at is None:
                    # where the ranks still running are, for the error or the stop (a
                    # collective one rank ran alone, a hang): their stacks, then the end
                    stacks_asked_at = now
                    watch.ask_stacks(watch.busy())
                if stacks_asked_at is None or watch.stacks_read() or \
                        now - stacks_asked_at >= STACKS_S:
                    watch.signal_alive(signal.SIGTERM)
                    term_sent_at = now
            elif term_sent_at is not None and now - term_sent_at > TERM_GRACE_S:
                watch.signal_alive(signal.SIGKILL)
            for w in watch.wait(self.timeout(now)):
                self._exited(w)
        watch.drain_to_end(DRAIN_S)
        watch.conclude()

    def _failed(self, now: float) -> bool:
        """A rank failed, and its root cause had time to report: a communication error is
        usually another rank's death seen from afar."""
        failures = self.watch.failures
        if not failures:
            return False
        return not self.watch.root_failure().secondary or now - failures[0].t >= FAILURE_GRACE_S

    def _exited(self, w: RankState) -> None:
        if w.failure or w.result is not None or self.teardown_cause in (Teardown.STOP, Teardown.TIMEOUT):
            return
        if self.teardown_cause is Teardown.FAILURE and w.exitcode < 0:
            return  # we ended it
        w.failure = exit_failure(w.rank, w.exitcode, w.handle.exit_hint)


def trained_alone(activities: dict[int, Activity], world_size: int) -> str | None:
    """The warning for a run whose ranks all took optimizer steps and none took part in
    a collective of the run's group; None otherwise."""
    if world_size < 2 or len(activities) < world_size:
        return None
    if all(a.optimizer_steps > 0 and a.collectives == 0 for a in activities.values()):
        return ("nbtrain: each rank trained alone: every rank took optimizer steps and none "
                f"took part in a collective of the run's {world_size}-rank process group, so "
                f"these are {world_size} separate trainings on the same data, not one. A "
                "framework that saw one device does this: Lightning's Trainer(devices='auto') "
                "or devices=1 on CPU (give devices=WORLD_SIZE and strategy='ddp'), or code "
                "that made its own single-process setup.")
    return None
