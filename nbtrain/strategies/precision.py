"""fp16's loss scaling as an optimizer: what ``ctx.setup`` returns under
``mixed_precision="fp16"`` (bf16 needs no scaler)."""

from __future__ import annotations

import torch


def unwrap(optimizer):
    """The optimizer a ``ScaledOptimizer`` wraps, or ``optimizer`` itself."""
    return optimizer.optimizer if isinstance(optimizer, ScaledOptimizer) else optimizer


class ScaledOptimizer(torch.optim.Optimizer):
    """fp16: ``step()`` unscales the gradients, skips the step when they hold inf/nan (as
    one process with torch's ``GradScaler`` does), and updates the scale.

    An ``Optimizer`` to every check (LR schedulers refuse anything else) whose state,
    parameter groups, state dict and hooks are the wrapped optimizer's own: a scheduler
    built on it moves the real learning rates. ``skipped`` counts the skipped steps;
    ``on_skip(optimizer)`` is told of each.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler, on_skip=None):
        # No Optimizer.__init__: nothing of its own to hold, all is the wrapped one's.
        self.optimizer = optimizer
        self.scaler = scaler
        self.on_skip = on_skip
        self.skipped = 0
        self._stepped = False  # the scaler let the wrapped optimizer step (no extra sync)
        optimizer.register_step_post_hook(self._note_step)

    def _note_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("fp16 training with a closure is not supported; call "
                             "optimizer.step() without one.")
        self._stepped = False
        result = self.scaler.step(self.optimizer)
        self.scaler.update()
        if not self._stepped:  # inf/nan in the gradients: the scaler skipped the step
            self.skipped += 1
            if self.on_skip is not None:
                self.on_skip(self.optimizer)
        return result

    # Optimizer's methods, each the wrapped optimizer's (its own would read state that
    # this object does not have).
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"fp16 loss scaling of {self.optimizer!r}"
