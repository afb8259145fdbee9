"""Watches the workers of one run from a kernel thread: their exits, results, failures and
output. Fails fast: the first failure ends every other rank. Always reaps what it started.

One selector waits on everything at once: each worker's exit sentinel, its control pipe
(result or failure), its stdout and stderr pipes, and a wake-up pipe for ``stop()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import threading
import time
from dataclasses import dataclass, field

from ..errors import signal_hint, signal_name
from ..wire import (
    ACTIVITY,
    AT_STORE,
    FAILURE,
    JOINED,
    STORE,
    Activity,
    decode_activity,
    decode_failure,
)
from .launcher import WorkerHandle

FAILURE_GRACE_S = 0.25  # after a first failure, wait this long for the root cause to report
TERM_GRACE_S = 1.0  # SIGTERM, then SIGKILL after this long
DRAIN_S = 1.0  # after exits, how long to wait for the last output lines
# A rank that has not joined its process group this long after the start is named, with
# its Python stack, and the start fails (a fork once copied a held lock into a rank,
# which then waited forever; see rank/worker.py). Generous: spawn imports torch in every rank
# and NCCL's first communicator takes seconds on 8 GPUs.
JOIN_TIMEOUT_S = 120.0
STACK_WAIT_S = 1.0  # after SIGUSR1, how long a late rank gets to print its stack
# A rank still running this long after another rank returned is named in the cell with
# its Python stack (once): a silent wait looks like a hang (a rank stuck in a collective
# the others left, or a slow teardown).
STRAGGLER_S = 30.0

_COMM_ERROR = re.compile(r"gloo|nccl|connection (closed|reset) by peer|broken pipe|"
                         r"DistBackendError|DistNetworkError|DistStoreError|Socket Timeout",
                         re.IGNORECASE)


@dataclass
class Failure:
    rank: int
    exc_type: str
    message: str
    traceback: str
    t: float
    # A communication error caused by another rank's death: not the root cause.
    secondary: bool = False
    hint: str = ""


@dataclass
class _Worker:
    handle: WorkerHandle
    exitcode: int | None = None
    result: bytes | None = None
    failure: Failure | None = None
    control_open: bool = True
    at_store: bool = False  # it reached rank 0's store (wire.AT_STORE)
    joined: bool = False  # its process group is up (wire.JOINED)
    stack: list[str] | None = None  # stderr lines since it was asked for its stack
    activity: Activity | None = None  # what its function did
    partial: dict[str, str] = field(default_factory=lambda: {"out": "", "err": ""})


class Supervisor:
    """Runs ``loop()`` in a thread; the run reads the outcome when ``done`` is set."""

    def __init__(self, handles: list[WorkerHandle], emit, deadline: float | None,
                 join: bool = True):
        self.workers = {h.rank: _Worker(h) for h in handles}
        self._emit = emit  # emit(rank, "out" | "err", line)
        self.deadline = deadline
        # The ranks start their process group under this supervisor: relay rank 0's store
        # port, and name the ranks that have not joined by this time.
        self.join_deadline = time.monotonic() + JOIN_TIMEOUT_S if join else None
        self._stacks_asked_at: float | None = None
        self._first_result_at: float | None = None
        self._stragglers_named = False
        self.stop_reason: str | None = None
        self.timed_out_ranks: list[int] = []
        self.teardown_cause: str | None = None  # "failure", "stop", "timeout"
        self.crash: BaseException | None = None
        self._stop_requested: str | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._main, name="nbtrain-supervisor", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def request_stop(self, reason: str) -> None:
        self._stop_requested = reason
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # -- outcome -----------------------------------------------------------------------
    @property
    def failures(self) -> list[Failure]:
        return sorted((w.failure for w in self.workers.values() if w.failure), key=lambda f: f.t)

    def root_failure(self) -> Failure | None:
        failures = self.failures
        primary = [f for f in failures if not f.secondary]
        return (primary or failures or [None])[0]

    # -- the loop ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # a bug here must still end the workers and the wait
            self.crash = err
            raise
        finally:
            self._cleanup()
            self.done.set()

    def _register(self) -> selectors.BaseSelector:
        """Watch every worker's exit, control pipe and output; returns the selector."""
        sel = self._sel
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        for w in self.workers.values():
            h = w.handle
            sel.register(h.process.sentinel, selectors.EVENT_READ, ("exit", w))
            sel.register(h.control, selectors.EVENT_READ, ("control", w))
            for stream, conn in (("out", h.out), ("err", h.err)):
                os.set_blocking(conn.fileno(), False)
                sel.register(conn, selectors.EVENT_READ, (stream, w))
        return sel

    def _loop(self) -> None:
        sel = self._register()
        term_sent_at: float | None = None
        while any(w.exitcode is None for w in self.workers.values()):
            now = time.monotonic()
            self._check_joined(now)
            self._name_stragglers(now)
            if self.teardown_cause is None:
                self._maybe_start_teardown(now)
            if self.teardown_cause is not None:
                if term_sent_at is None:
                    self._signal_alive(signal.SIGTERM)
                    term_sent_at = now
                elif now - term_sent_at > TERM_GRACE_S:
                    self._signal_alive(signal.SIGKILL)
            timeout = 0.05 if (self.teardown_cause or self.failures) else 0.5
            if self.deadline is not None:
                timeout = max(0.0, min(timeout, self.deadline - now))
            for key, _ in sel.select(timeout):
                self._handle(*key.data)
        self._drain_output()

    def _maybe_start_teardown(self, now: float) -> None:
        if self._stop_requested:
            self.teardown_cause, self.stop_reason = "stop", self._stop_requested
        elif self.deadline is not None and now >= self.deadline:
            self.teardown_cause = "timeout"
            self.timed_out_ranks = [r for r, w in self.workers.items() if w.exitcode is None]
        elif self.failures:
            # A communication error is usually another rank's death seen from afar: wait
            # briefly for the rank that caused it to report.
            first = self.failures[0]
            if not self.root_failure().secondary or now - first.t >= FAILURE_GRACE_S:
                self.teardown_cause = "failure"

    def _check_joined(self, now: float) -> None:
        """Past the join deadline, ask the ranks that have not joined where they are
        (SIGUSR1: their Python stacks, on stderr), then fail them with it."""
        if self.join_deadline is None or self.teardown_cause is not None or \
                now < self.join_deadline:
            return
        late = [w for w in self.workers.values()
                if not w.joined and w.exitcode is None and w.failure is None]
        if not late:
            self.join_deadline = None
            return
        if self._stacks_asked_at is None:
            self._stacks_asked_at = now
            for w in late:
                w.stack = []
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.handle.pid, signal.SIGUSR1)
            return
        if now - self._stacks_asked_at < STACK_WAIT_S:
            return
        joined = [r for r, w in self.workers.items() if w.joined]
        missing = [w.handle.rank for w in late if not w.at_store]
        for w in late:
            rank = w.handle.rank
            stack = "\n".join(w.stack or []) or "(it printed no stack)"
            if w.at_store and missing:  # waiting in the group's start for those
                message = (f"rank {rank} waited in the process group's start for rank"
                           f"{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))}")
            else:
                message = (f"rank {rank} did not join the process group within "
                           f"{JOIN_TIMEOUT_S:g} s of the start (joined: "
                           f"{', '.join(map(str, joined)) or 'none'}); where it waits:")
            w.failure = Failure(
                rank, "StartTimeout", message, stack, now,
                secondary=w.at_store and bool(missing),
                hint="The start was ended; nothing of your function ran. Launch again. If a "
                     "start hangs again, the stack above says where: please report it with "
                     "that stack.")
        self.join_deadline = None

    def _name_stragglers(self, now: float) -> None:
        if self._stragglers_named or self._first_result_at is None or \
                self.teardown_cause is not None or now - self._first_result_at < STRAGGLER_S:
            return
        self._stragglers_named = True
        done = [r for r, w in self.workers.items() if w.result is not None]
        for w in self.workers.values():
            if w.result is None and w.failure is None and w.exitcode is None:
                self._emit(w.handle.rank, "err",
                           f"nbtrain: rank {w.handle.rank} is still running "
                           f"{now - self._first_result_at:.0f} s after rank"
                           f"{'s' if len(done) > 1 else ''} {', '.join(map(str, done))} "
                           "returned; where it is now:")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.handle.pid, signal.SIGUSR1)

    @property
    def note(self) -> str | None:
        """What the run should say when it ends well (each rank trained alone)."""
        activities = {r: w.activity for r, w in self.workers.items() if w.activity is not None}
        return trained_alone(activities, len(self.workers))

    def _signal_alive(self, sig: int) -> None:
        for w in self.workers.values():
            if w.exitcode is None:
                kill_group(w.handle.pid, sig)

    def _handle(self, what: str, w: _Worker | None) -> None:
        if what == "wake":
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 1024)
        elif what == "control":
            self._read_control(w)
        elif what in ("out", "err"):
            self._read_output(w, what)
        elif what == "exit":
            self._on_exit(w)

    def _forget(self, fileobj) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(fileobj)

    def _read_control(self, w: _Worker) -> None:
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
            for other in self.workers.values():
                if other is not w and other.exitcode is None:
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
                body = decode_failure(data)
                text = f"{body.type}: {body.message}\n{body.traceback}"
                w.failure = Failure(w.handle.rank, body.type, body.message, body.traceback,
                                    time.monotonic(), secondary=bool(_COMM_ERROR.search(text)),
                                    hint=body.hint)
        except ValueError as err:  # not nbtrain's message: the rank's failure, said as such
            w.failure = Failure(w.handle.rank, "MalformedMessage", str(err), "",
                                time.monotonic(), hint="nbtrain's rank and kernel disagree on "
                                "the wire; are both the same nbtrain?")
        if tag in (ACTIVITY, FAILURE):
            return
        w.result = data
        if self._first_result_at is None:
            self._first_result_at = time.monotonic()

    def _reap(self, w: _Worker) -> bool:
        """Reap a worker that exited and read what it sent last; False if already done."""
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
            self._read_control(w)
        return True

    def _on_exit(self, w: _Worker) -> None:
        if not self._reap(w):
            return
        h = w.handle
        if w.failure or w.result is not None or self.teardown_cause in ("stop", "timeout"):
            return
        if self.teardown_cause == "failure" and w.exitcode < 0:
            return  # we ended it
        w.failure = exit_failure(h.rank, w.exitcode, h.exit_hint)

    def _read_output(self, w: _Worker, stream: str) -> bool:
        conn = w.handle.out if stream == "out" else w.handle.err
        try:
            data = os.read(conn.fileno(), 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self._forget(conn)
            if w.partial[stream]:
                self._emit(w.handle.rank, stream, w.partial[stream])
                w.partial[stream] = ""
            return False
        text = w.partial[stream] + data.decode("utf-8", errors="replace")
        *lines, w.partial[stream] = text.split("\n")
        for line in lines:
            if w.stack is not None and stream == "err":  # its stack goes into its failure
                w.stack.append(line)
            else:
                self._emit(w.handle.rank, stream, line)
        return True

    def _drain_output(self) -> None:
        """Read the last lines (up to end-of-file, or DRAIN_S if a grandchild holds the pipe)."""
        end = time.monotonic() + DRAIN_S
        while time.monotonic() < end:
            keys = [k for k in self._sel.get_map().values() if k.data[0] in ("out", "err")]
            if not keys:
                break
            for key, _ in self._sel.select(max(0.0, end - time.monotonic())):
                if key.data[0] in ("out", "err"):
                    self._read_output(key.data[1], key.data[0])
                elif key.data[0] == "control":
                    self._read_control(key.data[1])
        for w in self.workers.values():  # whatever a partial last line held
            for s in ("out", "err"):
                if w.partial[s]:
                    self._emit(w.handle.rank, s, w.partial[s])
                    w.partial[s] = ""

    def _cleanup(self) -> None:
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


def exit_failure(rank: int, exitcode: int, exit_hint: str = "") -> Failure:
    """A rank that exited without a report: killed by a signal, or an exit code (code 1:
    ``exit_hint``, what its launcher says that usually means)."""
    if exitcode < 0:
        sig = -exitcode
        return Failure(rank, signal_name(sig),
                       f"rank {rank} was killed by {signal_name(sig)} (signal {sig}) "
                       "without a Python traceback", "", time.monotonic(),
                       hint=signal_hint(sig))
    return Failure(rank, "WorkerExit", f"rank {rank} exited with code {exitcode} before "
                   "returning (os._exit() or a crash in native code?)", "", time.monotonic(),
                   hint=exit_hint if exitcode == 1 else "")


def _poll(conn) -> bool:
    try:
        return conn.poll()
    except (OSError, EOFError):
        return False


def kill_group(pid: int, sig: int) -> None:
    """Signal a worker and whatever it started (its process group).

    The worker itself is also signalled by pid: a spawned worker becomes a group leader
    only once its interpreter runs nbtrain's code (the kernel's ``setpgid`` fails after
    the child's exec), and until then ``killpg`` finds no such group (an interrupted
    start left such a worker alive). Only while ``pid`` is a live child of this process:
    once reaped, the number may belong to someone else.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    try:
        alive = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:  # reaped already, or not our child
        return
    if alive:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


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
