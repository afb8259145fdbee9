"""``nbtrain.listen()``: the notebook watches a job that runs elsewhere (torchrun, ``nbtrain
run``), live, as it watches its own launches.

    watch = nbtrain.listen(host="0.0.0.0")   # a telemetry listener, token and all
    watch.address                            # hand it to the job: NBTRAIN_ATTACH=... or
                                             # nbtrain run ... --attach ADDRESS
    watch.runs                               # every run that attached, newest last

Every rank of the job proves the token to the listener (``host:port:token``, one string;
the token itself never crosses the wire: ``telemetry/channel.py``'s handshake) and says
which run it belongs to (a run id rank 0 drew, the world size,
the function and strategy); the listener makes one ``Run`` per run id, and each rank's
events (the typed events of a local run, JSON, bounded frames, never pickle) go to it.
Each run gets the live view a local launch gets (the widget dashboard in a notebook,
text progress in a terminal), in the cell that called ``listen()``. A watched run has
``history``, ``summary()``, ``status`` and per-rank status; its results stay with the
job. It ends when every rank's connection closed: ``done`` if every rank finished,
``failed`` (with the rank's traceback) if one failed, else ``stopped``.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..cells import cell_parent
from ..outcome import Ending, Reported, Teardown
from ..run import Run
from ..telemetry.channel import TelemetryServer, format_address
from ..telemetry.events import Event, Lifecycle

__all__ = ["Watch", "listen"]


def listen(host: str = "127.0.0.1", port: int = 0, dashboard: bool | str = "auto") -> Watch:
    """Open a telemetry listener on ``host:port`` (0: a free port) for jobs elsewhere.

    ``host="0.0.0.0"`` listens on every interface (jobs on other machines); the default
    takes jobs on this machine only. A job attaches with ``NBTRAIN_ATTACH=watch.address``
    in its environment (``nbtrain run ... --attach ADDRESS`` sets it); its ranks need the
    token in that address. ``dashboard``: the view each attaching run gets, as in
    ``launch()`` (False: none). ``watch.close()`` stops listening.
    """
    return Watch(host, port, dashboard)


@dataclass
class RemoteFailure:
    """A rank's failure as the job reported it (what ``Run`` reads to raise WorkerError)."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    hint: str = ""
    ending: Ending = Ending.RAISED  # what the job said: its exception (or its end)
    secondary: bool = False


class Job:
    """One attached run: the ``Run`` the notebook holds, and the job's open connections
    (what ``Run`` reads from a supervisor)."""

    crash = None
    teardown_cause = Teardown.REMOTE
    timed_out_ranks = ()
    note = None

    def __init__(self, run: Run):
        self.run = run
        self.done = threading.Event()
        self.workers: dict[int, Any] = {}
        self.failure: RemoteFailure | None = None
        self._open = 0
        self._lock = threading.Lock()

    def link(self, rank: int, offset: float) -> _Link:
        with self._lock:
            self._open += 1
        return _Link(self, rank, offset)

    def unlink(self) -> None:
        with self._lock:
            self._open -= 1
            ended = self._open == 0
        if ended:
            self.done.set()

    def root_failure(self) -> RemoteFailure | None:
        return self.failure

    def request_stop(self, reason: str) -> None:
        """``run.stop()`` on a watched run stops watching it; the job goes on."""
        self.done.set()


class PolledJob(Job):
    """A job nbtrain submitted (SLURM's, Ray's): ``world_size`` ranks whose events arrive
    through the listener, but whose end, results and failures its own thread (``_poll``,
    the engine's) reads from the engine; a rank's connection closing decides nothing."""

    teardown_cause = None

    def __init__(self, run: Run, world_size: int, name: str):
        super().__init__(run)
        self.workers = {rank: Reported() for rank in range(world_size)}
        self._thread = threading.Thread(target=self._poll, name=name, daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def unlink(self) -> None:
        with self._lock:
            self._open -= 1

    def _poll(self) -> None:
        raise NotImplementedError


class _Link:
    """One rank's connection: its events, moved onto this kernel's clock, to the run."""

    def __init__(self, job: Job, rank: int, offset: float):
        self.job, self.rank, self.offset = job, rank, offset
        self._closed = False

    def __call__(self, event: Event) -> None:
        if self.job.done.is_set():
            return  # no longer watched
        event = dataclasses.replace(event, t=event.t + self.offset)
        if isinstance(event, Lifecycle) and event.state == "failed" and self.job.failure is None:
            exc_type, message = _last_line(event.detail)
            self.job.failure = RemoteFailure(event.rank, exc_type, message, event.detail)
        self.job.run.receive(event)

    def closed(self) -> None:
        if not self._closed:
            self._closed = True
            self.job.unlink()


class Watch:
    """A listener for jobs elsewhere; ``listen()`` makes one. See the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 dashboard: bool | str = "auto"):
        from ..run import DASHBOARDS

        if dashboard not in DASHBOARDS:
            raise ValueError(f"dashboard={dashboard!r}: use 'auto' (the default), True, "
                             "False, or force one view: 'widget', 'static' or 'text'.")
        self.dashboard = dashboard
        self._jobs: dict[str, Job] = {}
        self._expected: dict[str, Job] = {}  # runs made here before their job attaches
        self._lock = threading.Lock()
        self._cell = cell_parent()  # views of attaching runs show in listen()'s cell
        self._server = TelemetryServer(host=host, port=port, on_hello=self._hello)
        bound, bound_port = self._server.address
        self.address = format_address(_reachable(host, bound), bound_port, self._server.token)
        self._announce()

    # -- public ------------------------------------------------------------------------
    @property
    def runs(self) -> list[Run]:
        """Every run that attached, in the order they attached (newest last)."""
        with self._lock:
            return [job.run for job in self._jobs.values()]

    @property
    def refused(self) -> int:
        """Connections turned away (a wrong or missing token, a malformed hello)."""
        return self._server.refused

    def wait(self, runs: int = 1, timeout: float | None = None) -> list[Run]:
        """Block until ``runs`` runs attached and ended; return ``watch.runs``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current = self.runs
            if len(current) >= runs and all(r.done for r in current):
                return current
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{len(current)} of {runs} runs attached, "
                                   f"{sum(r.done for r in current)} ended, after {timeout:g}s.")
            time.sleep(0.1)

    def compare(self, **options):
        """``nbtrain.compare`` of the finished watched runs (memory, speed, a takeaway)."""
        from ..ui import compare

        return compare(*[r for r in self.runs if r.status == "done"], **options)

    def expect(self, run_id: str, job: Job) -> None:
        """The ranks that say ``run_id`` belong to ``job`` (its ``Run`` made already, by
        ``nbtrain.submit``), not to a new run."""
        with self._lock:
            self._expected[run_id] = job

    def close(self) -> None:
        """Stop listening; runs still attached stop being watched (their jobs go on)."""
        self._server.close()
        for job in list(self._jobs.values()):
            job.request_stop("the listener closed")

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        host, port = self.address.rsplit(":", 2)[:2]
        return (f"<Watch {host}:{port}: {len(self.runs)} run(s) attached; hand the job "
                "NBTRAIN_ATTACH=watch.address>")

    # -- the listener's thread ---------------------------------------------------------
    def _hello(self, hello: dict) -> _Link | None:
        run_id, rank, world_size = hello.get("run"), hello["rank"], hello.get("world_size")
        if not isinstance(run_id, str) or not isinstance(world_size, int) \
                or not 0 <= rank < world_size:
            return None  # a local worker's hello, or nonsense: not a job's rank
        offset = time.monotonic() - hello["t"] if isinstance(hello.get("t"), (int, float)) else 0.0
        with self._lock:
            job = self._jobs.get(run_id)
            if job is None:
                job = self._expected.pop(run_id, None) or self._new_job(hello, world_size)
                self._jobs[run_id] = job
        if job.done.is_set():
            return None
        return job.link(rank, offset)

    def _new_job(self, hello: dict, world_size: int) -> Job:
        plan = SimpleNamespace(accelerator=str(hello.get("accelerator", "cpu")),
                               indices=tuple(range(world_size)), world_size=world_size)
        run = Run(str(hello.get("name", "fn")), _strategy(hello.get("strategy")), plan,
                  "torchrun", None, seed=hello.get("seed"))
        run.remote = {"host": hello.get("host"), "run": hello["run"]}
        job = Job(run)
        if self.dashboard is not False:
            with in_cell(self._cell):
                view = run.open_view(self.dashboard)
            if view is not None:
                view.start()
        run.follow(job, [])
        return job

    def _announce(self) -> None:
        line = (f"nbtrain is listening on {self.address.rsplit(':', 1)[0]}: start the job "
                "with NBTRAIN_ATTACH=watch.address (or nbtrain run ... --attach "
                "ADDRESS); its runs show here and in watch.runs.")
        if self.dashboard is False:
            return
        if self._cell is not None:
            from IPython.display import display

            display({"text/plain": line}, raw=True)
        else:
            print(line, file=sys.stderr)


def _strategy(name):
    """The registered strategy of that name (what compare() reads), else its name."""
    from .. import strategies

    try:
        return strategies.get(str(name))
    except (ValueError, TypeError):
        return SimpleNamespace(name=str(name))


def _last_line(traceback: str) -> tuple[str, str]:
    """``("ValueError", "bad batch")`` from a traceback's last line."""
    last = traceback.strip().splitlines()[-1] if traceback.strip() else "failed"
    exc_type, sep, message = last.partition(": ")
    return (exc_type.rsplit(".", 1)[-1], message) if sep else (last, "")


def _reachable(host: str, bound: str) -> str:
    """The host a job should dial: the given one, or for a wildcard this machine's name
    as others see it."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return name
    return name if address.startswith("127.") else address


class in_cell:
    """Displays from this thread go to the cell ``parent``: ipykernel's thread parent, or
    in older ipykernels (6.17: Colab, Kaggle), its one parent, set for the moment."""

    def __init__(self, parent):
        self.parent = parent
        self.token = None
        self.saved = None

    def __enter__(self):
        if self.parent is not None:
            from IPython import get_ipython

            self.pub = get_ipython().display_pub
            if hasattr(self.pub, "set_thread_parent"):
                self.token = self.pub.set_thread_parent(self.parent)
            else:
                self.saved = self.pub.parent_header
                self.pub.parent_header = self.parent
        return self

    def __exit__(self, *exc):
        if self.token is not None:
            self.pub.reset_thread_parent(self.token)
        elif self.saved is not None:
            self.pub.parent_header = self.saved
