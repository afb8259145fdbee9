"""The core every view shares: a sink that folds events into a ``LiveState`` and redraws
from its own thread at most once per ``interval``.

The sink thread only updates the state (cheap) and wakes the drawer; the drawer sleeps
out the rate limit, then draws everything that arrived meanwhile in one go, and ticks
once a ``heartbeat`` so elapsed time moves between events. A view that fails to draw
three times in a row stops drawing: the UI never breaks or slows the run.

A view shown by ``launch()`` displays only what is cheap in its constructor (the
header); whatever is slow to build (the live figure) is done by ``prepare()`` on the
drawer thread, which ``launch()`` starts once the workers are started (``start()``), so
the workers never wait for the dashboard. A view with a figure (``wait_for_data``)
builds and draws it only once a rank has logged a step or a metric: built while the
ranks start, it competed with them for the cores (on 2 cores a quarter of a warm
launch's call -> first step) and could only show empty axes. Until then events redraw
the header alone (``draw_header``). A view built with ``display=False`` starts
its thread at once (the first event would start it anyway).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..telemetry.events import Event
from .series import Throttle
from .state import LiveState

if TYPE_CHECKING:
    from ..run import Run


class LiveView:
    interval = 0.2  # seconds between redraws, at most
    heartbeat = 1.0  # seconds between redraws when no event arrives
    max_points = 400  # per trace
    wait_for_data = False  # draw (and prepare) only once there is something to plot

    def __init__(self, run: Run | None = None, *, world_size: int = 1):
        self.state = LiveState(run.world_size if run is not None else world_size,
                               self.max_points)
        self.run = run
        self.draws = 0
        self.failures = 0
        self.broken: BaseException | None = None
        self.closed = False
        self._throttle = Throttle(self.interval)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draw_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if run is not None:
            self.state.bind(run)

    # -- the sink interface ------------------------------------------------------------
    def bind(self, run: Run) -> None:
        """Attach the run (header facts); the picker binds after launch() returns."""
        self.run = run
        self.state.bind(run)
        self._wake.set()

    def on_events(self, events: list[Event]) -> None:
        self.state.update(events)
        self.start()
        self._wake.set()

    def close(self, run: Run) -> None:
        """The run ended: stop the drawer and draw the outcome (a failure in red) now,
        before ``run.wait()`` returns or raises."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        if run is not None:
            self.run = run
            self.state.finish(run)
        self.closed = True
        self._safe_draw(final=True)

    # -- drawing -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._loop, name="nbtrain-dashboard",
                                            daemon=True)
            self._thread.start()

    def prepare(self) -> None:
        """What is slow to set up, done on the drawer thread before its first draw."""

    def draw_header(self) -> None:
        """Redraw what is cheap (the header) while the figure waits for data."""

    def _loop(self) -> None:
        if self.wait_for_data:
            while not self._stop.is_set() and not self.state.has_data():
                self._wake.wait(self.heartbeat)
                wait = self._throttle.wait_time()  # the header keeps the redraw rate too
                if wait > 0 and self._stop.wait(wait):
                    return
                self._wake.clear()
                self._throttle.ready()
                with self._draw_lock:
                    if not self.closed:
                        try:
                            self.draw_header()
                        except Exception:  # an output must never break the run
                            pass
            if self._stop.is_set():
                return
        with self._draw_lock:
            if self._stop.is_set():
                return  # ended already: close() draws the outcome
            try:
                self.prepare()
            except Exception as err:  # an output must never break the run
                self.broken = err
                return
        self._safe_draw(final=False)
        while not self._stop.is_set():
            self._wake.wait(self.heartbeat)
            if self._stop.is_set():
                return
            wait = self._throttle.wait_time()
            if wait > 0 and self._stop.wait(wait):
                return
            self._wake.clear()
            self._throttle.ready()
            self._safe_draw(final=False)

    def _safe_draw(self, final: bool) -> None:
        if self.broken is not None:
            return
        with self._draw_lock:
            if self.closed and not final:
                return  # the outcome is drawn; a late live draw must not cover it
            try:
                self.draw(final)
                self.draws += 1
                self.failures = 0
            except Exception as err:  # an output must never break the run
                self.failures += 1
                if self.failures >= 3 or final:
                    self.broken = err

    def draw(self, final: bool) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        with self.state.lock:
            return f"<{type(self).__name__} {self.state.progress_line()}>"
