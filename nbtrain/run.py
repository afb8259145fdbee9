"""``Run``: the kernel's handle on one launch — status, results, history, wait and stop."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pathlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .cells import busy_while_blocking
from .errors import RunStoppedError, RunTimeoutError, WorkerError, cell_names, places_of, where_text
from .outcome import Outcome, Teardown
from .output import CellOutput
from .questions import answer_waiting
from .restarts import Attempt, Restarts, history_text
from .telemetry.events import Checkpoint, Event, Lifecycle, Output, Restart
from .telemetry.history import History
from .telemetry.sinks import Sink, SinkDispatcher
from .telemetry.summary import Summary, summarize
from .wire import decode_result, first_line, label

# How runs are shown: a UI registers itself here, so Run depends on no UI.
#   "attach": (run, dashboard) -> a live view (a sink with .start()) or None
#   "display": (run) -> None, a finished or live run shown as a cell's value
#   "report": (runs, path) -> path, an HTML file of finished runs
_VIEWS: dict[str, Callable[..., Any]] = {}
DASHBOARDS = (True, False, None, "auto", "widget", "static", "text")


def register_views(attach: Callable[..., Any], display: Callable[[Run], None],
                   report: Callable[..., Any] | None = None) -> None:
    """Make ``attach`` the live view ``launch(dashboard=...)`` gets, ``display`` how a
    ``Run`` shows itself and ``report`` how it is saved as HTML (``nbtrain.ui`` registers
    its own when imported)."""
    _VIEWS.update(attach=attach, display=display, report=report)


_ACTIVE: weakref.WeakSet[Run] = weakref.WeakSet()
_LAST: Run | None = None  # the most recent run started in this process


def last_run() -> Run | None:
    """The most recent ``Run`` started in this kernel, however it ended (None before the
    first). An interrupted ``run = nbtrain.launch(...)`` never assigns ``run``; this
    gives it back, with its history::

        run = nbtrain.last_run()
        run.status, run.history
    """
    return _LAST


class Run:
    """A launch of ``fn`` on ``world_size`` ranks.

    ``status``: ``"starting"``, ``"running"``, ``"done"``, ``"failed"`` or ``"stopped"``.
    With ``max_restarts``, ``attempts`` lists the attempts that ended and were followed
    by another, and ``checkpoints`` the ones ``ctx.save`` completed.
    """

    def __init__(self, fn_name: str, strategy, plan, start_method: str,
                 timeout: float | None, sinks: list[Sink] = (), seed: int | None = None):
        self.fn_name = fn_name
        self.seed = seed  # rank r started from seed + r: launch(seed=run.seed) repeats it
        self.strategy = strategy
        self.accelerator = plan.accelerator
        self.devices = plan.indices
        self.world_size = plan.world_size
        self.start_method = start_method
        self.timeout = timeout
        self.started_at = time.monotonic()
        # What the run says when it ended well but not as meant (every rank trained
        # alone: a framework inside saw one device); None otherwise.
        self.note: str | None = None
        self.ended_at: float | None = None
        self.history = History(self.started_at)
        self.rank_status: dict[int, str] = dict.fromkeys(range(plan.world_size), "starting")
        self._status = "starting"
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._outcome = None
        self._cleanup: list = []  # callables run once the workers are gone
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cell = CellOutput()  # where the ranks' lines and displays go
        self._last_step: dict[int, int] = {}
        self._sinks = SinkDispatcher(list(sinks))
        # nbtrain.listen()'s run of a job elsewhere: its events, not its results (the job's)
        self.remote: dict | None = None
        # A one-rank run of the same function this run's summary is measured against (and
        # scaling()'s further rounds of the two, pooled), and launch(planned=)'s plan.
        self.baseline: Run | None = None
        self.rounds: list[tuple[Run, Run]] = []
        self.planned = None
        # launch(max_restarts=...): the checkpoints ctx.save completed, and the restarts
        self.checkpoints: list[str] = []
        self._restarts = Restarts()
        self._stop_asked = False

    # -- public ------------------------------------------------------------------------
    @property
    def attempts(self) -> list[Attempt]:
        """The attempts that ended and were followed by another (``max_restarts``)."""
        return self._restarts.attempts

    @property
    def status(self) -> str:
        """``"starting"`` (ranks joining their process group), ``"running"``, then
        ``"done"``, ``"failed"`` or ``"stopped"`` (``run.stop()``, an interrupt, a timeout);
        a run submitted to SLURM is ``"queued"`` first."""
        return self._status

    @property
    def done(self) -> bool:
        """Has the run ended, however it ended (``status`` says how)?"""
        return self._done.is_set()

    @property
    def elapsed(self) -> float:
        """Seconds since the launch; frozen once the run ends."""
        return (self.ended_at or time.monotonic()) - self.started_at

    @property
    def last_step(self) -> int | None:
        """The highest step any rank reported, or None before the first event."""
        return max(self._last_step.values(), default=None)

    @property
    def error(self) -> BaseException | None:
        """Why the run failed or stopped (a ``WorkerError``, ``RunTimeoutError``, ...), or
        None; ``wait()`` and ``results`` raise it."""
        return self._error

    @property
    def results(self) -> list[Any]:
        """One value per rank (what ``fn`` returned there; tensors on CPU)."""
        if not self.done:
            raise RuntimeError("the run is still going; call run.wait() first (or check "
                               "run.done).")
        if self._error is not None:
            raise self._error.with_traceback(None)  # this raise's frames, not an earlier one's
        if self._results is None and self.remote is not None:
            raise RunStoppedError("a watched run's results stay with its job (rank 0 of "
                                  "torchrun gets them from launch()); run.history and "
                                  "run.summary() hold what it streamed.")
        if self._results is None:
            raise RunStoppedError("the run was stopped before every rank returned, so it has "
                                  "no results; run.history holds what was logged.")
        return self._results

    @property
    def result(self) -> Any:
        """Rank 0's return value."""
        return self.results[0]

    def save_report(self, path: str | os.PathLike = "nbtrain-report.html") -> pathlib.Path:
        """This run as one self-contained HTML file at ``path`` (its header, charts and
        summary; plotly's JavaScript inlined, so it opens without a network); returns the
        path. Several runs side by side: ``nbtrain.ui.report.write_report(runs, path)``."""
        if not self.done:
            raise RuntimeError("run.save_report(): the run is still going; run.wait() first "
                               "(or run.stop()).")
        write = _VIEWS.get("report")
        if write is None:
            raise RuntimeError("run.save_report() needs nbtrain's UI (import nbtrain).")
        return write([self], path)

    def summary(self, baseline: Run | None = None, bandwidth=None) -> Summary:
        """Per rank: peak memory by category, mean step time and where it went, throughput,
        communication per step, last metric values; a table. When more devices do not pay,
        the verdict and what would help (beside ``baseline`` or ``run.baseline``, a one-rank
        run, and ``run.rounds``: with the speed-up); with ``bandwidth``, how much of the
        wait the link explains; with ``launch(planned=)``, the plan beside the bytes."""
        again = [(b.summary(), n.summary()) for b, n in self.rounds if baseline is None]
        baseline = baseline if baseline is not None else self.baseline
        return summarize(self.history, self.world_size, self.strategy, self.accelerator,
                         baseline.summary() if baseline is not None else None, bandwidth,
                         self.attempts, self.planned and self.planned.beside(self), again)

    def add_sink(self, sink: Sink) -> None:
        """Send this run's events to ``sink`` too (``on_events(events)``, ``close(run)``)."""
        self._sinks.add(sink)

    @property
    def dropped_for_sinks(self) -> int:
        """Events a slow sink (a dashboard) did not get; the history has them all."""
        return self._sinks.dropped

    def wait(self, timeout: float | None = None) -> list[Any] | None:
        """Block until the run ends; return ``results`` (None if stopped) or raise its error."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with busy_while_blocking():
                while not self._done.wait(0.1):
                    answer_waiting()  # a rank's input(), a debugger's prompt
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"the run is still going after {timeout:g}s "
                                           f"(status: {self._status}); run.stop() ends it.")
        except KeyboardInterrupt:  # raised afresh: no frames of threading.py
            raise KeyboardInterrupt("run.wait() was interrupted; the run goes on "
                                    "(run.stop() ends it).") from None
        if self._error is not None:
            raise self._error.with_traceback(None)  # this raise's frames, not an earlier one's
        return self._results

    def stop(self, reason: str = "stopped by run.stop()", timeout: float = 10.0) -> None:
        """End every worker now (SIGTERM, then SIGKILL) and wait until they are gone."""
        if self.done or self._outcome is None:
            return
        self._stop_asked = True  # no restart after this
        self._outcome.request_stop(reason)
        self._done.wait(timeout)

    def __repr__(self) -> str:
        where = (f"{self.world_size}×{self.accelerator}" +
                 (f" {list(self.devices)}" if self.accelerator == "cuda" else ""))
        return (f"<Run {self.fn_name} strategy={self.strategy.name} {where} "
                f"start={self.start_method}: {self._status} after {self.elapsed:.1f}s>")

    def deadline(self) -> float | None:
        """When ``timeout=`` ends the run (monotonic), its restarts included; or None."""
        return self.started_at + self.timeout if self.timeout else None

    def open_view(self, dashboard: bool | str = "auto"):
        """The live view ``launch(dashboard=...)`` asks for, from whatever UI registered
        itself (``nbtrain.ui`` does); None without one. It is one of the run's sinks."""
        attach = _VIEWS.get("attach")
        return attach(self, dashboard) if attach is not None else None

    def _ipython_display_(self) -> None:
        """A run shown on its own (last line of a cell): the registered UI's summary
        dashboard, or the summary as text."""
        display = _VIEWS.get("display")
        if display is not None:
            display(self)
        else:
            print(f"{self!r}\n{self.summary()}")

    # -- the port what starts and follows ranks feeds (a supervisor, a pool, torchrun's
    # ranks, a listener, a SLURM job); nothing else of the run is theirs to touch --------
    def receive(self, event: Event) -> None:
        """One telemetry event from a rank: into the history and the sinks (the view);
        a rank's lifecycle event moves its status."""
        if isinstance(event, Lifecycle) and event.detail:  # a traceback: cells by name
            event = dataclasses.replace(event, detail=cell_names(event.detail))
        elif isinstance(event, Checkpoint):
            self.checkpoints.append(event.path)
            if event.resumes:
                self._restarts.points.append(event.path)
        self.history.append(event)
        self._last_step[event.rank] = event.step
        self._sinks.put(event)
        if isinstance(event, Lifecycle):
            state = {"started": "running", "finished": "done", "failed": "failed"}[event.state]
            with self._lock:
                self.rank_status[event.rank] = state
                if self._status in ("starting", "queued") and state == "running":
                    self._status = "running"

    def write_output(self, rank: int, stream: str, line: str) -> None:
        """One whole line of a rank's output (``stream``: ``"out"`` or ``"err"``), into the
        history and the sinks, and to the cell labelled ``[rank N]``; what a forked rank
        displayed (``"display"``) and the line a rank redraws in place (``"err-live"``),
        to the cell only (``output.CellOutput``)."""
        if stream in ("out", "err"):
            event = Output(rank=rank, step=self._last_step.get(rank, 0), t=time.monotonic(),
                           stream="stdout" if stream == "out" else "stderr", line=line)
            self.history.append(event)
            self._sinks.put(event)
        self._cell.write(rank, stream, line)

    def queued(self) -> None:
        """The ranks wait for a scheduler (a SLURM job in its queue): ``status`` says
        ``"queued"`` until the first rank starts."""
        with self._lock:
            if self._status == "starting":
                self._status = "queued"

    def follow(self, outcome: Outcome, cleanup: list, restart: Callable | None = None,
               max_restarts: int = 0) -> None:
        """Follow the ranks' ``outcome`` (a supervisor, a pool's operation, a job) until
        it is done, then run ``cleanup`` and end the run; with ``restart``, an ending a
        restart may cure is followed by another attempt (``restarts.Restarts``)."""
        global _LAST
        _LAST = self
        self._outcome, self._cleanup = outcome, cleanup
        self._restarts.start, self._restarts.most = restart, max_restarts
        _ACTIVE.add(self)
        # Exit hooks run last-registered first: ours must run before multiprocessing's,
        # which would otherwise join live workers at interpreter exit and hang.
        atexit.unregister(_stop_active_runs)
        atexit.register(_stop_active_runs)
        threading.Thread(target=self._finish, name="nbtrain-run", daemon=True).start()

    def _finish(self) -> None:
        while True:
            outcome = self._outcome
            outcome.done.wait()
            for close in self._cleanup:
                with contextlib.suppress(Exception):
                    close()
            if not self._next_attempt(outcome):
                break
        try:
            self._conclude(outcome)
        except BaseException as err:  # never leave a waiter hanging
            self._error, self._status = err, "failed"
        self.ended_at = time.monotonic()
        self._sinks.close(self)
        _ACTIVE.discard(self)
        self._done.set()

    def _next_attempt(self, outcome) -> bool:
        """Start the next attempt when this one's ending is one a restart may cure and
        restarts are left; True when one started."""
        if self._stop_asked:
            return False
        try:
            started = self._restarts.next(outcome, self.deadline(), self._announce)
        except BaseException as err:  # the attempt's own failure is what the run raises
            self.note = f"nbtrain could not restart the run: {type(err).__name__}: {err}"
            return False
        if started is None:
            return False
        self._outcome, self._cleanup = outcome, cleanup = started
        outcome.start()
        if self._stop_asked:  # run.stop() while the next attempt started
            outcome.request_stop("stopped by run.stop()")
        return True

    def _announce(self, cause: str, resume: str | None) -> None:
        """The next attempt, recorded and shown before its ranks start (so their events
        come after it)."""
        attempt = self._restarts.record(cause, self.last_step, resume)
        event = Restart(rank=0, step=self.last_step or 0, t=time.monotonic(),
                        attempt=attempt.number, cause=cause, resume=resume or "")
        self.history.append(event)
        self._sinks.put(event)
        with self._lock:
            self.rank_status = dict.fromkeys(self.rank_status, "starting")
        self._say(f"nbtrain: {attempt} ({attempt.number} of {self._restarts.most} restarts)")

    def _say(self, text: str) -> None:
        """A line of nbtrain's own in the run's output (the cell), after the ranks'."""
        with contextlib.suppress(Exception):
            self._cell.streams["err"].write(text and text + "\n")
            self._cell.streams["err"].flush()

    def _conclude(self, outcome) -> None:
        workers, at = outcome.workers, places_of(outcome.workers)  # where ranks were ended
        if outcome.crash is not None:
            self._status = "failed"
            raise RuntimeError("nbtrain's supervisor failed (a bug in nbtrain; the workers were "
                               f"ended): {type(outcome.crash).__name__}: {outcome.crash}") from outcome.crash
        if outcome.teardown_cause is Teardown.STOP:
            self._status = "stopped"
            self.rank_status.update({r: "stopped" for r, w in workers.items() if w.result is None})
            self._say(where_text(at) and f"nbtrain: the run was stopped; {where_text(at)}")
            return
        if outcome.teardown_cause is Teardown.TIMEOUT:
            self._status = "failed"
            finished = [r for r, w in workers.items() if w.result is not None]
            where = {r: at[r] for r in outcome.timed_out_ranks}
            self.rank_status.update(dict.fromkeys(where, "failed"))
            self._error = RunTimeoutError(self.timeout or 0, list(where), finished, where)
            return
        root = outcome.root_failure()
        if root is not None:
            self._status = "failed"
            others = []
            for rank, w in sorted(workers.items()):
                if rank == root.rank:
                    continue
                if w.failure is not None and not w.failure.stopped:
                    others.append(f"rank {rank}: also failed with {w.failure.exc_type}: "
                                  f"{first_line(w.failure.message)}")
                    self.rank_status[rank] = "failed"
                elif w.result is not None:
                    others.append(f"rank {rank}: had finished")
                else:
                    others.append(f"rank {rank}: stopped by nbtrain"
                                  + (at[rank] and f", at {at[rank]}"))
                    self.rank_status[rank] = "stopped"
            self.rank_status[root.rank] = "failed"
            hint = "\n".join(h for h in (root.hint, history_text(self.attempts)) if h)
            self._error = WorkerError(root.rank, root.exc_type, root.message,
                                      label(cell_names(root.traceback), root.rank), others,
                                      hint)
            # launch() showed a live view in this cell: it shows the traceback already
            self._error.shown_in_cell = getattr(self, "_nbtrain_shown_in", None)
            return
        if outcome.teardown_cause is Teardown.REMOTE:  # a watched job: its results stay with it
            ended = all(s == "done" for s in self.rank_status.values())
            self._status = "done" if ended else "stopped"
            return
        results = []
        for rank in range(self.world_size):
            data = workers[rank].result
            try:
                results.append(decode_result(data))
            except Exception as err:
                self._status = "failed"
                self._error = WorkerError(rank, type(err).__name__,
                                          f"the kernel could not rebuild rank {rank}'s return "
                                          f"value: {err}",
                                          hint="Return plain data (numbers, tensors, dicts).")
                return
            self.rank_status[rank] = "done"
        self._results = results
        self._status = "done"
        if outcome.note:  # e.g. every rank trained alone
            self.note = outcome.note
            self._say(outcome.note)


def _stop_active_runs() -> None:
    """At interpreter exit, end live runs before multiprocessing joins their processes."""
    for run in list(_ACTIVE):
        run.stop(reason="the interpreter is exiting", timeout=5)
