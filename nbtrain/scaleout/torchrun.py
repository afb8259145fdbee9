"""``launch()`` inside a process that torchrun (or another elastic launcher) started.

torchrun already made the processes: each one is a rank (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` from its rendezvous). ``launch()`` then
starts nothing: it joins the process group through ``env://`` and runs ``fn(ctx)`` here,
through the worker's own ``execute`` (same ``Context``, strategies, seeding rule,
checkpoints, result encoding). It returns, so the script goes on (a second ``launch()``
reuses the process group).

What each rank gets back: rank 0 a finished ``Run`` whose ``results`` hold every rank's
return value and whose ``history`` every rank's events (both gathered to rank 0 at the
end); the other ranks ``None``. A failing rank raises ``WorkerError`` in its own process,
so torchrun sees it fail and ends the others. With ``NBTRAIN_ATTACH`` set (``nbtrain
run --attach``), every rank also streams its events to a notebook's ``nbtrain.listen()``.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from ..deviceplan import DevicePlan
from ..errors import WorkerError
from ..launch.start import Request, register_in_process
from ..launch.starting.devices import resolve_accelerator
from ..outcome import Reported
from ..rank.worker import execute
from ..run import Run
from ..spec import WORKER_ENV, WorkerSpec
from ..telemetry.channel import parse_address
from ..telemetry.client import TelemetryClient
from ..telemetry.events import Event, decode, encode
from ..wire import FAILURE, decode_failure, label
from . import clusters

ATTACH_ENV = "NBTRAIN_ATTACH"
RUN_ID_ENV = "NBTRAIN_RUN_ID"  # the run's id for the listener (nbtrain.submit sets it)
_NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_warned_attach = False


def detected(environ=os.environ) -> bool:
    """True in a process torchrun started: its rank variables are all set (and it is not
    one of nbtrain's own workers, which set them too)."""
    return all(environ.get(k) for k in _NEEDED) and not environ.get(WORKER_ENV)


class _Finished:
    """What ``Run`` reads from a supervisor, for ranks that already ran in-process."""

    crash = None
    teardown_cause = None
    timed_out_ranks = ()
    note = None

    def __init__(self, results: list[bytes]):
        self.done = threading.Event()
        self.done.set()
        self.workers = {rank: Reported(data) for rank, data in enumerate(results)}

    def start(self) -> None:
        pass  # nothing to follow: they ran

    def root_failure(self):
        return None

    def request_stop(self, reason: str) -> None:
        pass


class _Tee:
    """The ``ctx``'s telemetry in a torchrun rank: each event is kept (rank 0 hands it to
    its ``Run`` at once) and, when attached, sent on to a listener."""

    def __init__(self, rank: int, keep, remote: TelemetryClient | None):
        self.rank = rank
        self.dropped = 0
        self._keep = keep
        self.remote = remote

    def send(self, event: Event) -> None:
        self._keep(event)
        if self.remote is not None:
            self.remote.send(event)

    def flush(self, timeout: float = 5.0) -> bool:
        """What is queued for the listener is on the wire (kept events are at once)."""
        return self.remote.flush(timeout) if self.remote is not None else True

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


class InProcessRank:
    """``launch()`` in a process torchrun (or srun, jsrun, a PyTorchJob) started: this
    process is one rank. ``fn(ctx, *args, **kwargs)`` runs here, to its end, inside
    ``start``; rank 0's ``Run`` gets every rank's results and events, gathered (the other
    ranks' ``launch()`` returns None). See the module docstring."""

    blocking = True
    stop_timeout = 10.0

    def __init__(self, started_by: str, env=os.environ):
        self.started_by = started_by
        self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local_rank = int(env["LOCAL_RANK"])
        self.returns_run = self.rank == 0
        self.run_id = ""
        self.pg_timeout = 1800.0

    def plan(self, accelerator: str) -> DevicePlan:
        return DevicePlan(resolve_accelerator(accelerator), tuple(range(self.world_size)))

    def prepare(self, request: Request, plan: DevicePlan) -> Request:
        import torch.distributed as dist

        if self.started_by == "torchrun":
            end_with_agent(os.getppid(), self.rank)
        request.strategy.check(plan)  # before the group: a wrong strategy fails alone
        _join(plan, self.local_rank, request.collective_timeout or self.pg_timeout)  # kept
        # for a later launch() (which finds the group made: its own wait is the first's)
        # One base seed and run id for the whole job, drawn on rank 0 (nbtrain.submit
        # names the run, so the notebook's listener knows it as its own).
        run_id = os.environ.get(RUN_ID_ENV) or uuid.uuid4().hex[:12]
        shared = [request.base_seed, run_id] if self.rank == 0 else [None, None]
        dist.broadcast_object_list(shared, src=0)
        base_seed, self.run_id = shared
        # only rank 0 shows the run; the others keep its events to gather them there
        return dataclasses.replace(request, base_seed=base_seed,
                                   dashboard=request.dashboard if self.rank == 0 else False)

    def start(self, request: Request, plan: DevicePlan, run: Run):
        env = os.environ
        rank, world_size = self.rank, self.world_size
        spec = WorkerSpec(
            rank=rank, local_rank=self.local_rank, world_size=world_size,
            accelerator=plan.accelerator,
            device_index=self.local_rank if plan.accelerator == "cuda" else None,
            backend=plan.backend, store_host=env["MASTER_ADDR"],
            store_port=int(env["MASTER_PORT"]), telemetry_address=None, telemetry_token="",
            num_threads=None, pg_timeout_s=self.pg_timeout, parent_pid=os.getppid(),
            die_with_parent=False, telemetry=request.telemetry, resume_from=request.resume,
            seed=request.base_seed, data_seed=request.data_seed)
        kept: list[Event] = []
        tee = None
        if request.telemetry.enabled:  # the same on every rank: _attach's collective matches
            remote = _attach(spec, self.run_id, request.name, request.strategy.name)
            tee = _Tee(rank, run.receive if rank == 0 else kept.append, remote)
        message = execute(spec, (request.fn, request.args, request.kwargs, request.strategy),
                          telemetry=tee)
        if tee is not None and tee.remote is not None and tee.remote.lost:
            print(f"nbtrain: rank {rank} lost the listener at {_shown(env[ATTACH_ENV])} "
                  f"mid-run ({tee.remote.lost}); training went on without it.",
                  file=sys.stderr, flush=True)
        if message[:1] == FAILURE:
            _raise(message)
        gathered = _gather_to_rank0(
            (message, time.monotonic(), [encode(e) for e in kept]), rank, world_size)
        if rank != 0:  # its Run is a shell nobody reads (launch() returns None here)
            return _Finished([message] * world_size), []
        now = time.monotonic()
        for then, rank_events in [(then, events) for _, then, events in gathered][1:]:
            offset = now - then  # onto rank 0's clock (other hosts have their own)
            for data in rank_events:
                event = decode(data)
                if event is not None:
                    run.receive(dataclasses.replace(event, t=event.t + offset))
        return _Finished([m for m, _, _ in gathered]), []

    def abandon(self) -> None:
        pass


# The handles of the last gather's collectives, kept until the next gather (or exit), so
# the last reference to a finished collective is the main thread's. Dropped by a gloo
# worker thread instead, its destructor needs the GIL, and at interpreter exit that
# thread is ended inside it: std::terminate, SIGABRT.
_LAST_GATHER: list[Any] = []


def _gather_to_rank0(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere): ``gather_object``'s job, done
    with async collectives whose handles outlive their worker threads' part."""
    import pickle

    import torch
    import torch.distributed as dist

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.long)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world_size)]
    sized = dist.all_gather(sizes, size, async_op=True)
    sized.wait()
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)] \
        if rank == 0 else None
    gathered = dist.gather(buffer, out, dst=0, async_op=True)
    gathered.wait()
    _LAST_GATHER[:] = [sized, gathered]
    if out is None:
        return None
    return [pickle.loads(t[:int(n)].numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]


_agent_watched: int | None = None


def end_with_agent(agent: int, rank: int, every_s: float = 0.5) -> None:
    """End this rank when torchrun's agent (its parent, ``agent``) is gone.

    The agent starts each rank in a session of its own and ends them itself, unless it
    is killed (a SIGKILL from a timeout, the OOM killer, a notebook ending the command):
    then its ranks stay, waiting in the process group for peers that will not come (seen:
    two ranks of a restarted attempt in gloo's connect for over an hour). A thread
    notices the parent change and ends the process; ``PR_SET_PDEATHSIG`` would follow the
    agent's thread that started the rank, not the agent.
    """
    global _agent_watched
    if _agent_watched == agent or agent <= 1:  # watched already, or no parent to follow
        return
    _agent_watched = agent

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(every_s)
        print(f"nbtrain: rank {rank}: torchrun's agent (pid {agent}) is gone; ending this "
              "rank.", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="nbtrain-agent-watch", daemon=True).start()


def _join(plan: DevicePlan, local_rank: int, timeout_s: float) -> None:
    """Join torchrun's process group (env://), unless the script (or an earlier
    ``launch()``) already did."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    init: dict[str, Any] = dict(backend=plan.backend, init_method="env://", timeout=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts (torch 2.13), and env:// adds no
        # prefix per attempt: a restarted rank 0 can read the dead attempt's address of a
        # peer that has not written its new one yet and fail ("connectFullMesh failed ...
        # Connection refused"; plain torchrun with DDP does too; torch's issue 135712).
        # A prefix per attempt (the count agrees on one node; `nbtrain run` sets
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead, which holds across nodes too).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timeout)
        init = dict(backend=plan.backend, timeout=timeout,
                    store=dist.PrefixStore(f"nbtrain/attempt_{attempt}/", store),
                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if plan.accelerator == "cuda":
        torch.cuda.set_device(local_rank)
        init["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**init)
    # The group nbtrain made, nbtrain ends when the script does: left to the interpreter's
    # exit, its C++ threads are destroyed still running (SIGABRT), and the other agent
    # waits for its timeout.
    atexit.register(_leave, dist)


def _leave(dist) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _raise(message: bytes) -> None:
    body = decode_failure(message)
    if body.type == "KeyboardInterrupt":
        raise KeyboardInterrupt(body.message)
    raise WorkerError(body.rank, body.type, body.message, label(body.traceback, body.rank),
                      hint=body.hint)


def _attach(spec: WorkerSpec, run_id: str, name: str, strategy: str) -> TelemetryClient | None:
    """A client to the listener named by ``NBTRAIN_ATTACH``, or None; a listener that
    cannot be reached or refuses the token is said once (rank 0, for the whole job) and
    training goes on."""
    import torch.distributed as dist

    address = os.environ.get(ATTACH_ENV, "").strip()
    client, why = None, ""
    # Every rank takes part in the all-gather below, attached or not, so a node that
    # lacks NBTRAIN_ATTACH cannot leave the others in a different collective.
    if address:
        got = _connect(spec, address, run_id, name, strategy)
        if isinstance(got, TelemetryClient):
            client = got
        else:
            why = got
    failures: list[Any] = [None] * spec.world_size
    dist.all_gather_object(failures, why)
    global _warned_attach
    if spec.rank == 0 and any(failures) and not _warned_attach:
        _warned_attach = True
        ranks = [r for r, w in enumerate(failures) if w]
        reason = next(w for w in failures if w)
        print(f"nbtrain: could not attach to {_shown(address)} (rank{'s' * (len(ranks) > 1)} "
              f"{', '.join(map(str, ranks))}: {reason}); training goes on without it.",
              file=sys.stderr, flush=True)
    return client


def _connect(spec: WorkerSpec, address: str, run_id: str, name: str,
             strategy: str) -> TelemetryClient | str:
    """A client to the listener at ``address``, or why there is none."""
    try:
        host, port, token = parse_address(address)
        hello = {"run": run_id, "world_size": spec.world_size, "name": name,
                 "strategy": strategy, "accelerator": spec.accelerator,
                 "host": socket.gethostname(), "seed": spec.seed, "ack": True,
                 "t": time.monotonic()}
        return TelemetryClient((host, port), token, spec.rank, connect_timeout=5.0,
                               hello=hello)
    except (OSError, ValueError) as err:
        return f"{type(err).__name__}: {err}"


def _shown(address: str) -> str:
    """The address without its token (logs are often shared)."""
    try:
        host, port, _ = parse_address(address)
        return f"{host}:{port}"
    except ValueError:
        return "NBTRAIN_ATTACH"


__all__ = ["ATTACH_ENV", "InProcessRank", "detected"]


def _in_process(accelerator: str) -> tuple[InProcessRank, DevicePlan] | None:
    """``start.in_process``'s question: is this process a rank already (torchrun's, or a
    cluster's)? Then its backend and plan."""
    started_by = "torchrun" if detected() else clusters.adopt()
    if not started_by:
        return None
    backend = InProcessRank(started_by)
    return backend, backend.plan(accelerator)


register_in_process(_in_process)
