"""ZeRO-1: DDP for the model, torch's ``ZeroRedundancyOptimizer`` for the optimizer.

Parameters and gradients stay whole on every rank (DDP all-reduces the gradients); the
optimizer state is partitioned, by whole parameters, so each rank keeps about 1/N of it
and updates only its parameters, then broadcasts them. ``ctx.setup(model, opt)`` turns
the user's optimizer into a ``ZeroRedundancyOptimizer`` of the same class with the same
hyper-parameters and param groups; an LR scheduler must be built on the optimizer that
``ctx.setup`` returns.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .base import Host
from .ddp import DDP


@dataclass
class Zero1(DDP):
    # Keep each rank's parameters in one flat bucket for the broadcast after the step.
    parameters_as_bucket_view: bool = False

    # Why its ranks hold different amounts (compare() says it beside the range)
    uneven: ClassVar[str] = (
        "ZeroRedundancyOptimizer gives each rank the optimizer state of whole parameters, "
        "so the shares are as even as the parameters' sizes allow; theory assumes an exact "
        "1/N.")
    description: ClassVar[str] = (
        "ZeRO stage 1: DDP with torch's ZeroRedundancyOptimizer, so each rank keeps the "
        "optimizer state of about 1/N of the parameters; parameters and gradients stay "
        "whole.")
    # Importing it compiles TorchScript (about 1.3 s on 2 cores).
    warm_imports: ClassVar[tuple[str, ...]] = ("torch.distributed.optim",)

    def sharded(self) -> frozenset[str]:
        return frozenset({"optimizer"})

    def held(self, sizes, world_size: int) -> dict[str, float]:
        """Parameters and gradients whole; the optimizer state of the parameters
        ZeroRedundancyOptimizer gives the fullest rank (largest first, each to the rank
        with the fewest elements so far)."""
        counts, state = [0] * world_size, [0.0] * world_size
        for s in sorted(sizes, key=lambda s: s.numel, reverse=True):
            rank = counts.index(min(counts))
            counts[rank] += s.numel
            state[rank] += s.state_bytes + s.state_fixed
        return {"params": float(sum(s.param_bytes for s in sizes)),
                "grads": float(sum(s.grad_bytes for s in sizes)), "optimizer": max(state)}

    def sent(self, model: nn.Module, world_size: int) -> float:
        """DDP's all-reduce of the gradients, then each rank's updated parameters to the
        others (as much as an all-gather of them)."""
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return super().sent(model, world_size) + (world_size - 1) / world_size * params

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                        ctx: Host) -> torch.optim.Optimizer:
        return to_zero(optimizer, self.parameters_as_bucket_view)


def to_zero(optimizer: torch.optim.Optimizer, bucket_view: bool = False):
    """A ``ZeroRedundancyOptimizer`` with ``optimizer``'s class, defaults and groups."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise RuntimeError("strategy 'zero1' shards the optimizer state, but this optimizer "
                           "has stepped already. Build it and call ctx.setup(model, opt) "
                           "before training.")
    if optimizer.__class__.__init__ is torch.optim.Optimizer.__init__:
        raise TypeError(f"strategy 'zero1' rebuilds the optimizer from its class; "
                        f"{type(optimizer).__name__} has no constructor of its own.")
    groups = [dict(g) for g in optimizer.param_groups]
    # The constructor's own arguments only (AdamW keeps Adam's `decoupled_weight_decay`
    # among its defaults but does not take it); the groups carry every value anyway.
    signature = inspect.signature(type(optimizer).__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in signature}
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   parameters_as_bucket_view=bucket_view, **defaults)
