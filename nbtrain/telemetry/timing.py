"""Worker side: where a rank's step time goes, measured around the points every training
step passes, on the rank's own clock (a CUDA rank's, from CUDA events: ``device_timing``).

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
collective; no device synchronisation. On a host clock a step shorter than ``SAMPLE_S`` is
timed at random, with a chance of its expected length over ``SAMPLE_S`` (one timed step
per ``SAMPLE_S`` of training): a tiny step's breakdown cost about 45 µs in a 400 µs step
(the autograd hook on the output alone ~10 µs, registering it for one step), and a mean
over the timed steps is the mean over all. An untimed step's event has no phases, as with
the breakdown off; ``Telemetry(timing="every step")`` times every step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

PHASES = ("data", "forward", "backward", "optimizer", "comm", "other")
SAMPLE_S = 0.005  # steps at least this long are all timed; shorter ones, a sample of them


def outside_graphs(hook: Callable) -> Callable:
    """``hook``, run as it is also where dynamo compiles the call it is in (a model
    compiled after ctx.setup, a compiled ``optimizer.step``): the call is a graph break
    there, and the hook runs between the graphs, never traced into one, where a clock
    read would be the trace's, a CUDA event's ``record`` a graph op that left the event
    unrecorded (a step failed reading it, on an H200), and dynamo warned of each builtin
    it could not trace, in every rank's output. Half a microsecond a call; dynamo is
    imported by then (building an optimizer imports it: launch/starting/warm.py)."""
    return torch.compiler.disable(hook)


def _engine():
    """autograd's engine, whose ``queue_callback`` torch's DDP and FSDP use the same way;
    None where this torch has none (the breakdown then puts the final wait in backward)."""
    return getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)


class StepClock:
    """Accumulates each phase's seconds between ``take()`` calls (one per step).
    ``sample_s``: steps shorter than it are timed at random (0: every step)."""

    def __init__(self, sample_s: float = SAMPLE_S):
        self.timed = True  # whether the step in progress is timed
        self._sample_s = sample_s
        self._typical = 0.0  # a step's expected length (a moving mean of the last ~10)
        self._chance = random.Random(0)  # its own stream: the user's random state untouched
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
    def watch(self, model: nn.Module, optimizers: Iterable[torch.optim.Optimizer],
              before_forward: Callable | None = None,
              after_step: Callable | None = None) -> None:
        """Time ``model``'s forward and backward and the optimizers' steps. The caller's
        ``before_forward`` (a forward pre-hook) and ``after_step`` (the first optimizer's
        step post-hook) run in the same hooks, after the clock's own: a hook costs a tiny
        step microseconds, two at one point cost it twice."""
        start = self._forward_start
        if before_forward is not None:
            def start(module, args):
                self._forward_start(module, args)
                before_forward(module, args)
        self._hooks.append(model.register_forward_pre_hook(outside_graphs(start)))
        self._hooks.append(model.register_forward_hook(outside_graphs(self._forward_end)))
        for i, opt in enumerate(optimizers):
            self.watch_optimizer(opt, after_step if i == 0 else None)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer,
                        after_step: Callable | None = None) -> None:
        """Time ``optimizer``'s steps (one without torch's step hooks: its step is
        "other"); ``after_step`` runs after the optimizer phase is closed."""
        pre = getattr(optimizer, "register_step_pre_hook", None)
        post = getattr(optimizer, "register_step_post_hook", None)
        if pre is not None and post is not None:
            end = self._optimizer_end
            if after_step is not None:
                def end(optimizer, args, kwargs):
                    self._optimizer_end(optimizer, args, kwargs)
                    after_step(optimizer, args, kwargs)
            self._hooks.append(pre(outside_graphs(self._optimizer_start)))
            self._hooks.append(post(outside_graphs(end)))
        elif after_step is not None and post is not None:
            self._hooks.append(post(outside_graphs(after_step)))

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
        if self.timed:
            self._forward_at = (time.monotonic(), self._waited)

    def _forward_end(self, module, args, output) -> None:
        if self._forward_at is not None:
            self._close(self._forward_at, "forward")
            self._forward_at = None
        if self.timed and torch.is_grad_enabled():
            if isinstance(output, torch.Tensor):  # the common case, without a generator
                if output.requires_grad:
                    output.register_hook(self._backward_start)
                return
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
        if self.timed and self._optimizer_at is None:  # several: the first one's start
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
        """The phases of a step that lasted ``duration`` seconds (``other``: the rest;
        none when it was not timed), and start the next step's, timed or not. (On every
        step: kept to a few lines.)"""
        acc, self._acc = self._acc, dict.fromkeys(PHASES, 0.0)
        timed = self.timed
        typical = self._typical = (0.9 * self._typical + 0.1 * duration if self._typical
                                   else duration)
        self.timed = typical >= self._sample_s or self._chance.random() * self._sample_s < typical
        waited = acc["comm"] = self._waited
        if waited:
            self._waited = 0.0
            for name in _OPEN:  # open across the boundary: its waits were taken
                at = getattr(self, name)
                if at is not None:
                    setattr(self, name, (at[0], at[1] - waited))
        if not timed:
            return {}
        acc["other"] = max(0.0, duration - sum(acc.values()))
        return acc


_OPEN = ("_forward_at", "_backward_at", "_final_at", "_optimizer_at")


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


__all__ = ["PHASES", "StepClock"]
