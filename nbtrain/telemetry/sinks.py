"""Sinks: every output of a run (dashboard, progress, a file) takes events the same way.

The kernel hands events to sinks from one thread, in batches: whatever arrived while a
sink was busy comes in its next call, so a slow sink (a dashboard redrawing) falls behind
by at most one call and never holds up the channel, the history or the workers. Beyond
``capacity`` queued events, sinks miss events (``run.dropped_for_sinks`` counts them);
the history always has them all."""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

from .events import Event

# The run a sink is closed with is an ``nbtrain.run.Run``; it is not imported here, so the
# import graph stays one-way (the Run holds its sinks, sinks do not depend on it).
Run = Any


class Sink(Protocol):
    def on_events(self, events: list[Event]) -> None:
        """Events in arrival order (per rank, in the order the rank sent them)."""

    def close(self, run: Run) -> None:
        """The run ended (its outcome is set); last chance to draw or write."""


class SinkDispatcher:
    def __init__(self, sinks: list[Sink], capacity: int = 50_000):
        self.sinks: list[Sink] = []
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._loop, name="nbtrain-sinks", daemon=True)
        self._closing = None
        for sink in sinks:
            self.add(sink)

    def add(self, sink: Sink) -> None:
        """Attach a sink; call before the run's first events to see them all."""
        if not (callable(getattr(sink, "on_events", None)) and callable(getattr(sink, "close", None))):
            raise TypeError(f"{type(sink).__name__} is not a sink: it needs on_events(events) "
                            "and close(run).")
        self.sinks.append(sink)
        if not self._thread.is_alive():
            self._thread.start()

    def put(self, event: Event) -> None:
        if not self.sinks:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, run: Run, timeout: float = 10.0) -> None:
        """Deliver what is queued, then tell every sink the run ended."""
        if not self.sinks:
            return
        self._closing = run
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if batch[-1] is None:
                done = True
                batch.pop()
            if not batch:
                continue
            for sink in self.sinks:
                try:
                    sink.on_events(batch)
                except Exception:
                    pass  # an output must never break the run
        for sink in self.sinks:
            try:
                sink.close(self._closing)
            except Exception:
                pass
