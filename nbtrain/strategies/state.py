"""Torch's state dicts of a model and its optimizer, as nbtrain's checkpoints hold them:
keyed by parameter names (DDP's, FSDP's and the checkpoint wrapper's prefixes removed),
the optimizer's state flattened to ``state.<param>.<name>`` and
``param_groups.<param>.<option>`` keys, through torch's
``torch.distributed.checkpoint.state_dict`` helpers. These are the base ``Strategy``'s
state-dict hooks; a strategy that keeps its state its own way (DeepSpeed) gives the same
keys from its own."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .norms import sync_statistics
from .precision import unwrap


def local_optimizer(optimizer):
    """The optimizer that holds this rank's state: ZeRO's inner one, or itself."""
    inner = unwrap(optimizer)  # fp16's ScaledOptimizer wraps it
    # Not imported here: ``torch.distributed.optim`` compiles TorchScript on import (1.3 s
    # in a worker, on every launch, for a memory sample). A ZeRO optimizer has imported it.
    zero = sys.modules.get("torch.distributed.optim")
    return inner.optim if zero and isinstance(inner, zero.ZeroRedundancyOptimizer) else inner


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def model_state_dict(model: nn.Module, full: bool = False) -> dict[str, Any]:
    """This rank's shards (``full``: the whole tensors on rank 0, on the CPU)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if full:
        return get_model_state_dict(model, options=_options(full_state_dict=True,
                                                            cpu_offload=True))
    return get_model_state_dict(model)


def load_model_state_dict(model: nn.Module, state: dict[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(strict=strict,
                                                        flatten_optimizer_state_dict=True))


def optimizer_state_dict(model: nn.Module, optimizer, full: bool = False) -> dict[str, Any]:
    """This rank's state (``full``: the whole state on rank 0, ``{}`` elsewhere; ZeRO-1's
    partitions joined)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    local = local_optimizer(optimizer)
    distributed = dist.is_available() and dist.is_initialized()
    if not full:
        return get_optimizer_state_dict(model, local,
                                        options=_options(flatten_optimizer_state_dict=True))
    if local is unwrap(optimizer) or not distributed:
        options = _options(full_state_dict=True, cpu_offload=True,
                           flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(model, local, options=options)
    # ZeRO-1: each rank holds whole tensors for its own parameters; gather the pieces.
    part = get_optimizer_state_dict(model, local,
                                    options=_options(flatten_optimizer_state_dict=True))
    part = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in part.items()}
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, pieces, dst=0)
    merged: dict[str, Any] = {}
    for piece in pieces or []:
        merged.update(piece)
    return merged


def load_optimizer_state_dict(model: nn.Module, optimizer, state: dict[str, Any],
                              strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, local_optimizer(optimizer), state,
                             options=_options(strict=strict, flatten_optimizer_state_dict=True))


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0, on the CPU, a snapshot; ``{}`` elsewhere."""
    sync_statistics(module)  # rank 0's running statistics, as a checkpoint holds
    full = model_state_dict(module, full=True)
    # On CPU the "offloaded" whole tensors of an unsharded model are the live ones: a
    # snapshot taken before training would change with every step. Copy those.
    live = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())
            if t.device.type == "cpu" and type(t) in (torch.Tensor, nn.Parameter)}
    return {k: v.clone() if isinstance(v, torch.Tensor)
            and v.untyped_storage().data_ptr() in live else v for k, v in full.items()}


def memory_tensors(model: nn.Module | None, optimizers) -> dict[str, list[torch.Tensor]]:
    """The tensors of each memory category on this rank: the model's parameters (or,
    for a loop nbtrain did not set up, those its optimizers train), their gradients,
    and the optimizers' state."""
    optimizers = [local_optimizer(opt) for opt in optimizers]
    if model is not None:
        params = list(model.parameters())
    else:
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    state = [v for opt in optimizers for per_param in opt.state.values()
             for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": params, "grads": [p.grad for p in params], "optimizer": state}
