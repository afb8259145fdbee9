"""How workers start, run and end: ``launch()`` checks its arguments, picks a launcher
(fork, fork server or spawn), starts one worker per device and hands them to a supervisor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cells import busy_while_blocking
from ..restarts import collective_timeout
from ..run import Run
from ..strategies import Strategy
from ..telemetry.channel import TelemetryServer
from . import calls, options, start
from .following.supervisor import Supervisor
from .starting import launchers
from .starting.devices import parse_devices, threads_per_worker
from .starting.launcher import Launcher

__all__ = ["launch"]


@options.takes_run_options()
def launch(fn: Callable[..., Any], *args: Any, devices: int | str | list[int] = "auto",
           accelerator: str = "auto", start_method: str = "auto", **kwargs: Any) -> Run:
    """Run ``fn(ctx, *args, **kwargs)`` once per rank, one rank per device.

    A function written without ``ctx`` (for torchrun or ``notebook_launcher``: ``def
    main():``, ``def main(cfg):``) is called as it is, ``fn(*args, **kwargs)``: which one
    the arguments fit decides (a first parameter named ``ctx`` when both do). Keywords
    that are the run's options (below) are launch()'s; keywords that ``fn`` does not name
    and that are options of the strategy (``activation_checkpointing="auto"``,
    ``mixed_precision="bf16"``, ``sync_batchnorm=True``, FSDP's ``wrap=``, ...) configure
    the strategy; anything else ``fn`` cannot take fails here, before any worker starts.

    Args:
        devices: a count, a list of GPU indices, ``"auto"`` (all GPUs; 1 process on CPU)
            or ``-1`` (all).
        accelerator: ``"auto"``, ``"cuda"`` or ``"cpu"`` (gloo processes).
        start_method: ``"auto"`` (fork when safe, else the fork server, with a warning
            saying why), ``"fork"`` (workers are copies of the kernel), ``"forkserver"``
            (forked from a clean process that has imported torch; the first launch starts
            it, later ones are warm) or ``"spawn"`` (a new interpreter per worker).
        {run options}

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
    given, kwargs = options.split("launch()", kwargs)
    calls.warn_shadowed("launch()", fn, calls.given(
        launch, devices=devices, accelerator=accelerator, start_method=start_method,
        **given))
    request = start.check("launch()", fn, args, kwargs, given)
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
                pg_timeout=request.collective_timeout or collective_timeout(
                    run.timeout, request.max_restarts),
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
