"""``pool.launch``'s backend on the one start path (``start.execute``): a run on a
``RankPool``'s warm ranks."""

from __future__ import annotations

from typing import Any

from ...run import Run
from ...wire import LaunchRun, RunSettings
from .. import start
from .op import INTERRUPT_GRACE_S


class PoolLaunch:
    """``pool.launch``'s backend on the one start path (``start.execute``): the run goes
    to the pool's warm ranks as a ``LaunchRun`` command, followed by a ``PoolOp``; the
    pool is busy from ``prepare`` until the run's telemetry is closed."""

    blocking = False
    returns_run = True
    stop_timeout = INTERRUPT_GRACE_S + 10

    def __init__(self, pool: Any):  # a RankPool (pool.py builds this; no import back)
        self.pool = pool
        self.started_by = f"{pool.start_method} pool"
        self.payload: bytes | None = None
        self.claimed = False

    def prepare(self, request: start.Request, plan) -> start.Request:
        from ..starting.spawn import serialize

        pool, chosen = self.pool, request.strategy
        if chosen.start_method and chosen.start_method != pool.start_method:
            raise ValueError(f"strategy {chosen.name!r} means start_method="
                             f"{chosen.start_method!r}, but this pool's workers were started "
                             f"by {pool.start_method}. Use strategy='ddp' (the same DDP), or "
                             f"a pool with start_method={chosen.start_method!r}.")
        chosen.check(plan)  # before the pool starts (the path checks it again: cheap)
        self.payload = serialize(request.fn, request.args, request.kwargs, chosen,
                                 "the pool's workers", "or pass it as an argument")
        channel = pool.channel
        channel.settle()
        channel.claim("launch")
        self.claimed = True
        channel.heal()  # a rank that died since the last command: new workers (no run yet)
        return request

    def start(self, request: start.Request, plan, run: Run):
        from ...telemetry.channel import TelemetryServer

        pool = self.pool
        settings = request.telemetry
        # with telemetry off, restarts still hear of checkpoints (ctx.save's reports)
        server = (TelemetryServer(run.receive, host=start.HOST)
                  if settings.enabled or request.max_restarts else None)
        try:
            run_settings = RunSettings(
                telemetry_address=server.address if server else None,
                telemetry_token=server.token if server else "", telemetry=settings,
                resume_from=request.resume, seed=request.base_seed,
                data_seed=request.data_seed)
            deadline = run.deadline()
            op = pool.channel.begin(list(range(pool.world_size)),
                             LaunchRun(self.payload, run_settings), deadline,
                             emit=run.write_output)
        except BaseException:
            if server is not None:
                server.close()
            raise
        ranks = set(range(pool.world_size))

        def after() -> None:
            try:
                if server is not None:
                    server.drain_and_close(ranks)
                pool.channel.finish(op)
                note = pool.channel.note(op)  # the run's error says what became of us
                for f in op.failures if note else ():
                    f.hint = (f.hint + "\n" + note).strip()
            finally:
                pool.channel.release()

        return op, [after]

    def again(self) -> PoolLaunch:
        """The next attempt's (``max_restarts``): the same pool, whose workers a dead rank
        ended; ``prepare`` starts new ones (``PoolChannel.heal``)."""
        return PoolLaunch(self.pool)

    def abandon(self) -> None:
        if self.claimed:
            self.pool.channel.release()
