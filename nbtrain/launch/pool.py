"""``RankPool``: warm workers kept across launches and cells.

The pool starts one worker per device with the ordinary launchers (fork or spawn) and a
``WorkerSpec`` marked ``pool``; each worker joins the process group once (rank 0 hosts its
store, as in any launch) and then waits for commands
(``pool_worker``). Every command is one *operation*: a ``PoolOp`` thread, a
``Supervisor`` that ends when every rank it asked has replied rather than exited, reads
the replies and labels the output lines ``[rank N]``. ``pool.launch`` hands its
operation to a ``Run`` as its supervisor, so a pool run is the same ``Run`` that
``nbtrain.launch`` returns (``pool_op``).

Failure stays contained where the process group survives it: an exception is a reply
like any other; an interrupt or ``timeout=`` interrupts the busy ranks. A rank that
does not answer (stuck in a collective) or one that died ends the whole pool, which
says so and starts again on its next use.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..cells import busy_while_blocking
from ..wire import (
    Command,
    Exec,
    Exit,
    MemoryQuery,
    Pull,
    Push,
    decode_memory,
    decode_result,
    decode_value,
    encode_command,
)
from . import calls, start
from .launcher import WorkerHandle, interrupts_deferred
from .pool_launch import PoolLaunch
from .pool_op import INTERRUPT_GRACE_S, STUCK_S, PoolOp, RankCellError, cell_error
from .supervisor import kill_group

EXIT_GRACE_S = 2.0  # after "exit", how long before SIGKILL
_POOLS: set[RankPool] = set()  # open pools (held: their workers live until close())
_active: weakref.ref | None = None  # the pool %%ranks uses: the last one started


def active_pool() -> RankPool:
    pool = _active() if _active is not None else None
    if pool is None or pool.closed:
        raise RuntimeError("no RankPool is open: start one first, e.g. "
                           "pool = nbtrain.RankPool(devices=2, accelerator='cpu').")
    return pool


class RankPool:
    """Warm workers, one per device, kept across ``pool.launch`` calls and ``%%ranks`` cells.

        pool = nbtrain.RankPool(devices=2, accelerator="cpu", start_method="spawn")
        run = pool.launch(train, strategy="ddp")    # a Run, as nbtrain.launch gives
        pool.pull("x")                               # one value per rank
        pool.close()                                 # or: with nbtrain.RankPool(...) as pool:

    Args:
        devices, accelerator, start_method: as for ``nbtrain.launch``. The process group
            starts once, with the pool; only the first start pays for spawn.
        timeout: seconds a collective may wait before the process group gives up
            (torch's process-group timeout; default 600).

    After a rank dies, or ranks stuck in a collective had to be ended, the pool says so;
    its next use starts fresh workers (names defined in ``%%ranks`` cells are lost).
    """

    def __init__(self, devices: int | str | list[int] = "auto", accelerator: str = "auto",
                 start_method: str = "auto", timeout: float | None = None):
        from .devices import parse_devices
        from .guards import choose_start_method

        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        self.plan = parse_devices(devices, accelerator)
        self.start_method = choose_start_method(start_method, self.plan.accelerator)
        self._pg_timeout = float(timeout or 600.0)
        self._handles: list[WorkerHandle] = []
        self._launcher = None
        self._lock = threading.Lock()
        self._busy: str | None = None  # what runs now: "cell", "launch", ...
        self._ended: str | None = None  # why the workers were ended (restart on next use)
        self._cells = 0
        self.closed = False
        self.started = 0  # how many times workers were started
        self._start()
        global _active
        _active = weakref.ref(self)
        _POOLS.add(self)
        atexit.unregister(_close_pools)
        atexit.register(_close_pools)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    # -- lifecycle -----------------------------------------------------------------------
    def _start(self) -> None:
        from . import LAUNCHERS
        from .devices import threads_per_worker

        launcher = LAUNCHERS[self.start_method]()
        launcher.warm()
        handles: list[WorkerHandle] = []
        op = None
        try:
            threads = launcher.threads(threads_per_worker(self.world_size))
            specs = start.rank_specs(self.plan, threads=threads, pg_timeout=self._pg_timeout,
                                     pool=True)
            handles = start.start_ranks(launcher, specs, None)
            self._handles, self._launcher = handles, launcher
            # Rank 0 hosts the store (see rank/worker.py); the op passes its port on, and
            # waits for every rank's READY.
            op = self._begin(list(range(self.world_size)), None, None, join=True)
            self._finish(op)
            failures = {r: w.failure for r, w in op.workers.items() if w.failure}
            if failures:
                raise cell_error(failures, "the pool could not start its process group")
        except BaseException:
            for h in handles:
                # one the op already reaped (and closed) is gone, and its pid may be reused
                with contextlib.suppress(ValueError):
                    if h.process.exitcode is None:
                        kill_group(h.pid, signal.SIGKILL)
            if op is not None:  # interrupted while waiting: let the op see the exits first
                op.done.wait(5)
            self._end_workers(handles, launcher)
            self._handles, self._launcher = [], None
            raise
        self._ended = None
        self.started += 1

    def _end_workers(self, handles, launcher, graceful: bool = False) -> None:
        if graceful:
            for h in handles:
                if h.process.exitcode is None:
                    with contextlib.suppress(OSError, ValueError):
                        h.commands.send_bytes(encode_command(Exit()))
            deadline = time.monotonic() + EXIT_GRACE_S
            for h in handles:
                h.process.join(max(0.0, deadline - time.monotonic()))
        for h in handles:
            kill_group(h.pid, signal.SIGKILL)  # and whatever it started (DataLoader workers)
            with contextlib.suppress(ValueError):  # already closed
                h.process.join(5)
            for conn in (h.control, h.out, h.err, h.commands):
                if conn is not None:
                    with contextlib.suppress(OSError):
                        conn.close()
            with contextlib.suppress(Exception):
                h.process.close()
        if launcher is not None:
            launcher.close()

    def _kill_all(self) -> None:
        for h in self._handles:
            kill_group(h.pid, signal.SIGKILL)

    def _teardown(self, reason: str) -> None:
        """End the workers (a rank died or stayed stuck); the next use starts new ones."""
        self._end_workers(self._handles, self._launcher)
        self._handles, self._launcher = [], None
        self._ended = reason

    def restart(self) -> None:
        """End the workers and start new ones (fresh namespaces and process group)."""
        self._check_open()
        with self._claim("restart"):
            if self._handles:
                self._end_workers(self._handles, self._launcher, graceful=True)
                self._handles, self._launcher = [], None
            self._start()

    def close(self) -> None:
        """End every worker, the rendezvous store and the helper processes the pool made."""
        if self.closed:
            return
        op = getattr(self, "_op", None)
        if op is not None and not op.done.is_set():  # a background run: stop it first
            op.request_stop("the pool is closing")
            op.done.wait(INTERRUPT_GRACE_S + 5)
        deadline = time.monotonic() + 10
        while self._busy is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the run's own cleanup (its listener, a teardown) finishes
        self.closed = True
        self._end_workers(self._handles, self._launcher, graceful=True)
        self._handles, self._launcher = [], None
        _POOLS.discard(self)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RankPool is closed; start a new one with "
                               "nbtrain.RankPool(...).")

    @contextlib.contextmanager
    def _claim(self, what: str):
        with self._lock:
            if self._busy is not None:
                raise RuntimeError(f"the pool is busy ({self._busy}); wait for it to finish "
                                   "or stop it (run.stop()) first.")
            self._busy = what
        try:
            yield
        finally:
            self._busy = None

    def _ensure_started(self) -> None:
        self._check_open()
        if not self._handles:
            why = self._ended or "it was ended"
            print(f"nbtrain: restarting the pool's {self.world_size} workers ({why}); names "
                  "defined in %%ranks cells before are gone.", file=sys.stderr)
            self._start()

    # -- operations ----------------------------------------------------------------------
    def _begin(self, ranks: list[int], command: Command | None, deadline: float | None,
               emit=None, join: bool = False) -> PoolOp:
        """Send ``command`` to ``ranks`` and start watching them (no command: wait for
        what they send unasked, the start's READY; ``join``: they are starting their
        process group)."""
        handles = [self._handles[r] for r in ranks]
        op = PoolOp(handles, emit or _writer(), deadline, self._kill_all, join,
                    watch_cpu=self.plan.accelerator == "cpu")
        if command is not None:
            for h in handles:
                try:
                    h.commands.send_bytes(encode_command(command))
                except OSError:  # it died; the op sees its exit and reports it
                    pass
        self._op = op
        op.start()
        return op

    def _finish(self, op: PoolOp) -> None:
        """After an operation: end the pool if a rank died or stayed stuck."""
        op.done.wait()
        if op.crash is not None:
            self._teardown(f"nbtrain's pool supervisor failed: {op.crash!r}")
            return
        if op.pool_broken:
            dead = op.died
            parts = []
            if dead:
                parts.append(", ".join(f"rank {r} died ({op.workers[r].failure.exc_type})"
                                       if op.workers[r].failure else f"rank {r} died"
                                       for r in dead))
            if op.killed:
                how = (f"and slept without CPU time for {STUCK_S:g}s" if op.stuck
                       else f"within {INTERRUPT_GRACE_S:g}s")
                parts.append(f"rank{'s' if len(op.killed) > 1 else ''} "
                             f"{', '.join(map(str, op.killed))} did not answer an interrupt "
                             f"{how} (stuck in a collective?)")
            self._teardown("; ".join(parts))

    def _settle(self, within: float = 5.0) -> None:
        """A run whose ranks are done may still be closing its telemetry (an interrupted
        launch raises as soon as the ranks stopped): the next launch waits for that
        instead of calling the pool busy."""
        op = self._op
        if self._busy is None or op is None or not op.done.is_set():
            return
        deadline = time.monotonic() + within
        while self._busy is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def _wait(self, op: PoolOp) -> None:
        """Wait in the cell; an interrupt interrupts the ranks (and, if stuck, the pool)."""
        try:
            with busy_while_blocking():
                while not op.done.wait(0.05):
                    pass
        except KeyboardInterrupt:
            self._interrupt_and_wait(op)
            raise

    @staticmethod
    def _interrupt_and_wait(op: PoolOp) -> None:
        op.request_stop("interrupted")
        while True:  # a second interrupt does not cut the teardown short
            try:
                if op.done.wait(0.05):
                    break
            except KeyboardInterrupt:
                pass

    def _ranks(self, ranks) -> list[int]:
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int):
            ranks = [ranks]
        out = []
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.world_size:
                raise ValueError(f"rank {r!r} is not in this pool (ranks 0..{self.world_size - 1}).")
            if r not in out:
                out.append(r)
        if not out:
            raise ValueError("give at least one rank.")
        return out

    def _command(self, ranks, command, what: str, timeout: float | None = None) -> PoolOp:
        """Run one command on ``ranks`` in the foreground; raise what failed."""
        self._check_open()
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        ranks = self._ranks(ranks)
        with self._claim(what):
            self._ensure_started()
            dead = [h.rank for h in self._handles if h.process.exitcode is not None]
            deadline = time.monotonic() + timeout if timeout else None
            op, interrupted = None, False
            try:
                # An interrupt while the command goes out is taken once it is out: the
                # ranks are then interrupted as they would be a moment later.
                with interrupts_deferred():
                    # A rank that died since the last command: report it, end the pool.
                    op = (self._begin(dead, None, None) if dead
                          else self._begin(ranks, command, deadline))
                self._wait(op)
            except KeyboardInterrupt:
                if op is None:
                    raise
                interrupted = True
                if not op.done.is_set():
                    self._interrupt_and_wait(op)
            self._finish(op)
        note = f"The pool's workers were ended: {self._ended}. " \
               "Its next use starts new ones." if not self._handles else ""
        failures = {r: w.failure for r, w in op.workers.items() if w.failure}
        if interrupted and (op.interrupted or not failures):
            if not op.interrupted:  # every rank had replied before the interrupt
                raise KeyboardInterrupt(note)
            raise KeyboardInterrupt(note or f"interrupted on rank(s) {op.interrupted}; "
                                    "the pool is still usable")
        if op.teardown_cause == "timeout":
            from ..errors import RunTimeoutError

            err = RunTimeoutError(timeout, op.timed_out_ranks,
                                  [r for r in ranks if r not in op.timed_out_ranks])
            err.hint = (err.hint + "\n" + note).strip()
            err.args = (err._text(),)
            raise err
        if failures:
            raise cell_error(failures, note)
        return op

    def run(self, code: str, ranks: int | list[int] | None = None,
            timeout: float | None = None) -> dict[int, str | None]:
        """Run ``code`` on ``ranks`` (all by default), each in its own namespace kept
        across calls (``rank``, ``world_size``, ``device``, ``dist``, ``torch`` defined).
        Output comes back labelled ``[rank N]``. Returns each rank's repr of the value of
        the code's last expression (None if there is none). What ``%%ranks`` calls."""
        if not isinstance(code, str):
            raise TypeError(f"pool.run() takes code as a string; got {type(code).__name__}.")
        self._cells += 1
        command = Exec(code, f"<%%ranks cell {self._cells}>")
        op = self._command(ranks, command, "cell", timeout)
        return {r: decode_value(w.result).repr for r, w in sorted(op.workers.items())}

    def pull(self, name: str, ranks: int | list[int] | None = None) -> list[Any]:
        """The value of ``name`` on each rank (tensors moved to CPU), in rank order."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"pull({name!r}): give the name of a variable on the ranks.")
        op = self._command(ranks, Pull(name), "pull")
        return [decode_result(w.result) for _, w in sorted(op.workers.items())]

    def push(self, ranks: int | list[int] | None = None, **values: Any) -> None:
        """Define names on the ranks: ``pool.push(lr=0.1, x=torch.ones(3))``."""
        if not values:
            raise ValueError("push(name=value, ...): give at least one name.")
        import dill

        try:
            data = dill.dumps(values, recurse=True)
        except Exception as err:
            raise TypeError(f"cannot send {sorted(values)} to the ranks: {err}. Send plain "
                            "data (numbers, tensors on CPU, lists, dicts).") from err
        self._command(ranks, Push(data), "push")

    @property
    def status(self) -> PoolStatus:
        """Each rank: pid, alive, busy, and memory (live tensor bytes, RSS; on CUDA the
        allocator's allocated and reserved bytes). Memory is asked of idle ranks only."""
        self._check_open()
        rows = []
        memory: dict[int, dict] = {}
        busy = self._busy
        if busy is None and self._handles and \
                all(h.process.exitcode is None for h in self._handles):
            with contextlib.suppress(Exception):
                op = self._command(None, MemoryQuery(), "status")
                memory = {r: decode_memory(w.result) for r, w in op.workers.items()}
        for rank in range(self.world_size):
            h = self._handles[rank] if self._handles else None
            alive = h is not None and h.process.exitcode is None
            rows.append({"rank": rank, "pid": h.pid if h else None, "alive": alive,
                         "busy": bool(busy) and alive, **memory.get(rank, {})})
        return PoolStatus(rows, self._ended, busy)

    def launch(self, fn: Callable[..., Any], *args: Any, strategy="ddp",
               background: bool = False, timeout: float | None = None,
               telemetry=True, sinks=(), dashboard: bool | str = "auto",
               resume=None, seed: int | None = None, **kwargs: Any):
        """Run ``fn(ctx, *args, **kwargs)`` on the warm workers; returns a ``Run`` exactly
        as ``nbtrain.launch`` does (same arguments, except that devices, accelerator and
        start method are the pool's). What the run made is freed on every rank when it
        ends (on CUDA the allocator's cache is emptied too)."""
        calls.warn_shadowed("pool.launch()", fn, calls.given(
            RankPool.launch, strategy=strategy, background=background, timeout=timeout,
            telemetry=telemetry, sinks=sinks, dashboard=dashboard, resume=resume, seed=seed))
        with busy_while_blocking():
            return self._launch(fn, args, kwargs, strategy, background, timeout, telemetry,
                                sinks, dashboard, resume, seed)

    def _launch(self, fn, args, kwargs, strategy, background, timeout, telemetry, sinks,
                dashboard, resume, seed):
        self._check_open()
        request = start.check("pool.launch()", fn, args, kwargs, strategy=strategy,
                              timeout=timeout, telemetry=telemetry, sinks=sinks,
                              dashboard=dashboard, resume=resume, seed=seed,
                              background=background)
        return start.execute(request, self.plan, PoolLaunch(self))

    def __repr__(self) -> str:
        state = ("closed" if self.closed else f"ended ({self._ended})" if self._ended
                 else self._busy or "idle")
        return (f"<RankPool {self.world_size}×{self.plan.accelerator} "
                f"start={self.start_method}: {state}>")


class PoolStatus(list):
    """``pool.status``: one dict per rank; prints as a table."""

    def __init__(self, rows: list[dict], ended: str | None, busy: str | None):
        super().__init__(rows)
        self.ended = ended
        self.busy = busy

    def __repr__(self) -> str:
        lines = []
        if self.ended:
            lines.append(f"workers ended: {self.ended} (the next use restarts them)")
        lines.append(f"{'rank':>4} {'pid':>8} {'alive':>5} {'busy':>5} {'tensors':>10} "
                     f"{'rss':>10} {'cuda alloc':>10} {'cuda resv':>10}")
        for row in self:
            lines.append(f"{row['rank']:>4} {row['pid'] or '-':>8} {str(row['alive']):>5} "
                         f"{str(row['busy']):>5} {_mb(row.get('tensor_bytes')):>10} "
                         f"{_mb(row.get('rss_bytes')):>10} {_mb(row.get('cuda_allocated')):>10} "
                         f"{_mb(row.get('cuda_reserved')):>10}")
        return "\n".join(lines)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MB"


def _writer():
    streams = {"out": sys.stdout, "err": sys.stderr}

    def emit(rank: int, stream: str, line: str) -> None:
        try:
            streams[stream].write(f"[rank {rank}] {line}\n")
            streams[stream].flush()
        except Exception:
            pass

    return emit

def _close_pools() -> None:
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


__all__ = ["RankCellError", "RankPool", "active_pool"]
