"""What every strategy shares: its name, mixed precision, checks, and the full state dict."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

import torch
from torch import nn

from . import state
from .activation import apply, clean_name, normalize
from .norms import convert_to_sync

if TYPE_CHECKING:
    from ..deviceplan import DevicePlan


class Host(Protocol):
    """What a strategy needs of the rank it runs on: a narrow view of the worker's
    ``Context`` (which implements it), so strategies do not depend on the context."""

    device: torch.device
    rank: int
    world_size: int

Precision = Literal["bf16", "fp16"] | None
PRECISIONS = (None, "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Lightning's spellings of the same settings (Trainer(precision=...)).
LIGHTNING_PRECISIONS = {"16-mixed": "fp16", "16": "fp16", 16: "fp16", "bf16-mixed": "bf16",
                        "32-true": None, "32": None, 32: None}


def precision_dtype(precision: Precision) -> torch.dtype | None:
    """The half type of ``"bf16"`` or ``"fp16"``; None for fp32."""
    return _DTYPES.get(precision) if precision else None


def normalize_precision(value) -> Precision:
    """``mixed_precision`` from nbtrain's or Lightning's spelling; a ValueError otherwise."""
    if value in PRECISIONS:
        return value
    if isinstance(value, (str, int)) and not isinstance(value, bool) and \
            value in LIGHTNING_PRECISIONS:
        return LIGHTNING_PRECISIONS[value]
    if value in ("16-true", "bf16-true", "64-true", "64", 64, "transformer-engine"):
        raise ValueError(f"mixed_precision={value!r}: nbtrain trains with fp32 weights and "
                         "half-precision compute only. Use '16-mixed' (fp16, with a loss "
                         "scaler) or 'bf16-mixed' (bf16), or None for fp32.")
    raise ValueError(f"mixed_precision={value!r} is not one of {PRECISIONS} (Lightning's "
                     f"'16-mixed', 'bf16-mixed' and '32-true' are understood too).")


@dataclass(frozen=True)
class ParamSize:
    """One parameter as ``Strategy.held`` reads it: its elements and rows (dim 0, along
    which FSDP shards), its bytes and its gradient's, and its optimizer state's bytes,
    those shaped like it (``state_bytes``: sharded with it) and the rest (a step count)."""

    numel: int
    rows: int
    param_bytes: int
    grad_bytes: int
    state_bytes: int = 0
    state_fixed: int = 0


def _grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@dataclass
class Strategy:
    """A way to wrap the model so N ranks train it together.

    Subclasses fill in ``setup_module``; instances are plain data, so they cross into
    spawned workers as they are.
    """

    name: str = ""
    # "bf16" or "fp16": compute in half precision, keep fp32 master weights.
    mixed_precision: Precision = None
    # Preferred start method of an alias ("ddp_notebook" -> fork), a name registered in
    # launch/starting/launchers.py (checked at launch); None: no preference.
    start_method: str | None = None
    # Module classes whose forward is recomputed in backward instead of keeping its
    # activations (torch's non-reentrant checkpoint wrapper), e.g. (Block,); "auto" (or
    # True): the model's own blocks (strategies.blocks).
    activation_checkpointing: tuple[type[nn.Module], ...] | str | None = None
    # BatchNorm with the statistics of the whole batch across ranks (torch's
    # SyncBatchNorm; Lightning's Trainer(sync_batchnorm=True)). CUDA only.
    sync_batchnorm: bool = False

    description: ClassVar[str] = ""
    # How its mixed precision reaches the forward, for nbtrain.plan's rehearsal
    # (halfmeta.py): "autocast" (the forward under torch.autocast, fp32 weights) or
    # "params" (the parameters themselves in half precision, FSDP's param_dtype)
    half_by: ClassVar[str] = "autocast"
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # Modules the strategy imports in every worker; a fork launch imports them once in
    # the kernel instead (see launch/starting/warm.py).
    warm_imports: ClassVar[tuple[str, ...]] = ()

    def warm_imports_for(self, accelerator: str) -> tuple[str, ...]:
        """What a fork launch imports once in the kernel for this strategy on
        ``accelerator`` (never anything that initialises CUDA there)."""
        return self.warm_imports

    def start_rank(self, device: torch.device) -> None:
        """In each rank, before the training function runs (after its process group)."""

    def __post_init__(self) -> None:
        self.mixed_precision = normalize_precision(self.mixed_precision)
        self.activation_checkpointing = normalize(self.activation_checkpointing)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return precision_dtype(self.mixed_precision)

    def check(self, plan: DevicePlan) -> None:
        """Fail before launch when this strategy cannot run on ``plan``."""
        if plan.accelerator not in self.accelerators:
            raise ValueError(f"strategy {self.name!r} needs {' or '.join(self.accelerators)}, "
                             f"but the accelerator is {plan.accelerator}.")
        if self.mixed_precision == "bf16":
            lacking = plan.gpus_without_bf16()
            if lacking:
                raise ValueError(
                    f"mixed_precision='bf16' needs GPUs from Ampere on (compute capability "
                    f"8.0), and {', '.join(lacking)} has none: torch would emulate it, "
                    "slowly. Use mixed_precision='fp16' ('16-mixed'): nbtrain adds the loss "
                    "scaler fp16 needs.")
        if self.sync_batchnorm and plan.accelerator != "cuda":
            raise ValueError(
                "sync_batchnorm=True needs GPUs: torch's SyncBatchNorm refuses CPU tensors. "
                "On CPU each rank normalises with its own batch's statistics (what you get "
                "without the option, and what DDP on GPUs does by default); drop "
                "sync_batchnorm=True here, or run with accelerator='cuda'.")

    def prepare_module(self, module: nn.Module) -> nn.Module:
        """Changes to the model made before anything else sees it (``ctx.setup`` calls
        it first): SyncBatchNorm when asked."""
        if self.sync_batchnorm:
            return convert_to_sync(module)
        return module

    def setup_module(self, module: nn.Module, ctx: Host) -> nn.Module:
        raise NotImplementedError

    def shard_device(self, ctx: Host) -> torch.device | None:
        """Where this rank's shards of a model built on the meta device are allocated,
        after wrapping (FSDP); None: the model is materialised whole, before."""
        return None

    def setup(self, module: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
              ctx: Host, materialize: Callable[[nn.Module, torch.device], None] | None = None,
              ) -> tuple[nn.Module, tuple]:
        """Wrap ``module`` and re-point ``optimizers`` at the parameters the wrapping made
        (``ctx.setup``). ``materialize(module, device)``, given for a model built on the
        meta device, allocates and initialises it (whole, or the shards it holds)."""
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        shards_on = self.shard_device(ctx)
        if materialize is not None and shards_on is None:
            materialize(module, ctx.device)
        wrapped = self.setup_module(module, ctx)
        if materialize is not None and shards_on is not None:
            materialize(wrapped, shards_on)
        inner = wrapped.module if isinstance(wrapped, nn.parallel.DistributedDataParallel) \
            else wrapped
        current = {clean_name(n): p for n, p in inner.named_parameters(remove_duplicate=False)}
        for opt in optimizers:
            repoint(opt, names, current)
        return wrapped, tuple(self.setup_optimizer(opt, wrapped, ctx) for opt in optimizers)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                        ctx: Host) -> torch.optim.Optimizer:
        """The optimizer to train with, given one built on ``module``'s parameters."""
        return optimizer

    def grad_scaler(self, ctx: Host):
        """A loss scaler for fp16 (bf16 needs none), or None."""
        if self.mixed_precision != "fp16":
            return None
        return torch.amp.GradScaler(ctx.device.type)

    # -- the training step and the state: torch's way here. A strategy that trains
    # through its own engine (DeepSpeed) overrides these, so the context, checkpoints
    # and telemetry never ask which strategy they have.
    @classmethod
    def owns(cls, obj: Any) -> bool:
        """Is ``obj`` (a model or an optimizer) one only this strategy's hooks handle?
        (``strategies.owner_of`` asks each strategy.)"""
        return False

    def backward(self, model: nn.Module | None, loss: torch.Tensor, scaler=None) -> None:
        """``loss.backward()``; scaled by fp16's ``scaler`` when there is one."""
        (loss if scaler is None else scaler.scale(loss)).backward()

    @contextlib.contextmanager
    def no_backward_sync(self, model: nn.Module) -> Iterator[None]:
        """Backward inside accumulates gradients locally, unsynchronised (DDP's
        ``no_sync``, FSDP's ``set_requires_gradient_sync(False)``)."""
        if isinstance(model, nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
        elif hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        else:
            raise TypeError(f"ctx.no_backward_sync() takes the model ctx.setup() returned; "
                            f"got {type(model).__name__}, which is not wrapped by a strategy.")

    def clip_grad_norm_(self, model: nn.Module, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (unscaled) gradients to ``max_norm``; the whole model's norm before,
        reduced across ranks when the gradients are sharded (FSDP's DTensors)."""
        params = [p for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if hasattr(total, "full_tensor"):  # a DTensor: partial norms of the shards
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def model_state_dict(self, model: nn.Module, full: bool = False) -> dict[str, Any]:
        """The model's state under torch's keys: this rank's shards (``full``: the whole
        tensors on rank 0). A collective."""
        return state.model_state_dict(model, full)

    def load_model_state_dict(self, model: nn.Module, values: dict[str, Any],
                              strict: bool = True) -> None:
        state.load_model_state_dict(model, values, strict)

    def optimizer_state_dict(self, model: nn.Module, optimizer,
                             full: bool = False) -> dict[str, Any]:
        """The optimizer's state under torch's flattened keys. A collective."""
        return state.optimizer_state_dict(model, optimizer, full)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer, values: dict[str, Any],
                                  strict: bool = True) -> None:
        state.load_optimizer_state_dict(model, optimizer, values, strict)

    def memory_tensors(self, model: nn.Module | None,
                       optimizers) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors by memory category: ``params``, ``grads``, ``optimizer``."""
        return state.memory_tensors(model, optimizers)

    def collective_probe(self, model: nn.Module):
        """For telemetry: an object whose ``take()`` gives the sizes of the collectives
        the strategy issued from C++ since the last call (where a Python hook would miss
        them or cost the step), and whose ``on_forward(module, args)``, if it has one,
        telemetry runs before each forward of ``model``; or None when its collectives go
        through Python."""
        return None

    def sharded(self) -> frozenset[str]:
        """Which of ``params``, ``grads`` and ``optimizer`` this strategy divides among the
        ranks at a step's peak (ZeRO's stages): none, for a strategy that keeps them whole."""
        return frozenset()

    def shards(self, world_size: int) -> int:
        """Among how many ranks what it shards is divided (hybrid sharding: a group)."""
        return world_size

    def installed(self) -> bool:
        """Whether what this strategy runs on is installed (DeepSpeed's is an extra)."""
        return True

    def fewer_bytes(self, accelerator: str) -> list[str]:
        """What would make this strategy communicate less per step, each one argument
        away (the run's summary names them when communication costs the ranks)."""
        return []

    def theory(self, state: dict[str, float], world_size: int,
               n_params: int) -> dict[str, float]:
        """The ZeRO table's row: the bytes of model state one rank holds on its device,
        given the whole model's ``state`` (``params``, ``grads``, ``optimizer``) of
        ``n_params`` parameters."""
        shards = self.shards(world_size)
        return {k: v / shards if k in self.sharded() else float(v) for k, v in state.items()}

    # -- what a rank holds, for nbtrain.plan() (planner.py): from the parameters' sizes,
    # before any rank runs ---------------------------------------------------------------
    def held(self, sizes: list[ParamSize], world_size: int) -> dict[str, float]:
        """The bytes of ``params``, ``grads`` and ``optimizer`` the fullest rank keeps on
        its device between steps, given every parameter's ``sizes`` (shared ones once).
        By default the ZeRO table's row (``theory``)."""
        whole = {"params": sum(s.param_bytes for s in sizes),
                 "grads": sum(s.grad_bytes for s in sizes),
                 "optimizer": sum(s.state_bytes + s.state_fixed for s in sizes)}
        return self.theory(whole, world_size, sum(s.numel for s in sizes))

    def gathered(self, model: nn.Module, world_size: int) -> float:
        """Bytes a rank holds beyond ``held`` at a step's peak (FSDP: the parameters it
        gathers); none by default."""
        return 0.0

    def sent(self, model: nn.Module, world_size: int) -> float:
        """Bytes one rank sends per training step, by the ring algorithms NCCL and gloo
        use (an all-reduce sends 2(N-1)/N of its buffer, an all-gather or a
        reduce-scatter (N-1)/N): by default one all-reduce of the gradients."""
        return 2 * (world_size - 1) / world_size * _grad_bytes(model)

    def release(self) -> None:
        """After a run in a warm worker (a RankPool): let go of what the strategy keeps
        beyond the run, so the next starts clean."""

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole unsharded state dict on rank 0, on CPU; ``{}`` on other ranks.

        A collective: every rank must call it.
        """
        return state.full_state_dict(module)

    def checkpoint_activations(self, module: nn.Module) -> dict[int, nn.Module]:
        """Apply activation checkpointing when asked: ``{id(block): wrapper}``."""
        if not self.activation_checkpointing:
            return {}
        return apply(module, self.activation_checkpointing)

    def summary(self) -> str:
        extras = [f"mixed_precision={self.mixed_precision}"] if self.mixed_precision else []
        if self.activation_checkpointing:
            extras.append("activation_checkpointing=" + checkpointed(self))
        return self.name + (f" ({', '.join(extras)})" if extras else "")


def repoint(opt: torch.optim.Optimizer, names: dict[int, str],
            current: dict[str, nn.Parameter]) -> None:
    """Point ``opt``'s groups at the parameters now named as ``names`` named the old ones."""
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


def checkpointed(strategy: Strategy) -> str:
    """``activation_checkpointing`` as the summary shows it."""
    ac = strategy.activation_checkpointing
    return ac if isinstance(ac, str) else ",".join(c.__name__ for c in ac)


def autocast_forward(module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run ``module``'s forward under autocast, without wrapping it (state-dict keys stay)."""
    forward = module.forward

    def forward_in_autocast(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = forward_in_autocast
