"""Activation checkpointing by module class, with torch's non-reentrant checkpoint
wrapper: the wrapped blocks keep only their inputs from forward and recompute the rest
during backward (less activation memory, about one more forward of compute).

Applied before DDP or FSDP wraps the model; FSDP then shards the wrapper, as torchtitan
does. State-dict keys do not change (the wrapper's prefix is removed from them).
"""

from __future__ import annotations

from functools import partial

from torch import nn

PREFIX = "_checkpoint_wrapped_module."


def normalize(classes) -> tuple[type[nn.Module], ...] | None:
    """``activation_checkpointing=`` as a tuple of module classes (or None)."""
    if classes is None or classes == () or classes is False:
        return None
    items = tuple(classes) if isinstance(classes, (list, tuple, set, frozenset)) else (classes,)
    bad = [c for c in items if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise TypeError(f"activation_checkpointing= takes nn.Module classes (the model's "
                        f"blocks, e.g. (Block,)); got {bad[0]!r}.")
    return items


def apply(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> dict[int, nn.Module]:
    """Wrap every submodule of ``classes``; returns ``{id(block): its wrapper}``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

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
    return {id(m._checkpoint_wrapped_module): m for m in module.modules()
            if isinstance(m, CheckpointWrapper)}


def clean_name(name: str) -> str:
    """A parameter's name without the checkpoint wrapper's part."""
    return name.replace(PREFIX, "")
