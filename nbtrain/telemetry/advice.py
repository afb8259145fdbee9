"""When more devices do not pay: the one-sentence verdict on a run's scaling and what
would help, read from what the run measured (its time breakdown, and a one-rank run of
the same function when there is one).

Like for like, or said not to be. The speed-up is the N-rank run's throughput in samples
per second over the one-rank run's, when both counted their samples (``ctx.dataloader``,
or ``ctx.log(samples=n)``): right whether each rank takes the batch it is given (weak
scaling, as data parallelism is used) or a share of a global batch. Without samples, it
is N × (one rank's step time / an N-rank step's time), which holds only when each rank
does one rank's work per step: the sentence says so. Both sides are steady state (the
steps after the first tenth, warm-up left out) and undisturbed (their tenth percentile:
a shared machine only slows steps); fewer than ``MIN_STEPS`` steady steps on a side are
said to be too few, and ``scaling()`` measures a short function again, in alternating
rounds, until each side has ``STEADY_SECONDS`` of steps or ``MAX_ROUNDS`` rounds. An efficiency above ``SUPERLINEAR`` is flagged
with its likely cause, never called a win: N devices cannot do more than N times one's
work unless the one-rank run was slowed, or each rank did less.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this scaling efficiency a run is told it does not pay well; at this share of a
# step spent waiting on communication, communication is named as the cause.
EFFICIENT = 0.6
COMM_HEAVY = 0.25
DATA_HEAVY = 0.2
SUPERLINEAR = 1.1  # above: more than N times one's throughput, to be explained
MIN_STEPS = 20  # steady steps a side needs for a speed-up worth reading
# scaling(): a side with less than this of steady steps is measured again, one rank and
# N alternately, up to MAX_ROUNDS rounds in all (benchmarks/scaling.py: on 2 shared
# cores one round of 30 short steps wandered 2× between repeats; five, pooled, ≤ 15 %)
STEADY_SECONDS = 2.0
MAX_ROUNDS = 5


@dataclass(frozen=True)
class Scaling:
    """An N-rank run beside one rank of the same function."""

    world_size: int
    step_time: float  # seconds, the N-rank run's slowest rank's steady step
    baseline_step_time: float  # seconds, the one-rank run's
    samples_per_s: float | None = None  # the N-rank run's, every rank together
    baseline_samples_per_s: float | None = None
    steps: int | None = None  # steady steps measured, the fewer of the two sides
    rounds: int = 1  # scaling()'s rounds of the two, pooled (a short function's)

    @property
    def by_samples(self) -> bool:
        return bool(self.samples_per_s and self.baseline_samples_per_s)

    @property
    def speedup(self) -> float:
        if self.by_samples:
            return self.samples_per_s / self.baseline_samples_per_s
        return self.world_size * self.baseline_step_time / self.step_time

    @property
    def efficiency(self) -> float:
        return self.speedup / self.world_size

    @property
    def superlinear(self) -> bool:
        return self.efficiency > SUPERLINEAR

    @property
    def too_few(self) -> bool:
        return self.steps is not None and self.steps < MIN_STEPS

    @property
    def efficiency_said(self) -> str:
        rounds = f", {self.rounds} rounds of each" if self.rounds > 1 else ""
        return f"{self.efficiency:.0%} scaling efficiency{rounds}"

    def line(self) -> str:
        return (f"{self.world_size} ranks gave {self.speedup:.2f}× the throughput of one "
                f"({self.efficiency_said})")

    def caveats(self) -> list[str]:
        """What makes the figure less than like for like, said beside it."""
        out = []
        if not self.by_samples:
            out.append("measured in steps, not samples: it assumes each rank does one "
                       "rank's work per step (give ctx.log(samples=n), or use "
                       "ctx.dataloader, to count samples)")
        if self.too_few:
            out.append(f"only {self.steps} steady steps on a side: too few to average out a "
                       f"shared machine (train {MIN_STEPS} or more)")
        return out

    def superlinear_cause(self) -> str:
        """Why more than N times one's throughput, most likely first."""
        if not self.by_samples:
            return ("each rank likely did less work than the one-rank run (a global batch "
                    "split across ranks counts as N times fewer samples per step); count "
                    "samples with ctx.log(samples=n) or ctx.dataloader")
        return ("the one-rank run was slowed (a busy machine while it ran: run again), or "
                "each rank's smaller share of the data fits a cache one rank's did not")


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
        said = scaling.caveats()
        if scaling.superlinear:
            sentence = (f"{scaling.line()}: above 100%, more than {world_size} devices can "
                        f"give, so not a result to trust. Likely: "
                        f"{scaling.superlinear_cause()}.")
            return _with(sentence, said[1:] if not scaling.by_samples else said), []
        if scaling.speedup < 1:
            sentence = (f"{world_size} ranks were slower than one: {scaling.speedup:.2f}× "
                        f"one rank's throughput ({scaling.efficiency_said})"
                        + (f", and {waited}." if waited else "."))
        elif scaling.efficiency < EFFICIENT:
            sentence = (f"{scaling.line()}, below {EFFICIENT:.0%}"
                        + (f": {waited}." if waited else "."))
        else:
            return _with(f"{scaling.line()}.", said), []
        sentence = _with(sentence, said)
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


def _with(sentence: str, caveats: list[str]) -> str:
    return sentence + "".join(f" ({c}.)" for c in caveats)


def advice_text(sentence: str | None, remedies: list[str]) -> str:
    if not sentence:
        return ""
    if not remedies:
        return sentence
    return sentence + " What would help, most likely first:\n" + "\n".join(
        f"  - {r}" for r in remedies)
