"""``run.summary()``: per-rank figures from the history — peak memory by category, mean
step time and where it went (data, forward, backward, optimizer, communication waited
for, other), throughput, communication per step, last metric values."""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .advice import Scaling, advice_text, verdict
from .events import Comm, Memory, Metric, Step
from .history import History
from .timing import PHASES

MEMORY_ORDER = ("params", "grads", "optimizer", "activations", "peak", "params_host",
                "grads_host", "optimizer_host", "cuda_allocated", "cuda_reserved", "cuda_peak",
                "device_used")


@dataclass
class RankSummary:
    rank: int
    steps: int = 0
    step_time: float | None = None  # mean seconds, first step (warm-up) left out
    samples_per_s: float | None = None
    memory: dict[str, int] = field(default_factory=dict)  # peak bytes per category
    comm_per_step: dict[str, dict[str, float]] = field(default_factory=dict)  # op -> calls, bytes
    # mean seconds per step in each phase (telemetry/timing.py), same steps as step_time
    phases: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # last value of each
    # steady state, for a speed-up (advice.py): the steps after the first tenth, as
    # (seconds, samples); their undisturbed step (the tenth percentile: a shared machine
    # only ever slows a step) and its samples per second when the steps counted samples
    steady: list[tuple[float, int]] = field(default_factory=list, repr=False)
    steady_step_time: float | None = None
    steady_samples_per_s: float | None = None

    @property
    def steady_steps(self) -> int:
        return len(self.steady)

    @property
    def model_bytes(self) -> int:
        return sum(self.memory.get(k, 0) for k in ("params", "grads", "optimizer"))

    def share(self, phase: str) -> float | None:
        """The fraction of this rank's step time spent in ``phase``, or None."""
        total = sum(self.phases.values())
        return self.phases[phase] / total if total > 0 and phase in self.phases else None


@dataclass
class Summary:
    ranks: list[RankSummary]
    # beside a one-rank run of the same function (``run.summary(baseline=...)``)
    scaling: Scaling | None = None
    verdict: str | None = None  # when more devices do not pay (telemetry/advice.py)
    remedies: list[str] = field(default_factory=list)
    # with a bandwidth measurement: how much of the communication wait the link explains
    link: str | None = None
    restarts: list[str] = field(default_factory=list)  # launch(max_restarts=...)'s attempts
    evaluation: str | None = None  # the evaluation passes' time beside the training's
    planned: str | None = None  # launch(planned=...): the plan's row beside the measured

    @property
    def step_time(self) -> float | None:
        """The slowest rank's mean step time: what the run waits for."""
        times = [r.step_time for r in self.ranks if r.step_time]
        return max(times) if times else None

    @property
    def advice(self) -> str:
        """The verdict and what would help, as text ("" when the ranks scale well)."""
        return advice_text(self.verdict, self.remedies)

    @property
    def samples_per_s(self) -> float:
        return sum(r.samples_per_s or 0.0 for r in self.ranks)

    @property
    def comm_share(self) -> float | None:
        """The largest fraction of a step any rank spent waiting for communication."""
        shares = [r.share("comm") for r in self.ranks if r.share("comm") is not None]
        return max(shares) if shares else None

    def _restart_lines(self) -> list[str]:
        n = len(self.restarts)
        if not n:
            return []
        return [f"restarted {n} time{'s' if n > 1 else ''}:", *(f"  {a}" for a in self.restarts)]

    def time_line(self) -> str | None:
        """Where the step time goes, in one sentence (the slowest rank's), or None."""
        timed = [r for r in self.ranks if r.phases and r.step_time]
        if not timed:
            return None
        r = max(timed, key=lambda r: r.step_time)
        parts = [f"{name} {r.share(name):.0%}" for name in PHASES if (r.share(name) or 0) >= 0.005]
        return (f"where a step's {r.step_time * 1000:.1f} ms went"
                f"{f' on rank {r.rank}' if len(self.ranks) > 1 else ''}: {', '.join(parts)}")

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for r in self.ranks:
            row: dict[str, Any] = {"rank": r.rank, "steps": r.steps, "step_time_s": r.step_time,
                                   "samples_per_s": r.samples_per_s}
            row.update({f"{k}_bytes": v for k, v in r.memory.items()})
            row.update({f"{k}_s": v for k, v in r.phases.items()})
            for op, figures in r.comm_per_step.items():
                row[f"{op}_calls_per_step"] = figures["calls"]
                row[f"{op}_bytes_per_step"] = figures["bytes"]
            row.update(r.metrics)
            rows.append(row)
        return rows

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame(self.rows())

    def _columns(self) -> list[tuple[str, list[str]]]:
        """(heading, one cell per rank) for every figure the ranks have."""
        metric_names = list(dict.fromkeys(k for r in self.ranks for k in r.metrics))
        memory_names = [k for k in MEMORY_ORDER if any(k in r.memory for r in self.ranks)]
        ops = list(dict.fromkeys(op for r in self.ranks for op in r.comm_per_step))
        columns = [("rank", [str(r.rank) for r in self.ranks]),
                   ("steps", [str(r.steps) for r in self.ranks]),
                   ("step ms", [_fmt(r.step_time, 1000, ".1f") for r in self.ranks]),
                   ("samples/s", [_fmt(r.samples_per_s, 1, ".0f") for r in self.ranks])]
        phases = [k for k in PHASES if any(k in r.phases for r in self.ranks)]
        columns += [(f"{k} %", [_fmt(r.share(k), 100, ".0f") for r in self.ranks])
                    for k in phases]
        columns += [(k, [_fmt(r.metrics.get(k), 1, ".4g") for r in self.ranks])
                    for k in metric_names]
        columns += [(f"{k.replace('_host', ' (host)')} MB",
                     [_fmt(r.memory.get(k), 1 / 2**20, ".2f") for r in self.ranks])
                    for k in memory_names]
        columns += [(f"{op}/step", [_comm(r.comm_per_step.get(op)) for r in self.ranks])
                    for op in ops]
        return columns

    def __str__(self) -> str:
        columns = self._columns()
        header = [name for name, _ in columns]
        table = [header] + [[cells[i] for _, cells in columns] for i in range(len(self.ranks))]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if len(self.ranks) > 1 and self.samples_per_s:
            lines.append(f"total throughput: {self.samples_per_s:.0f} samples/s")
        if self.time_line():
            lines.append(self.time_line())
        if self.link:
            lines.append(self.link)
        if self.evaluation:
            lines.append(self.evaluation)
        if self.planned:
            lines.append(self.planned)
        lines += self._restart_lines()
        if self.advice:
            lines.append(self.advice)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        """In a notebook: one column per rank, one row per figure, so it never wraps."""
        columns = self._columns()
        ranks, rows = columns[0][1], columns[1:]
        head = "".join(f"<th style='text-align:right'>rank {r}</th>" for r in ranks)
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(name)}</th>"
            + "".join(f"<td style='text-align:right'>{html.escape(c)}</td>" for c in cells)
            + "</tr>" for name, cells in rows)
        notes = [f"total throughput: {self.samples_per_s:.0f} samples/s"
                 if len(self.ranks) > 1 and self.samples_per_s else "", self.time_line() or "",
                 self.link or "", self.evaluation or "", *self._restart_lines()]
        notes = "<br>".join(html.escape(n) for n in notes if n)
        if self.planned:
            notes += f"<pre style='margin:4px 0'>{html.escape(self.planned)}</pre>"
        if self.verdict:
            notes += f"<br><b>{html.escape(self.verdict)}</b>" + "".join(
                f"<br>&nbsp;&nbsp;– {html.escape(r)}" for r in self.remedies)
        total = (f"<caption style='caption-side:bottom;text-align:left'>{notes}</caption>"
                 if notes else "")
        return (f"<table class='nbtrain-summary'>{total}<thead><tr><th></th>{head}</tr>"
                f"</thead><tbody>{body}</tbody></table>")


def _comm(figures: dict[str, float] | None) -> str:
    """One collective's traffic per step: its bytes, then its calls (an average, so not
    always whole: DDP's first step has no bucket all-reduce of its own)."""
    if not figures:
        return "-"
    calls = figures["calls"]
    return f"{figures['bytes'] / 2**20:.2f} MB in {calls:.3g} call{'' if calls == 1 else 's'}"


def _fmt(value, scale: float, spec: str) -> str:
    return "-" if value is None else format(value * scale, spec)


def summarize(history: History, world_size: int, strategy=None, accelerator: str = "cpu",
              baseline: Summary | None = None, bandwidth=None, attempts=(),
              planned: str | None = None, again=()) -> Summary:
    """Per-rank figures of ``history``; with ``strategy`` (what remedies it offers) and
    ``baseline`` (a one-rank run's summary; ``again``, more rounds of the two as
    (one rank, N ranks) summaries), the verdict on how the ranks scaled; with
    ``bandwidth`` (``nbtrain.bandwidth()``'s sweep), what share of the communication wait
    the link itself explains."""
    summary = Summary(_ranks(history, world_size), restarts=[str(a) for a in attempts],
                      planned=planned,
                      evaluation=evaluation_line(history))
    if bandwidth is not None:
        summary.link = link_line(summary, bandwidth)
    if baseline is not None:
        summary.scaling = scaling_of(summary, baseline, again)
    fewer = strategy.fewer_bytes(accelerator) if hasattr(strategy, "fewer_bytes") else []
    data = [r.share("data") for r in summary.ranks if r.share("data") is not None]
    summary.verdict, summary.remedies = verdict(world_size, summary.comm_share,
                                                max(data, default=None), summary.scaling,
                                                fewer)
    return summary


def undisturbed(steady: list[tuple[float, int]]) -> tuple[float | None, float | None]:
    """``(seconds, samples per second)`` of the undisturbed step among ``steady``'s
    (seconds, samples): the tenth percentile of the times, the ninetieth of the rates
    (None unless every step counted samples). Not the median: on a shared machine a
    neighbour only ever slows a step, by up to 2× for a tenth of a second at a time on a
    2-core one, so the median moved with whatever else ran (``benchmarks/scaling.py``:
    two repeats of five pooled rounds 30 % apart by the median, 19 % by the lower
    quartile, 7 % by the tenth percentile)."""
    times = sorted(d for d, _ in steady)
    if not times:
        return None, None
    rates = sorted((n / d for d, n in steady if n and d > 0), reverse=True)
    return (times[len(times) // 10],
            rates[len(rates) // 10] if rates and len(rates) == len(times) else None)


def scaling_of(summary: Summary, baseline: Summary,
               again: list[tuple[Summary, Summary]] = ()) -> Scaling | None:
    """``summary``'s N ranks beside ``baseline``'s one, both in steady state: the
    slowest rank's undisturbed step, the ranks' samples per second summed (when every
    rank of both counted samples). ``again``: more rounds of the two, (one rank, N
    ranks), measured after them (``scaling()``, when a run is short): each side's steps
    pooled over every round."""
    ones, ns = [baseline, *(b for b, _ in again)], [summary, *(n for _, n in again)]
    if any(len(s.ranks) != len(summary.ranks) for s in ns):
        raise ValueError("scaling_of(): every round's N-rank run needs the same ranks.")
    pooled = [undisturbed([x for s in ns for x in s.ranks[r].steady])
              for r in range(len(summary.ranks))]
    one = undisturbed([x for s in ones for x in s.ranks[0].steady])
    if not one[0] or not all(t for t, _ in pooled):
        return None
    counted = one[1] is not None and all(rate for _, rate in pooled)
    steps = min(sum(s.ranks[r].steady_steps for s in side) for side in (ones, ns)
                for r in range(len(side[0].ranks)))
    return Scaling(len(summary.ranks), max(t for t, _ in pooled), one[0],
                   sum(rate for _, rate in pooled) if counted else None,
                   one[1] if counted else None, steps, rounds=len(ones))


def evaluation_line(history: History, rank: int = 0) -> str | None:
    """How long ``rank``'s evaluation passes took, beside its training steps, or None."""
    passes, began = [], None
    for e in history.events("evaluation", rank):
        if e.done == 0:
            began = e
        elif e.done >= e.batches and began is not None:
            passes.append(e.t - began.t)
            began = None
    if not passes:
        return None
    spent = sum(passes)
    training = sum(e.duration for e in history.events("step", rank))
    share = f", {spent / (spent + training):.0%} of the time" if spent + training > 0 else ""
    return (f"evaluation: {len(passes)} pass{'es' if len(passes) > 1 else ''} on rank {rank}, "
            f"{_took(spent)} in all beside {_took(training)} of training steps{share}")


def _took(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def link_line(summary: Summary, bandwidth) -> str | None:
    """The least time a step's collectives take at the measured bandwidth, beside the time
    the slowest rank waited for them. An all-gather or reduce-scatter of B bytes moves half
    what an all-reduce of B moves (one ring pass, not two), so it counts as B / 2."""
    timed = [r for r in summary.ranks if r.phases.get("comm") and r.comm_per_step]
    if not timed:
        return None
    r = max(timed, key=lambda r: r.phases["comm"])
    sizes = {op: f["bytes"] for op, f in r.comm_per_step.items()}
    equivalent = sizes.get("all_reduce", 0) + sum(v / 2 for op, v in sizes.items()
                                                  if op in ("all_gather", "reduce_scatter"))
    if not equivalent:
        return None
    least, waited = bandwidth.seconds_for(equivalent), r.phases["comm"]
    head = (f"the link: a step's {sum(sizes.values()) / 2**20:.1f} MB of collectives take at "
            f"least {least * 1000:.1f} ms at the bandwidth measured; rank {r.rank} waited "
            f"{waited * 1000:.1f} ms")
    if least >= 0.95 * waited:
        return head + ": the link's bandwidth explains all of it" + (
            " (some of the communication ran during compute)" if least > 1.05 * waited else "")
    return (head + f", {least / waited:.0%} of it the link's time; the rest is latency and "
            "waiting for the other ranks")


def _ranks(history: History, world_size: int) -> list[RankSummary]:
    ranks = []
    for rank in range(world_size):
        s = RankSummary(rank)
        steps = [e for e in history.events("step", rank) if isinstance(e, Step)]
        s.steps = len(steps)
        timed = steps[1:] if len(steps) > 1 else steps
        if timed:
            total = sum(e.duration for e in timed)
            s.step_time = total / len(timed)
            samples = sum(e.samples for e in timed)
            s.samples_per_s = samples / total if total > 0 and samples else None
            s.steady = [(e.duration, e.samples) for e in steps[max(1, len(steps) // 10):]]
            s.steady_step_time, s.steady_samples_per_s = undisturbed(s.steady)
            measured = [e for e in timed if e.phases]
            if measured:
                s.phases = {k: sum(e.phases.get(k, 0.0) for e in measured) / len(measured)
                            for k in PHASES}
        for e in history.events("memory", rank):
            if isinstance(e, Memory):
                for k, v in e.values.items():
                    s.memory[k] = max(s.memory.get(k, 0), v)
        calls: dict[str, int] = defaultdict(int)
        sizes: dict[str, int] = defaultdict(int)
        for e in history.events("comm", rank):
            if isinstance(e, Comm):
                for op, n in e.counts.items():  # each of the run's steps
                    calls[op] += n * e.steps
                    sizes[op] += e.bytes.get(op, 0) * e.steps
        per = max(s.steps, 1)
        s.comm_per_step = {op: {"calls": calls[op] / per, "bytes": sizes[op] / per}
                           for op in calls}
        for e in history.events("metric", rank):
            if isinstance(e, Metric):
                s.metrics.update(e.values)
        ranks.append(s)
    return ranks
