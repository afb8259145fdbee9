"""Ranks that are late, seen by a ``Watch`` on each pass of its follower: ``Late``.

A rank that has not joined its process group ``JOIN_TIMEOUT_S`` after the start fails
the start, with the stack it was waiting in (a fork once copied a held lock into a rank,
which then waited forever; see rank/worker.py). A rank still running ``STRAGGLER_S``
after another returned is named in the cell, once, with the line it is at: a silent wait
looks like a hang (a collective the others left, NCCL's usually; or uneven work). Both
ask the rank for its Python stack (SIGUSR1: faulthandler writes it to its stderr, which
the watch keeps in ``RankState.stack`` until it is read, ``release_stack``).
"""

from __future__ import annotations

import time

from ...errors import cell_names
from ...outcome import Ending
from .failures import Failure
from .stacks import Dump

# Generous: spawn imports torch in every rank and NCCL's first communicator takes seconds
# on 8 GPUs.
JOIN_TIMEOUT_S = 120.0
STACK_WAIT_S = 1.0  # after SIGUSR1, how long a late rank gets to write its stack
STRAGGLER_S = 30.0


class Late:
    """When ranks are late, and what was asked of them. ``join``: the ranks are starting
    their process group (a one-shot run's, a pool's start)."""

    def __init__(self, join: bool):
        self.join_deadline = time.monotonic() + JOIN_TIMEOUT_S if join else None
        self._joiners_asked_at: float | None = None
        self.first_result_at: float | None = None
        self._stragglers_asked_at: float | None = None
        self._stragglers: dict[int, str] = {}  # rank -> its line, until its stack is read

    def returned(self, now: float) -> None:
        if self.first_result_at is None:
            self.first_result_at = now

    def notice(self, watch, now: float) -> None:
        """Name late joiners and stragglers (``watch``: the ``Watch`` that asks)."""
        self._check_joined(watch, now)
        self._name_stragglers(watch, now)

    def _check_joined(self, watch, now: float) -> None:
        """Past the join deadline, ask the ranks that have not joined where they are, then
        fail them with it."""
        if self.join_deadline is None or now < self.join_deadline:
            return
        late = [w for w in watch.workers.values()
                if not w.joined and w.exitcode is None and w.failure is None]
        if not late:
            self.join_deadline = None
            return
        if self._joiners_asked_at is None:
            self._joiners_asked_at = now
            watch.ask_stacks(late)
            return
        if now - self._joiners_asked_at < STACK_WAIT_S:
            return
        joined = [r for r, w in watch.workers.items() if w.joined]
        missing = [w.rank for w in late if not w.at_store]
        for w in late:
            stack = "\n".join(w.stack or []) or "(it printed no stack)"
            if w.at_store and missing:  # waiting in the group's start for those
                message = (f"rank {w.rank} waited in the process group's start for rank"
                           f"{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))}")
            else:
                message = (f"rank {w.rank} did not join the process group within "
                           f"{JOIN_TIMEOUT_S:g} s of the start (joined: "
                           f"{', '.join(map(str, joined)) or 'none'}); where it waits:")
            w.failure = Failure(
                w.rank, "StartTimeout", message, stack, now,
                secondary=w.at_store and bool(missing), ending=Ending.NEVER_JOINED,
                hint="The start was ended; nothing of your function ran. Launch again. If a "
                     "start hangs again, the stack above says where: please report it with "
                     "that stack.")
            w.stack = None  # all it wrote is in its failure
        self.join_deadline = None

    def _name_stragglers(self, watch, now: float) -> None:
        """``STRAGGLER_S`` after the first result, ask each rank still running for its
        stack; once it is written (or ``STACK_WAIT_S`` passed), name the rank in the cell
        with the frames of its function's thread, as a traceback shows them."""
        if self._stragglers_asked_at is None:
            if self.first_result_at is None or now - self.first_result_at < STRAGGLER_S:
                return
            self._stragglers_asked_at = now
            done = [r for r, w in watch.workers.items() if w.result is not None]
            busy = watch.busy()
            self._stragglers = {
                w.rank: f"nbtrain: rank {w.rank} is still running "
                        f"{now - self.first_result_at:.0f} s after rank"
                        f"{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} "
                        "returned; where it is now:" for w in busy}
            watch.ask_stacks(busy)
        waited = now - self._stragglers_asked_at >= STACK_WAIT_S
        for rank, line in list(self._stragglers.items()):
            w = watch.workers[rank]
            if w.stack is None or w.exitcode is not None:  # ended meanwhile
                del self._stragglers[rank]
                continue
            if not (waited or Dump.parse(w.stack).complete()):
                continue
            del self._stragglers[rank]
            dump, lines = watch.release_stack(w)
            frames = dump.traceback().partition("\n")[2]  # without "Traceback (...):"
            watch.emit(rank, "err", line)  # its function's frames; else all it wrote
            for text in (cell_names(frames).splitlines() if frames else lines):
                watch.emit(rank, "err", text)
