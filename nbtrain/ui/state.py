"""What a dashboard draws, kept up to date from a run's events in O(1) per event.

``LiveState`` is plain data: per-rank series (bounded, see ``series.Series``), the
latest memory by category, communication per step by op, status per rank and errors. It
can be rebuilt from a recorded history (``from_history``) so finished runs, tests and the
live view share one drawing path.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ..telemetry.events import Comm, Evaluation, Event, Lifecycle, Memory, Metric, Restart, Step
from ..wire import first_line
from .series import Series

if TYPE_CHECKING:
    from ..run import Run

PHASE_WINDOW = 20  # the time breakdown shows the mean of each rank's last steps
_LIFECYCLE = {"started": "running", "finished": "done", "failed": "failed"}


class LiveState:
    def __init__(self, world_size: int = 1, max_points: int = 400):
        self.world_size = world_size
        self.max_points = max_points
        self.lock = threading.Lock()
        self.metrics: dict[tuple[str, int], Series] = {}  # (name, rank) -> value by step
        self.step_ms: dict[int, Series] = {}  # rank -> ms by step, from its second step
        self.warmup: dict[int, tuple[int, float]] = {}  # rank -> (step, ms) of its first
        self.rate: dict[int, Series] = {}  # rank -> samples/s by step
        self.steps: dict[int, int] = {}
        # From rank 0's last Step: (epoch, batches per epoch, planned total steps).
        self.plan: tuple[int, int, int] = (0, 0, 0)
        self.last_step = -1  # rank 0's last finished step index
        self.samples: dict[int, int] = {}
        self.busy: dict[int, float] = {}  # seconds spent in timed steps
        # rank -> where its recent steps' time went (telemetry/timing.py), newest last
        self.phases: dict[int, deque[dict[str, float]]] = {}
        self.evaluating: dict[int, tuple[int, int]] = {}  # rank -> (done, batches) of a pass
        self.restarts: list[Restart] = []  # launch(max_restarts=...): where each began
        self.memory: dict[int, dict[str, int]] = {}  # latest bytes by category
        # launch(planned=...): the plan's model state per rank for the run's strategy
        self.planned: float | None = None
        self.comm: dict[str, Series] = {}  # op -> bytes per step, first rank that reports
        self.comm_rank: int | None = None
        self.status: dict[int, str] = dict.fromkeys(range(world_size), "starting")
        self.errors: dict[int, str] = {}
        # rank -> one line for a failure no traceback came with (a timeout, a signal)
        self.briefs: dict[int, str] = {}
        self.last_metrics: dict[int, dict[str, float]] = {}
        self.outcome: str | None = None  # the run's status once it ended
        self.error: str | None = None  # the run's error message once it ended
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self.info: dict[str, str] = {}  # strategy, devices, start method
        self.events = 0
        self.version = 0

    # -- building ----------------------------------------------------------------------
    def update(self, events: list[Event]) -> None:
        with self.lock:
            for e in events:
                self._one(e)
            self.events += len(events)
            self.version += 1

    def _one(self, e: Event) -> None:
        if isinstance(e, Restart):  # every rank starts again; the last attempt's errors go
            self.restarts.append(e)
            self.status = dict.fromkeys(self.status, "starting")
            self.errors.clear()
            return
        rank = e.rank
        if rank >= self.world_size:
            self.world_size = rank + 1
        if isinstance(e, Metric):
            last = self.last_metrics.setdefault(rank, {})
            for name, value in e.values.items():
                series = self.metrics.get((name, rank))
                if series is None:
                    series = self.metrics[(name, rank)] = Series(self.max_points)
                series.append(e.step, value)
                last[name] = value
        elif isinstance(e, Evaluation):
            if e.done < e.batches:
                self.evaluating[rank] = (e.done, e.batches)
            else:
                self.evaluating.pop(rank, None)
        elif isinstance(e, Step):
            self.evaluating.pop(rank, None)
            self.steps[rank] = self.steps.get(rank, 0) + 1
            if rank == 0:
                self.plan = (e.epoch, e.epoch_steps, e.total_steps)
                self.last_step = e.step
            if self.steps[rank] == 1:  # includes the warm-up: a mark, not a curve point
                self.warmup[rank] = (e.step, e.duration * 1000)
                return
            self.step_ms.setdefault(rank, Series(self.max_points)).append(
                e.step, e.duration * 1000)
            if e.duration > 0 and e.samples:
                self.rate.setdefault(rank, Series(self.max_points)).append(
                    e.step, e.samples / e.duration)
            self.samples[rank] = self.samples.get(rank, 0) + e.samples
            self.busy[rank] = self.busy.get(rank, 0.0) + e.duration
            if e.phases:
                self.phases.setdefault(rank, deque(maxlen=PHASE_WINDOW)).append(e.phases)
        elif isinstance(e, Memory):
            self.memory[rank] = dict(e.values)
        elif isinstance(e, Comm):
            if self.comm_rank is None:
                self.comm_rank = rank
            if rank != self.comm_rank:
                return  # collectives are symmetric: one rank's view is enough to draw
            for op in set(self.comm) | set(e.bytes):  # a run of steps: flat from first to last
                series, size = self.comm.setdefault(op, Series(self.max_points)), e.bytes.get(op, 0)
                series.append(e.step, size)
                if e.steps > 1:
                    series.append(e.last, size)
        elif isinstance(e, Lifecycle):
            self.evaluating.pop(rank, None)
            self.status[rank] = _LIFECYCLE.get(e.state, e.state)
            if e.state == "failed" and e.detail:
                self.errors[rank] = e.detail

    def bind(self, run: Run) -> None:
        """Take the run's facts for the header (strategy, devices, start method)."""
        with self.lock:
            self._bind(run)
            self.version += 1

    def finish(self, run: Run) -> None:
        """The run ended: take its final status per rank and its error."""
        with self.lock:
            self._bind(run)
            self.status.update(run.rank_status)
            self.outcome = run.status
            self.ended_at = run.ended_at or time.monotonic()
            if run.error is not None:
                self.error = f"{type(run.error).__name__}: {run.error}"
                rank = getattr(run.error, "rank", None)
                if isinstance(rank, int) and rank not in self.errors:
                    self.errors[rank] = str(run.error)
                    self.briefs[rank] = brief(run.error, rank)
            self.version += 1

    def _bind(self, run: Run) -> None:
        self.world_size = max(self.world_size, run.world_size)
        for rank in range(run.world_size):
            self.status.setdefault(rank, "starting")
        self.started_at = run.started_at
        self.info = run_info(run)
        planned, strategy = getattr(run, "planned", None), run.strategy
        if planned is not None:
            row = planned.row(strategy.name, bool(strategy.activation_checkpointing))
            self.planned = row.params + row.grads + row.optimizer

    @classmethod
    def from_run(cls, run: Run, max_points: int = 400) -> LiveState:
        state = cls(run.world_size, max_points)
        state.update(run.history.events())
        state.bind(run)
        if run.done:
            state.finish(run)
        return state

    # -- reading -----------------------------------------------------------------------
    def has_data(self) -> bool:
        """Some rank logged a step or a metric: a figure has something to plot."""
        with self.lock:
            return bool(self.steps or self.metrics)

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.monotonic()) - self.started_at

    @property
    def ranks(self) -> list[int]:
        return list(range(self.world_size))

    def phase_ms(self, rank: int) -> dict[str, float]:
        """Mean milliseconds per step in each phase over the rank's last steps."""
        recent = self.phases.get(rank)
        if not recent:
            return {}
        names = dict.fromkeys(k for p in recent for k in p)
        return {k: 1000 * sum(p.get(k, 0.0) for p in recent) / len(recent) for k in names}

    @property
    def metric_names(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.metrics))

    def samples_per_s(self, rank: int) -> float | None:
        busy = self.busy.get(rank, 0.0)
        return self.samples.get(rank, 0) / busy if busy > 0 and self.samples.get(rank) else None

    @property
    def overall(self) -> str:
        """The run's status: its outcome once ended, else what the ranks say."""
        if self.outcome:
            return self.outcome
        states = set(self.status.values())
        if "failed" in states:
            return "failed"
        if states and states <= {"done"}:
            return "done"
        return "running" if "running" in states or "done" in states else "starting"

    def evaluation_part(self) -> list[str]:
        """``["evaluating 12/40"]`` while a rank evaluates (the first such rank's pass)."""
        if not self.evaluating or self.outcome is not None:
            return []
        done, batches = self.evaluating[min(self.evaluating)]
        return [f"evaluating {done}/{batches}"]

    def progress_line(self) -> str:
        """One line: status, steps, throughput, last loss, elapsed — the text fallback."""
        status = self.overall
        steps = max(self.steps.values(), default=0)
        rate = sum(r for k in self.ranks if (r := self.samples_per_s(k)))
        parts = [f"nbtrain {self.info.get('strategy', '')} ×{self.world_size}: {status}",
                 f"step {steps}", *self.evaluation_part()]
        if rate:
            parts.append(f"{rate:,.0f} samples/s")
        last = self.last_metrics.get(0) or next(iter(self.last_metrics.values()), {})
        for name, value in list(last.items())[:2]:
            parts.append(f"{name} {value:.4g}")
        parts.append(f"{self.elapsed:.1f}s")
        failed = [f"rank {r} failed" for r, s in sorted(self.status.items()) if s == "failed"]
        return " | ".join(parts + failed)


def run_info(run: Run) -> dict[str, str]:
    strategy = run.strategy.summary() if hasattr(run.strategy, "summary") else str(run.strategy)
    where = (f"{run.world_size} × {run.accelerator}" +
             (f" {list(run.devices)}" if run.accelerator == "cuda" else ""))
    return {"strategy": strategy, "devices": where, "start_method": run.start_method,
            "fn": run.fn_name}


def brief(error, rank: int) -> str:
    """One line for a rank's failure that came without a traceback of its own: what
    happened, and where the rank was if it said (a timeout's ``where``)."""
    kind = getattr(error, "exc_type", type(error).__name__)
    at = (getattr(error, "where", None) or {}).get(rank)
    return f"{kind}: {first_line(str(getattr(error, 'message', error)))}" + \
        (f"; at {at}" if at else "")
