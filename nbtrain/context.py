"""The worker-side ``ctx`` handed to the user's function, once per rank.

It knows where this rank stands (rank, world size, device), wraps the model with the
chosen strategy, shards data, and reports metrics to the kernel as typed events.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .telemetry.events import Metric
from .telemetry.recorder import Recorder

if TYPE_CHECKING:
    from .launch.worker import WorkerSpec
    from .strategies import Strategy
    from .telemetry.channel import TelemetryClient

_LOG_BATCH = 16  # accelerator-resident metric tensors are read back this many calls at a time


class Context:
    def __init__(self, spec: WorkerSpec, strategy: Strategy,
                 telemetry: TelemetryClient | None = None):
        self.rank = spec.rank
        self.local_rank = spec.local_rank
        self.world_size = spec.world_size
        self.strategy = strategy
        self.device = (torch.device("cuda", spec.device_index) if spec.accelerator == "cuda"
                       else torch.device("cpu"))
        self._telemetry = telemetry
        self._recorder = (Recorder(self.rank, self.device, telemetry, spec.telemetry)
                          if telemetry is not None else None)
        self._scaler = None
        self._batches = 0
        self._logs = 0
        self._pending: list[tuple[int, float, dict[str, Any]]] = []

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def step(self) -> int:
        """Index of the current batch from ``ctx.dataloader`` (or of the ``log`` call)."""
        return self._batches - 1 if self._batches else self._logs

    def __repr__(self) -> str:
        return (f"Context(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"strategy={self.strategy.name!r})")

    # -- model and optimizers ----------------------------------------------------------
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer):
        """Move ``model`` to ``ctx.device`` and wrap it with the strategy.

        Optimizers built on ``model.parameters()`` before this call are re-pointed at the
        parameters the strategy made (FSDP replaces them with sharded ones), keeping their
        hyper-parameters and any LR scheduler attached to them.
        Returns the model, or ``(model, *optimizers)`` when optimizers were given.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"ctx.setup() takes an nn.Module first, got {type(model).__name__}.")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"ctx.setup(model, *optimizers): {type(opt).__name__} is not a "
                                "torch.optim.Optimizer.")
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        wrapped = self.strategy.setup_module(model, self)
        inner = wrapped.module if isinstance(wrapped, nn.parallel.DistributedDataParallel) else wrapped
        current = dict(inner.named_parameters(remove_duplicate=False))
        for opt in optimizers:
            _repoint(opt, names, current)
        if self._recorder is not None:
            self._recorder.watch(wrapped, optimizers,
                                 ddp=isinstance(wrapped, nn.parallel.DistributedDataParallel))
        self._scaler = self.strategy.grad_scaler(self)
        if self._scaler is not None:
            optimizers = tuple(_ScaledOptimizer(opt, self._scaler) for opt in optimizers)
        return (wrapped, *optimizers) if optimizers else wrapped

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled when the strategy trains in fp16."""
        if self._scaler is not None:
            self._scaler.scale(loss).backward()
        else:
            loss.backward()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The full, unsharded state dict on rank 0 (on CPU); ``{}`` on the other ranks.

        Every rank must call it (it gathers shards).
        """
        return self.strategy.full_state_dict(model)

    # -- data --------------------------------------------------------------------------
    def dataloader(self, dataset: Dataset, batch_size: int = 1, shuffle: bool = False,
                   drop_last: bool = False, seed: int = 0, **kwargs) -> DeviceLoader:
        """A DataLoader over this rank's shard of ``dataset``; batches arrive on ``ctx.device``.

        Reshuffles every epoch (``set_epoch`` is called for you). ``kwargs`` go to
        ``torch.utils.data.DataLoader`` (``num_workers``, ``collate_fn``, ...).
        """
        if isinstance(dataset, IterableDataset):
            raise TypeError("ctx.dataloader shards map-style datasets (with __len__ and "
                            "__getitem__). For an IterableDataset, yield every "
                            "ctx.world_size-th item starting at ctx.rank and wrap it in "
                            "torch.utils.data.DataLoader yourself.")
        if "sampler" in kwargs or "batch_sampler" in kwargs:
            raise ValueError("ctx.dataloader makes its own DistributedSampler; drop sampler=/"
                             "batch_sampler=, or build your own DataLoader.")
        sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank,
                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        kwargs.setdefault("pin_memory", self.device.type == "cuda")
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                            drop_last=drop_last, **kwargs)
        return DeviceLoader(loader, sampler, self)

    def _on_batch(self, samples: int) -> None:
        self._batches += 1
        if self._recorder is not None:
            self._recorder.on_batch(self._batches - 1, samples)

    def _on_epoch_end(self) -> None:
        if self._recorder is not None:
            self._recorder.on_epoch_end()

    def _close(self) -> None:
        """End of the user's function: send what is pending."""
        self._flush_logs()
        if self._recorder is not None:
            self._recorder.close()

    # -- metrics -----------------------------------------------------------------------
    def log(self, **metrics: float | torch.Tensor) -> None:
        """Record scalar metrics for this rank at the current step (a typed event).

        Tensors may stay on the GPU: they are read back in batches, not one sync per call.
        """
        if not metrics or self._telemetry is None:
            return
        values: dict[str, Any] = {}
        on_accelerator = False
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"ctx.log({key}=...) takes a scalar; got a tensor of shape "
                                     f"{tuple(value.shape)}. Log a reduction such as .mean().")
                value = value.detach()
                if value.device.type != "cpu":
                    on_accelerator = True
                    value = value.clone()
                else:
                    value = value.item()
            elif isinstance(value, (int, float)) or hasattr(value, "__float__"):
                value = float(value)
            else:
                raise TypeError(f"ctx.log({key}=...) takes numbers or scalar tensors; got "
                                f"{type(value).__name__}.")
            values[key] = value
        self._pending.append((self.step, time.monotonic(), values))
        self._logs += 1
        if not on_accelerator or len(self._pending) >= _LOG_BATCH:
            self._flush_logs()

    def _flush_logs(self) -> None:
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
            self._telemetry.send(Metric(rank=self.rank, step=step, t=t, values=floats))

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


class DeviceLoader:
    """Iterates a DataLoader, moving each batch to the rank's device and counting steps."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, ctx: Context):
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        self._ctx = ctx

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        device = self._ctx.device
        non_blocking = device.type == "cuda"
        for batch in self.loader:
            self._ctx._on_batch(_batch_size(batch))
            yield _to_device(batch, device, non_blocking)
        self._ctx._on_epoch_end()
        self.epoch += 1


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _to_device(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        moved = [_to_device(v, device, non_blocking) for v in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    return obj


def _repoint(opt: torch.optim.Optimizer, names: dict[int, str],
             current: dict[str, nn.Parameter]) -> None:
    replaced = 0
    for group in opt.param_groups:
        params = []
        for p in group["params"]:
            new = current.get(names.get(id(p), ""), p)
            replaced += new is not p
            params.append(new)
        group["params"] = params
    if replaced and opt.state:
        raise RuntimeError("ctx.setup() got an optimizer that has already stepped, but the "
                           "strategy replaced the model's parameters (FSDP shards them), so "
                           "its state no longer matches. Build the optimizer and call "
                           "ctx.setup(model, opt) before training.")


class _ScaledOptimizer:
    """fp16: ``step()`` unscales, skips the step on inf/nan, and updates the scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler):
        self.optimizer = optimizer
        self.scaler = scaler

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("fp16 training with a closure is not supported; call "
                             "optimizer.step() without one.")
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        return result

    def __getattr__(self, name):
        return getattr(self.optimizer, name)
