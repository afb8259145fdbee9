"""DDP: every rank keeps the whole model; gradients are all-reduced in buckets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import Host, Strategy, autocast_forward
from .unused import explain_unused


@dataclass
class DDP(Strategy):
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    # The gradients are views into DDP's all-reduce buckets instead of a second copy
    # beside them: one gradient-sized buffer less from backward to the optimizer step
    # (torch's DDP keeps both by default). False gives torch's default back.
    gradient_as_bucket_view: bool = True

    description: ClassVar[str] = (
        "DistributedDataParallel: every rank holds the full model, gradients and optimizer "
        "state, and gradients are averaged with all-reduce after each backward.")

    def setup_module(self, module: nn.Module, ctx: Host) -> nn.Module:
        module = module.to(ctx.device)
        self.checkpoint_activations(module)
        if self.compute_dtype is not None:
            autocast_forward(module, ctx.device.type, self.compute_dtype)
        kwargs = {}
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        ddp = DistributedDataParallel(
            module,
            device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **kwargs,
        )
        if not self.find_unused_parameters:
            explain_unused(ddp, self.name)
        return ddp
