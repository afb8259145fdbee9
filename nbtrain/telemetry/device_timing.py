"""Worker side: a CUDA rank's step clock, the phases of ``timing`` from CUDA events.

On a GPU the host only queues the work, and a wait on a collective returns at once (the
stream waits, not the host), so host times would say little. ``DeviceStepClock`` marks
the same points with CUDA events on the stream that runs them (the current stream: the
default one, where DDP's finalize and FSDP's waits make the compute wait for the NCCL
streams), so each phase is the device's time between its marks, and a wait on a
collective is the time the compute stream stood still at it (FSDP's all-gathers are
waited for on their own stream; the compute's wait for them is a ``wait_event`` no hook
sees, so a late prefetch counts in forward or backward). A step's events are read
once they have completed (``Event.query``), a step or two later, never by a device sync;
its Step event waits for them (``close``), and the last ones are read at the end. In a
compiled model the marks are recorded between its graphs (``timing.outside_graphs``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from .timing import PHASES, StepClock

HOLD = 32  # steps whose events a device clock waits for; older ones go with host times


class DeviceStepClock(StepClock):
    """The phases of a CUDA rank's steps from CUDA events (see the module): forward,
    backward and optimizer are the device's time between their marks, less the waits on
    collectives inside them; comm is those waits plus the final callbacks' wait for the
    gradients' communication; data is the host's (the loader runs there); other is the
    rest of the step. ``event`` makes a timing event (a fake in tests). Every step is
    timed: its marks are queued on the device, and a step's events read once complete."""

    def __init__(self, event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None):
        super().__init__(sample_s=0.0)
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = stream or torch.cuda.current_stream
        self._compute = None  # the stream the forward runs on
        self._waits: list[bool] = []  # per wait in progress: marked (on the compute stream)
        self._marks: list = []  # this step's events, in the order recorded
        self._spans: list[tuple[str, int, int]] = []  # (phase, first mark, last mark)
        self._open: dict[str, int] = {}  # phase -> its first mark, while open
        self._held: deque = deque()  # (made, duration, host phases, marks, spans)
        self._free: list = []  # events read, to record again
        self._off = False  # recording an event failed: host times from then on

    def _current(self):
        """The stream work is queued on now (None where it cannot be told)."""
        try:
            return self._stream()
        except Exception:  # noqa: BLE001 - a telemetry probe never fails the step
            return None

    def _mark(self) -> int | None:
        try:
            event = self._free.pop() if self._free else self._event()
            event.record()
        except RuntimeError:  # no events here after all: host times, never a failed step
            self._off = True
            return None
        self._marks.append(event)
        return len(self._marks) - 1

    def _begin(self, phase: str) -> None:
        if phase not in self._open and not self._off:
            at = self._mark()
            if at is not None:
                self._open[phase] = at

    def _end(self, phase: str) -> None:
        first = self._open.pop(phase, None)
        if first is not None:
            last = self._mark()
            if last is not None:
                self._spans.append((phase, first, last))

    # the points the host clock passes, marked on the device too
    def _forward_start(self, module, args) -> None:
        super()._forward_start(module, args)
        if self._compute is None and not self._off:
            self._compute = self._current()
        self._begin("forward")

    def _forward_end(self, module, args, output) -> None:
        self._end("forward")
        super()._forward_end(module, args, output)

    def _backward_start(self, grad):
        if self._backward_at is None:
            self._begin("backward")
        return super()._backward_start(grad)

    def _backward_end(self) -> None:
        if self._backward_at is not None:
            self._end("backward")
            self._begin("final")
        super()._backward_end()

    def _final_end(self) -> None:
        super()._final_end()
        self._end("final")

    def _optimizer_start(self, optimizer, args, kwargs) -> None:
        self._begin("optimizer")
        super()._optimizer_start(optimizer, args, kwargs)

    def _optimizer_end(self, optimizer, args, kwargs) -> None:
        super()._optimizer_end(optimizer, args, kwargs)
        self._end("optimizer")

    def _wait_begins(self) -> None:
        # A wait made on another stream (FSDP's all-gather stream) holds up that stream,
        # not the compute: what the compute stands still for shows where it waits for
        # that stream's event, inside its phase. Inside the final callbacks: comm already.
        marked = ("final" not in self._open and "wait" not in self._open
                  and (self._compute is None or self._current() == self._compute))
        self._waits.append(marked)
        if marked:
            self._begin("wait")

    def _wait_ends(self) -> None:
        if self._waits and self._waits.pop():
            self._end("wait")

    # -- steps -----------------------------------------------------------------------------
    def forget(self) -> None:
        super().forget()
        if not self._open:  # marks an open phase began with stay
            self._free.extend(self._marks)
            self._marks, self._spans = [], []

    def stash(self) -> Any:
        marks = None
        if not self._open:
            marks, self._marks, self._spans = (self._marks, self._spans), [], []
        return super().stash(), marks

    def restore(self, state: Any) -> None:
        host, marks = state
        super().restore(host)
        if marks is not None and not self._open:
            self._free.extend(self._marks)
            self._marks, self._spans = marks

    def close(self, made: Callable[[dict], Any], duration: float) -> list:
        host = self.take(duration)
        still_open = list(self._open)
        for phase in still_open:  # a phase across the boundary: split at it
            self._end(phase)
        marks, spans = self._marks, self._spans
        self._marks, self._spans = [], []
        for phase in still_open:
            self._begin(phase)
        self._held.append((made, duration, host, marks, spans))
        return self._release(wait=False)

    def flush(self) -> list:
        """The steps still held, their events waited for (the run's end)."""
        return self._release(wait=True)

    def _release(self, wait: bool) -> list:
        ready = []
        while self._held:
            made, duration, host, marks, spans = self._held[0]
            if self._off:
                phases = host
            elif not (wait or all(m.query() for m in marks)):
                if len(self._held) <= HOLD:
                    break
                phases = host  # the device is far behind: this step's host times
            else:
                try:
                    for m in marks if wait else ():
                        m.synchronize()
                    phases = _device_phases(marks, spans, duration, host["data"])
                    self._free.extend(marks)
                except (RuntimeError, ValueError):
                    # a device in error (the run is failing), or an event never recorded
                    # (torch's ValueError): this step's host times, never a failed step
                    phases = host
            self._held.popleft()
            ready.append(made(phases))
        return ready


def _device_phases(marks: list, spans: list[tuple[str, int, int]], duration: float,
                   data: float) -> dict[str, float]:
    """Seconds per phase from a step's events: each span's device time, less the waits
    inside it; waits and the final callbacks are comm."""
    acc = dict.fromkeys(PHASES, 0.0)
    acc["data"] = data
    if marks:
        at = [0.0] + [marks[0].elapsed_time(m) / 1000 for m in marks[1:]]
        waits = [(a, b) for phase, a, b in spans if phase in ("wait", "final")]
        for phase, a, b in spans:
            seconds = at[b] - at[a]
            if phase in ("wait", "final"):
                acc["comm"] += seconds
                continue
            seconds -= sum(at[d] - at[c] for c, d in waits if a < c and d < b)
            acc[phase] += max(0.0, seconds)
    device = sum(acc.values()) - data
    room = max(0.0, duration - data)
    if device > room > 0:
        # The step is the host's window between two boundaries; the device ran this
        # step's work partly after it (a loop that syncs only in the next step, before
        # its optimizer step ends it). The device's split, in the window's length.
        for phase in ("forward", "backward", "optimizer", "comm"):
            acc[phase] *= room / device
    acc["other"] = max(0.0, duration - sum(acc.values()))
    return acc


__all__ = ["HOLD", "DeviceStepClock"]
