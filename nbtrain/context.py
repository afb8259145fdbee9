"""The worker-side ``ctx`` handed to the user's function, once per rank.

It knows where this rank stands (rank, world size, device), wraps the model with the
chosen strategy, shards data, and reports metrics to the kernel as typed events. It also
carries the memory techniques that need the strategy's help: meta-device initialisation
(``init_module``), gradient accumulation without synchronisation (``accumulate``,
``no_backward_sync``), clipping of sharded gradients (``clip_grad_norm_``) and
strategy-independent checkpoints (``save``/``load``, ``resume_from``).
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from .accumulate import Accumulator
from .loader import DeviceLoader, shard_loader
from .resume import Checkpointer, default_path
from .strategies.precision import ScaledOptimizer, unwrap
from .telemetry.recorder import Recorder, report_checkpoint, samples_given

if TYPE_CHECKING:
    from .spec import WorkerSpec
    from .strategies import Strategy
    from .telemetry.client import TelemetryClient

class Context:
    """``ctx``, what the training function gets on every rank as its first argument.

    Where the rank stands: ``rank``, ``local_rank``, ``world_size``, ``device``,
    ``is_main``, ``strategy``, ``seed``, ``step``. What it does for the function:
    ``setup(model, *optimizers)`` (to the device, wrapped by the strategy),
    ``dataloader(dataset, ...)`` (sharded per rank, batches on the device),
    ``backward(loss)`` (through the strategy, scaled under fp16), ``log(**metrics)`` (to the
    dashboard), ``accumulate``/``no_backward_sync``, ``clip_grad_norm_``, ``init_module()``
    (a model built on the meta device), ``full_state_dict(model)``, ``save``/``load`` and
    ``resume_from`` (checkpoints that load into any strategy).
    """

    def __init__(self, spec: WorkerSpec, strategy: Strategy,
                 telemetry: TelemetryClient | None = None, function: str = "train"):
        self.rank = spec.rank
        self.local_rank = spec.local_rank
        self.world_size = spec.world_size
        self.strategy = strategy
        self.device = (torch.device("cuda", spec.device_index) if spec.accelerator == "cuda"
                       else torch.device("cpu"))
        self._recorder = (Recorder(self.rank, self.device, telemetry, spec.telemetry)
                          if telemetry is not None and spec.telemetry.enabled else None)
        # With telemetry off, a restart still needs to hear of checkpoints: the client
        # carries those reports alone (launch(max_restarts=...) connects it).
        self._reports = telemetry if self._recorder is None else None
        self._accumulators: list[Accumulator] = []  # ctx.accumulate's, in phase or not
        self._scaler = None
        self._skipped = 0  # fp16 steps the loss scaler skipped
        self._model: nn.Module | None = None  # the model ctx.setup returned last
        self._models: list[nn.Module] = []  # all of them (the loaders tell evaluations by them)
        self._optimizers: list[torch.optim.Optimizer] = []  # and its optimizers
        self._batches = 0  # the index the next batch from ctx.dataloader gets
        self._batch_seen = False
        self._logs = 0
        self._checkpoints: Checkpointer | None = None  # ctx.checkpoint_every
        self._loaders: list[DeviceLoader] = []
        self._function = function
        self._kernel_pid = spec.parent_pid
        self._init_recording = None  # from ctx.init_module()
        self._model_of: dict[int, nn.Module] = {}  # id(optimizer) -> the model it trains
        # The checkpoint given to launch(resume=...), or None: load it to go on from there.
        self.resume_from: str | None = spec.resume_from
        # The launch's base seed, the same on every rank (this rank's generators started
        # from seed + rank); see nbtrain.seeding.
        self.seed: int = spec.seed
        self._data_seed = spec.data_seed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def step(self) -> int:
        """Index of the current training batch from ``ctx.dataloader`` (or of the ``log``
        call). Settable: ``ctx.step = n`` makes the next batch (or ``log`` call) step n."""
        return self._batches - 1 if self._batch_seen else self._logs

    @step.setter
    def step(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"ctx.step = {value!r}: give an int >= 0.")
        self._go_to(value)
        if self._checkpoints is not None:  # a hand-written loop's step boundary
            self._checkpoints.step_set(value)

    def _go_to(self, step: int) -> None:
        self._batches = self._logs = step
        if self._recorder is not None:
            self._recorder.skip_to(step)

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"strategy={self.strategy.name!r})")

    # -- model and optimizers ----------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer,
              activation_checkpointing=None):
        """Move ``model`` to ``ctx.device`` and wrap it with the strategy.

        Optimizers built on ``model.parameters()`` before this call are re-pointed at the
        parameters the strategy made (FSDP replaces them with sharded ones), keeping their
        hyper-parameters and any LR scheduler attached to them. With ``zero1`` each
        optimizer comes back as a ``ZeroRedundancyOptimizer`` of the same class and
        hyper-parameters (build LR schedulers on the returned one).
        ``activation_checkpointing=(Block,)`` recomputes those blocks' activations in
        backward (overrides the strategy's setting). A model built in
        ``ctx.init_module()`` is materialised here, each rank holding only its shard.
        Returns the model, or ``(model, *optimizers)`` when optimizers were given.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"ctx.setup() takes an nn.Module first, got {type(model).__name__}.")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"ctx.setup(model, *optimizers): {type(opt).__name__} is not a "
                                "torch.optim.Optimizer.")
        strategy = self.strategy
        if activation_checkpointing is not None:
            strategy = dataclasses.replace(strategy,
                                           activation_checkpointing=activation_checkpointing)
        from .strategies import meta_values

        model = strategy.prepare_module(model)
        materialize = None
        if meta_values.on_meta(model):  # where each tensor's values come from, before sharding
            materialize = functools.partial(
                meta_values.materialize, sources=meta_values.sources(model, self._init_recording))
        wrapped, optimizers = strategy.setup(model, optimizers, self, materialize)
        self._model = wrapped
        self._models.append(wrapped)
        self._optimizers = list(optimizers)
        if self._recorder is not None:
            self._recorder.watch(wrapped, optimizers, strategy)
        self._scaler = strategy.grad_scaler(self)
        if self._scaler is not None:
            optimizers = tuple(ScaledOptimizer(opt, self._scaler, self._step_skipped)
                               for opt in optimizers)
        for opt in optimizers:
            self._model_of[id(opt)] = wrapped
        return (wrapped, *optimizers) if optimizers else wrapped

    @contextlib.contextmanager
    def init_module(self):
        """Build the model inside this block for fast, low-memory initialisation.

        Modules are created on the meta device (no memory, no time); ``ctx.setup`` then
        lets the strategy shard them and allocates and initialises only this rank's
        shard, with the same values ordinary construction with the same seed gives (the
        seed may be set before the block or inside it)::

            with ctx.init_module():
                torch.manual_seed(0)
                model = Net()
            model, opt = ctx.setup(model, torch.optim.AdamW(model.parameters()))

        Everything that sets initial values must happen inside the block.
        """
        from .strategies import meta_init, meta_values

        if self._init_recording is None:
            self._init_recording = meta_values.Recording()
        with meta_init.record(self._init_recording):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as the strategy does it (scaled in fp16; DeepSpeed's own)."""
        self.strategy.backward(self._model, loss, self._scaler)

    @property
    def skipped_steps(self) -> int:
        """fp16: optimizer steps the loss scaler skipped so far (inf or nan gradients)."""
        return self._skipped

    def _own_state(self) -> dict[str, Any]:
        """What of ctx a restart goes on with: fp16's loss scale and the skipped steps."""
        return {"scaler": self._scaler.state_dict() if self._scaler is not None else None,
                "skipped": self._skipped}

    def _restore_own_state(self, state: dict[str, Any]) -> None:
        if state.get("scaler") and self._scaler is not None:
            self._scaler.load_state_dict(state["scaler"])
        self._skipped = state.get("skipped", 0)

    def _step_skipped(self, optimizer: torch.optim.Optimizer) -> None:
        self._skipped += 1
        if self._recorder is not None:
            self._recorder.step_skipped(optimizer)
            self._recorder.log(self.step, {"skipped_steps": self._skipped})

    # -- gradient accumulation and clipping ---------------------------------------------
    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module, enabled: bool = True):
        """Within this block, backward accumulates gradients locally without
        synchronising them across ranks (DDP's ``no_sync``, FSDP's
        ``set_requires_gradient_sync(False)``). Put forward and backward inside it."""
        if not enabled:
            yield
            return
        with self.strategy.no_backward_sync(model):
            yield

    def accumulate(self, model: nn.Module, steps: int) -> Accumulator:
        """Gradient accumulation over ``steps`` micro-batches; every micro-step but the
        last skips the gradient synchronisation::

            acc = ctx.accumulate(model, 4)
            for x, y in loader:
                with acc:
                    ctx.backward(loss_fn(model(x), y) / 4)
                if acc.ready:  # after every 4th micro-step
                    opt.step(); opt.zero_grad()
        """
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"ctx.accumulate(model, steps={steps!r}): give an int >= 1.")
        acc = Accumulator(functools.partial(self.no_backward_sync, model), steps)
        self._accumulators.append(acc)
        return acc

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0,
                        optimizer=None) -> torch.Tensor:
        """Clip the gradients to a total norm of ``max_norm``; returns the norm before.

        The norm is of the whole model's gradients even when they are sharded (FSDP's
        DTensor shards are reduced across ranks). In fp16, pass the optimizer: its
        gradients are unscaled first. Under DeepSpeed the norm is read from its
        partitions and the coming ``opt.step()`` clips (DeepSpeed clips inside its step).
        """
        if not isinstance(max_norm, (int, float)) or max_norm <= 0:
            raise ValueError(f"max_norm={max_norm!r} must be a positive number.")
        if self._scaler is not None:
            if optimizer is None:
                raise ValueError("fp16 gradients are scaled: call "
                                 "ctx.clip_grad_norm_(model, max_norm, optimizer=opt) so "
                                 "they are unscaled before clipping.")
            self._scaler.unscale_(unwrap(optimizer))
        return self.strategy.clip_grad_norm_(model, max_norm, norm_type)

    # -- checkpoints --------------------------------------------------------------------
    def save(self, path: str | os.PathLike, state: dict[str, Any], full: bool = False,
             resume: bool = False) -> None:
        """Save ``state`` (e.g. ``{"model": model, "optimizer": opt, "step": step}``).

        Sharded by default: a directory where each rank writes its own shards (torch's
        distributed checkpoint); ``full=True``: one file with the gathered state, written
        by rank 0. Either loads into any strategy and world size, and in the notebook
        with ``nbtrain.checkpoint.load``. Every rank must call it.

        ``resume=True``: a restart (``launch(max_restarts=...)``) may go on from this
        save: it holds what the function loads from ``ctx.resume_from`` to go on (its
        step too). Other saves (a best model, an export) never become a restart's point;
        ``ctx.checkpoint_every``'s always are.
        """
        from . import checkpoint

        checkpoint.save(path, state, full=full, models=self._model_of)
        self._saved(os.path.abspath(path), resume)

    def _saved(self, path: str, resumes: bool) -> None:
        """Every rank wrote the checkpoint at ``path``: rank 0 tells the kernel."""
        if self._recorder is not None:
            self._recorder.checkpoint(self.step, path, report=self.rank == 0,
                                      resumes=resumes)
        elif self._reports is not None and self.rank == 0 and resumes:
            report_checkpoint(self._reports, self.step, path, resumes)

    def load(self, path: str | os.PathLike, state: dict[str, Any],
             strict: bool = True) -> dict[str, Any]:
        """Load a checkpoint into ``state`` (models and optimizers in place, other values
        replaced) and return it. Every rank must call it."""
        from . import checkpoint

        with self._recorder.paused() if self._recorder is not None else contextlib.nullcontext():
            return checkpoint.load(path, state, strict=strict, models=self._model_of)

    def checkpoint_every(self, steps: int, path: str | os.PathLike | None = None,
                         **state: Any) -> dict[str, Any]:
        """Save ``state`` (``model=``, ``optimizer=``, plain values) every ``steps``
        training steps, so that a restart (``launch(max_restarts=...)``) goes on from the
        last one exactly: with the step, where ``ctx.dataloader``'s loader was and this
        rank's random streams. When this launch goes on from a checkpoint (a restart, or
        ``launch(resume=...)``), it is loaded here first. Returns the state, its plain
        values as loaded and ``step``: the steps already done (0 on a fresh start).

        Steps are the batches of ``ctx.dataloader``'s loader (``loader=`` in the state
        names which, else the function's first; loop with ``loader.epochs(n)`` and it
        starts at the saved epoch and batch), or, in a loop without one, the
        values given to ``ctx.step`` at the top of each step: ``for step in
        range(state["step"], n): ctx.step = step``. ``path``: a directory every rank
        sees (default: one per kernel and function in the temporary directory). Every
        rank must call it, once, after ``ctx.setup``.
        """
        if self._checkpoints is not None:
            raise RuntimeError("ctx.checkpoint_every was already called in this run; call "
                               "it once, with everything to save.")
        keeper = Checkpointer.begin(steps, path or default_path(self._function,
                                                                self._kernel_pid),
                                    state, self._loaders, self.rank, self.device,
                                    functools.partial(self.save, resume=True), self.load,
                                    in_phase=lambda: all(a.in_phase
                                                         for a in self._accumulators),
                                    ctx_state=(self._own_state, self._restore_own_state))
        self._checkpoints = keeper
        state = keeper.resume(self.resume_from)
        if keeper.start:
            self._go_to(keeper.start)  # the curves go on from there
        return state

    def checkpoint_exists(self, path: str | os.PathLike) -> bool:
        from . import checkpoint

        return checkpoint.exists(path)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict on rank 0 (on CPU); ``{}`` on the other ranks.

        Every rank must call it (it gathers shards).
        """
        return self.strategy.full_state_dict(model)

    # -- data --------------------------------------------------------------------------
    def dataloader(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False,
                   drop_last: bool = False, seed: int | None = None,
                   **kwargs) -> DeviceLoader:
        """A DataLoader over this rank's shard of ``dataset``; batches arrive on ``ctx.device``.

        Reshuffles every epoch (``set_epoch`` is called for you). The order's ``seed`` must
        be the same on every rank; by default ``launch(seed=...)``, else 0 (as torch and
        Lightning). ``kwargs`` go to ``DataLoader`` (``num_workers``, ``collate_fn``, ...).
        A pass begun after ``model.eval()`` evaluates: its batches are no training steps;
        ``loader.gather(values)`` puts the ranks' per-sample values together."""
        kwargs.setdefault("pin_memory", self.device.type == "cuda")
        loader, sampler = shard_loader(dataset, self.rank, self.world_size, batch_size,
                                       shuffle, drop_last,
                                       self._data_seed if seed is None else seed, **kwargs)
        made = DeviceLoader(
            loader, sampler, self.device, on_batch=self._on_batch,
            on_data_time=self._data_clock(), on_epoch_end=self._on_epoch_end,
            models=self._models,
            recorder=self._recorder)
        self._loaders.append(made)
        if self._checkpoints is not None and self._checkpoints.loader is None:
            self._checkpoints.attach(made)  # the first loader after checkpoint_every
        return made

    @property
    def total_steps(self) -> int | None:
        """How many steps the function will run, if it says so (``ctx.total_steps = n``):
        the dashboard then shows progress against it and an ETA."""
        if self._recorder is None or not self._recorder.total_steps:
            return None
        return self._recorder.total_steps

    @total_steps.setter
    def total_steps(self, value: int | None) -> None:
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"ctx.total_steps={value!r} must be a positive int (or None).")
        if self._recorder is not None:
            self._recorder.total_steps = value or 0

    def _on_batch(self, samples: int, epoch: int = 0, epoch_steps: int = 0) -> None:
        self._batch_seen = True
        self._batches += 1
        if self._recorder is not None:
            self._recorder.on_batch(self._batches - 1, samples, epoch, epoch_steps)

    def _data_clock(self):
        """Where the loader's waits for batches go: the step clock's ``data`` (called
        straight, twice a batch), or None when the time breakdown is off."""
        clock = self._recorder.clock if self._recorder is not None else None
        return clock.data if clock is not None else None

    def _on_epoch_end(self) -> None:
        if self._recorder is not None:
            self._recorder.on_epoch_end()

    def _close(self) -> None:
        """End of the user's function: send what is pending."""
        if self._recorder is not None:
            self._recorder.close()

    # -- metrics -----------------------------------------------------------------------
    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record scalar metrics for this rank at the current step (a typed event).

        Tensors may stay on the GPU: they are read back in batches, not one sync per call.
        ``samples=n``: the samples this rank's step trains on (a loop without
        ``ctx.dataloader``, which counts them itself): throughput and scaling are then
        measured in samples, not steps.
        """
        samples = samples_given(metrics.pop("samples", None))
        if samples and self._recorder is not None:
            self._recorder.count_samples(samples)
        if not metrics or self._recorder is None:
            return
        self._recorder.log(self.step, metrics)
        self._logs += 1

    # -- coordination ------------------------------------------------------------------
    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def print(self, *args, all_ranks: bool = False, **kwargs) -> None:
        """``print`` on rank 0 only (every rank with ``all_ranks=True``)."""
        if all_ranks or self.is_main:
            kwargs.setdefault("flush", True)
            builtins.print(*args, **kwargs)

