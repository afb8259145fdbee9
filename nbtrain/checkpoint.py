"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save and load a training
state — models, optimizers and plain values — in a way that does not depend on the
strategy or the world size it was saved with.

A state is a dict such as ``{"model": model, "optimizer": opt, "step": 12}``. Models
and optimizers become their state dicts through torch's
``torch.distributed.checkpoint.state_dict`` helpers, keyed by parameter names (DDP's,
FSDP's and the checkpoint wrapper's prefixes removed; optimizer state flattened to
``state.<param>.<name>`` keys), so a checkpoint saved by FSDP on 2 ranks loads into DDP
on 1 rank or into a plain model in the notebook. Other values are saved as they are and
replaced in the dict on load.

Two formats:

- sharded (default): a DCP directory; every rank writes its own shards in parallel, and
  loading reshards to whatever the loading run has.
- full (``full=True``): one ``torch.save`` file written by rank 0 with the gathered,
  unsharded state; ``torch.load`` reads it anywhere.

Both are written to a temporary name and moved into place when complete, so an
interrupted save leaves the previous checkpoint intact. The fp16 loss scale is not part
of a checkpoint (it re-calibrates in a few steps).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["exists", "load", "save"]

_META = ".metadata"


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint (a DCP directory or a full file)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, _META)) or os.path.isfile(path)


def save(path: str | os.PathLike, state: Mapping[str, Any], *, full: bool = False,
         models: Mapping[int, nn.Module] | None = None) -> None:
    """Save ``state`` to ``path``. In a distributed run every rank must call it.

    ``models`` maps ``id(optimizer)`` to the model it trains (``ctx.save`` passes what
    ``ctx.setup`` saw); without it, the one model in ``state`` is used.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    path = _check_path(path)
    entries = _entries(state, models)
    rank = dist.get_rank() if _distributed() else 0
    from .strategies.norms import sync_statistics

    for _, kind, obj, _ in entries:  # one copy of the running statistics: rank 0's
        if kind == "module":
            sync_statistics(obj)
    tmp = path + ".saving"
    if not full:
        data = {key: _state_dict(kind, obj, model) for key, kind, obj, model in entries}
        if rank == 0:
            _remove(tmp)
        _barrier()
        import torch.distributed.checkpoint as dcp

        dcp.save(data, checkpoint_id=tmp, no_dist=not _distributed())
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        data = {}
        for key, kind, obj, model in entries:
            if _engine(obj, model) is not None:  # DeepSpeed: whole on every rank already
                data[key] = _state_dict(kind, obj, model)
            elif kind == "module":
                data[key] = get_model_state_dict(obj, options=options)
            elif kind == "optimizer":
                data[key] = _full_optimizer_state(obj, model)
            else:
                data[key] = obj
        if rank == 0:
            torch.save(data, tmp)
    if rank == 0:
        _move_into_place(tmp, path)
    _barrier()


def load(path: str | os.PathLike, state: dict[str, Any], *, strict: bool = True,
         models: Mapping[int, nn.Module] | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``state`` (models and optimizers in place;
    other values replaced in the dict) and return ``state``.

    Works in a distributed run (every rank calls it; shards are re-cut for this run's
    strategy and world size) and in a plain process such as the notebook kernel.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = os.fspath(path)
    if not exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (a directory written by "
                                "ctx.save or a file written by ctx.save(full=True)). "
                                "Check the path, or test it with nbtrain.checkpoint.exists().")
    entries = _entries(state, models)
    sharded = os.path.isdir(path)
    if sharded:
        import torch.distributed.checkpoint as dcp

        data = {key: _state_dict(kind, obj, model) for key, kind, obj, model in entries}
        with warnings.catch_warnings():  # loading in the notebook, without a process group,
            # is what no_dist=True asks for; DCP still warns that it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(data, checkpoint_id=path, no_dist=not _distributed())
    else:
        # Memory-mapped: each rank reads only what it copies, its shards.
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        missing = [key for key, *_ in entries if key not in saved]
        if missing:
            raise KeyError(f"the checkpoint {path!r} has no {missing}; it holds "
                           f"{sorted(saved)}.")
        data = {key: _from_full(kind, obj, model, saved[key]) for key, kind, obj, model in entries}
    flat = StateDictOptions(strict=strict, flatten_optimizer_state_dict=True)
    for key, kind, obj, model in entries:
        engine = _engine(obj, model)
        if engine is not None:
            from .strategies import deepspeed

            if kind == "module":
                deepspeed.load_model_state_dict(engine, data[key], strict=strict)
            else:
                deepspeed.load_optimizer_state_dict(engine, data[key])
        elif kind == "module":
            set_model_state_dict(obj, data[key], options=flat)
        elif kind == "optimizer":
            set_optimizer_state_dict(model, _local(obj), data[key], options=flat)
        else:
            state[key] = data[key]
    return state


# -- helpers ------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"a checkpoint path is a str or os.PathLike; got {type(path).__name__}.")
    return os.fspath(path).rstrip("/")


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _move_into_place(tmp: str, path: str) -> None:
    old = path + ".old"
    _remove(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _remove(old)


def _is_optimizer(obj: Any) -> bool:
    from .strategies.deepspeed import EngineOptimizer

    return isinstance(obj, (torch.optim.Optimizer, EngineOptimizer)) or isinstance(
        getattr(obj, "optimizer", None), torch.optim.Optimizer)


def _local(optimizer):
    from .strategies.zero import local_optimizer

    return local_optimizer(optimizer)


def _entries(state: Mapping[str, Any], models: Mapping[int, nn.Module] | None):
    if not isinstance(state, Mapping):
        raise TypeError("a checkpoint state is a dict such as {'model': model, "
                        f"'optimizer': opt, 'step': step}}; got {type(state).__name__}.")
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    entries = []
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint state keys are strings; got {key!r}.")
        if isinstance(value, nn.Module):
            entries.append((key, "module", value, None))
        elif _is_optimizer(value):
            model = (models or {}).get(id(value))
            if model is None:
                if len(modules) != 1:
                    raise ValueError(f"state[{key!r}] is an optimizer, and which model it "
                                     "trains is not known: put exactly one model in the "
                                     "state, or set both up with ctx.setup(model, opt).")
                model = modules[0]
            entries.append((key, "optimizer", value, model))
        else:
            entries.append((key, "value", value, None))
    return entries


def _engine(obj: Any, model: nn.Module | None):
    """The DeepSpeed engine behind a state entry (the engine, or the optimizer
    ``ctx.setup`` returned with it), else None."""
    from .strategies.deepspeed import EngineOptimizer, is_engine

    if isinstance(obj, EngineOptimizer):
        return obj.engine
    return obj if isinstance(obj, nn.Module) and is_engine(obj) else None


def _state_dict(kind: str, obj: Any, model: nn.Module | None) -> Any:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    engine = _engine(obj, model) if kind != "value" else None
    if engine is not None:  # torch's keys, from DeepSpeed's partitions
        from .strategies import deepspeed

        if kind == "module":
            return deepspeed.model_state_dict(engine)
        return deepspeed.optimizer_state_dict(engine)
    if kind == "module":
        return get_model_state_dict(obj)
    if kind == "optimizer":
        return get_optimizer_state_dict(model, _local(obj),
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))
    return obj


def _from_full(kind: str, obj: Any, model: nn.Module | None, saved: Any) -> Any:
    """This rank's state dict, its tensors filled from the full one (DTensors take their
    shard, cut by torch's ``distribute_tensor``)."""
    if kind == "value":
        return saved
    from .strategies.meta_init import copy_into

    local = _state_dict(kind, obj, model)
    for k, v in local.items():
        if k not in saved:
            raise KeyError(f"the checkpoint has no {k!r}; was it saved from another model?")
        if isinstance(v, torch.Tensor):
            with torch.no_grad():
                copy_into(v, saved[k])
        else:
            local[k] = saved[k]
    return local


def _full_optimizer_state(optimizer, model: nn.Module) -> dict[str, Any]:
    """The whole optimizer state on rank 0 (``{}`` elsewhere); ZeRO's partitions joined."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    local = _local(optimizer)
    if local is getattr(optimizer, "optimizer", optimizer) or not _distributed():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(model, local, options=options)
    # ZeRO-1: each rank holds whole tensors for its own parameters; gather the pieces.
    part = get_optimizer_state_dict(model, local,
                                    options=StateDictOptions(flatten_optimizer_state_dict=True))
    part = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in part.items()}
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, pieces, dst=0)
    merged: dict[str, Any] = {}
    for piece in pieces or []:
        merged.update(piece)
    return merged
