"""``RankPool``: warm workers kept across launches and cells.

The pool starts one worker per device with the ordinary launchers (fork or spawn) and a
``WorkerSpec`` marked ``pool``; each worker joins the process group once (rank 0 hosts its
store, as in any launch) and then waits for commands
(``pool_worker``). Here: ``RankPool`` (what users call) and ``PoolWorkers``, its
lifecycle (start, end, restart). Commands go through its ``PoolChannel``
(``pool_channel.py``): one at a time, each followed by a ``PoolOp`` (``pool_op.py``) that
ends when every rank it asked has replied rather than exited. ``pool.launch`` hands its
operation to a ``Run`` (``pool_launch.py``), so a pool run is the same ``Run`` that
``nbtrain.launch`` returns.

Failure stays contained: an exception is a reply like any other; an interrupt or
``timeout=`` interrupts the busy ranks. A CPU rank stuck in a collective its peers are
not in is freed by them (they drop the process group) and every rank then starts a new
one, names kept (``pool_channel.py``). A rank that died, or one stuck beyond that help
(every rank stuck; NCCL), ends the whole pool, which says so and starts again on its
next use.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import linecache
import signal
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

from ...cells import POOL_CODE, busy_while_blocking
from ...deviceplan import DevicePlan
from ...units import format_bytes
from ...wire import (
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
from .. import calls, options, start
from ..following.watch import kill_group
from ..starting import launchers
from ..starting.devices import parse_devices, threads_per_worker
from ..starting.launcher import WorkerHandle
from .channel import PoolChannel
from .launch import PoolLaunch
from .op import RankCellError, cell_error

EXIT_GRACE_S = 2.0  # after "exit", how long before SIGKILL
_POOLS: set[RankPool] = set()  # open pools (held: their workers live until close())
_active: weakref.ref | None = None  # the pool %%ranks uses: the last one started


def active_pool() -> RankPool:
    pool = _active() if _active is not None else None
    if pool is None or pool.closed:
        raise RuntimeError("no RankPool is open: start one first, e.g. "
                           "pool = nbtrain.RankPool(devices=2, accelerator='cpu').")
    return pool


# the run options the pool decided when it started, with why
_FIXED = {"collective_timeout": (None, "the pool's process group is made when its workers "
                                 "start: RankPool(timeout=...) sets how long a collective "
                                 "may wait.")}


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

    A rank that dies between commands is replaced at the next one, which then runs on
    fresh workers (one line says so; names defined in ``%%ranks`` cells are lost). A
    rank that dies during a command fails that command and ends the workers; the next
    use starts fresh ones. A CPU rank stuck in a collective the others are not in (a
    ``%%ranks 0`` cell that all-reduces, a launch whose other rank raised) is freed at
    the timeout, interrupt or failure: the process group starts again and names are
    kept. On GPUs (NCCL), or when every rank is stuck, the workers are ended instead.
    """

    def __init__(self, devices: int | str | list[int] = "auto", accelerator: str = "auto",
                 start_method: str = "auto", timeout: float | None = None):
        start.refuse_in_a_rank("RankPool()")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        self.plan = parse_devices(devices, accelerator)
        self.start_method = launchers.choose_start_method(start_method, self.plan.accelerator)
        self.workers = PoolWorkers(self.plan, self.start_method, float(timeout or 600.0))
        self.channel = PoolChannel(self.workers)
        self._cells = 0
        self.closed = False
        self.workers.start(self.channel)
        global _active
        _active = weakref.ref(self)
        _POOLS.add(self)
        atexit.unregister(_close_pools)
        atexit.register(_close_pools)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def started(self) -> int:
        """How many times its workers were started (1, plus one per restart)."""
        return self.workers.started

    def restart(self) -> None:
        """End the workers and start new ones (fresh namespaces and process group)."""
        self._check_open()
        with self.channel.claimed("restart"):
            self.workers.end(None, graceful=True)
            self.workers.start(self.channel)

    def close(self) -> None:
        """End every worker, the rendezvous store and the helper processes the pool made."""
        if self.closed:
            return
        self.channel.wait_idle(10)  # a background run is stopped first
        self.closed = True
        self.workers.end(None, graceful=True)
        _POOLS.discard(self)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this RankPool is closed; start a new one with "
                               "nbtrain.RankPool(...).")

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

    def _command(self, ranks, command, what: str, timeout: float | None = None):
        self._check_open()
        return self.channel.command(self._ranks(ranks), command, what, timeout)

    def run(self, code: str, ranks: int | list[int] | None = None,
            timeout: float | None = None, *, filename: str | None = None,
            ) -> dict[int, str | None]:
        """Run ``code`` on ``ranks`` (all by default), each in its own namespace kept
        across calls (``rank``, ``world_size``, ``device``, ``dist``, ``torch`` defined).
        Output comes back labelled ``[rank N]``. Returns each rank's repr of the value of
        the code's last expression (None if there is none). What ``%%ranks`` calls, with
        ``filename`` (what tracebacks name the code) its cell's."""
        if not isinstance(code, str):
            raise TypeError(f"pool.run() takes code as a string; got {type(code).__name__}.")
        if filename is None:
            self._cells += 1
            filename = POOL_CODE.format(self._cells)
        command = Exec(code, filename)
        # the kernel's copy too: the stack a rank writes as it dies names only the line
        linecache.cache[command.filename] = (len(code), None, code.splitlines(True),
                                             command.filename)
        # A syntax error is the cell's, raised here as IPython shows one (its line and a
        # caret), not once per rank.
        ast.parse(code, filename)
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
        busy = self.channel.busy
        if busy is None and self.workers.handles and not self.workers.dead():
            with contextlib.suppress(Exception):  # a rank that died meanwhile: no figures
                op = self._command(None, MemoryQuery(), "status")
                memory = {r: decode_memory(w.result) for r, w in op.workers.items()}
        handles = self.workers.handles  # after the query: it may have ended them
        for rank in range(self.world_size):
            h = handles[rank] if handles else None
            alive = h is not None and h.process.exitcode is None
            rows.append({"rank": rank, "pid": h.pid if h else None, "alive": alive,
                         "busy": bool(busy) and alive, **memory.get(rank, {})})
        return PoolStatus(rows, self.workers.ended, busy)

    @options.takes_run_options(fixed=_FIXED)
    def launch(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        """Run ``fn(ctx, *args, **kwargs)`` on the warm workers; returns a ``Run`` exactly
        as ``nbtrain.launch`` does (same arguments, except that devices, accelerator and
        start method are the pool's). What the run made is freed on every rank when it
        ends (on CUDA the allocator's cache is emptied too). The run's options:

            {run options}
        """
        given, kwargs = options.split("pool.launch()", kwargs, _FIXED)
        calls.warn_shadowed("pool.launch()", fn, calls.given(RankPool.launch, **given))
        self._check_open()
        request = start.check("pool.launch()", fn, args, kwargs, given)
        with busy_while_blocking():
            return start.execute(request, self.plan, PoolLaunch(self))

    def __repr__(self) -> str:
        ended = self.workers.ended
        state = ("closed" if self.closed else f"ended ({ended})" if ended
                 else self.channel.busy or "idle")
        return (f"<RankPool {self.world_size}×{self.plan.accelerator} "
                f"start={self.start_method}: {state}>")


class PoolWorkers:
    """A pool's worker processes, one per device of ``plan``: started with their process
    group (``start``), ended when a command found one dead or stuck, or on close (``end``),
    and started again on the next use (``ensure_started``)."""

    def __init__(self, plan: DevicePlan, start_method: str, pg_timeout: float):
        self.plan, self.start_method, self.pg_timeout = plan, start_method, pg_timeout
        self.handles: list[WorkerHandle] = []
        self.launcher = None
        self.ended: str | None = None  # why the workers were ended (restart on next use)
        self.started = 0  # how many times workers were started

    def dead(self) -> list[int]:
        return [h.rank for h in self.handles if h.process.exitcode is not None]

    def ended_note(self) -> str:
        """What a failed command adds once the workers were ended ("" while they live)."""
        return (f"The pool's workers were ended: {self.ended}. Its next use starts new ones."
                if not self.handles else "")

    def start(self, channel: PoolChannel) -> None:
        """Start the workers and follow them (``channel``) until each has joined the process
        group and said READY; on any failure nothing is left running."""
        launcher = launchers.make(self.start_method)
        launcher.warm()
        handles: list[WorkerHandle] = []
        op = None
        try:
            threads = launcher.threads(threads_per_worker(self.plan.world_size))
            specs = start.rank_specs(self.plan, threads=threads, pg_timeout=self.pg_timeout,
                                     pool=True)
            handles = start.start_ranks(launcher, specs, None)
            self.handles, self.launcher = handles, launcher
            # Rank 0 hosts the store (see rank/worker.py); the op passes its port on, and
            # waits for every rank's READY.
            op = channel.begin(list(range(self.plan.world_size)), None, None, join=True)
            channel.finish(op)
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
            _end(handles, launcher)
            self.handles, self.launcher = [], None
            raise
        self.ended = None
        self.started += 1

    def ensure_started(self, channel: PoolChannel) -> None:
        if not self.handles:
            why = self.ended or "it was ended"
            print(f"nbtrain: restarting the pool's {self.plan.world_size} workers ({why}); "
                  "names defined in %%ranks cells before are gone.", file=sys.stderr,
                  flush=True)
            self.start(channel)

    def kill_all(self) -> None:
        for h in self.handles:
            kill_group(h.pid, signal.SIGKILL)

    def end(self, reason: str | None, graceful: bool = False) -> None:
        """End the workers (``graceful``: ask them to exit first); ``reason``: why, said
        by the next use, which starts new ones."""
        _end(self.handles, self.launcher, graceful)
        self.handles, self.launcher = [], None
        self.ended = reason


def _end(handles: list[WorkerHandle], launcher, graceful: bool = False) -> None:
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
    return "-" if n is None else format_bytes(n)


def _close_pools() -> None:
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


__all__ = ["RankCellError", "RankPool", "active_pool"]
