"""``ctx.dataloader``'s loader: a DataLoader over this rank's part of the data
(``DistributedSampler``), each batch moved to the rank's device, its steps counted and
the time spent waiting for batches measured (telemetry's step boundaries and "data")."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler


class DeviceLoader:
    """Iterates a DataLoader, moving each batch to the rank's device; says when a batch
    begins a step (``on_batch(samples, epoch, batches per epoch)``), how long the batch
    took to load and move (``on_data_time(seconds)``; None: not timed) and when an epoch
    ends."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler, device: torch.device,
                 on_batch: Callable[[int, int, int], None],
                 on_data_time: Callable[[float], None] | None,
                 on_epoch_end: Callable[[], None]):
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        self.device = device
        self._on_batch, self._on_data_time = on_batch, on_data_time
        self._on_epoch_end = on_epoch_end

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        device = self.device
        non_blocking = device.type == "cuda"
        steps = len(self.loader)
        batches = iter(self.loader)
        timed = self._on_data_time
        while True:
            t = time.monotonic() if timed else 0.0
            try:
                batch = next(batches)
            except StopIteration:
                break
            if timed:
                timed(time.monotonic() - t)  # the step that ends now waited for it
            self._on_batch(_batch_size(batch), self.epoch, steps)
            t = time.monotonic() if timed else 0.0
            moved = _to_device(batch, device, non_blocking)
            if timed:
                timed(time.monotonic() - t)
            yield moved
        self._on_epoch_end()
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
