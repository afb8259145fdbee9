"""One command on a ``RankPool``'s ranks, followed from a kernel thread: ``PoolOp``, a
``Follower`` (``supervisor.py``) that ends when every rank it asked has replied instead of
exited, and the error a failed cell raises (``RankCellError``).

Teardown differs from a one-shot run's. A failure, a stop (an interrupt) or the
deadline first asks the ranks still busy where they are (their stacks, as a one-shot
run's supervisor does), then sends them SIGINT, again every ``RESEND_S``. A rank stuck in
a collective sits in a native wait that holds off Python's signal handlers. On CPU ranks
that is seen, not waited out: a busy rank that sleeps without using the CPU for
``STUCK_S`` after a failure is interrupted at once, and one that still does ``STUCK_S``
after the interrupt is stuck (a rank in Python code answers within milliseconds; a
collective that moves data, or a long op, uses the CPU). A stuck CPU rank is freed by its
peers: the idle ranks drop the process group (gloo's wait then fails at once), and the
pool starts a new group once every rank replied (``PoolChannel.finish``); names on the
ranks are kept. Only ranks that no idle peer can free (all stuck), or that stay busy
``FREE_S`` after, get the whole pool ended; on GPU ranks (NCCL waits on the device, and
a peer's leaving does not end them), and where /proc is missing, those that do not
answer within ``INTERRUPT_GRACE_S``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from ...errors import WorkerError, cell_names
from ...wire import first_line, label
from ..following.failures import Failure, exit_failure
from ..following.supervisor import STACKS_S, Follower
from ..following.watch import RankState
from ..starting.launcher import WorkerHandle

INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long busy ranks get to reply
RESEND_S = 0.25  # SIGINT again to ranks that have not replied yet
# After one rank failed, how long the others get to finish before they are interrupted
# (those waiting for it in a collective never would).
FAILED_RANK_GRACE_S = 1.0
# A busy CPU rank asleep this long without CPU time is waiting in native code.
STUCK_S = 0.3
# After the idle ranks dropped the process group, how long the stuck ones get to reply
# (gloo fails their wait within milliseconds; then their own code unwinds).
FREE_S = 2.0


class RankCellError(WorkerError):
    """A ``%%ranks`` cell (or a pull/push) failed on one or more ranks.

    ``failures`` maps each failing rank to its ``(type, message, traceback)``."""

    def __init__(self, failures: dict[int, tuple[str, str, str]], note: str = ""):
        self.failures = dict(failures)
        first = min(failures)
        exc_type, message, _ = failures[first]
        tracebacks = "\n".join(label(tb or f"{t}: {m}\n", r)
                               for r, (t, m, tb) in sorted(failures.items()))
        others = [f"rank {r}: also failed with {t}: {first_line(m)}"
                  for r, (t, m, _) in sorted(failures.items()) if r != first]
        super().__init__(first, exc_type, message, tracebacks, others, note)

    def __reduce__(self):
        return (type(self), (self.failures, self.hint))


class PoolOp(Follower):
    """One command on some of the pool's ranks, followed until each of them replied.

    A failure, a stop or the deadline first asks the ranks still busy for their stacks
    (each one's ``where``), then interrupts them. Ranks that do not answer and are seen
    asleep without CPU time (CPU ranks, ``watch_cpu``) are freed by their idle peers
    (``drop_group(busy ranks)`` sends each live idle rank not yet told ``DropGroup`` and
    returns those it told; ``dropped``: all it told). Ranks no peer frees, or that do not
    answer (within ``INTERRUPT_GRACE_S`` where nothing is watched) get the whole pool
    ended (``kill_pool``). The ranks and their pipes stay the pool's."""

    thread_name = "nbtrain-pool-op"
    owns_ranks = False

    def __init__(self, handles: list[WorkerHandle], emit, deadline: float | None,
                 kill_pool: Callable[[], None], join: bool = False, watch_cpu: bool = False,
                 drop_group: Callable[[set[int]], set[int]] | None = None):
        super().__init__(handles, emit, deadline, join)
        self._kill_pool = kill_pool
        # CPU ranks only: a GPU rank can sleep in a long device sync and still answer.
        self._quiet = Quiet() if watch_cpu else None
        self._drop_group = drop_group if watch_cpu else None
        self.stuck = False  # the killed (or freed) ranks were seen asleep, not only late
        self.freed: list[int] = []  # stuck ranks whose peers dropped the group to free them
        self.dropped: set[int] = set()  # the ranks told to drop it (then: start it again)
        self._freeing_at: float | None = None
        self.regrouped = ""  # what the channel says once it started a new group
        self.interrupted_at: float | None = None
        self._stacks_asked_at: float | None = None
        self._sigint_at = 0.0
        self.killed: list[int] = []  # ranks that did not answer the interrupt
        self.died: list[int] = []  # ranks that ended before the pool ended them

    @property
    def interrupted(self) -> list[int]:
        """The ranks it interrupted (busy when the teardown began)."""
        return sorted(self.watch.interrupted)

    @property
    def pool_broken(self) -> bool:
        return bool(self.killed) or any(w.exitcode is not None for w in self.workers.values())

    def follow(self) -> None:
        watch = self.watch
        now = time.monotonic()
        # A rank that replied as it was asked still writes its stack: read it here, not
        # in the next command's cell.
        while (watch.alive() if self.killed else watch.busy()) or self._stacks_due(now):
            self.notice(now)
            self._advance(now)
            for w in watch.wait(self.timeout(now)):
                self._exited(w)
            now = time.monotonic()
        self.watch.read_stacks()
        watch.drain_available()
        for r in self.freed:  # what their wait raised as the peers left is ours, not theirs
            failure = self.workers[r].failure
            if failure is not None:
                failure.stopped = failure.secondary = True

    def _advance(self, now: float) -> None:
        watch = self.watch
        if self.teardown_cause is None:
            failures = watch.failures
            failed = bool(failures) and (now - failures[0].t >= FAILED_RANK_GRACE_S
                                         or self._asleep(now))
            if self.teardown_due(now, failed):
                self._stacks_asked_at = now  # where each is, before the interrupt moves it
                watch.ask_stacks(watch.busy())
        if self.interrupted_at is None:
            if self.teardown_cause is not None and not self._stacks_due(now):
                self.watch.read_stacks()
                self.interrupted_at = now
                watch.interrupted.update(w.rank for w in watch.busy())
                self._interrupt(now)
        elif not self.killed and watch.busy():
            waited = now - self.interrupted_at
            stuck = waited >= STUCK_S and self._asleep(now)
            if stuck and self._freeing_at is None and self._drop_group is not None:
                self.stuck, self._freeing_at = True, now
                self.freed = [w.rank for w in watch.busy()]
            if self._freeing_at is not None:
                # each pass: a rank freed in turn may hold up the next
                self.dropped |= self._drop_group({w.rank for w in watch.busy()})
                if not self.dropped or now - self._freeing_at >= FREE_S:
                    self._kill()
            elif waited >= INTERRUPT_GRACE_S or stuck:
                self.stuck = waited < INTERRUPT_GRACE_S
                self._kill()
            elif now - self._sigint_at >= RESEND_S:
                self._interrupt(now)

    def _kill(self) -> None:
        self.killed = [w.rank for w in self.watch.busy()]
        self._kill_pool()

    def _stacks_due(self, now: float) -> bool:
        """Whether stacks were asked for, and some are still to come (within STACKS_S)."""
        asked = self._stacks_asked_at
        return asked is not None and not self.watch.stacks_read() and now - asked < STACKS_S

    def _asleep(self, now: float) -> bool:
        """Whether every busy rank has slept without CPU time for ``STUCK_S``. Asked on
        every pass once a rank failed or a teardown began, and only then: the watch
        costs a /proc read per busy rank."""
        if self._quiet is None:
            return False
        quiet = [self._quiet.observe(w.handle.pid, now) for w in self.watch.busy()]
        return bool(quiet) and min(quiet) >= STUCK_S

    def _interrupt(self, now: float) -> None:
        """SIGINT to the ranks still busy. Sent again every RESEND_S: a rank ignores it
        between commands, so one that arrived before the rank began the command is lost."""
        self._sigint_at = now
        for w in self.watch.busy():
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.handle.pid, signal.SIGINT)

    def _exited(self, w: RankState) -> None:
        if self.killed:
            return  # we ended it
        self.died.append(w.rank)
        if w.failure is None:
            w.failure = exit_failure(w.rank, w.exitcode, w.handle.exit_hint)


class Quiet:
    """How long each process has slept without CPU time, from ``/proc/<pid>/stat``: its
    main thread's state, and the CPU ticks of all its threads. A process counts as quiet
    while its main thread is asleep (``S``) and the whole process used under a tenth of
    the time since it went quiet (torch's gloo thread polls a few times a second)."""

    TICK_S = 1 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)

    def __init__(self, read=None):
        self._read = read or _stat
        self._since: dict[int, tuple[float, int]] = {}  # pid -> (quiet since, ticks then)

    def observe(self, pid: int, now: float) -> float:
        """Seconds ``pid`` has been quiet (0.0 while it works, or without /proc)."""
        got = self._read(pid)
        if got is None:
            self._since.pop(pid, None)
            return 0.0
        state, ticks = got
        since = self._since.get(pid)
        if since is not None and state == "S" and \
                ticks - since[1] <= 1 + 0.1 * (now - since[0]) / self.TICK_S:
            return now - since[0]
        self._since[pid] = (now, ticks)
        return 0.0


def _stat(pid: int) -> tuple[str, int] | None:
    """(main thread's state, user + system CPU ticks of the process), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def cell_error(failures: dict[int, Failure], note: str) -> RankCellError:
    hints = {f.hint for f in failures.values() if f.hint}
    return RankCellError({r: (f.exc_type, f.message, cell_names(f.traceback))
                          for r, f in sorted(failures.items())},
                         "\n".join([*sorted(hints), note]).strip())
