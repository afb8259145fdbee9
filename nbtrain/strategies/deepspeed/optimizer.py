"""The optimizer a DeepSpeed run's function holds: the engine's step behind torch's
optimizer interface."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils.hooks import RemovableHandle


class EngineOptimizer:
    """What the training function holds as its optimizer: ``step()`` steps the engine
    (optimizer step, then its gradients cleared), ``zero_grad()`` clears them;
    ``param_groups`` and ``state_dict`` are DeepSpeed's optimizer's (an LR scheduler
    built on this object's ``param_groups`` drives it)."""

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer
        # step pre-hooks run as the engine's step begins (its unscaling and clipping
        # included); post-hooks, as the torch optimizer inside it ends its step, before the
        # engine clears the gradients (memory is sampled there)
        self._pre_hooks: OrderedDict[int, object] = OrderedDict()  # RemovableHandle's kind

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DeepSpeed's step takes no closure.")
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})
        try:
            self.engine.step()
        finally:  # a ctx.clip_grad_norm_ clips this step only
            if hasattr(self.optimizer, "clip_grad"):
                self.optimizer.clip_grad = self.engine.gradient_clipping()

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return getattr(self.optimizer, "state", {})

    def state_dict(self):
        return self.optimizer.state_dict()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer DeepSpeed steps (on this rank's partition)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def register_step_pre_hook(self, hook) -> RemovableHandle:
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook):
        return self.torch_optimizer.register_step_post_hook(
            lambda opt, args, kwargs: hook(self, args, kwargs))

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.optimizer).__name__})"


def is_engine(model) -> bool:
    return callable(getattr(model, "zero_optimization_stage", None))

