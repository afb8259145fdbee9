"""A ``RankPool``'s command channel: one command at a time, sent to some of its warm ranks
and followed by a ``PoolOp`` until each replied. The workers themselves (started, ended,
restarted) are the pool's lifecycle, ``PoolWorkers`` in ``pool.py``; this side only asks
it to start them, or to end them when a command found a rank dead or stuck beyond help.
A CPU rank stuck in a collective its peers are not in is freed by them (they drop the
process group, ``PoolOp``); after that command every rank starts a new group here."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from ...cells import busy_while_blocking
from ...errors import RunTimeoutError, places_of, where_text
from ...outcome import Teardown
from ...output import CellOutput
from ...questions import answer_waiting
from ...wire import Command, DropGroup, Regroup, encode_command
from ..following.links import links
from ..starting.launcher import interrupts_deferred
from .op import INTERRUPT_GRACE_S, STUCK_S, PoolOp, cell_error

REGROUP_S = 30.0  # at most this long for the ranks to start a new process group


class PoolChannel:
    """Sends commands to a pool's workers and follows each; what runs now is ``busy``
    (``"cell"``, ``"launch"``, ...), claimed before a command goes out."""

    def __init__(self, workers: Any):  # pool.PoolWorkers (pool.py builds this; no import back)
        self.workers = workers
        self.busy: str | None = None
        self.op: PoolOp | None = None  # the last command's
        self._lock = threading.Lock()

    # -- one command at a time -----------------------------------------------------------
    def claim(self, what: str) -> None:
        """Mark the pool busy with ``what``; a RuntimeError if it is busy already."""
        with self._lock:
            if self.busy is not None:
                raise RuntimeError(f"the pool is busy ({self.busy}); wait for it to finish "
                                   "or stop it (run.stop()) first.")
            self.busy = what

    def release(self) -> None:
        self.busy = None

    @contextlib.contextmanager
    def claimed(self, what: str):
        self.claim(what)
        try:
            yield
        finally:
            self.release()

    def settle(self, within: float = 5.0) -> None:
        """A run whose ranks are done may still be closing its telemetry (an interrupted
        launch raises as soon as the ranks stopped): the next launch waits for that
        instead of calling the pool busy."""
        op = self.op
        if self.busy is None or op is None or not op.done.is_set():
            return
        deadline = time.monotonic() + within
        while self.busy is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def wait_idle(self, within: float) -> None:
        """Stop a command still running (a background run) and wait until none is."""
        op = self.op
        if op is not None and not op.done.is_set():
            op.request_stop("the pool is closing")
            op.done.wait(INTERRUPT_GRACE_S + 5)
        deadline = time.monotonic() + within
        while self.busy is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the run's own cleanup (its listener, a teardown) finishes

    def heal(self) -> None:
        """Before a command: workers that were ended, or a rank that died since the last
        command (the OOM killer, a kill), are replaced by new ones, with one line saying
        why, so the command runs (names defined in earlier ``%%ranks`` cells are gone)."""
        dead = self.workers.dead()
        if dead:
            op = self.begin(dead, None, None)  # reaps them and names how each ended
            op.done.wait()
            self.finish(op)  # ends the workers, saying which rank died and how
        self.workers.ensure_started(self)

    # -- sending and following -----------------------------------------------------------
    def begin(self, ranks: list[int], command: Command | None, deadline: float | None,
              emit=None, join: bool = False) -> PoolOp:
        """Send ``command`` to ``ranks`` and start following them (no command: wait for
        what they send unasked, the start's READY; ``join``: they are starting their
        process group)."""
        workers = self.workers
        handles = [workers.handles[r] for r in ranks]
        op = PoolOp(handles, emit or _writer(), deadline, workers.kill_all, join,
                    watch_cpu=workers.plan.accelerator == "cpu",
                    drop_group=None if join else self._dropper())
        if command is not None:
            for h in handles:
                try:
                    h.commands.send_bytes(encode_command(command))
                except OSError:  # it died; the op sees its exit and reports it
                    pass
        self.op = op
        op.start()
        return op

    def _dropper(self):
        """A command's ``drop_group``: ``DropGroup`` to each live rank of the pool that is
        not busy (idle in its command loop) and was not told yet, with the connections it
        has to the other ranks; returns those told now."""
        told: set[int] = set()

        def drop_group(busy: set[int]) -> set[int]:
            handles = [h for h in self.workers.handles if h.process.exitcode is None]
            idle = [h for h in handles if h.rank not in busy and h.rank not in told]
            fds = links({h.rank: h.pid for h in handles}) if idle else {}
            for h in idle:
                with contextlib.suppress(OSError):  # it died: the op sees its exit
                    h.commands.send_bytes(encode_command(DropGroup(fds.get(h.rank, ()))))
                    told.add(h.rank)
            return {h.rank for h in idle} & told

        return drop_group

    def _regroup(self, op: PoolOp) -> None:
        """After peers dropped the process group to free ``op.freed``: every rank starts a
        new one (their names are kept); if that fails, the workers are ended."""
        again = self.begin(list(range(self.workers.plan.world_size)), Regroup(),
                           time.monotonic() + REGROUP_S, _quieter(_writer()), join=True)
        try:
            while not again.done.wait(0.05):
                pass
        except KeyboardInterrupt:  # the pool is not left half started
            self.interrupt_and_wait(again)
            self.workers.end("interrupted while its process group started again")
            raise KeyboardInterrupt(self.workers.ended_note()) from None
        failed = [f"rank {f.rank}: {f.exc_type}: {f.message}" for f in again.failures]
        if again.crash or again.pool_broken or again.teardown_cause or failed:
            self.workers.end("its process group could not be started again after freeing "
                             f"a stuck rank ({'; '.join(failed) or again.teardown_cause.value})")
            return
        ranks = ", ".join(map(str, op.freed))
        s = "s" if len(op.freed) > 1 else ""
        op.regrouped = (
            f"rank{s} {ranks} {'were' if s else 'was'} stuck in a collective the other "
            f"ranks never joined; the pool freed {'them' if s else 'it'} by starting its "
            "process group again.")

    def note(self, op: PoolOp, cells: bool = False) -> str:
        """What a command's error adds: the workers were ended, or the group restarted
        (``cells``: what that means for the names cells made)."""
        return self.workers.ended_note() or op.regrouped and (op.regrouped + (
            " Names on the ranks are kept; build again what was built on the old group "
            "(a DDP or FSDP model, dist.new_group groups)." if cells else ""))

    def finish(self, op: PoolOp) -> None:
        """After a command: end the workers if a rank died or stayed stuck; start a new
        process group if peers dropped theirs to free a stuck rank."""
        op.done.wait()
        if op.crash is not None:
            self.workers.end(f"nbtrain's pool supervisor failed: {op.crash!r}")
        elif op.pool_broken:
            parts = []
            if op.died:
                parts.append(", ".join(f"rank {r} died ({op.workers[r].failure.exc_type})"
                                       if op.workers[r].failure else f"rank {r} died"
                                       for r in op.died))
            if op.killed:
                how = (f"and slept without CPU time for {STUCK_S:g}s" if op.stuck
                       else f"within {INTERRUPT_GRACE_S:g}s")
                parts.append(f"rank{'s' if len(op.killed) > 1 else ''} "
                             f"{', '.join(map(str, op.killed))} did not answer an interrupt "
                             f"{how} (stuck in a collective?)")
            self.workers.end("; ".join(parts))
        elif op.dropped:
            self._regroup(op)

    def wait(self, op: PoolOp) -> None:
        """Wait in the cell; an interrupt interrupts the ranks (and, if stuck, the pool)."""
        try:
            with busy_while_blocking():
                while not op.done.wait(0.05):
                    answer_waiting()  # a rank's input(), a debugger's prompt
        except KeyboardInterrupt:
            self.interrupt_and_wait(op)
            raise

    @staticmethod
    def interrupt_and_wait(op: PoolOp) -> None:
        op.request_stop("interrupted")
        while True:  # a second interrupt does not cut the teardown short
            try:
                if op.done.wait(0.05):
                    break
            except KeyboardInterrupt:
                pass

    def command(self, ranks: list[int], command: Command, what: str,
                timeout: float | None = None) -> PoolOp:
        """Run one command on ``ranks`` in the foreground; raise what failed."""
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        with self.claimed(what):
            self.heal()
            deadline = time.monotonic() + timeout if timeout else None
            op, interrupted = None, False
            try:
                # An interrupt while the command goes out is taken once it is out: the
                # ranks are then interrupted as they would be a moment later.
                with interrupts_deferred():
                    op = self.begin(ranks, command, deadline)
                self.wait(op)
            except KeyboardInterrupt:
                if op is None:
                    raise
                interrupted = True
                if not op.done.is_set():
                    self.interrupt_and_wait(op)
            self.finish(op)
        ended, note = self.workers.ended_note(), self.note(op, cells=True)
        # a freed rank's failure (its wait failed as its peers left) is not the cell's
        failures = {r: w.failure for r, w in op.workers.items()
                    if w.failure and not w.failure.stopped}
        at = places_of(op.workers)  # where the busy ranks were when it was torn down
        if interrupted and (op.interrupted or not failures):
            if not op.interrupted:  # every rank had replied before the interrupt
                raise KeyboardInterrupt(note)
            raise KeyboardInterrupt("\n".join(filter(None, [
                ended or f"interrupted on rank(s) {op.interrupted}; the pool is still usable",
                not ended and note, where_text({r: at[r] for r in op.interrupted})])))
        if op.teardown_cause is Teardown.TIMEOUT:
            err = RunTimeoutError(timeout, op.timed_out_ranks,
                                  [r for r in ranks if r not in op.timed_out_ranks],
                                  {r: at[r] for r in op.timed_out_ranks})
            err.hint = (err.hint + "\n" + note).strip()
            err.args = (err._text(),)
            raise err
        if failures:  # where the ranks it ended were (the others' tracebacks say it)
            raise cell_error(failures, "\n".join(filter(None, [
                note, where_text({r: at[r] for r in [*op.killed, *op.freed]})])))
        return op


def _quieter(emit):
    """What ranks write while their group starts again goes to stderr: it is not the
    cell's output (gloo's line saying so never reaches here: the watch drops it)."""
    def quieter(rank: int, stream: str, line: str) -> None:
        emit(rank, "err" if stream == "out" else stream, line)

    return quieter


def _writer():
    return CellOutput().write
