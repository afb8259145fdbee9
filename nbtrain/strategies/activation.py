"""Activation checkpointing by module class, with torch's non-reentrant checkpoint
wrapper: the wrapped blocks keep only their inputs from forward and recompute the rest
during backward (less activation memory, about one more forward of compute).

Applied before DDP or FSDP wraps the model; FSDP then shards the wrapper, as torchtitan
does. State-dict keys do not change (the wrapper's prefix is removed from them).
``"auto"`` (or True) checkpoints the model's own blocks (``blocks.find``).

What real models need beside it:

- BatchNorm in a checkpointed block would update its running statistics twice a step
  (once in forward, once in the recomputation): while autograd recomputes (inside
  backward), each such norm layer runs with momentum 0, so it computes what forward
  computed and leaves its running statistics (and batch count) as they were.
- A model that keeps a cache during training (transformers' ``use_cache``, on by
  default in a model built from a config) would run attention again in the
  recomputation against the cache its forward already filled (sliding-window and
  encoder-decoder attention then fail): the cache is turned off, and that is said once,
  as transformers' own ``gradient_checkpointing_enable()`` does.
"""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn

PREFIX = "_checkpoint_wrapped_module."
AUTO = "auto"


def normalize(classes) -> tuple[type[nn.Module], ...] | str | None:
    """``activation_checkpointing=`` as a tuple of module classes, ``"auto"`` (the
    model's blocks) or None."""
    if classes is None or classes == () or classes is False:
        return None
    if classes is True or (isinstance(classes, str) and classes.lower() == AUTO):
        return AUTO
    if isinstance(classes, str):
        raise ValueError(f"activation_checkpointing={classes!r}: give 'auto' (the model's "
                         "blocks), True, or the blocks' classes, e.g. (Block,).")
    items = tuple(classes) if isinstance(classes, (list, tuple, set, frozenset)) else (classes,)
    bad = [c for c in items if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"activation_checkpointing= takes nn.Module classes (the model's "
                        f"blocks, e.g. (Block,)); got {bad[0]!r}.")
    return items


def apply(module: nn.Module, classes: tuple[type[nn.Module], ...] | str
          ) -> dict[int, nn.Module]:
    """Wrap every submodule of ``classes`` (``"auto"``: the model's blocks); returns
    ``{id(block): its wrapper}``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from . import blocks

    if classes == AUTO:
        classes = blocks.find(module)
        if not classes:
            raise ValueError(
                f"activation_checkpointing='auto' found no blocks in {type(module).__name__} "
                "(it declares none in _no_split_modules and repeats no module class in a "
                "ModuleList or Sequential); give the classes to recompute, e.g. "
                "activation_checkpointing=(MyBlock,).")
    if not any(isinstance(m, classes) for m in module.modules() if m is not module):
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(f"activation_checkpointing=({names},) matched no submodule of "
                         f"{type(module).__name__}; give the classes of its blocks (the "
                         "model itself cannot be checkpointed as a whole).")
    apply_activation_checkpointing(
        module,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                      checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, classes))
    wrappers = {id(m._checkpoint_wrapped_module): m for m in module.modules()
                if isinstance(m, CheckpointWrapper)}
    for wrapper in wrappers.values():
        for m in wrapper.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase):
                _update_statistics_once(m)
    _cache_off(module)
    return wrappers


def _update_statistics_once(norm: nn.Module) -> None:
    """While autograd recomputes the block (a forward inside backward), ``norm`` runs
    with momentum 0 (the same call, so the same saved tensors; running statistics kept
    as they are) and its batch count is put back after."""

    def before(m, args):
        if m.training and m.track_running_stats and torch._C._current_graph_task_id() != -1:
            count = m.num_batches_tracked
            m._nbtrain_recomputing = (m.momentum, None if count is None else count.clone())
            m.momentum = 0.0

    def after(m, args, output):
        saved = getattr(m, "_nbtrain_recomputing", None)
        if saved is not None:
            m.momentum, count = saved
            if count is not None:
                m.num_batches_tracked.copy_(count)
            m._nbtrain_recomputing = None

    norm.register_forward_pre_hook(before)
    norm.register_forward_hook(after, always_call=True)


def _cache_off(model: nn.Module) -> None:
    """Turn off a transformers model's cache for training (see the module docstring)."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False
            if os.environ.get("RANK", "0") == "0":
                print(f"nbtrain: activation checkpointing: turned off {type(m).__name__}'s "
                      "cache (config.use_cache=False); recomputing attention against a "
                      "filled cache gives wrong shapes or values.", flush=True)


def clean_name(name: str) -> str:
    """A parameter's name without the checkpoint wrapper's part."""
    return name.replace(PREFIX, "")
