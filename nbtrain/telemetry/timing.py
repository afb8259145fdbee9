"""Worker side: where a rank's step time goes, measured around the points every training
step passes, on the rank's own clock (CPU ranks; on a GPU, CUDA events: see below).

- **data**: inside ``ctx.dataloader``'s iteration (the next batch, and its move to the
  device).
- **forward**: the watched model's forward (its forward pre-hook to its forward hook).
- **backward**: from the moment the backward pass reaches the model's output (a hook on
  the output's gradient) to the end of autograd's work, marked by a callback queued on
  autograd's engine at that moment (engine callbacks run in the order queued, after the
  last gradient: DDP and FSDP queue theirs later, when their last bucket is ready).
- **optimizer**: the optimizers' ``step()`` (their step pre- and post-hooks).
- **comm**: communication the rank *waited* for, not hidden behind compute:
  the rest of autograd's final callbacks (a second callback, queued from the first, runs
  after DDP's ``finalize_backward`` and FSDP's post-backward callback, which wait for the
  gradients' all-reduce or reduce-scatter), plus every wait on a collective made from
  Python (``Work.wait()``, which ``torch.distributed``'s collectives called without
  ``async_op`` call too: FSDP's all-gathers, ``dist.all_reduce`` of a loss, ZeRO's
  broadcasts). A wait inside another
  phase counts as comm, not as that phase.
- **other**: the rest of the step (the user's own code: the loss, logging, ``zero_grad``).

Costs a few Python calls per forward, backward and optimizer step, and one per wait on a
collective; no device synchronisation.

On a GPU the host only queues the work, and a wait on a collective returns at once (the
stream waits, not the host), so host times would say little. ``DeviceStepClock`` marks
the same points with CUDA events on the stream that runs them (the current stream: the
default one, where DDP's finalize and FSDP's waits make the compute wait for the NCCL
streams), so each phase is the device's time between its marks, and a wait on a
collective is the time the compute stream stood still at it (FSDP's all-gathers are
waited for on their own stream; the compute's wait for them is a ``wait_event`` no hook
sees, so a late prefetch counts in forward or backward). A step's events are read
once they have completed (``Event.query``), a step or two later, never by a device sync;
its Step event waits for them (``close``), and the last ones are read at the end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

PHASES = ("data", "forward", "backward", "optimizer", "comm", "other")


def _engine():
    """autograd's engine, whose ``queue_callback`` torch's DDP and FSDP use the same way;
    None where this torch has none (the breakdown then puts the final wait in backward)."""
    return getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)


class StepClock:
    """Accumulates each phase's seconds between ``take()`` calls (one per step)."""

    def __init__(self):
        self._acc = dict.fromkeys(PHASES, 0.0)
        self._waited = 0.0  # seconds waited on collectives this step (phases subtract theirs)
        self._forward_at: tuple[float, float] | None = None  # (started, waited then)
        self._backward_at: tuple[float, float] | None = None
        self._optimizer_at: tuple[float, float] | None = None
        self._final_at: tuple[float, float] | None = None
        self._hooks: list = []
        self._wait_original = None
        self._engine = _engine()

    # -- installing ----------------------------------------------------------------------
    def watch(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Time ``model``'s forward and backward and the optimizers' steps. Call before any
        other step post-hook that reads ``take()`` (post-hooks run in the order added)."""
        self._hooks.append(model.register_forward_pre_hook(self._forward_start))
        self._hooks.append(model.register_forward_hook(self._forward_end))
        for opt in optimizers:
            self.watch_optimizer(opt)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Time ``optimizer``'s steps (one without torch's step hooks: its step is "other")."""
        pre = getattr(optimizer, "register_step_pre_hook", None)
        post = getattr(optimizer, "register_step_post_hook", None)
        if pre is not None and post is not None:
            self._hooks.append(pre(self._optimizer_start))
            self._hooks.append(post(self._optimizer_end))

    def install_waits(self) -> None:
        """Time every wait on a collective made from Python: ``Work.wait``, which the
        collectives of ``torch.distributed`` called without ``async_op`` call too."""
        work = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", None)
        if work is not None and self._wait_original is None:
            # torch's own, even if a run that never closed left its wrapper (a pool rank)
            original = getattr(work.wait, "nbtrain_original", work.wait)
            clock = self

            def wait(self, *args, **kwargs):
                t = time.monotonic()
                clock._wait_begins()
                try:
                    return original(self, *args, **kwargs)
                finally:
                    clock._waited += time.monotonic() - t
                    clock._wait_ends()

            wait.nbtrain_original = original
            try:
                work.wait = wait
                self._wait_original = original
            except (AttributeError, TypeError):  # a build whose Work is sealed
                pass

    def uninstall(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._wait_original is not None:
            torch._C._distributed_c10d.Work.wait = self._wait_original
            self._wait_original = None

    # -- what the loop passes --------------------------------------------------------------
    def data(self, seconds: float) -> None:
        self._acc["data"] += seconds

    def _forward_start(self, module, args) -> None:
        self._forward_at = (time.monotonic(), self._waited)

    def _forward_end(self, module, args, output) -> None:
        if self._forward_at is not None:
            self._close(self._forward_at, "forward")
            self._forward_at = None
        if torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._backward_start)
                    break

    def _backward_start(self, grad):
        if self._backward_at is None:
            self._backward_at = (time.monotonic(), self._waited)
            if self._engine is not None:
                self._engine.queue_callback(self._backward_end)
        return None

    def _backward_end(self) -> None:
        """autograd's work is done; the final callbacks queued after this one (DDP's,
        FSDP's) wait for the gradients' communication."""
        if self._backward_at is not None:
            self._close(self._backward_at, "backward")
            self._backward_at = None
            self._final_at = (time.monotonic(), self._waited)
            self._engine.queue_callback(self._final_end)

    def _final_end(self) -> None:
        if self._final_at is not None:
            started, waited = self._final_at
            self._final_at = None
            self._waited = waited + time.monotonic() - started  # all of it is waiting

    def _optimizer_start(self, optimizer, args, kwargs) -> None:
        if self._optimizer_at is None:  # several optimizers: the first one's start
            self._optimizer_at = (time.monotonic(), self._waited)

    def _optimizer_end(self, optimizer, args, kwargs) -> None:
        if self._optimizer_at is not None:
            self._close(self._optimizer_at, "optimizer")
            self._optimizer_at = None

    def _close(self, at: tuple[float, float], phase: str) -> None:
        started, waited = at
        self._acc[phase] += (time.monotonic() - started) - (self._waited - waited)

    def _wait_begins(self) -> None:
        """A wait on a collective starts (the device clock marks it)."""

    def _wait_ends(self) -> None:
        """It ended."""

    # -- one step ------------------------------------------------------------------------
    def forget(self) -> None:
        """What was timed since the last step closed belongs to no step (a gap)."""
        self._acc, self._waited = dict.fromkeys(PHASES, 0.0), 0.0

    def stash(self) -> Any:
        """What the step in progress has timed so far, taken aside (an evaluation
        begins in it); ``restore`` puts it back and drops what was timed meanwhile."""
        state = (self._acc, self._waited)
        self.forget()
        return state

    def restore(self, state: Any) -> None:
        self._acc, self._waited = state

    def close(self, made: Callable[[dict], Any], duration: float) -> list:
        """The step's event, ``made(phases)``, ready to send: here at once."""
        return [made(self.take(duration))]

    def flush(self) -> list:
        """Steps still held (none here)."""
        return []

    def take(self, duration: float) -> dict[str, float]:
        """The phases of a step that lasted ``duration`` seconds (``other``: the rest),
        and start the next step's."""
        acc, self._acc = self._acc, dict.fromkeys(PHASES, 0.0)
        acc["comm"], self._waited = self._waited, 0.0
        for name in ("_forward_at", "_backward_at", "_final_at", "_optimizer_at"):
            at = getattr(self, name)  # open across the boundary: its waits were taken
            if at is not None:
                setattr(self, name, (at[0], at[1] - acc["comm"]))
        acc["other"] = max(0.0, duration - sum(acc.values()))
        return {k: round(v, 6) for k, v in acc.items()}


HOLD = 32  # steps whose events a device clock waits for; older ones go with host times


class DeviceStepClock(StepClock):
    """The phases of a CUDA rank's steps from CUDA events (see the module): forward,
    backward and optimizer are the device's time between their marks, less the waits on
    collectives inside them; comm is those waits plus the final callbacks' wait for the
    gradients' communication; data is the host's (the loader runs there); other is the
    rest of the step. ``event`` makes a timing event (a fake in tests)."""

    def __init__(self, event: Callable[[], Any] | None = None,
                 stream: Callable[[], Any] | None = None):
        super().__init__()
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
                except RuntimeError:  # a device in error (the run is failing): host times
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
    return {k: round(v, 6) for k, v in acc.items()}


def _tensors(output, depth: int = 0):
    """The tensors in a forward's output: a tensor, or inside a tuple, list or dict (a
    transformers ``ModelOutput`` is one) of them."""
    if isinstance(output, torch.Tensor):
        yield output
    elif depth < 3 and isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o, depth + 1)


__all__ = ["PHASES", "DeviceStepClock", "StepClock"]
