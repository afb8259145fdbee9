"""``nbtrain.submit(train, devices=N, engine=nbtrain.Ray(address))``: the notebook's function
on a Ray cluster's workers, watched live from the notebook.

    run = nbtrain.submit(train, devices=4, engine=nbtrain.Ray("auto"), strategy="fsdp")
    run.wait()        # every rank's results, as launch() gives them
    run.stop()        # every rank's actor killed, the placement group removed

One Ray actor per rank, placed by a placement group of one bundle a rank (``SPREAD`` over
the nodes by default; ``STRICT_SPREAD`` for a rank per node, ``PACK`` to fill a node
first); a GPU rank's bundle holds one GPU, which Ray makes the actor's only visible one.
Each actor runs the function as torchrun's ranks run it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` of rank 0's node...: ``launch()`` sees them and runs the function in that
process, ``ctx``, strategies and checkpoints unchanged), and streams its events to a
listener this call opens, so the run's dashboard is live in the cell; rank 0 returns
every rank's results (gathered), as a SLURM job's does.

Why Ray's core (actors, a placement group) and not Ray Train's ``TorchTrainer``: the
process group, the strategies, checkpoints and the per-rank view are nbtrain's rank side
already, as under torchrun; Ray Train would set up a second process group and its own
controller (its trivial fit took 26 s on 2 cores). What this asks of the cluster: the
notebook's machine joins it (``address`` a cluster's GCS address, ``"auto"``, or None for
one started here) and its workers reach ``listen_host`` (the kernel's listener), or, on
Ray Client (``"ray://head:10001"``: the notebook outside the cluster), the ranks' events
go to an actor there that the kernel reads through Ray (``scaleout/relay.py``). A worker
or a node lost mid-run is an ending ``max_restarts`` restarts from the last checkpoint
(on storage every node sees), new actors placed where the cluster has room.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from ..deviceplan import DevicePlan
from ..launch import start
from ..launch.following.failures import communication_error
from ..launch.starting.spawn import serialize
from ..outcome import Ending, Teardown
from ..run import Run
from ..wire import encode_result
from .listen import PolledJob, RemoteFailure, Watch
from .relay import Relay, RelayFeed
from .torchrun import ATTACH_ENV, RUN_ID_ENV

INSTALL = 'pip install "nbtrain[ray]"'
PLACEMENTS = ("SPREAD", "STRICT_SPREAD", "PACK", "STRICT_PACK")
POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Ray:
    """Where ``submit`` runs the ranks: a Ray cluster.

    ``address``: the cluster's (``"auto"``, ``"10.0.0.5:6379"``), or None: the one this
    process is connected to, else one started here. ``placement``: the placement group's
    strategy. ``cpus_per_rank``: the CPUs each rank's bundle holds. ``listen_host``: the
    address the workers reach this kernel at (default: this node's address in Ray).
    ``relay``: the ranks' events reach the kernel through an actor on the cluster instead
    (a notebook the workers cannot dial: Ray Client, NAT); by default when ``address``
    is Ray Client's, ``"ray://head:10001"``."""

    address: str | None = None
    placement: str = "SPREAD"
    cpus_per_rank: float = 1.0
    listen_host: str | None = None
    start_timeout: float = 60.0  # seconds to place every rank
    relay: bool | None = None  # None: relayed when the address is Ray Client's (ray://)

    @property
    def relayed(self) -> bool:
        """The ranks' events come through an actor on the cluster (``scaleout/relay.py``)
        rather than to a listener in this kernel."""
        if self.relay is not None:
            return self.relay
        return (self.address or "").startswith("ray://")

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"Ray(placement={self.placement!r}): one of {', '.join(PLACEMENTS)}.")
        if not self.cpus_per_rank > 0:
            raise ValueError(f"Ray(cpus_per_rank={self.cpus_per_rank!r}) must be > 0.")


def submit_ray(engine: Ray, fn: Callable[..., Any], args: tuple, kwargs: dict,
               given: dict[str, Any], *, ranks: int, accelerator: str) -> Run:
    """``submit(..., engine=Ray(...))``: ``given`` the run's options (``options.split``)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ImportError(f"nbtrain.submit(engine=nbtrain.Ray(...)) needs Ray: {INSTALL}") \
            from None
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ValueError(f"accelerator={accelerator!r}: use 'auto', 'cuda' or 'cpu'.")
    request = start.check("submit()", fn, args, kwargs, given)
    cluster = _connect(engine)
    if accelerator == "auto":
        accelerator = "cuda" if cluster.get("GPU", 0) >= ranks else "cpu"
    need = {"CPU": engine.cpus_per_rank * ranks, **({"GPU": ranks} if accelerator == "cuda"
                                                    else {})}
    short = {k: (v, cluster.get(k, 0)) for k, v in need.items() if cluster.get(k, 0) < v}
    if short:
        said = ", ".join(f"{v:g} {k} (it has {have:g})" for k, (v, have) in short.items())
        raise ValueError(f"the Ray cluster cannot hold {ranks} ranks: they need {said}. Give "
                         "fewer devices, Ray(cpus_per_rank=...) smaller, or add nodes.")
    plan = DevicePlan(accelerator, tuple(range(ranks)))
    return start.execute(request, plan, _RayLaunch(engine))


def _connect(engine: Ray) -> dict:
    """Join the cluster (once per process) and say what it holds."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    address = engine.address
    if address not in (None, "auto", "local"):  # Ray retries an address that never
        host, _, port = address.removeprefix("ray://").rpartition(":")  # answers a minute
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
        except (OSError, ValueError) as err:
            raise ConnectionError(
                f"nbtrain.Ray({address!r}): no Ray cluster answers there ({err}). Start one "
                "(ray start --head) and give its address, e.g. Ray('10.0.0.5:6379'), or "
                "Ray() for one on this machine.") from None
    for attempt in range(CLIENT_TRIES):
        try:
            ray.init(address=address, namespace="nbtrain", log_to_driver=False,
                     include_dashboard=False, configure_logging=False)
            break
        except ConnectionAbortedError as err:
            # Ray Client's proxy starts one server process per client, by a fork of a
            # process with gRPC's threads running; now and then that child dies at once
            # ("Starting Ray client server failed", an empty log): a new connection
            # starts another
            if "client server failed" not in str(err):
                raise
            if attempt == CLIENT_TRIES - 1:
                said = str(err).strip().splitlines()[-1]
                raise ConnectionError(
                    f"nbtrain.Ray({address!r}): Ray Client's server for this notebook did "
                    f"not start in {CLIENT_TRIES} tries ({said}): that log is in the head "
                    "node's /tmp/ray/session_latest/logs.") from err
            ray.shutdown()
    return ray.cluster_resources()


CLIENT_TRIES = 3  # Ray Client connections tried when its server fails to start


class _RayLaunch:
    """``submit``'s Ray backend on the one start path: actors in a placement group, each
    running the function as a torchrun rank; a ``_RayJob`` follows them."""

    started_by = "ray"
    stop_timeout = 10.0
    blocking = False
    returns_run = True

    def __init__(self, engine: Ray):
        self.engine = engine
        self.payload: bytes | None = None

    def prepare(self, request: start.Request, plan: DevicePlan) -> start.Request:
        self.payload = serialize(request.fn, request.args, request.kwargs, request.strategy,
                                 "a Ray worker", "or define what it needs inside the function")
        return dataclasses.replace(request, base_seed=request.seed)

    def start(self, request: start.Request, plan: DevicePlan, run: Run):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 1 if plan.accelerator == "cuda" else 0
        bundle = {"CPU": self.engine.cpus_per_rank, **({"GPU": 1} if gpus else {})}
        group = placement_group([bundle] * plan.world_size, strategy=self.engine.placement)
        try:
            ray.get(group.ready(), timeout=self.engine.start_timeout)
        except Exception:
            remove_placement_group(group)
            raise TimeoutError(
                f"Ray could not place {plan.world_size} ranks of {bundle} "
                f"({self.engine.placement}) within {self.engine.start_timeout:g} s: the "
                "cluster is busy or too small for that placement.") from None
        actor = ray.remote(_Rank)
        actors = [actor.options(num_cpus=self.engine.cpus_per_rank, num_gpus=gpus,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    group, placement_group_bundle_index=i)).remote()
                  for i in range(plan.world_size)]
        job = _RayJob(run, actors, group)
        watch, run_id = None, uuid.uuid4().hex[:12]
        try:
            where = ray.get([a.where.remote() for a in actors])
            attach = None
            if request.telemetry.enabled and self.engine.relayed:  # the ranks attach to an
                relay = ray.remote(num_cpus=0)(Relay).remote(run_id)  # actor the kernel
                job.relay(relay)  # reads through Ray: nothing dials the notebook
                attach = ray.get(relay.address.remote(), timeout=self.engine.start_timeout)
            elif request.telemetry.enabled:
                host = self.engine.listen_host or ray.util.get_node_ip_address()
                watch = Watch(host, 0, dashboard=False)
                watch.expect(run_id, job)  # before any rank can say hello
                attach = watch.address
            master, port = where[0][1], where[0][2]
            refs = []
            for rank, (node, _, _) in enumerate(where):
                peers = [i for i, w in enumerate(where) if w[0] == node]
                environ = {"RANK": str(rank), "WORLD_SIZE": str(plan.world_size),
                           "LOCAL_RANK": "0" if gpus else str(peers.index(rank)),
                           "LOCAL_WORLD_SIZE": "1" if gpus else str(len(peers)),
                           "MASTER_ADDR": master, "MASTER_PORT": str(port),
                           RUN_ID_ENV: run_id}
                if attach is not None:
                    environ[ATTACH_ENV] = attach
                refs.append(actors[rank].run.remote(self.payload, plan.accelerator,
                                                    request.for_ranks(), environ,
                                                    list(sys.path)))
        except BaseException:
            job.release()
            if watch is not None:
                watch.close()
            raise
        job.follow(refs)
        run.remote = {"ray": self.engine.address or "local", "relayed": job.feed is not None,
                      "nodes": [w[0] for w in where]}  # each rank's node
        return job, [job.release] + ([watch.close] if watch is not None else [])

    def again(self) -> _RayLaunch:
        """The next attempt's (``max_restarts``): new actors, placed anew (a lost node's
        ranks go where the cluster has room)."""
        return _RayLaunch(self.engine)

    def abandon(self) -> None:
        pass


class _Rank:
    """One rank, in a Ray worker process."""

    def where(self) -> tuple[str, str, int]:
        """(its node's id, its address, a free port there: rank 0's is the store's)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), port

    def run(self, payload: bytes, accelerator: str, options: dict[str, Any],
            environ: dict[str, str], path: list[str]):
        """``launch()`` as this rank; rank 0 returns every rank's results. A failure comes
        back as (type, message, traceback), not as Ray's wrapping of it. The kernel's
        import path, where this node has its folders, is searched after the worker's own:
        the modules the function names by reference load here as there."""
        import dill

        from ..launch import launch

        os.environ.update(environ)
        sys.path.extend(p for p in path if p not in sys.path and os.path.isdir(p or "."))
        try:
            fn, args, kwargs, strategy = dill.loads(payload)
            run = launch(fn, *args, strategy=strategy, accelerator=accelerator,
                         dashboard=False, **options, **kwargs)
            return ("ok", None if run is None else run.results)
        except BaseException as err:
            return ("failed", type(err).__name__, str(err)[:2000], traceback.format_exc())


class _RayJob(PolledJob):
    """The ranks' actors as ``Run`` reads a supervisor: events through the listener,
    results and failures from the actors' calls."""

    def __init__(self, run: Run, actors: list, group):
        super().__init__(run, len(actors), "nbtrain-ray")
        self.actors, self.group = actors, group
        self.feed: RelayFeed | None = None  # the relay's events, pulled each poll
        self._refs: list = []
        self._released = False

    def relay(self, actor) -> None:
        self.feed = RelayFeed(self, actor)

    def follow(self, refs: list) -> None:
        self._refs = refs

    def request_stop(self, reason: str) -> None:
        if self.done.is_set():
            return
        self.teardown_cause = Teardown.STOP
        self.release()

    def release(self) -> None:
        """Kill every rank's actor and remove the placement group: nothing stays on the
        cluster."""
        import ray
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            if self._released:
                return
            self._released = True
        for actor in [*self.actors, *([self.feed.actor] if self.feed else [])]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.group)
        except Exception:
            pass

    def _poll(self) -> None:
        import ray

        try:
            pending = {ref: rank for rank, ref in enumerate(self._refs)}
            first_failed = None
            while pending and self.teardown_cause is not Teardown.STOP:
                ready, _ = ray.wait(list(pending), timeout=POLL_S)
                self._pull(self.feed.pull if self.feed else None)
                for ref in ready:
                    self._take(pending.pop(ref), ref)
                if self.failure is not None:
                    first_failed = first_failed or time.monotonic()
                    # the others wait on the failed rank's collectives: end them (a peer's
                    # communication error first: the rank that caused it has a moment)
                    if not self.failure.secondary or time.monotonic() - first_failed > 3:
                        break
            self._pull(self.feed.drain if self.feed else None)  # the ranks' last events
        except BaseException as err:  # never leave the run waiting
            self.crash = err
        finally:
            self.release()
            self.done.set()

    def _pull(self, take) -> None:
        """The relay's events, unless the run was stopped (its actor killed meanwhile)."""
        try:
            if take is not None and not self._released:
                take()
        except Exception:
            if not self._released:
                raise

    def _take(self, rank: int, ref) -> None:
        import ray

        try:
            answer = ray.get(ref)
        except Exception as err:  # the actor died: killed, out of memory, its node lost
            line = (str(err).strip().splitlines() or [""])[0][:500]
            died = RemoteFailure(rank, type(err).__name__, f"rank {rank}'s Ray worker died: "
                                 f"{line}", str(err)[-20_000:], ending=Ending.KILLED,
                                 hint="A worker or its node was lost; max_restarts= "
                                      "starts the ranks again from the last checkpoint.")
            if self.failure is None or self.failure.secondary:
                self.failure = died
            self.workers[rank].failure = died
            return
        if answer[0] == "ok":
            if rank == 0 and answer[1] is not None:
                for r, result in enumerate(answer[1]):
                    self.workers[r].result = encode_result(result, r)
            return
        _, exc_type, message, text = answer
        comm = communication_error(f"{exc_type}: {message}\n{text}")
        failure = RemoteFailure(rank, exc_type, message, text, secondary=comm,
                                ending=Ending.COMMUNICATION if comm else Ending.RAISED)
        if self.failure is None or (self.failure.secondary and not comm):
            self.failure = failure
        self.workers[rank].failure = failure


__all__ = ["Ray"]
