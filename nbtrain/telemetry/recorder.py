"""Worker side: turns what the training loop does into events, without the user writing
anything. Step boundaries come from ``ctx.dataloader`` batches (or, without it, from
optimizer steps); memory is sampled after optimizer steps; collectives are tallied per
step (DDP's bucket all-reduces from DDP's own bookkeeping: the strategy's
``collective_probe``), a run of identical steps sent as one ``Comm``. With
``profile_memory``, the forward before a sampled optimizer step is watched for the
activations it saves."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from .client import TelemetryClient
from .device_timing import DeviceStepClock
from .events import Checkpoint, Comm, Evaluation, Memory, Metric, Step
from .probes import (
    ActivationProbe,
    CommCounter,
    cuda_memory,
    memory_by_category,
)
from .settings import Telemetry
from .timing import SAMPLE_S, StepClock, outside_graphs

METRIC_BATCH = 16  # ctx.log calls whose accelerator tensors are read back together
EVALUATION_EVERY_S = 1.0  # an evaluation's progress goes out at most this often
COMM_EVERY_S = 0.5  # a run of steps with the same collectives goes out at least this often


class Recorder:
    def __init__(self, rank: int, device: torch.device, client: TelemetryClient,
                 settings: Telemetry):
        self.rank = rank
        self.device = device
        self._cuda = device.type == "cuda"
        self.client = client
        self.settings = settings
        # where each step's time goes; installed first, so that its optimizer post-hook
        # closes the optimizer phase before the step's boundary reads it
        self.clock = None
        if settings.timing:
            self.clock = (DeviceStepClock() if device.type == "cuda" else
                          StepClock(0.0 if settings.timing == "every step" else SAMPLE_S))
        if self.clock is not None:
            self.clock.install_waits()
        self.comm = CommCounter() if settings.comm else None
        if self.comm:
            self.comm.install()
        self._model: nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._step = -1  # the step in progress
        self._last: float | None = None  # when it started
        self._samples = 0
        self._samples_given = 0  # ctx.log(samples=n): a hand-written loop's steps' samples
        self._epoch = (0, 0)  # (epoch, batches per epoch) of the step in progress
        self.total_steps = 0  # ctx.total_steps
        self._ddp = None  # the strategy's collective probe (DDP's buckets), if any
        self._opt_steps = 0
        self._opt_end = 0.0  # when the last optimizer step finished
        self._evaluation_sent = 0.0
        self._paused_at: float | None = None  # an evaluation pass began (on_evaluation)
        self._stash: Any = None  # what the paused step had timed and counted by then
        self._batches_seen = False
        self._watched_at = time.monotonic()
        self._paused = False
        self._activations = ActivationProbe() if settings.profile_memory else None
        self._activation_bytes: int | None = None
        self._pending: list[tuple[int, float, dict[str, Any]]] = []  # metrics not sent yet
        self._collectives: _Collectives | None = None  # steps' identical collectives, unsent

    def watch(self, model: nn.Module, optimizers, strategy=None) -> None:
        self._watched_at = time.monotonic()  # without ctx.dataloader, step 0 starts here
        self._model = model
        self._optimizers = list(optimizers)
        if strategy is not None and self.comm:
            self._ddp = strategy.collective_probe(model)
        # one hook a point: the probe's and the step's ride in the clock's when it times
        probe = getattr(self._ddp, "on_forward", None)
        if self.clock is not None:
            self.clock.watch(model, self._optimizers, before_forward=probe,
                             after_step=self._after_optimizer_step)
        else:
            if probe is not None:
                model.register_forward_pre_hook(outside_graphs(probe))
            if self._optimizers:
                self._optimizers[0].register_step_post_hook(
                    outside_graphs(self._after_optimizer_step))
        if self._activations is not None:
            model.register_forward_pre_hook(outside_graphs(self._before_forward))
            model.register_forward_hook(outside_graphs(self._after_forward))

    # -- a loop that never touches ctx (integrations/hosting.py) -------------------------------
    def adopt_start(self) -> None:
        """The function started: without ctx.setup, step 0 starts here."""
        self._watched_at = time.monotonic()

    def adopt(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """Any optimizer's step (torch's global hook): the first optimizer seen marks the
        steps; every one seen counts in memory."""
        if not any(o is optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)
            if self.clock is not None:  # from its next step on (this one has begun)
                self.clock.watch_optimizer(optimizer)
        if optimizer is self._optimizers[0]:
            self._after_optimizer_step(optimizer, args, kwargs)

    def step_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16's loss scaler skipped ``optimizer``'s step: it still ends a step."""
        if self._optimizers and optimizer is self._optimizers[0]:
            self._after_optimizer_step(optimizer, (), {})

    @property
    def steps_taken(self) -> int:
        return self._opt_steps

    def _sampling_next(self) -> bool:
        every = self.settings.memory_every
        return bool(every) and self._opt_steps % every == 0

    def _before_forward(self, module, args) -> None:
        if torch.is_grad_enabled() and self._sampling_next() and not self._paused:
            self._activations.stop()
            self._activations.start()

    def _after_forward(self, module, args, output) -> None:
        measured = self._activations.stop()
        if measured is not None:
            self._activation_bytes = measured

    def skip_to(self, step: int) -> None:
        """Resuming: the next step is ``step``."""
        if not self._batches_seen:
            self._opt_steps = step

    @contextlib.contextmanager
    def paused(self):
        """Optimizer steps in here are not training steps (a checkpoint load's warm-up)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    # -- step boundaries ---------------------------------------------------------------
    def on_batch(self, step: int, samples: int, epoch: int = 0, epoch_steps: int = 0) -> None:
        self._batches_seen = True
        self._boundary(step, samples)
        self._epoch = (epoch, epoch_steps)

    def checkpoint(self, step: int, path: str, report: bool = True,
                   resumes: bool = False) -> None:
        """Every rank finished writing the checkpoint at ``path``: ``report`` (rank 0)
        says so. What each rank sent before it goes on the wire now, before the rank can
        die: a restart resumes from here, and replays only the steps after it. With
        ``ctx.dataloader``, the step the save ends (saves are at step boundaries) is
        closed first: it went out only when the next batch began, and a rank that died
        before the next flush took it along (a gap in the step-time chart)."""
        if self._batches_seen:
            self._close_step(time.monotonic())
            self._last = None  # what follows until the next batch is not a step
        self._send_collectives()
        if report:
            report_checkpoint(self.client, step, path, resumes)
        self.client.flush()

    def on_evaluation(self, done: int, batches: int) -> None:
        """An evaluation pass has ``done`` of its ``batches`` (``batches``: it ended). It
        pauses the step in progress: that step goes on after it as if it had not been
        (its start moves later by the pass's length, and what the pass ran is dropped).
        Its progress goes out as it begins and ends, and at most every
        ``EVALUATION_EVERY_S`` between."""
        now = time.monotonic()
        if done == 0:
            self._pause(now)
        elif done >= batches:
            self._resume(now)
        elif now - self._evaluation_sent < EVALUATION_EVERY_S:
            return
        self._evaluation_sent = now
        self.client.send(Evaluation(rank=self.rank, step=max(self._step, 0), t=now,
                                    done=done, batches=batches))

    @contextlib.contextmanager
    def aside(self):
        """What runs in here (gathering an evaluation's results) is in no step."""
        outer = self._paused_at is not None
        if not outer:
            self._pause(time.monotonic())
        try:
            yield
        finally:
            if not outer:
                self._resume(time.monotonic())

    def _pause(self, now: float) -> None:
        if self._paused_at is None:
            self._paused_at = now
            self._stash = (self.clock.stash() if self.clock is not None else None,
                           self.comm.take() if self.comm else None)

    def _resume(self, now: float) -> None:
        if self._paused_at is None:
            return
        clock, comm = self._stash
        if self.clock is not None:
            self.clock.restore(clock)
        if self.comm:
            self.comm.restore(comm)
        shift = now - self._paused_at
        if self._last is not None:
            if self._opt_end >= self._last:  # the step's optimizer step, before the pause:
                self._opt_end += shift  # where the step ends if it is the last (close)
            self._last += shift
        elif not self._batches_seen:  # before the first optimizer step: step 0 starts later
            self._watched_at += shift
        self._paused_at = self._stash = None

    def count_samples(self, samples: int) -> None:
        """``ctx.log(samples=n)``: the steps of a loop without ``ctx.dataloader`` train on
        ``n`` samples each on this rank (the step in progress, and the next ones)."""
        self._samples_given = samples
        if not self._batches_seen:
            self._samples = samples

    def on_epoch_end(self) -> None:
        self._close_step(time.monotonic())
        self._last = None  # the gap until the next epoch is not a step

    def _boundary(self, step: int, samples: int) -> None:
        now = time.monotonic()
        if self._last is None:  # after a gap (an evaluation, a save, between epochs)
            self._forget()
        self._close_step(now)
        self._step, self._last, self._samples = step, now, samples
        if self._cuda:  # the peak read after this step is this step's
            torch.cuda.reset_peak_memory_stats(self.device)

    def _close_step(self, now: float) -> None:
        if self._last is None:
            return
        duration = now - self._last
        step, samples, epoch, total = self._step, self._samples, self._epoch, self.total_steps

        def made(phases):  # what this step was, whenever its phases are known
            return Step.of(rank=self.rank, step=step, t=now, duration=duration,
                           samples=samples, epoch=epoch[0], epoch_steps=epoch[1],
                           total_steps=total, phases=phases)

        # with the breakdown, once known (a CUDA rank's, when its events have completed)
        for ready in self.clock.close(made, duration) if self.clock else [made({})]:
            self.client.send(ready)
        if self.comm:
            counts, sizes = self.comm.take()
            buckets = self._ddp.take() if self._ddp is not None else []
            if buckets:
                counts["all_reduce"] = counts.get("all_reduce", 0) + len(buckets)
                sizes["all_reduce"] = sizes.get("all_reduce", 0) + sum(buckets)
            self._count(self._step, now, counts, sizes)

    def _count(self, step: int, now: float, counts: dict, sizes: dict) -> None:
        """One step's collectives. A step like the run before it (the next step, the same
        calls and bytes) joins it: a tiny step's third event is most of what telemetry
        costs it on the wire. Any other step sends the run, and a run goes out when it
        is ``COMM_EVERY_S`` old (the chart moves), at a checkpoint, and at the end (the
        client hands an older listener one a step)."""
        run = self._collectives
        if (run is not None and step == run.step + run.steps and counts == run.counts
                and sizes == run.bytes):
            run.steps, run.t = run.steps + 1, now
            if now - run.since >= COMM_EVERY_S:
                self._send_collectives()
            return
        self._send_collectives()
        if counts:
            self._collectives = _Collectives(step, now, counts, sizes)

    def _send_collectives(self) -> None:
        run, self._collectives = self._collectives, None
        if run is not None:
            self.client.send(Comm.of(rank=self.rank, step=run.step, t=run.t,
                                     counts=run.counts, bytes=run.bytes, steps=run.steps))

    def _forget(self) -> None:
        """What ran between two steps (an evaluation's forwards and collectives) is in
        neither: none of it goes to the next."""
        if self.clock is not None:
            self.clock.forget()
        if self.comm:
            self.comm.take()
            if self._ddp is not None:
                self._ddp.take()

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._paused:
            return
        step = self._step  # with ctx.dataloader: the batch this optimizer step ends
        if not self._batches_seen:  # without: optimizer steps are the steps; this ends one
            step = self._opt_steps
            if self._last is None:
                self._step, self._last = step, self._watched_at
            self._boundary(step + 1, self._samples_given)
        self._opt_steps += 1
        self._opt_end = time.monotonic()
        every = self.settings.memory_every
        if every and (self._opt_steps - 1) % every == 0:
            self.sample_memory(max(step, 0))

    def sample_memory(self, step: int) -> None:
        values = memory_by_category(self._model, self._optimizers, self.device)
        if self._activation_bytes is not None:
            values["activations"] = self._activation_bytes
            values["peak"] = sum(values[k] for k in ("params", "grads", "optimizer",
                                                     "activations"))
            self._activation_bytes = None
        if self.device.type == "cuda":
            values.update(cuda_memory(self.device))
        self.client.send(Memory(rank=self.rank, step=step, t=time.monotonic(), values=values))

    # -- ctx.log ------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Scalar metrics at ``step``, as a ``Metric`` event. Tensors on an accelerator are
        read back ``METRIC_BATCH`` calls at a time, not with one sync per call."""
        values: dict[str, Any] = {}
        on_accelerator = False
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"ctx.log({key}=...) takes a scalar; got a tensor of shape "
                                     f"{tuple(value.shape)}. Log a reduction such as .mean().")
                if value.device.type != "cpu":
                    on_accelerator = True
                    value = value.detach().clone()
                else:
                    value = value.item()
            elif isinstance(value, (int, float)) or hasattr(value, "__float__"):
                value = float(value)
            else:
                raise TypeError(f"ctx.log({key}=...) takes numbers or scalar tensors; got "
                                f"{type(value).__name__}.")
            values[key] = value
        if not (on_accelerator or self._pending):  # numbers already: out at once
            self.client.send(Metric.of(rank=self.rank, step=step, t=time.monotonic(),
                                       values=values))
            return
        self._pending.append((step, time.monotonic(), values))
        if not on_accelerator or len(self._pending) >= METRIC_BATCH:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        if not self._pending:
            return
        tensors = [v for _, _, vals in self._pending for v in vals.values()
                   if isinstance(v, torch.Tensor)]
        numbers = iter(torch.stack([t.float().reshape(()) for t in tensors]).tolist()
                       if tensors else [])
        pending, self._pending = self._pending, []
        for step, t, vals in pending:
            floats = {k: next(numbers) if isinstance(v, torch.Tensor) else v
                      for k, v in vals.items()}
            self.client.send(Metric(rank=self.rank, step=step, t=t, values=floats))

    def close(self) -> None:
        self.flush_metrics()
        # The last step ends with its optimizer step, not with whatever the function did
        # after the loop (gathering a state dict, evaluating).
        end = time.monotonic()
        if not self._batches_seen:
            self._last = None  # the step begun by the last optimizer step has none of its own
        elif self._last is not None and self._opt_end > self._last:
            end = self._opt_end
        self._close_step(end)
        self._send_collectives()
        if self.comm:
            self.comm.uninstall()
        if self.clock is not None:
            for step in self.clock.flush():  # a CUDA rank's last steps, their events read
                self.client.send(step)
            self.clock.uninstall()


class _Collectives:
    """Consecutive steps from ``step`` with the same collectives, not sent yet."""

    __slots__ = ("step", "steps", "t", "since", "counts", "bytes")

    def __init__(self, step: int, now: float, counts: dict, sizes: dict):
        self.step, self.steps, self.t, self.since = step, 1, now, now
        self.counts, self.bytes = counts, sizes


def report_checkpoint(client, step: int, path: str, resumes: bool) -> None:
    """Rank 0's report that every rank wrote the checkpoint at ``path``, on the wire
    before this returns (the rank may die next). With telemetry off, the client carries
    these alone, when a restart may need them."""
    client.send(Checkpoint(rank=0, step=step, t=time.monotonic(), path=path,
                           resumes=resumes))
    client.flush()


def samples_given(value) -> int | None:
    """``ctx.log(samples=n)``'s n, checked: an int >= 1 (a one-element tensor too)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ctx.log(samples={value!r}): give the number of samples this "
                         "rank's step trains on, an int >= 1.")
    return value
