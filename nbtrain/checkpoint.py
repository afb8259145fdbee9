"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save and load a training
state — models, optimizers and plain values — in a way that does not depend on the
strategy or the world size it was saved with.

A state is a dict such as ``{"model": model, "optimizer": opt, "step": 12}``. Models
and optimizers become their state dicts through torch's
``torch.distributed.checkpoint.state_dict`` helpers, keyed by parameter names (DDP's,
FSDP's and the checkpoint wrapper's prefixes removed; optimizer state flattened to
``state.<param>.<name>`` keys), so a checkpoint saved by FSDP on 2 ranks loads into DDP
on 1 rank or into a plain model in the notebook. Objects with ``state_dict`` and
``load_state_dict`` (an LR scheduler, a GradScaler) are saved as their state dicts and
loaded in place, as torch's ``Stateful`` are. Other values are saved as they are and
replaced in the dict on load.

Two formats:

- sharded (default): a DCP directory; every rank writes its own shards in parallel, and
  loading reshards to whatever the loading run has.
- full (``full=True``): one ``torch.save`` file written by rank 0 with the gathered,
  unsharded state; ``torch.load`` reads it anywhere.

Both are written to a temporary name and moved into place when complete, so an
interrupted save leaves the previous checkpoint intact. The fp16 loss scale is part of
``ctx.checkpoint_every``'s (``resume.py``), not of a ``ctx.save`` of your own (it
re-calibrates within a few steps).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .strategies import owner_of
from .strategies.meta_values import copy_into
from .strategies.norms import sync_statistics

__all__ = ["exists", "keys", "load", "save"]

_META = ".metadata"


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint (a DCP directory or a full file)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, _META)) or os.path.isfile(path)


def keys(path: str | os.PathLike) -> set[str]:
    """The names a checkpoint holds: a sharded one's as DCP flattens them
    (``model.fc.weight``, ``step``), a full one's top-level keys."""
    path = os.fspath(path)
    if os.path.isdir(path):
        from torch.distributed.checkpoint import FileSystemReader

        return set(FileSystemReader(path).read_metadata().state_dict_metadata)
    return set(torch.load(path, map_location="cpu", weights_only=False, mmap=True))


def save(path: str | os.PathLike, state: Mapping[str, Any], *, full: bool = False,
         models: Mapping[int, nn.Module] | None = None) -> None:
    """Save ``state`` to ``path``. In a distributed run every rank must call it.

    ``models`` maps ``id(optimizer)`` to the model it trains (``ctx.save`` passes what
    ``ctx.setup`` saw); without it, the one model in ``state`` is used.
    """
    path = _check_path(path)
    entries = _entries(state, models)
    rank = dist.get_rank() if _distributed() else 0
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

        with _in_one_process_quietly():
            dcp.save(data, checkpoint_id=tmp, no_dist=not _distributed())
    else:
        data = {key: _state_dict(kind, obj, model, full=True)
                for key, kind, obj, model in entries}
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
        with _in_one_process_quietly():
            dcp.load(data, checkpoint_id=path, no_dist=not _distributed())
    else:
        # Memory-mapped: each rank reads only what it copies, its shards.
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        missing = [key for key, *_ in entries if key not in saved]
        if missing:
            raise KeyError(f"the checkpoint {path!r} has no {missing}; it holds "
                           f"{sorted(saved)}.")
        data = {key: _from_full(kind, obj, model, saved[key]) for key, kind, obj, model in entries}
    for key, kind, obj, model in entries:
        if kind == "module":
            owner_of(obj).load_model_state_dict(obj, data[key], strict=strict)
        elif kind == "optimizer":
            owner_of(obj).load_optimizer_state_dict(model, obj, data[key], strict=strict)
        elif kind == "value":
            state[key] = data[key]
    return state


# -- helpers ------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _in_one_process_quietly():
    """Saving or loading in the notebook, without a process group, is what
    ``no_dist=True`` asks DCP for; DCP still warns, on every call, that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


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
    """A torch optimizer, or what stands for one (fp16's scaling wrapper, DeepSpeed's)."""
    return isinstance(obj, torch.optim.Optimizer) or (
        not isinstance(obj, nn.Module)
        and all(callable(getattr(obj, m, None)) for m in ("step", "zero_grad", "state_dict"))
        and hasattr(obj, "param_groups"))


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
        elif all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict")):
            entries.append((key, "stateful", value, None))  # an LR scheduler, a GradScaler
        else:
            entries.append((key, "value", value, None))
    return entries


def _state_dict(kind: str, obj: Any, model: nn.Module | None, full: bool = False) -> Any:
    """An entry's state under torch's keys, from the strategy that made it."""
    if kind == "module":
        return owner_of(obj).model_state_dict(obj, full)
    if kind == "optimizer":
        return owner_of(obj).optimizer_state_dict(model, obj, full)
    if kind == "stateful" and full:
        return obj.state_dict()
    return obj  # DCP saves and loads a stateful object through its state dict itself


def _from_full(kind: str, obj: Any, model: nn.Module | None, saved: Any) -> Any:
    """This rank's state dict, its tensors filled from the full one (DTensors take their
    shard, cut by torch's ``distribute_tensor``)."""
    if kind == "value":
        return saved
    if kind == "stateful":  # (an older nbtrain pickled the object itself)
        obj.load_state_dict(saved if isinstance(saved, Mapping) else saved.state_dict())
        return obj
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
