"""The one path every run walks, whatever starts its ranks.

``launch()``, ``RankPool.launch()`` (and the picker, through ``launch()``), torchrun's
ranks and ``nbtrain.submit`` each make a checked ``Request`` (``check``), a device plan
and a ``Backend``, and hand them to ``execute``:

    given, kwargs = options.split(who, kwargs)      # the run's options (options.py)
    request = check(who, fn, args, kwargs, given)   # before anything
    run = execute(request, plan, backend)
      request = backend.prepare(request, plan)   # its own checks; what it decides first
      request.strategy.check(plan)               # can the strategy run on these devices
      run, view = open_run(request, plan, ...)   # the Run, its header in the cell
      outcome, cleanup = backend.start(request, plan, run)   # the ranks start
      run.follow(outcome, cleanup); outcome.start()          # and are followed
      finish(run, view, request.background)      # the figure, then wait in the cell

The backends: ``launch/__init__.py``'s ``OneShot`` (a launcher starts the ranks, a
``Supervisor`` follows them), ``launch/pool/ranks.py``'s warm ranks (a ``PoolOp``),
``scaleout/torchrun.py``'s rank in this process (registered here: ``in_process``), and
``scaleout/slurm.py``'s job. ``rank_specs`` and ``start_ranks`` are what the two local
backends share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .. import seeding, strategies
from ..cells import current_kernel
from ..outcome import Outcome
from ..run import Run
from ..spec import WORKER_ENV, WorkerSpec
from ..strategies import Strategy
from ..telemetry.settings import Telemetry
from . import calls
from .following.watch import kill_group
from .options import RunOptions
from .starting.launcher import Launcher, WorkerHandle, interrupts_deferred

HOST = "127.0.0.1"  # where the ranks of this machine meet: their store, the listener


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request(RunOptions):
    """A run as asked for, checked (``check``): its options (``options.py``; the strategy
    bound to the function) and the call."""

    fn: Callable[..., Any]  # what the ranks call with ctx first (calls.py)
    args: tuple
    kwargs: dict  # fn's own keywords; the strategy's options are in ``strategy``
    strategy: Strategy
    base_seed: int  # rank r starts from base_seed + r; ``seed`` is as given (None: fresh)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", "fn")

    @property
    def data_seed(self) -> int:
        """``ctx.dataloader``'s shuffle seed, the same on every rank."""
        return self.seed if self.seed is not None else 0


def check(who: str, fn, args: tuple, kwargs: dict, given: dict[str, Any]) -> Request:
    """Everything about a run that can be wrong, checked before anything starts: how
    ``fn`` is called (with ``ctx`` or without, which keywords are the strategy's) and the
    run's options ``given`` (``options.split`` picked them out of the call's keywords)."""
    refuse_in_a_rank(who)
    if not callable(fn):
        raise TypeError(f"{who} takes the function to run first; got {type(fn).__name__}.")
    options = RunOptions.check(given)
    call, own, chosen = calls.bind(who, fn, args, kwargs, strategies.get(options.strategy))
    fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(RunOptions)}
    return Request(**{**fields, "strategy": chosen}, fn=call, args=tuple(args), kwargs=own,
                   base_seed=seeding.base_seed(options.seed))


def refuse_in_a_rank(who: str) -> None:
    """A rank of a run or a pool starts no ranks of its own (its own would fork from it,
    and their process group would meet the run's)."""
    if os.environ.get(WORKER_ENV):
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        raise RuntimeError(
            f"nbtrain's {who} was called in rank {rank} of {world}: a rank starts no ranks "
            "of its own. Call the function here instead (it runs as this rank, in the "
            "run's process group), or launch it from the notebook.")


class Backend(Protocol):
    """What starts a run's ranks and follows them (see the module docstring)."""

    started_by: str  # what run.start_method says: "fork", "spawn pool", "torchrun", ...
    stop_timeout: float  # how long stopping the run may take
    blocking: bool  # start() runs the ranks to their end here (a rank in this process)
    returns_run: bool  # execute() gives the Run back (False: a torchrun rank but 0)

    def prepare(self, request: Request, plan) -> Request:
        """Its own checks, before anything is shown; what it decides for the whole run
        (a job-wide seed) goes into the request it returns."""

    def start(self, request: Request, plan, run: Run) -> tuple[Outcome, list[Callable]]:
        """Start the ranks; what ``run`` follows them with, and what to close after."""

    def abandon(self) -> None:
        """``start`` was not reached or failed: let go of what ``prepare`` took."""

    # Optional: ``again()``, a new backend of the same kind for the next attempt of a
    # run with ``max_restarts`` (a backend without it cannot be restarted by nbtrain).


def execute(request: Request, plan, backend: Backend) -> Run | None:
    """The path every run walks: the backend's checks and the strategy's, the Run and its
    view, the ranks started and handed to the run as one step (an interrupt meanwhile
    stops the run), then the wait in the cell (or the run at once, in the background)."""
    try:
        if request.max_restarts and not hasattr(backend, "again"):
            raise ValueError(f"max_restarts: a run started by {backend.started_by} is not "
                             "restarted by nbtrain (under torchrun, give torchrun's own "
                             "--max-restarts); launch() restarts the ranks it starts.")
        request = backend.prepare(request, plan)
        request.strategy.check(plan)
        _check_planned(request, plan)
        run, view = open_run(request, plan, backend.started_by)
    except BaseException:
        backend.abandon()
        raise
    if backend.blocking:  # the ranks run to their end in start(): draw while they do
        if view is not None:
            view.start()
            view = None
        outcome, cleanup = backend.start(request, plan, run)
        run.follow(outcome, cleanup)
        outcome.start()
    else:
        with handing_over(run, backend.stop_timeout):
            try:
                outcome, cleanup = backend.start(request, plan, run)
            except BaseException:
                backend.abandon()
                raise
            run.follow(outcome, cleanup, _restarter(request, plan, backend, run),
                       request.max_restarts)
            outcome.start()
    run = finish(run, view, request.background, backend.stop_timeout)
    return run if backend.returns_run else None


def _restarter(request: Request, plan, backend: Backend, run: Run):
    """What starts the next attempt of ``run`` (``max_restarts``): a new backend of the
    same kind, the same request going on from the last complete checkpoint (or the one
    the run was launched with, or none)."""
    if not request.max_restarts:
        return None

    def restart(checkpoints: list[str], announce: Callable[[str | None], None]):
        from ..checkpoint import exists

        resume = next((p for p in reversed(checkpoints) if exists(p)), request.resume)
        again = backend.again()
        attempt = again.prepare(dataclasses.replace(request, resume=resume), plan)
        announce(resume)
        return again.start(attempt, plan, run)

    return restart


# What runs a launch in this process instead of starting ranks, when this process is one
# already (torchrun's, SLURM's srun, LSF's jsrun, Kubeflow's): scaleout/torchrun.py
# registers itself here, so launch/ does not import scale-out. Each returns the backend
# and the plan when this process is such a rank, else None.
InProcess = Callable[[str], "tuple[Backend, Any] | None"]
_IN_PROCESS: list[InProcess] = []


def register_in_process(detect: InProcess) -> None:
    if detect not in _IN_PROCESS:
        _IN_PROCESS.append(detect)


def in_process(accelerator: str) -> tuple[Backend, Any] | None:
    """The registered backend (and its plan) that runs a launch as this process's rank,
    or None: ranks are to be started."""
    for detect in _IN_PROCESS:
        found = detect(accelerator)
        if found is not None:
            return found
    return None


def _check_planned(request: Request, plan) -> None:
    """``planned=``: a plan of as many ranks as this run has, with a row for its strategy."""
    planned = request.planned
    if planned is None:
        return
    if planned.world_size != plan.world_size:
        raise ValueError(f"planned=: the plan is of {planned.world_size} ranks and this run "
                         f"has {plan.world_size}; plan again with devices={plan.world_size}.")
    strategy = request.strategy
    try:
        planned.row(strategy.name, bool(strategy.activation_checkpointing))
    except KeyError as err:
        raise ValueError(f"planned=: {err.args[0]}. Plan with strategies=[{strategy.name!r}, "
                         "...] (and checkpointing=True for activation checkpointing).") \
            from None


def open_run(request: Request, plan, started_by: str):
    """The run's ``Run`` and, unless turned off, its view (the header shows now; nothing
    heavy is built before the ranks start)."""
    run = Run(request.name, request.strategy, plan, started_by, request.timeout,
              request.sinks, seed=request.base_seed)
    run.planned = request.planned
    view = None
    if request.dashboard is not False and request.telemetry.enabled:
        view = run.open_view(request.dashboard)
    return run, view


def rank_specs(plan, *, threads: int | None, pg_timeout: float,
               telemetry_address: tuple[str, int] | None = None, token: str = "",
               telemetry: Telemetry | None = None, resume: str | None = None,
               seed: int = 0, data_seed: int = 0, pool: bool = False) -> list[WorkerSpec]:
    """One ``WorkerSpec`` per rank of ``plan`` on this machine (rank 0 hosts the store)."""
    return [WorkerSpec(
        rank=rank, local_rank=rank, world_size=plan.world_size,
        accelerator=plan.accelerator,
        device_index=index if plan.accelerator == "cuda" else None,
        backend=plan.backend, store_host=HOST, store_port=None,
        telemetry_address=telemetry_address, telemetry_token=token, num_threads=threads,
        pg_timeout_s=pg_timeout, parent_pid=os.getpid(),
        die_with_parent=threading.current_thread() is threading.main_thread(),
        telemetry=telemetry or Telemetry(), resume_from=resume, seed=seed,
        data_seed=data_seed, pool=pool, argv=calls.rank_argv(),
        shell=current_kernel() is not None)
        for rank, index in enumerate(plan.indices)]


def start_ranks(launcher: Launcher, specs: list[WorkerSpec], payload: Any
                ) -> list[WorkerHandle]:
    """Start every rank; if one cannot start (or an interrupt comes), end those started."""
    handles: list[WorkerHandle] = []
    try:
        for spec in specs:
            with interrupts_deferred():  # a started rank always has a handle
                handles.append(launcher.start(spec, payload))
    except BaseException:
        for h in handles:
            kill_group(h.pid, signal.SIGKILL)
            h.process.join(5)
            h.commands.close()
        raise
    return handles


def finish(run: Run, view, background: bool, stop_timeout: float = 10.0) -> Run:
    """Build the view's figure (the ranks are starting), then return the run at once
    (background) or wait for it in the cell."""
    if view is not None:
        view.start()
    return run if background else wait_in_cell(run, stop_timeout)


def wait_in_cell(run: Run, stop_timeout: float = 10.0) -> Run:
    """Block until ``run`` ends; an interrupt stops it and says how to get it back."""
    try:
        run.wait()
    except KeyboardInterrupt:
        _stop_interrupted(run, stop_timeout)
    return run


@dataclasses.dataclass
class Handover:
    run: Run | None = None  # set once the run is made


@contextlib.contextmanager
def handing_over(run: Run | None = None, stop_timeout: float = 10.0):
    """Start the ranks and hand them to their run as one step: an interrupt that arrives
    meanwhile is taken when the block ends, once the run follows the ranks, and stops
    the run as an interrupt in the wait does (no rank is left running unfollowed).
    Yields a ``Handover``; set its ``run`` if the run is made inside the block."""
    handover = Handover(run)
    try:
        with interrupts_deferred():
            yield handover
    except KeyboardInterrupt:
        if handover.run is not None:
            _stop_interrupted(handover.run, stop_timeout)
        raise


def _stop_interrupted(run: Run, stop_timeout: float) -> None:
    run.stop(reason="interrupted", timeout=stop_timeout)
    step = run.last_step
    at = f" at step {step}" if step is not None else ""
    # A new exception, raised here: the traceback is the cell and this line, not the
    # threading frames the wait was in.
    raise KeyboardInterrupt(f"the run was stopped{at}; nbtrain.last_run() returns it, "
                            "with its history.") from None
