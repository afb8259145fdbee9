"""``ctx.dataloader``'s loader: a DataLoader over this rank's part of the data
(``DistributedSampler``), each batch moved to the rank's device, its steps counted and
the time spent waiting for batches measured (telemetry's step boundaries and "data").
It knows where it is (epoch, batch) and can go on from there after a restart
(``ctx.checkpoint_every``). A pass made while the models are in eval mode is an
evaluation: its batches are no training steps, and ``gather`` puts the ranks' per-sample
results together, each sample once."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from .strategies.norms import sync_statistics


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` whose next epoch can start ``skip`` indices in: a resumed
    run's loader goes on without loading the batches it already trained on."""

    skip = 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class DeviceLoader:
    """Iterates a DataLoader, moving each batch to the rank's device; says when a batch
    begins a step (``on_batch(samples, epoch, batches per epoch)``), how long the batch
    took to load and move (``on_data_time(seconds)``; None: not timed) and when an epoch
    ends. ``on_fetch``, when set, is called before each batch is fetched: the boundary
    between two steps, where ``ctx.checkpoint_every`` saves. A pass that begins while
    every one of ``models`` (those ``ctx.setup`` returned) is in eval mode is an
    evaluation: its batches are no steps, every rank takes rank 0's running statistics
    (batch norm's: under FSDP each rank updated its own in the last forward), and
    ``recorder.on_evaluation(done, batches)`` is told as it begins, after each batch and
    as it ends (``done == batches``, also when the loop broke off); ``gather``'s
    collectives run in ``recorder.aside()``, in no step either."""

    def __init__(self, loader: DataLoader, sampler: ResumableSampler, device: torch.device,
                 on_batch: Callable[[int, int, int], None],
                 on_data_time: Callable[[float], None] | None,
                 on_epoch_end: Callable[[], None],
                 models: list[nn.Module] | None = None,
                 recorder: Any = None):
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        self.batch = 0  # batches of this epoch handed out
        self.handed_out = 0  # batches handed out in all
        self.device = device
        self._on_batch, self._on_data_time = on_batch, on_data_time
        self._on_epoch_end = on_epoch_end
        self._models = models if models is not None else []
        self._recorder = recorder  # the rank's telemetry Recorder, None when off
        self.on_fetch: Callable[[DeviceLoader], None] | None = None
        self._resume: tuple[int, int] | None = None
        self._done_epochs = 0  # epochs a resumed loader hands out empty
        self._counted = False  # a loop over self.epochs(n) began (it skips the done ones)
        self._warned = False  # that an evaluation's pass trained

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, batches of it done): where the next batch comes from."""
        return self.epoch, self.batch

    def resume_at(self, epoch: int, batch: int) -> None:
        """Go on from ``batch`` of ``epoch``: the loop over epochs runs as written, the
        epochs already done yield nothing, the next epoch starts at ``batch``."""
        if self._counted:
            raise RuntimeError("ctx.checkpoint_every was called inside the loop over "
                               "loader.epochs(n): call it before the loop, which then "
                               "starts at the epoch the run goes on in.")
        self._resume = (epoch, batch)
        self._done_epochs = epoch

    def epochs(self, n: int) -> Iterator[int]:
        """The loop over epochs: ``for epoch in loader.epochs(n): for batch in loader:``.
        ``range(n)`` on a fresh start; after a restart (``ctx.checkpoint_every``), from
        the epoch the run goes on in, so code that runs once an epoch (a scheduler's
        step, an evaluation) runs once for each. A loop over ``range(n)`` trains the
        same (the epochs already done yield nothing) but runs that code again for them."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"loader.epochs({n!r}): give the number of epochs, an int >= 0.")
        return self._epochs(n)

    def _epochs(self, n: int) -> Iterator[int]:
        start, self._done_epochs = self._done_epochs, 0  # the loop skips them itself
        self._counted = True
        yield from range(start, n)

    def __iter__(self) -> Iterator[Any]:
        if self._done_epochs:  # a resumed run: this epoch was trained before the restart
            self._done_epochs -= 1
            return
        if self._resume is not None:
            (self.epoch, self.batch), self._resume = self._resume, None
            self.sampler.skip = self.batch * (self.loader.batch_size or 1)
        else:
            self.batch = 0
        self.sampler.set_epoch(self.epoch)
        batches = iter(self.loader)
        evaluating = bool(self._models) and not any(m.training for m in self._models)
        if evaluating and not (yield from self._evaluate(batches)):
            self.epoch += 1
            return
        steps = len(self.loader)
        device = self.device
        non_blocking = device.type == "cuda"
        timed = self._on_data_time
        while True:
            if self.on_fetch is not None:
                self.on_fetch(self)
            t = time.monotonic() if timed else 0.0
            try:
                batch = next(batches)
            except StopIteration:
                break
            if timed:
                timed(time.monotonic() - t)  # the step that ends now waited for it
            self.batch += 1
            self.handed_out += 1
            self._on_batch(_batch_size(batch), self.epoch, steps)
            t = time.monotonic() if timed else 0.0
            moved = _to_device(batch, device, non_blocking)
            if timed:
                timed(time.monotonic() - t)
            yield moved
        self._on_epoch_end()
        self.epoch += 1
        self.batch = 0

    def _evaluate(self, batches: Iterator[Any]) -> Generator[Any, None, bool]:
        """An evaluation's pass: no steps, no checkpoints, not timed. Returns True when
        an optimizer step ran in it after all (a training pass whose ``model.train()``
        was forgotten after an evaluation): the rest of the pass is training."""
        total, device = len(self.loader), self.device
        stepped: list[bool] = []
        hook = register_optimizer_step_post_hook(lambda *_: stepped.append(True))
        try:
            for model in self._models:  # one model on every rank: rank 0's statistics
                sync_statistics(model)
            self._on_evaluation(0, total)
            for done, batch in enumerate(batches, 1):
                yield _to_device(batch, device, device.type == "cuda")
                if stepped:
                    self.batch = done
                    if not self._warned:
                        self._warned = True
                        print("nbtrain: an optimizer step ran "
                              "during a pass over ctx.dataloader begun with every model in "
                              "eval mode, which nbtrain took for an evaluation; it counts as "
                              "training from its next batch. Call model.train() before "
                              "training: in eval mode dropout is off and batch norm does not "
                              "learn its statistics.", file=sys.stderr, flush=True)
                    return True
                if done < total:
                    self._on_evaluation(done, total)
        finally:  # also when the loop over the pass broke off
            hook.remove()
            self._on_evaluation(total, total)
        return False

    def _on_evaluation(self, done: int, total: int) -> None:
        if self._recorder is not None:
            self._recorder.on_evaluation(done, total)

    def gather(self, values: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Every rank's per-sample ``values`` from its last pass over this loader, put
        together on every rank: one row per sample of the dataset, in the dataset's
        order, each sample once (the samples ``DistributedSampler`` repeats so that every
        rank gets as many are dropped). ``values``: a tensor with one row per sample
        this rank's pass yielded, or the list of its batches' tensors. Every rank must
        call it. For a validation loss or accuracy that counts each sample once::

            model.eval()
            with torch.no_grad():
                losses = [F.cross_entropy(model(x), y, reduction="none") for x, y in val]
            val_loss = val.gather(losses).mean()
        """
        if isinstance(values, (list, tuple)):
            values = torch.cat(list(values)) if values else torch.empty(0)
        if not isinstance(values, torch.Tensor) or values.dim() == 0:
            raise TypeError(f"loader.gather takes a tensor with one row per sample (or a "
                            f"list of the batches' tensors), got {type(values).__name__}"
                            f"{' of 0 dimensions' if isinstance(values, torch.Tensor) else ''}.")
        sampler = self.sampler
        if sampler.drop_last:
            raise ValueError("loader.gather needs every sample, and this loader "
                             "drops the last ones (drop_last=True): make the evaluation's "
                             "loader with ctx.dataloader(dataset, batch_size) alone.")
        if len(values) != sampler.num_samples:
            raise ValueError(f"loader.gather takes one row per sample of this "
                             f"rank's pass over the loader, {sampler.num_samples}; got "
                             f"{len(values)}. Pass every batch's values, from one whole pass.")
        n = sampler.num_replicas
        shapes: list[Any] = [None] * n
        parts = [torch.empty_like(values) for _ in range(n)]
        # the dataset indices of this rank's rows: its sampler's, in the pass's epoch
        mine = torch.tensor(list(DistributedSampler.__iter__(sampler)), device=values.device)
        where = [torch.empty_like(mine) for _ in range(n)]
        aside = self._recorder.aside() if self._recorder is not None else nullcontext()
        with aside:  # an evaluation's, in no training step
            dist.all_gather_object(shapes, f"{tuple(values.shape)} {values.dtype}")
            if len(set(shapes)) > 1:
                raise ValueError("loader.gather: the ranks' values differ in shape or dtype ("
                                 + ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
                                 + "); give each sample's values the same shape and dtype "
                                 "on every rank.")
            dist.all_gather(parts, values.contiguous())
            dist.all_gather(where, mine)
        out = values.new_empty((len(sampler.dataset), *values.shape[1:]))
        out[torch.cat(where)] = torch.cat(parts)  # a repeated sample: either copy, the same
        return out


def shard_loader(dataset, rank: int, world_size: int, batch_size: int, shuffle: bool,
                 drop_last: bool, seed: int, **kwargs) -> tuple[DataLoader, ResumableSampler]:
    """``ctx.dataloader``'s DataLoader over this rank's shard of ``dataset``, and its
    sampler; what it cannot shard is told so."""
    if isinstance(dataset, IterableDataset):
        raise TypeError("ctx.dataloader shards map-style datasets (with __len__ and "
                        "__getitem__). For an IterableDataset, yield every "
                        "ctx.world_size-th item starting at ctx.rank and wrap it in "
                        "torch.utils.data.DataLoader yourself.")
    if "sampler" in kwargs or "batch_sampler" in kwargs:
        raise ValueError("ctx.dataloader makes its own DistributedSampler; drop sampler=/"
                         "batch_sampler=, or build your own DataLoader.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"ctx.dataloader(seed={seed!r}): give an int, the same on every "
                        "rank (or leave it out to use launch(seed=...)).")
    sampler = ResumableSampler(dataset, num_replicas=world_size, rank=rank,
                               shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                      **kwargs), sampler


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
