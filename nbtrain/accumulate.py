"""``ctx.accumulate(model, k)``: gradient accumulation over k micro-batches, every
micro-step but the last without the gradient synchronisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Accumulator:
    """``with acc:`` around each micro-step's forward and backward; ``acc.ready`` is
    True after the micro-step that synchronised the gradients (time to step).
    ``no_sync(enabled)`` is the context that skips the synchronisation (ctx's)."""

    def __init__(self, no_sync: Callable[[bool], Any], steps: int):
        self.no_sync, self.steps = no_sync, steps
        self.micro_steps = 0
        self._block = None

    @property
    def ready(self) -> bool:
        return self.micro_steps > 0 and self.micro_steps % self.steps == 0

    @property
    def in_phase(self) -> bool:
        """No micro-batch's gradients wait for an optimizer step: a checkpoint taken now
        resumes in phase (``checkpoint_every`` waits for this)."""
        return self.micro_steps % self.steps == 0

    def __enter__(self) -> Accumulator:
        last = (self.micro_steps + 1) % self.steps == 0
        self._block = self.no_sync(not last)
        self._block.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        block, self._block = self._block, None
        block.__exit__(*exc)
        if exc[0] is None:
            self.micro_steps += 1
