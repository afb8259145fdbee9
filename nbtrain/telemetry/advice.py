"""When more devices do not pay: the one-sentence verdict on a run's scaling and what
would help, read from what the run measured (its time breakdown, and a one-rank run of
the same function when there is one).

Weak scaling, as data parallelism is used: each rank takes the batch the function gives
it, so N ranks do N times one rank's work per step. The speed-up is N × (one rank's step
time / an N-rank step's time), the scaling efficiency that divided by N.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this scaling efficiency a run is told it does not pay well; at this share of a
# step spent waiting on communication, communication is named as the cause.
EFFICIENT = 0.6
COMM_HEAVY = 0.25
DATA_HEAVY = 0.2


@dataclass(frozen=True)
class Scaling:
    """An N-rank run beside one rank of the same function."""

    world_size: int
    step_time: float  # seconds, the N-rank run's slowest rank's mean
    baseline_step_time: float  # seconds, the one-rank run's

    @property
    def efficiency(self) -> float:
        return self.baseline_step_time / self.step_time

    @property
    def speedup(self) -> float:
        return self.world_size * self.efficiency

    def line(self) -> str:
        return (f"{self.world_size} ranks gave {self.speedup:.2f}× the throughput of one "
                f"({self.efficiency:.0%} scaling efficiency)")


def verdict(world_size: int, comm_share: float | None, data_share: float | None,
            scaling: Scaling | None, fewer_bytes: list[str]) -> tuple[str | None, list[str]]:
    """``(sentence, remedies)``: a sentence when the ranks are slower than one, scale
    below ``EFFICIENT``, or (without a one-rank run) wait on communication for
    ``COMM_HEAVY`` or more of a step; the remedies ranked by what was measured."""
    if world_size < 2:
        return None, []
    comm = comm_share or 0.0
    waited = f"they waited on communication for {comm:.0%} of each step" if comm else ""
    if scaling is not None:
        if scaling.speedup < 1:
            sentence = (f"{world_size} ranks were slower than one: {scaling.speedup:.2f}× "
                        f"one rank's throughput ({scaling.efficiency:.0%} scaling "
                        "efficiency)" + (f", and {waited}." if waited else "."))
        elif scaling.efficiency < EFFICIENT:
            sentence = (f"{scaling.line()}, below {EFFICIENT:.0%}"
                        + (f": {waited}." if waited else "."))
        else:
            return f"{scaling.line()}.", []
    elif comm >= COMM_HEAVY:
        sentence = (f"The ranks waited on communication for {comm:.0%} of each step: more "
                    "devices pay little while it is that large.")
    else:
        return None, []
    remedies = []
    if comm >= COMM_HEAVY:
        remedies += ["a larger batch per rank: the compute of a step grows with it, the "
                     "bytes it communicates do not",
                     "gradient accumulation, which synchronises once per k micro-batches: "
                     "acc = ctx.accumulate(model, k), then `with acc:` around each "
                     "micro-batch's backward",
                     *fewer_bytes]
    if (data_share or 0.0) >= DATA_HEAVY:
        remedies.append("the data: ctx.dataloader(..., num_workers=2) loads batches in "
                        "the background")
    if scaling is not None and scaling.speedup < 1:
        remedies.append("or one device: here it trains faster than "
                        f"{world_size}")
    return sentence, remedies


def advice_text(sentence: str | None, remedies: list[str]) -> str:
    if not sentence:
        return ""
    if not remedies:
        return sentence
    return sentence + " What would help, most likely first:\n" + "\n".join(
        f"  - {r}" for r in remedies)
