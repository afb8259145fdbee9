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
    # Compress the gradients DDP all-reduces (torch's DDP communication hooks): "fp16" or
    # "bf16" (GPUs) halve the bytes (cast, all-reduce, cast back); "powersgd" (GPUs) sends
    # a rank-1 approximation of each gradient matrix (PowerSGD, with error feedback;
    # plain all-reduce for the first 2 steps). None: torch's all-reduce of fp32 buckets.
    comm_hook: str | None = None

    description: ClassVar[str] = (
        "DistributedDataParallel: every rank holds the full model, gradients and optimizer "
        "state, and gradients are averaged with all-reduce after each backward.")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.comm_hook!r} is not one of torch's DDP "
                             f"communication hooks nbtrain offers: "
                             f"{', '.join(map(repr, COMM_HOOKS))} (or None).")

    def collective_probe(self, model: nn.Module):
        """DDP's bucket all-reduces, read from its own bookkeeping (``DDPBuckets``). A
        communication hook's collectives go through ``torch.distributed`` in Python and
        are counted there, as they are sent (compressed)."""
        if not isinstance(model, DistributedDataParallel) or self.comm_hook is not None:
            return None
        return DDPBuckets(model)

    def fewer_bytes(self, accelerator: str) -> list[str]:
        if self.comm_hook is not None:
            return [] if self.comm_hook == "powersgd" else [
                "strategies.get('ddp', comm_hook='powersgd'): a rank-1 approximation of "
                "each gradient matrix instead of all of it"]
        if accelerator != "cuda":
            return ["strategies.get('ddp', comm_hook='fp16'): gradients all-reduced in "
                    "fp16, half the bytes"]
        return ["strategies.get('ddp', comm_hook='bf16'): gradients all-reduced in bf16, "
                "half the bytes ('powersgd': far fewer)"]

    def check(self, plan) -> None:
        super().check(plan)
        if self.comm_hook == "bf16" and plan.accelerator != "cuda":
            raise ValueError("comm_hook='bf16' runs on NCCL only (torch's bf16 hook needs "
                             "CUDA GPUs); on CPU ranks use comm_hook='fp16', which halves "
                             "the bytes the same way.")
        if self.comm_hook == "powersgd" and plan.accelerator != "cuda":
            raise ValueError("comm_hook='powersgd' is for GPUs (NCCL): on gloo, with more "
                             "than one gradient bucket, its all-reduces start from gloo's "
                             "callback threads in an order that differs between ranks, and "
                             "gloo aborts the ranks. On CPU ranks use comm_hook='fp16'.")

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
        if self.comm_hook is not None:
            register_comm_hook(ddp, self.comm_hook)
        if not self.find_unused_parameters:
            explain_unused(ddp, self.name)
        return ddp


COMM_HOOKS = ("fp16", "bf16", "powersgd")


def register_comm_hook(ddp: DistributedDataParallel, name: str) -> None:
    """One of torch's DDP communication hooks on ``ddp`` (``COMM_HOOKS``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        # rank 1 with error feedback, as in the PowerSGD paper's and torch's examples;
        # from the third step (the first two build DDP's buckets and PowerSGD's state)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        hook = {"fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[name]
        ddp.register_comm_hook(None, hook)


class DDPBuckets:
    """DDP's gradient all-reduces, read from DDP's own bookkeeping.

    DDP all-reduces its gradient buckets from C++; routing them through a Python comm
    hook to count them cost ~4% of a small model's step (measured), so instead each step
    that synchronised gradients (``require_backward_grad_sync`` at forward time: not a
    ``no_sync`` micro-step) adds one all-reduce per bucket, with the buckets' bytes from
    ``_get_ddp_logging_data()`` (read until DDP has rebuilt its buckets after the first
    step, then cached).
    """

    def __init__(self, ddp_model: nn.Module):
        self.model = ddp_model
        self.synced = False
        self._sizes: list[int] | None = None

    def on_forward(self, module, args) -> None:
        """A forward pre-hook of the DDP model, which telemetry installs (in the time
        breakdown's own, when it times: one hook, not two), outside any graph
        (timing.outside_graphs): a model compiled after ctx.setup would trace the
        flag's read into a constant."""
        self.synced = self.synced or bool(module.require_backward_grad_sync)

    def take(self) -> list[int]:
        """Bucket sizes all-reduced since the last call (empty when none were)."""
        if not self.synced:
            return []
        self.synced = False
        if self._sizes is not None:
            return self._sizes
        data = self.model._get_ddp_logging_data()
        text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        sizes = [int(v) for v in str(text).split(",") if v.strip()]
        if data.get("has_rebuilt_buckets"):
            self._sizes = sizes
        return sizes
