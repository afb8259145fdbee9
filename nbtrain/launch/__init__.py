"""How workers start, run and end: ``launch()`` checks its arguments, picks a launcher
(fork, fork server or spawn), starts one worker per device and hands them to a supervisor."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..cells import busy_while_blocking
from ..restarts import collective_timeout
from ..run import Run
from ..strategies import Strategy
from ..telemetry.channel import TelemetryServer
from ..telemetry.settings import Telemetry
from ..telemetry.sinks import Sink
from . import calls, start
from .following.supervisor import Supervisor
from .starting import launchers
from .starting.devices import parse_devices, threads_per_worker
from .starting.launcher import Launcher

__all__ = ["launch"]


def launch(fn: Callable[..., Any], *args: Any, devices: int | str | list[int] = "auto",
           strategy: str | Strategy = "ddp", accelerator: str = "auto",
           start_method: str = "auto", background: bool = False,
           timeout: float | None = None, telemetry: bool | Telemetry = True,
           sinks: list[Sink] = (), dashboard: bool | str = "auto",
           resume: str | os.PathLike | None = None, seed: int | None = None,
           max_restarts: int = 0, **kwargs: Any) -> Run:
    """Run ``fn(ctx, *args, **kwargs)`` once per rank, one rank per device.

    A function written without ``ctx`` (for torchrun or ``notebook_launcher``: ``def
    main():``, ``def main(cfg):``) is called as it is, ``fn(*args, **kwargs)``: which one
    the arguments fit decides (a first parameter named ``ctx`` when both do). Keywords
    that ``fn`` does not name and that are options of the strategy
    (``activation_checkpointing="auto"``, ``mixed_precision="bf16"``,
    ``sync_batchnorm=True``, FSDP's ``wrap=``, ...) configure the strategy; anything else
    ``fn`` cannot take fails here, before any worker starts.

    Args:
        devices: a count, a list of GPU indices, ``"auto"`` (all GPUs; 1 process on CPU)
            or ``-1`` (all).
        strategy: a registered name (``nbtrain.strategies.names()``) or a Strategy,
            e.g. ``nbtrain.strategies.get("fsdp", mixed_precision="bf16")``.
        accelerator: ``"auto"``, ``"cuda"`` or ``"cpu"`` (gloo processes).
        start_method: ``"auto"`` (fork when safe, else the fork server, with a warning
            saying why), ``"fork"`` (workers are copies of the kernel), ``"forkserver"``
            (forked from a clean process that has imported torch; the first launch starts
            it, later ones are warm) or ``"spawn"`` (a new interpreter per worker).
        background: return the ``Run`` at once instead of blocking until it ends.
        timeout: seconds after which the run is ended and an error names the ranks still
            running (a hang in a collective, for instance).
        telemetry: what workers stream to ``run.history``: ``True`` (metrics, step
            times, memory by category every 10 steps, communication per step),
            ``False`` (nothing), or ``nbtrain.Telemetry(memory_every=..., comm=...)``.
        sinks: extra outputs that receive the events (objects with
            ``on_events(events)`` and ``close(run)``; see ``nbtrain.telemetry.sinks``).
        dashboard: the run's live view in the cell. ``"auto"``/``True``: the live widget
            dashboard where a widget frontend is connected (JupyterLab, Notebook 7), a
            static figure refreshed every few seconds in other kernels (nbclient, VS Code
            or Colab without widgets), text progress in a terminal; ``"widget"``,
            ``"static"``, ``"text"`` force one; ``False`` shows nothing. The environment
            variable ``NBTRAIN_DASHBOARD`` (same values, or ``off``) overrides ``"auto"``.
        resume: a checkpoint written by ``ctx.save``; every rank finds it in
            ``ctx.resume_from`` (None without it) and goes on from it with
            ``ctx.load(ctx.resume_from, state)``.
        seed: the base seed (0 to 2**32 - 1). Rank r seeds torch, ``random`` and numpy
            with ``seed + r`` before ``fn`` runs, after fork and spawn alike, and
            ``ctx.dataloader`` shuffles with ``seed`` on every rank. None (default): a
            fresh base seed per launch (``run.seed`` keeps it; pass it to repeat the run)
            and shuffling with seed 0. Seeding inside ``fn`` overrides it, as usual.
        max_restarts: when a rank dies (a signal such as the OOM killer's, an exit
            without returning, a collective that timed out), end every rank and start
            again, on the same devices, up to this many times; each attempt finds the
            last checkpoint ``ctx.save`` completed in ``ctx.resume_from`` (the one given
            as ``resume``, or None, before any). An exception raised by ``fn`` is not
            retried. The same ``Run`` goes on; ``run.attempts`` lists the restarts.

    Returns the ``Run``. Blocking, a failed rank raises ``nbtrain.WorkerError`` here; an
    interrupt (Ctrl-C, the stop button) ends every worker and raises KeyboardInterrupt
    (``nbtrain.last_run()`` then gives the run back, with its history).

    Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``
    set), in a SLURM step of several tasks (``srun -n 4 python train.py``), under LSF's
    ``jsrun`` or in a Kubeflow PyTorchJob (``scaleout/clusters.py``), nothing is started:
    ``fn`` runs in this process as that rank, on its ``LOCAL_RANK``'s GPU (or CPU);
    ``devices``, ``start_method``, ``background`` and ``timeout`` are the launcher's
    business and ignored. Rank 0 gets the finished ``Run``
    (every rank's results and history, gathered), the other ranks ``None``; a failing
    rank raises ``WorkerError`` in its process. ``NBTRAIN_ATTACH=HOST:PORT:TOKEN`` (from
    ``nbtrain.listen()``) streams every rank's events to that notebook.
    """
    options = start.options(locals())
    calls.warn_shadowed("launch()", fn, calls.given(
        launch, devices=devices, accelerator=accelerator, start_method=start_method,
        **options))
    request = start.check("launch()", fn, args, kwargs, **options)
    # Ranks started by torchrun or a cluster (SLURM's srun, LSF's jsrun, Kubeflow): this
    # process is one, and a scale-out backend runs the function here (scaleout/).
    found = start.in_process(accelerator)
    if found is not None:
        backend, plan = found
        return start.execute(request, plan, backend)
    with busy_while_blocking():  # from here, widget traffic must not read as "Idle"
        plan = parse_devices(devices, accelerator)
        method = _start_method(start_method, request.strategy, plan.accelerator)
        return start.execute(request, plan, OneShot(method))


def _start_method(requested: str, strategy: Strategy, accelerator: str) -> str:
    preferred = strategy.start_method
    if preferred and requested not in ("auto", preferred):
        raise ValueError(f"strategy {strategy.name!r} means start_method={preferred!r}, but "
                         f"start_method={requested!r} was given. Use strategy='ddp' to choose "
                         "the start method freely.")
    return launchers.choose_start_method(preferred or requested, accelerator)


class OneShot:
    """A launch's ranks on this machine: started by the launcher of ``method`` (rank 0
    hosts the rendezvous store: see ``rank/worker.py``), followed by a ``Supervisor``
    until they end, which passes the store's port on and watches them join."""

    blocking = False
    returns_run = True
    stop_timeout = 10.0

    def __init__(self, method: str):
        self.started_by = method
        self.launcher: Launcher = launchers.make(method)
        self.payload: Any = None

    def prepare(self, request: start.Request, plan) -> start.Request:
        # what each rank receives, checked now (a spawned rank needs it picklable)
        self.payload = self.launcher.prepare(request.fn, request.args, request.kwargs,
                                             request.strategy)
        return request

    def start(self, request: start.Request, plan, run: Run):
        launcher = self.launcher
        cleanup: list[Callable[[], None]] = [launcher.close]
        try:
            server = None
            if request.telemetry.enabled or request.max_restarts:  # (telemetry off: the
                # checkpoints' reports alone, which a restart goes on from)
                server = TelemetryServer(run.receive, host=start.HOST)
                ranks = set(range(plan.world_size))
                cleanup.append(lambda: server.drain_and_close(ranks))
            threads = launcher.threads(threads_per_worker(plan.world_size))
            specs = start.rank_specs(
                plan, threads=threads,
                pg_timeout=collective_timeout(run.timeout, request.max_restarts),
                telemetry_address=server.address if server else None,
                token=server.token if server else "", telemetry=request.telemetry,
                resume=request.resume, seed=run.seed, data_seed=request.data_seed)
            handles = start.start_ranks(launcher, specs, self.payload)
        except BaseException:
            for close in cleanup:
                close()
            raise
        return Supervisor(handles, run.write_output, run.deadline()), cleanup

    def abandon(self) -> None:
        pass  # nothing is held before start()

    def again(self) -> OneShot:
        """The next attempt's (``max_restarts``): the same start method, a new launcher."""
        return OneShot(self.started_by)
