"""What a kernel thread sees of a set of ranks: ``Watch``, one selector over each rank's
exit sentinel, control pipe (result, failure, store port, activity), stdout and stderr,
and a wake-up pipe. It decodes what arrives into each rank's ``RankState``, names ranks
that do not join or lag behind (``late.py``), and reaps the ones that exit. It decides
nothing about ending them: that is the ``Follower`` around it (``supervisor.py``) and its
kinds.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import time
from collections import deque
from dataclasses import dataclass, field

from ...outcome import Ending, Frame
from ...questions import Question, post, question_in
from ...wire import (
    ACTIVITY,
    AT_STORE,
    FAILURE,
    JOINED,
    STORE,
    Activity,
    decode_activity,
    decode_failure,
)
from ..starting.launcher import WorkerHandle
from .failures import Failure, explain_alone, reported_failure, with_stack
from .late import Late
from .pipes import GLOO_START, PipeText
from .stacks import FATAL, Dump, dump_within, in_dump

UNENDED_S = 0.5  # an unended line stood this long shows (``PipeText.waiting``)


@dataclass
class RankState:
    """One rank as its watch has seen it so far."""

    handle: WorkerHandle
    exitcode: int | None = None
    result: bytes | None = None
    failure: Failure | None = None
    control_open: bool = True
    at_store: bool = False  # it reached rank 0's store (wire.AT_STORE)
    joined: bool = False  # its process group is up (wire.JOINED)
    stack: list[str] | None = None  # stderr lines since it was asked for its stack
    tail: bool = False  # its stack was read before the dump's last lines came: drop them
    dying: list[str] | None = None  # the stack it wrote as it died in native code
    last_err: deque[str] = field(default_factory=lambda: deque(maxlen=8))  # before that
    where: Frame | None = None  # where its function was when it was ended (if asked)
    activity: Activity | None = None  # what its function did
    pipes: dict[str, PipeText] = field(
        default_factory=lambda: {"out": PipeText("out"), "err": PipeText("err")})

    @property
    def rank(self) -> int:
        return self.handle.rank

    @property
    def busy(self) -> bool:
        """Alive, and neither replied nor failed yet."""
        return self.exitcode is None and self.result is None and self.failure is None


class Watch:
    """The ranks of one run or command: everything they send, seen from one selector.

    ``emit(rank, "out" | "err", line)`` receives their output line by line. ``join``:
    they are starting their process group, so rank 0's store port is relayed and ranks
    not joined within ``late.JOIN_TIMEOUT_S`` are named. A KeyboardInterrupt from a rank
    in ``interrupted`` (the follower sent it) is not a root cause."""

    def __init__(self, handles: list[WorkerHandle], emit, join: bool):
        self.workers = {h.rank: RankState(h) for h in handles}
        self.emit = emit
        self.late = Late(join)
        self.interrupted: set[int] = set()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._registered = False

    # -- what it has seen ----------------------------------------------------------------
    @property
    def failures(self) -> list[Failure]:
        return sorted((w.failure for w in self.workers.values() if w.failure), key=lambda f: f.t)

    def root_failure(self) -> Failure | None:
        failures = self.failures
        primary = [f for f in failures if not f.secondary]
        return (primary or failures or [None])[0]

    def busy(self) -> list[RankState]:
        return [w for w in self.workers.values() if w.busy]

    def alive(self) -> list[RankState]:
        return [w for w in self.workers.values() if w.exitcode is None]

    # -- waiting -------------------------------------------------------------------------
    def wake(self) -> None:
        """Cut the current ``wait`` short (a stop was asked for)."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def wait(self, timeout: float) -> list[RankState]:
        """Read what arrives within ``timeout``; returns the ranks that exited (reaped)."""
        if not self._registered:
            self._register()
        exited = []
        for key, _ in self._sel.select(timeout):
            what, w = key.data
            if what == "wake":
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 1024)
            elif what == "control":
                self.read_control(w)
            elif what in ("out", "err"):
                self.read_output(w, what)
            elif what == "exit" and self._reap(w):
                exited.append(w)
        self._show_unended(time.monotonic())
        return exited

    def _show_unended(self, now: float) -> None:
        """A line a rank began and has not ended for ``UNENDED_S`` shows, as a bar does."""
        for w in self.workers.values():
            if w.stack is None and w.dying is None:
                for stream, pipe in w.pipes.items():
                    if pipe.since is not None and \
                            (shown := pipe.waiting(now, UNENDED_S)) is not None:
                        self.emit(w.rank, stream + "-live", shown)

    def _register(self) -> None:
        sel, self._registered = self._sel, True
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        for w in self.workers.values():
            h = w.handle
            sel.register(h.process.sentinel, selectors.EVENT_READ, ("exit", w))
            sel.register(h.control, selectors.EVENT_READ, ("control", w))
            for stream, conn in (("out", h.out), ("err", h.err)):
                os.set_blocking(conn.fileno(), False)
                sel.register(conn, selectors.EVENT_READ, (stream, w))

    def _forget(self, fileobj) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(fileobj)

    # -- ranks that do not join, or lag behind (late.py), and their stacks ---------------
    def notice(self, now: float) -> None:
        self.late.notice(self, now)

    def ask_stacks(self, ranks: list[RankState]) -> None:
        """SIGUSR1: each rank writes every thread's Python stack to its stderr, which is
        kept in ``stack`` from now on rather than shown."""
        for w in ranks:
            w.stack = []
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.handle.pid, signal.SIGUSR1)

    def stacks_read(self) -> bool:
        """Whether every rank asked for its stack has written its function's thread."""
        return all(Dump.parse(w.stack).complete() for w in self.workers.values()
                   if w.stack is not None and w.failure is None)

    def conclude(self) -> None:
        """Once every rank has ended and its last lines are read: where each rank asked
        for its stack (and not failed) was (``where``), and a communication error whose
        peers had all returned is explained (they left; it ran a collective they did
        not)."""
        self.read_stacks()
        failures = self.failures
        if len(failures) == 1:
            explain_alone(failures[0], [r for r, w in self.workers.items()
                                        if w.result is not None], len(self.workers))

    def read_stacks(self) -> None:
        """Each rank asked for its stack: where its function was (if it has not failed);
        what else it wrote meanwhile (a warning as it was ended) reaches the cell."""
        for w in self.workers.values():
            if w.stack is not None:
                failed = w.failure is not None
                dump, _ = self.release_stack(w)
                w.where = None if failed else dump.where()

    def release_stack(self, w: RankState) -> tuple[Dump, list[str]]:
        """The stack ``w`` was asked for (its dump, and the dump's lines); what else it
        wrote meanwhile goes to the cell now, and its stderr from now on."""
        lines, w.stack, w.tail = w.stack or [], None, True
        for line in lines:
            if not in_dump(line):
                self.emit(w.rank, "err", line)
        lines = [line for line in lines if in_dump(line)]
        return Dump.parse(lines), lines

    # -- reading -------------------------------------------------------------------------
    def read_control(self, w: RankState) -> None:
        if not w.control_open:
            return
        try:
            data = w.handle.control.recv_bytes()
        except (EOFError, OSError):
            self._forget(w.handle.control)
            w.control_open = False
            return
        tag = data[:1]
        if tag == STORE:  # rank 0's store is up: tell the others where
            for other in self.alive():
                if other is not w:
                    with contextlib.suppress(OSError):
                        other.handle.commands.send_bytes(data)
            return
        if tag == AT_STORE:
            w.at_store = True
            return
        if tag == JOINED:
            w.joined = True
            return
        try:
            if tag == ACTIVITY:
                w.activity = decode_activity(data)
            elif tag == FAILURE:
                w.failure = reported_failure(w.rank, decode_failure(data),
                                             w.rank in self.interrupted)
        except ValueError as err:  # not nbtrain's message: the rank's failure, said as such
            w.failure = Failure(w.rank, "MalformedMessage", str(err), "", time.monotonic(),
                                hint="nbtrain's rank and kernel disagree on the wire; are "
                                     "both the same nbtrain?", ending=Ending.MALFORMED)
        if tag in (ACTIVITY, FAILURE):
            return
        w.result = data
        self.late.returned(time.monotonic())

    def read_output(self, w: RankState, stream: str) -> bool:
        """Whatever the pipe holds now, emitted line by line; False at its end."""
        conn = w.handle.out if stream == "out" else w.handle.err
        try:
            data = os.read(conn.fileno(), 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self._forget(conn)
            self._flush_partial(w, stream)
            return False
        for kind, line in w.pipes[stream].feed(data):
            if kind == "display" and (asked := question_in(line)) is not None:
                self._ask(w, *asked)
                continue
            if kind != stream:  # a display record, a redrawn line: to the cell
                self.emit(w.rank, kind, line)
                continue
            self._line(w, stream, line)
        return True

    def _line(self, w: RankState, stream: str, line: str) -> None:
        """One line the rank wrote: to the cell, or, on stderr, to the stack it was asked
        for or the dump it wrote as it died."""
        if GLOO_START.match(line):
            return
        if stream == "err" and (start := dump_within(line)):  # a bar, then a dump
            self._line(w, stream, line[:start])
            line = line[start:]
        if stream == "err" and self._dying(w, line):
            return
        if stream == "err" and w.tail:
            if in_dump(line):
                return  # the rest of a stack already read (its outer frames)
            w.tail = False
        if w.stack is not None and stream == "err":  # its stack goes into its failure
            w.stack.append(line)
        else:
            if stream == "err":
                w.last_err.append(line)
            self.emit(w.rank, stream, line)

    def _ask(self, w: RankState, prompt: str, password: bool) -> None:
        """The rank waits for input: the cell that waits for it asks (``questions.py``)."""
        def reply(data: bytes) -> None:
            w.handle.commands.send_bytes(data)

        post(Question(w.rank, prompt, password, reply, lambda: w.exitcode is None),
             notice=lambda text: self.emit(w.rank, "err", text))

    def _dying(self, w: RankState, line: str) -> bool:
        """Whether a stderr line is kept for a death's dump (its failure's, ``_flush_all``);
        one the rank went on after, or another dump followed, was a child's: to the cell."""
        if line.startswith(FATAL):
            self._emit_dump(w)
            w.dying = [line]
        elif w.dying is not None and in_dump(line):
            w.dying.append(line)
        else:
            self._emit_dump(w)
            return False
        return True

    def _flush_partial(self, w: RankState, stream: str) -> None:
        """The line the rank had not ended (it was ended as it wrote it: a stack it was
        asked for, cut mid-line, is still its stack's, not the cell's)."""
        rest = w.pipes[stream].end()
        if rest:
            if stream == "err" and w.dying is not None:
                w.dying.append(rest)
            else:
                self._line(w, stream, rest)

    def drain_to_end(self, within: float) -> None:
        """Read the last lines, up to end-of-file (or ``within`` seconds, if something the
        rank started still holds its pipes), and what was sent last on control pipes."""
        end = time.monotonic() + within
        while time.monotonic() < end:
            if not any(k.data[0] in ("out", "err") for k in self._sel.get_map().values()):
                break
            for key, _ in self._sel.select(max(0.0, end - time.monotonic())):
                what, w = key.data
                if what in ("out", "err"):
                    self.read_output(w, what)
                elif what == "control":
                    self.read_control(w)
        self._flush_all()

    def drain_available(self) -> None:
        """Read what the pipes hold now and keep them open (a pool's ranks flush their
        output before they reply, so a command's lines are there)."""
        for w in self.workers.values():
            for stream in ("out", "err"):
                conn = w.handle.out if stream == "out" else w.handle.err
                while _readable(conn) and self.read_output(w, stream):
                    pass
        self._flush_all()

    def _flush_all(self) -> None:
        """Emit partial lines; the stack a rank wrote as it died goes into its failure
        (or, if it has none, to the cell, so nothing it said is lost)."""
        for w in self.workers.values():
            for stream in ("out", "err"):
                self._flush_partial(w, stream)
            if w.dying is None:
                continue
            native = with_stack(w.failure, w.exitcode, w.dying, list(w.last_err))
            if native is None:
                self._emit_dump(w)
            w.failure, w.dying = native or w.failure, None

    def _emit_dump(self, w: RankState) -> None:
        """A dump that was not the rank's death (nothing it wrote is lost)."""
        for line in w.dying or []:
            self.emit(w.rank, "err", line)
        w.dying = None

    # -- ending --------------------------------------------------------------------------
    def signal_alive(self, sig: int) -> None:
        for w in self.alive():
            kill_group(w.handle.pid, sig)

    def _reap(self, w: RankState) -> bool:
        """Reap a rank that exited and read what it sent last; False if already done."""
        h = w.handle
        if w.exitcode is not None:
            return False
        self._forget(h.process.sentinel)
        # Until it is reaped the worker's pid (its group id) cannot be reused: end anything
        # it started and left behind (DataLoader workers), then reap it.
        kill_group(h.pid, signal.SIGKILL)
        h.process.join(timeout=5)
        w.exitcode = h.process.exitcode if h.process.exitcode is not None else -signal.SIGKILL
        while w.control_open and _poll(h.control):  # a report sent just before exit
            self.read_control(w)
        return True

    def close(self, end_ranks: bool) -> None:
        """Close the selector; ``end_ranks``: also kill, reap and close each rank (else
        they and their pipes stay with whoever owns them, a pool)."""
        if end_ranks:
            for w in self.workers.values():
                h = w.handle
                if h.process.exitcode is None:
                    kill_group(h.pid, signal.SIGKILL)
                    h.process.join(timeout=5)
                for conn in (h.control, h.out, h.err, h.commands):
                    with contextlib.suppress(OSError):
                        conn.close()
                with contextlib.suppress(Exception):
                    h.process.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _poll(conn) -> bool:
    try:
        return conn.poll()
    except (OSError, EOFError):
        return False


def _readable(conn) -> bool:
    try:
        return bool(selectors.select.select([conn.fileno()], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def kill_group(pid: int, sig: int) -> None:
    """Signal a worker and whatever it started (its process group), and the worker by pid:
    a spawned one leads a group only once nbtrain's code runs in it (an interrupted start
    left one alive that ``killpg`` missed). Only while ``pid`` is a live child of ours:
    once reaped, the number may be someone else's."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    try:
        alive = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already, or not our child
        return
    if alive:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
