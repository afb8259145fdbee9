"""What every strategy shares: its name, mixed precision, checks, and the full state dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..launch.devices import DevicePlan


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


@dataclass
class Strategy:
    """A way to wrap the model so N ranks train it together.

    Subclasses fill in ``setup_module``; instances are plain data, so they cross into
    spawned workers as they are.
    """

    name: str = ""
    # "bf16" or "fp16": compute in half precision, keep fp32 master weights.
    mixed_precision: Precision = None
    # Preferred start method of an alias ("ddp_notebook" -> fork); None: no preference.
    start_method: Literal["fork", "forkserver", "spawn"] | None = None
    # Module classes whose forward is recomputed in backward instead of keeping its
    # activations (torch's non-reentrant checkpoint wrapper), e.g. (Block,); "auto" (or
    # True): the model's own blocks (strategies.blocks).
    activation_checkpointing: tuple[type[nn.Module], ...] | str | None = None
    # BatchNorm with the statistics of the whole batch across ranks (torch's
    # SyncBatchNorm; Lightning's Trainer(sync_batchnorm=True)). CUDA only.
    sync_batchnorm: bool = False

    description: ClassVar[str] = ""
    accelerators: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    # Modules the strategy imports in every worker; a fork launch imports them once in
    # the kernel instead (see launch/warm.py).
    warm_imports: ClassVar[tuple[str, ...]] = ()

    def warm_imports_for(self, accelerator: str) -> tuple[str, ...]:
        """What a fork launch imports once in the kernel for this strategy on
        ``accelerator`` (never anything that initialises CUDA there)."""
        return self.warm_imports

    def start_rank(self, device: torch.device) -> None:
        """In each rank, before the training function runs (after its process group)."""

    def __post_init__(self) -> None:
        self.mixed_precision = normalize_precision(self.mixed_precision)
        from .activation import normalize

        self.activation_checkpointing = normalize(self.activation_checkpointing)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.mixed_precision) if self.mixed_precision else None

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
            from .norms import convert_to_sync

            return convert_to_sync(module)
        return module

    def setup_module(self, module: nn.Module, ctx: Host) -> nn.Module:
        raise NotImplementedError

    def setup_optimizer(self, optimizer: torch.optim.Optimizer, module: nn.Module,
                        ctx: Host) -> torch.optim.Optimizer:
        """The optimizer to train with, given one built on ``module``'s parameters."""
        return optimizer

    def grad_scaler(self, ctx: Host):
        """A loss scaler for fp16 (bf16 needs none), or None."""
        if self.mixed_precision != "fp16":
            return None
        return torch.amp.GradScaler(ctx.device.type)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole unsharded state dict on rank 0, on CPU; ``{}`` on other ranks.

        A collective: every rank must call it.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        from .norms import sync_statistics

        sync_statistics(module)  # rank 0's running statistics, as a checkpoint holds
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(module, options=options)
        # On CPU the "offloaded" whole tensors of an unsharded model are the live ones: a
        # snapshot taken before training would change with every step. Copy those.
        live = {t.untyped_storage().data_ptr() for t in (*module.parameters(),
                                                         *module.buffers())
                if t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter)}
        return {k: v.clone() if isinstance(v, torch.Tensor)
                and v.untyped_storage().data_ptr() in live else v for k, v in full.items()}

    def checkpoint_activations(self, module: nn.Module) -> dict[int, nn.Module]:
        """Apply activation checkpointing when asked: ``{id(block): wrapper}``."""
        if not self.activation_checkpointing:
            return {}
        from .activation import apply

        return apply(module, self.activation_checkpointing)

    def summary(self) -> str:
        extras = [f"mixed_precision={self.mixed_precision}"] if self.mixed_precision else []
        if self.activation_checkpointing:
            extras.append("activation_checkpointing=" + checkpointed(self))
        return self.name + (f" ({', '.join(extras)})" if extras else "")


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
