"""FSDP with torch's own ``fully_shard`` (FSDP2): parameters, gradients and optimizer
state are sharded across ranks as DTensors.

Which modules become FSDP units: the classes in ``wrap`` when given; otherwise the
model's blocks (``blocks.find``: the classes it declares in ``_no_split_modules``, as
transformers models do, else its repeated block class); a model without blocks gets the
size rule: top-down, each child module holding at least ``min_wrap_params`` parameters
(default: 1/20 of the model), entries of a ModuleList staying whole, and modules holding
over a quarter of the model looked inside. Then the root, which owns whatever is left.
Tied parameters always stay in one unit (``blocks.untie_units``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from . import norms, unused
from .base import Host, Strategy, checkpointed

if TYPE_CHECKING:
    from ..deviceplan import DevicePlan


@dataclass
class FSDP(Strategy):
    # True: free gathered parameters after forward and gather again for backward (ZeRO-3).
    # False: keep them until backward (SHARD_GRAD_OP / ZeRO-2 behaviour).
    reshard_after_forward: bool = True
    # Module classes to make FSDP units (e.g. (TransformerBlock,)); None: the model's
    # blocks (declared or repeated), else size-based.
    wrap: tuple[type[nn.Module], ...] | None = None
    # Size threshold for the size-based rule (given, it chooses that rule over the
    # model's blocks); None: 1/20 of the model's parameters.
    min_wrap_params: int | None = None
    # Keep sharded parameters, gradients and optimizer state on CPU (CUDA only).
    offload: bool = False
    # Shard within groups of `shard_size` ranks, replicate across groups (2-D mesh).
    hybrid: bool = False
    shard_size: int | None = None
    # Parameters some rank gives no gradient (experts no token reached): every rank
    # always reduces every parameter; True also finds those no rank used (one small
    # all-reduce a step) and leaves them without a gradient, as one process would.
    # False: they get zeros, and momentum or weight decay moves them (unused.py).
    find_unused_parameters: bool = True

    description: ClassVar[str] = (
        "Fully sharded data parallel: each rank stores 1/N of the parameters, gradients and "
        "optimizer state, and all-gathers parameters for forward and backward.")
    half_by: ClassVar[str] = "params"  # MixedPrecisionPolicy(param_dtype=...)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.wrap is not None:
            self.wrap = tuple(self.wrap) if isinstance(self.wrap, (list, tuple)) else (self.wrap,)
            bad = [w for w in self.wrap if not (isinstance(w, type) and issubclass(w, nn.Module))]
            if bad:
                raise TypeError(f"wrap= takes nn.Module classes; got {bad[0]!r}.")
        if self.min_wrap_params is not None and self.min_wrap_params < 1:
            raise ValueError(f"min_wrap_params={self.min_wrap_params} must be >= 1.")
        if self.shard_size is not None and not self.hybrid:
            raise ValueError("shard_size= only applies to hybrid sharding; use strategy "
                             "'fsdp_hybrid' or hybrid=True.")

    def sharded(self) -> frozenset[str]:
        # reshard_after_forward=False (fsdp_grad_op) keeps the gathered parameters from
        # forward to backward: at the peak they are whole, as ZeRO-2's are
        return frozenset({"grads", "optimizer"} | ({"params"} if self.reshard_after_forward
                                                     else set()))

    def shards(self, world_size: int) -> int:
        return self.mesh_shape(world_size)[1] if self.hybrid else world_size

    def fewer_bytes(self, accelerator: str) -> list[str]:
        if self.reshard_after_forward:
            return ["strategy='fsdp_grad_op': the parameters gathered for forward are kept "
                    "for backward, one all-gather less per step (for more memory)"]
        return ["strategy='ddp', if the whole model state fits on each device: one "
                "all-reduce of the gradients and no all-gathers"]

    def theory(self, state: dict[str, float], world_size: int,
               n_params: int) -> dict[str, float]:
        if self.offload:  # the shards live in host memory: ~0 on the device
            return dict.fromkeys(state, 0.0)
        return super().theory(state, world_size, n_params)

    def held(self, sizes, world_size: int) -> dict[str, float]:
        """Rank 0's chunk of each parameter's rows (``torch.chunk``'s, the largest), and
        of its gradient and optimizer state; nothing on the device with offload."""
        held = dict.fromkeys(("params", "grads", "optimizer"), 0.0)
        if self.offload:
            return held
        shards = self.shards(world_size)
        for s in sizes:
            share = min(-(-s.rows // shards), s.rows) / s.rows if s.rows else 1.0
            held["params"] += s.param_bytes * share
            held["grads"] += s.grad_bytes * share
            held["optimizer"] += s.state_bytes * share + s.state_fixed
        return held

    def _unit_bytes(self, model: nn.Module) -> tuple[list[int], int]:
        """Each unit's own parameters' bytes (children first), and the root's."""
        seen: set[int] = set()
        units = []
        for unit in self.units(model):
            own = [p for p in unit.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            units.append(sum(p.numel() * p.element_size() for p in own))
        root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in seen)
        return units, root

    def gathered(self, model: nn.Module, world_size: int) -> float:
        """At the peak: the root's parameters, gathered from forward to backward (FSDP2
        keeps the root's), two units' (the one running and the next, prefetched), or
        every unit's with ``reshard_after_forward=False``; and one unit's whole
        gradient before its reduce-scatter. With offload, whole copies of all of it.
        With mixed precision the parameters are gathered in it whole (FSDP casts its
        shard, then gathers), and the gradient is reduced in fp32."""
        units, root = self._unit_bytes(model)
        if self.compute_dtype is not None:  # a new half-precision copy, whole
            keep = self._half_ratio()
        else:  # beside the shard it holds; with offload, all of it
            keep = 1.0 if self.offload else 1 - 1 / self.shards(world_size)
        live = sum(units) if not self.reshard_after_forward else sum(sorted(units)[-2:])
        return (root + live) * keep + max(units, default=root)

    def _half_ratio(self) -> float:
        """The half type's bytes to fp32's (the sizes are the fp32 parameters')."""
        return torch.finfo(self.compute_dtype).bits / 32

    def sent(self, model: nn.Module, world_size: int) -> float:
        """All-gathers of the parameters in forward and again in backward (the root's
        once; once in all with ``reshard_after_forward=False``), a reduce-scatter of the
        gradients; with hybrid sharding, within a shard group, and an all-reduce of the
        shards across the groups."""
        units, root = self._unit_bytes(model)
        groups, size = self.mesh_shape(world_size) if self.hybrid else (1, world_size)
        params = root + sum(units) * (2 if self.reshard_after_forward else 1)
        if self.compute_dtype is not None:  # gathered in half precision, reduced in fp32
            params *= self._half_ratio()
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        within = (size - 1) / size * (params + grads)
        return within + 2 * (groups - 1) / groups * grads / size

    def check(self, plan: DevicePlan) -> None:
        super().check(plan)
        if self.offload and plan.accelerator != "cuda":
            raise ValueError(f"strategy {self.name or 'fsdp'!r} offloads GPU memory to the CPU; "
                             "on the CPU there is nothing to offload. Use 'fsdp' there.")
        if plan.accelerator == "cpu" and not cpu_fsdp_works():
            floor = ".".join(map(str, CPU_FSDP_TORCH))
            raise ValueError(
                f"strategy {self.name or 'fsdp'!r} on CPU ranks needs torch {floor} or "
                f"later: this torch ({torch.__version__}) has FSDP, but on CPU ranks it "
                "fails (2.6: its CPU streams record no events) or trains other weights than "
                "one process (2.7, 2.8). On GPUs it runs; on the CPU use 'ddp', or install a "
                "newer torch.")
        if self.hybrid:
            self.mesh_shape(plan.world_size)

    def mesh_shape(self, world_size: int) -> tuple[int, int]:
        """(replicate groups, ranks per shard group) for hybrid sharding."""
        size = self.shard_size
        if size is None:  # the largest proper divisor: 2 -> 1, 4 -> 2, 8 -> 4, 6 -> 3
            size = max([d for d in range(1, world_size) if world_size % d == 0] or [1])
        if size < 1 or world_size % size:
            raise ValueError(f"hybrid sharding needs shard_size to divide the world size: "
                             f"{world_size} ranks / shard_size {size} = {world_size / size:g}. "
                             f"Pick one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}.")
        return world_size // size, size

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules that become FSDP units, children before parents (root excluded)."""
        from . import blocks

        # min_wrap_params given: the size rule was asked for
        classes = self.wrap or (() if self.min_wrap_params else blocks.find(model))
        if classes:
            units = [m for m in reversed(list(model.modules()))
                     if m is not model and isinstance(m, classes)]
        else:
            units = self._by_size(model)
        return blocks.untie_units(model, units)

    def _by_size(self, model: nn.Module) -> list[nn.Module]:
        total = _count(model)
        threshold = self.min_wrap_params or max(1, total // 20)
        units: list[nn.Module] = []

        def visit(module: nn.Module, block: bool = False) -> None:
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # containers never run;
                for child in module.children():  # their entries are the model's blocks
                    visit(child, block=True)
                return
            size = _count(module)
            if size < threshold:
                return
            # A trunk holding most of the model: give its parts their own units too, and
            # keep it as a unit only if enough is left outside them. A block stays whole.
            if (not block and size > total // 4
                    and any(_count(c) >= threshold for c in module.children())):
                before = len(units)
                for child in module.children():
                    visit(child)
                inside = {id(p) for u in units[before:] for p in u.parameters()}
                if sum(p.numel() for p in module.parameters() if id(p) not in inside) < threshold:
                    return
            units.append(module)

        for child in model.children():
            visit(child)
        return units

    def shard_device(self, ctx: Host) -> torch.device:
        return torch.device("cpu") if self.offload else ctx.device

    def setup_module(self, module: nn.Module, ctx: Host) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        if self.hybrid:
            mesh = init_device_mesh(ctx.device.type, self.mesh_shape(ctx.world_size),
                                    mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        dtype = self.compute_dtype
        mp_policy = (MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
                     if dtype else MixedPrecisionPolicy())
        offload = CPUOffloadPolicy() if self.offload else OffloadPolicy()
        on_meta = any(p.is_meta for p in module.parameters())
        if not self.offload and not on_meta:  # meta: ctx materialises the shards after
            module = module.to(ctx.device)
        options = dict(mesh=mesh, reshard_after_forward=self.reshard_after_forward,
                       mp_policy=mp_policy, offload_policy=offload)
        units = self.units(module)
        wrappers = self.checkpoint_activations(module)  # FSDP shards the wrapper
        if dtype:  # norm layers with statistics compute in fp32 (norms.py)
            fp32 = dict(options, mp_policy=norms.fp32_policy(dtype))
            for norm in norms.with_statistics(module):
                if norm not in units and any(True for _ in norm.parameters()):
                    fully_shard(norm, **fp32)
        for unit in units:
            fully_shard(wrappers.get(id(unit), unit), **options)
        fully_shard(module, **options)
        unused.reduce_every_parameter(module)  # no rank-dependent reduce-scatter sizes
        norms.broadcast_before_forward(module)  # DDP's rule for running statistics
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                        ctx: Host) -> torch.optim.Optimizer:
        if self.find_unused_parameters:
            unused.track(module, optimizer, ctx.device)
        return optimizer

    def grad_scaler(self, ctx: Host):
        if self.mixed_precision != "fp16":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # Sharded gradients: whether any is inf must be agreed on by all ranks.
        return ShardedGradScaler(ctx.device.type)

    def summary(self) -> str:
        extras = []
        if self.mixed_precision:
            extras.append(f"mixed_precision={self.mixed_precision}")
        if self.wrap:
            extras.append("wrap=" + ",".join(w.__name__ for w in self.wrap))
        if self.activation_checkpointing:
            extras.append("activation_checkpointing=" + checkpointed(self))
        return self.name + (f" ({', '.join(extras)})" if extras else "")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# The first torch whose FSDP2 trains on CPU ranks (gloo) what one process trains, as
# the legs measured: 2.6 fails in every worker, 2.7 and 2.8 train other weights.
CPU_FSDP_TORCH = (2, 9)


def cpu_fsdp_works(version: str | None = None) -> bool:
    """Does this torch's FSDP2 train on CPU ranks as one process does?"""
    release = re.match(r"(\d+)\.(\d+)", version or torch.__version__)
    return release is not None and tuple(map(int, release.groups())) >= CPU_FSDP_TORCH
