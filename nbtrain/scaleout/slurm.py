"""``nbtrain.submit``: the notebook's function as a SLURM job, watched live from the notebook.

    run = nbtrain.submit(train, nodes=2, devices=4, strategy="fsdp",
                         slurm={"partition": "gpu", "time": "02:00:00"}, lr=3e-4)
    run.status        # "queued", then "running", "done" / "failed" / "stopped"
    run.wait()        # rank 0's results gathered from every rank, as launch() gives
    run.stop()        # scancel: the job and its processes are gone

The function, its arguments and what it uses from the cells travel by value (dill), as
they reach spawned workers. ``submitit`` (the ``nbtrain[slurm]`` extra) writes them to
``folder`` (on a filesystem the nodes share) and submits an sbatch job of ``nodes`` x
``devices`` tasks, started by ``srun``; each task calls ``launch()``, which sees SLURM's
step (``scaleout/clusters.py``) and runs the function as that rank. Every rank streams its
events to a listener this call opens (a token-protected port; ``listen_host`` must be
reachable from the nodes), so the run's dashboard is live in the cell. A failing rank
ends the job (``srun --kill-on-bad-exit``) and its traceback arrives as ``WorkerError``
(through the run, as a local launch's does);
the job's log files are named in ``run.remote["logs"]``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..deviceplan import DevicePlan
from ..launch import options, start
from ..launch.starting.spawn import serialize
from ..outcome import Teardown
from ..run import Run
from ..wire import encode_result
from .listen import PolledJob, RemoteFailure, Watch
from .ray import Ray, submit_ray
from .torchrun import ATTACH_ENV, RUN_ID_ENV

__all__ = ["submit"]

INSTALL = 'pip install "nbtrain[slurm]"'
POLL_S = 0.5
LINGER_S = 30.0  # how long a job whose tasks all returned may stay in the queue
# submitit's own parameters that mean what sbatch's options of the same names mean.
_SUBMITIT = {"partition", "time", "cpus_per_task", "cpus_per_gpu", "gpus_per_node",
             "gpus_per_task", "qos", "setup", "teardown", "mem", "mem_per_gpu",
             "mem_per_cpu", "comment", "constraint", "exclude", "account", "gres",
             "mail_type", "mail_user", "nodelist", "dependency", "exclusive", "job_name",
             "signal_delay_s", "srun_args"}


# the run options a submitted job decides otherwise, with why
_FIXED = {"background": (True, "submit() returns the Run at once; run.wait() blocks."),
          "timeout": (None, "a submitted job's limit is the cluster's: slurm={'time': "
                      "minutes} (SLURM ends the job then); or call run.stop().")}


@options.takes_run_options(fixed=_FIXED)
def submit(fn: Callable[..., Any], *args: Any, nodes: int = 1, devices: int = 1,
           accelerator: str = "auto", slurm: dict | None = None,
           folder: str | os.PathLike = "nbtrain-jobs", listen_host: str = "0.0.0.0",
           engine: Ray | None = None, **kwargs: Any) -> Run:
    """Submit ``fn(ctx, *args, **kwargs)`` to SLURM as ``nodes`` x ``devices`` ranks and
    return its ``Run`` at once (``run.wait()`` blocks). Names mean what ``launch()``'s do;
    ``devices`` counts per node. ``slurm``: sbatch options by name (``partition``,
    ``time`` as minutes or ``"HH:MM:SS"``, ``account``, ``mem``, ``setup`` (shell lines run
    first, e.g. ``["module load cuda"]``), ...; others go to sbatch as they are).
    ``accelerator="auto"``: one GPU per rank where ``gpus_per_node`` is asked for, else CPU
    ranks (gloo). See the module docstring for what must hold on the cluster.
    ``engine=nbtrain.Ray(address)``: on a Ray cluster instead, ``nodes`` x ``devices``
    ranks placed by Ray (``scaleout/ray.py``), where ``max_restarts`` starts them again
    from the last checkpoint after a worker or a node is lost (as ``launch()``'s; under
    SLURM, its own requeue does). The run's options, as ``launch()``'s:

        {run options}
    """
    for name, value in (("nodes", nodes), ("devices", devices)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: give a positive number of "
                             f"{'nodes' if name == 'nodes' else 'ranks per node'}.")
    given, kwargs = options.split("submit()", kwargs, _FIXED)
    given["background"] = True  # it returns at once: run.wait() blocks
    if engine is not None:
        if not isinstance(engine, Ray):
            raise TypeError(f"engine={engine!r}: give nbtrain.Ray(address), or leave it out "
                            "for SLURM.")
        return submit_ray(engine, fn, args, kwargs, given, ranks=nodes * devices,
                          accelerator=accelerator)
    try:
        import submitit
    except ImportError:
        raise ImportError(f"nbtrain.submit needs submitit: {INSTALL}") from None
    request = start.check("submit()", fn, args, kwargs, given)
    params = _sbatch_params(dict(slurm or {}))
    if accelerator == "auto":
        accelerator = "cuda" if params.get("gpus_per_node") else "cpu"
    if accelerator not in ("cpu", "cuda"):
        raise ValueError(f"accelerator={accelerator!r}: use 'auto', 'cuda' or 'cpu'.")
    if accelerator == "cuda":
        params.setdefault("gpus_per_node", devices)
    plan = DevicePlan(accelerator, tuple(range(nodes * devices)))
    backend = _Submission(submitit, nodes, devices, params, folder, listen_host)
    return start.execute(request, plan, backend)


class _Submission:
    """``submit``'s backend on the one start path (``start.execute``): the function goes
    to SLURM as a job of ``nodes`` x ``devices`` tasks (``_task``), whose ranks attach to
    a listener here; a ``_SlurmJob`` follows it through SLURM's queue to its results."""

    started_by = "slurm"
    stop_timeout = 10.0
    blocking = False
    returns_run = True

    def __init__(self, submitit, nodes: int, devices: int, params: dict, folder,
                 listen_host: str):
        self.submitit, self.nodes, self.devices = submitit, nodes, devices
        self.params, self.folder, self.listen_host = params, folder, listen_host
        self.payload: bytes | None = None

    def prepare(self, request: start.Request, plan: DevicePlan) -> start.Request:
        self.payload = serialize(request.fn, request.args, request.kwargs, request.strategy,
                                 "a SLURM job", "or define what it needs inside the function")
        # the job's rank 0 draws the base seed when none is given: the run says so
        return dataclasses.replace(request, base_seed=request.seed)

    def start(self, request: start.Request, plan: DevicePlan, run: Run):
        settings = request.telemetry
        run_id = uuid.uuid4().hex[:12]
        watch = Watch(self.listen_host, 0, dashboard=False) if settings.enabled else None
        params = dict(self.params)
        executor = self.submitit.SlurmExecutor(folder=os.fspath(self.folder))
        srun_args = ["--kill-on-bad-exit=1", *params.pop("srun_args", [])]
        executor.update_parameters(nodes=self.nodes, ntasks_per_node=self.devices,
                                   srun_args=srun_args,
                                   job_name=params.pop("job_name", f"nbtrain-{request.name}"),
                                   **params)
        environ = {RUN_ID_ENV: run_id}
        if watch is not None:
            environ[ATTACH_ENV] = watch.address
        try:
            job = executor.submit(_task, self.payload, plan.accelerator,
                                  request.for_ranks(), environ)
        except Exception:
            if watch is not None:
                watch.close()
            raise
        supervisor = _SlurmJob(run, job, plan.world_size, watch)
        if watch is not None:
            watch.expect(run_id, supervisor)
        run.remote = {"job": job.job_id, "folder": os.path.abspath(os.fspath(self.folder)),
                      "logs": [str(job.paths.stdout), str(job.paths.stderr)]}
        run.queued()
        return supervisor, [watch.close] if watch is not None else []

    def abandon(self) -> None:
        pass


def _minutes(value) -> int:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return max(1, int(value))
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", str(value).strip())
    if match is None:
        raise ValueError(f"slurm time={value!r}: give minutes or \"[D-]HH:MM:SS\".")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    return max(1, days * 1440 + hours * 60 + minutes + (seconds > 0))


def _sbatch_params(given: dict) -> dict:
    """submitit's parameters from sbatch option names (``-`` or ``_``); the others go to
    sbatch as they are."""
    params: dict[str, Any] = {}
    extra: dict[str, Any] = dict(given.pop("additional_parameters", {}) or {})
    for key, value in given.items():
        name = key.replace("-", "_")
        if name in ("nodes", "ntasks_per_node", "ntasks"):
            raise ValueError(f"slurm={{{key!r}: ...}}: give nodes= and devices= (ranks per "
                             "node) to submit() instead.")
        if name == "time":
            params["time"] = _minutes(value)
        elif name in _SUBMITIT:
            params[name] = value
        else:
            extra[name] = value
    if extra:
        params["additional_parameters"] = extra
    return params


def _task(payload: bytes, accelerator: str, options: dict[str, Any],
          environ: dict[str, str]):
    """One SLURM task: ``launch()`` as this task's rank. Rank 0 returns every rank's
    results (gathered), the others None."""
    import dill

    from ..launch import launch

    os.environ.update(environ)
    fn, args, kwargs, strategy = dill.loads(payload)
    run = launch(fn, *args, strategy=strategy, accelerator=accelerator, dashboard=False,
                 **options, **kwargs)
    return None if run is None else run.results


class _SlurmJob(PolledJob):
    """The submitted job as ``Run`` reads a supervisor: its ranks' events arrive through
    the listener; its state and results come from SLURM and submitit."""

    def __init__(self, run: Run, job, world_size: int, watch: Watch | None):
        super().__init__(run, world_size, "nbtrain-slurm")
        self.job, self.watch = job, watch
        self._written_at: float | None = None

    def request_stop(self, reason: str) -> None:
        """``run.stop()``: cancel the job (its ranks end with it)."""
        if self.done.is_set():
            return  # ended already (the listener's close asks too)
        self.teardown_cause = Teardown.STOP
        subprocess.run(["scancel", str(self.job.job_id)], capture_output=True, check=False)

    def _poll(self) -> None:
        try:
            while not self._finished():
                time.sleep(POLL_S)
            self._collect()
        except BaseException as err:  # never leave the run waiting
            self.crash = err
        finally:
            self.done.set()

    def _finished(self) -> bool:
        """The job left SLURM's queue (its processes are gone), or every task wrote its
        result file ``LINGER_S`` ago and it still lingers (a slow epilogue)."""
        if _squeue_state(self.job.job_id) is None:
            return True
        if not all(self.job.task(i).paths.result_pickle.exists()
                   for i in range(len(self.workers))):
            return False
        self._written_at = self._written_at or time.monotonic()
        return time.monotonic() - self._written_at > LINGER_S

    def _collect(self) -> None:
        if self.teardown_cause is Teardown.STOP:
            return
        deadline = time.monotonic() + 10  # result files land after the queue forgets
        while time.monotonic() < deadline and not all(
                self.job.task(i).paths.result_pickle.exists() for i in range(len(self.workers))):
            time.sleep(0.2)
        for rank in range(len(self.workers)):
            try:
                value = self.job.task(rank).result()
            except Exception as err:
                if self.failure is not None and self.failure.rank != rank:
                    continue  # ended with the job when the failing rank did (srun -K)
                if self.failure is None:
                    self.failure = RemoteFailure(
                        rank, type(err).__name__, _exception_line(str(err)), str(err)[-20_000:],
                        hint=f"The job's logs: {', '.join(self.run.remote['logs'])}")
                self.workers[rank].failure = self.failure if self.failure.rank == rank \
                    else RemoteFailure(rank, type(err).__name__, _exception_line(str(err)), "")
                continue
            if rank == 0 and value is not None:
                for r, result in enumerate(value):
                    self.workers[r].result = encode_result(result, r)
        if self.failure is None and any(w.result is None for w in self.workers.values()):
            self.failure = RemoteFailure(
                0, "JobEnded", "the SLURM job ended without every rank's result",
                "", hint=f"The job's logs: {', '.join(self.run.remote['logs'])}")


def _exception_line(text: str) -> str:
    """The exception's line of a remote error's text (its last non-empty line)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else text[:500]


def _squeue_state(job_id: str) -> str | None:
    """The job's state in SLURM's queue (``PENDING``, ``RUNNING``, ...), None once gone."""
    done = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                          capture_output=True, text=True, check=False)
    state = done.stdout.strip().splitlines()
    return state[0] if done.returncode == 0 and state else None

