"""What the workers report, chosen with ``launch(telemetry=...)``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Telemetry:
    """What the ranks report (telemetry settings).

    ``launch(telemetry=True)`` uses the defaults, ``telemetry=False`` turns every event
    off (``ctx.log`` included), ``telemetry=Telemetry(memory_every=1)`` samples memory
    every step.
    """

    # Stream events at all (metrics, steps, memory, communication, lifecycle).
    enabled: bool = True
    # Measure memory by category every N optimizer steps (0: never). Walking the
    # parameters costs microseconds per tensor; every 10 steps keeps it invisible.
    memory_every: int = 10
    # Count collectives (op type, calls, logical bytes) per step.
    comm: bool = True
    # Measure where each step's time goes on each rank (data, forward, backward,
    # optimizer, communication waited for, other): a few Python calls per step. True:
    # every step of 5 ms or more, and a random sample of shorter ones on a CPU rank (about
    # one timed step per 5 ms: a tiny step's breakdown cost as much as 10 % of it); the
    # others' Step events have no phases. "every step": every step, however short.
    timing: bool | str = True
    # Also measure activations (bytes saved for backward by the forward of the model
    # ctx.setup returned) and the step's tensor-level peak, on the memory-sampled steps:
    # the Memory events gain "activations" and "peak".
    profile_memory: bool = False

    def __post_init__(self) -> None:
        if self.timing not in (True, False, "every step"):
            raise ValueError(f"timing={self.timing!r}: give True (every step of 5 ms or "
                             "more, a sample of shorter ones), False, or \"every step\".")
        if not isinstance(self.memory_every, int) or self.memory_every < 0:
            raise ValueError(f"memory_every={self.memory_every!r} must be an int >= 0 "
                             "(0 turns memory sampling off).")

    @classmethod
    def from_arg(cls, value: bool | Telemetry) -> Telemetry:
        if isinstance(value, Telemetry):
            return value
        if isinstance(value, bool):
            return cls(enabled=value)
        raise TypeError(f"telemetry={value!r}: give True, False or nbtrain.Telemetry(...).")
