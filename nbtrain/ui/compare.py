"""``nbtrain.compare(*runs)``: finished runs side by side — memory per rank by category
beside the bytes theory predicts, step time, throughput, communication per step and the
metrics every run logged (their last values) — with a one-line takeaway a learner can read.

Ψ (the parameter count the theory needs) is ``n_params`` when given; otherwise it is
derived from the measured parameter bytes: a DDP run's bytes on one rank / 4, or else
the sum of an FSDP run's local shards over its ranks / 4 (shard padding makes this a
few bytes high). Theory assumes fp32 master weights and Adam (``optimizer=`` changes
that); see ``nbtrain.ui.theory``.
"""

from __future__ import annotations

import contextlib
import html
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..cells import mark_shown, shown_here
from ..telemetry.advice import advice_text, verdict
from ..telemetry.summary import Summary, scaling_of
from ..units import format_bytes, unit_for
from .palette import (
    HOST_CATEGORIES,
    category_label,
    category_marker,
    collective_color,
)
from .theory import CATEGORIES, FOOTNOTE, n_params_from_memory, theoretical_bytes

if TYPE_CHECKING:
    from ..run import Run

MEASURED = ("params", "grads", "optimizer", "activations", *HOST_CATEGORIES)
# Within these relative margins two runs are named as a tie: FSDP's shard padding puts
# equal memory a few bytes apart, and step times move by a few percent between runs.
MEMORY_TIE = 0.02
SPEED_TIE = 0.05


@dataclass
class Row:
    """One run's figures."""

    label: str
    strategy: str
    world_size: int
    memory: list[dict[str, int]]  # per rank, peak bytes by category
    step_time: float | None  # seconds, mean over ranks
    samples_per_s: float | None  # all ranks together
    comm: dict[str, float] = field(default_factory=dict)  # op -> bytes per step (rank 0)
    theory: dict[str, float] | None = None
    status: str = "done"
    chosen: Any = None  # the run's Strategy (or its name, for a run watched from afar)
    comm_share: float | None = None  # of a step, spent waiting on communication
    fn: str = ""  # the function's name: runs of the same one are compared for scaling
    accelerator: str = "cpu"
    metrics: dict[str, float] = field(default_factory=dict)  # rank 0's last ctx.log values
    summary: Summary | None = None  # the run's own (a speed-up is read from it)

    @property
    def model_bytes(self) -> int:
        """The most model state (params + grads + optimizer) any rank held."""
        return max((sum(m.get(c, 0) for c in CATEGORIES) for m in self.memory), default=0)

    @property
    def least_bytes(self) -> int:
        """The least model state any rank held."""
        return min((sum(m.get(c, 0) for c in CATEGORIES) for m in self.memory), default=0)

    @property
    def uneven(self) -> bool:
        """Ranks held model state more than ``MEMORY_TIE`` apart."""
        return bool(self.least_bytes) and self.model_bytes > self.least_bytes * (1 + MEMORY_TIE)

    def per_rank(self) -> str:
        """Model state per rank: one figure, or the range when the ranks differ."""
        if not self.model_bytes:
            return "-"
        if self.uneven:
            return f"{format_bytes(self.least_bytes)}–{format_bytes(self.model_bytes)}"
        return format_bytes(self.model_bytes)

    @property
    def host_bytes(self) -> int:
        """The most model state any rank kept in host memory (CPU offload on a GPU run)."""
        return max((sum(m.get(c, 0) for c in HOST_CATEGORIES) for m in self.memory), default=0)


def _names(rows: list[Row], name) -> str:
    labels = [name(r) for r in rows]
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def _verb(rows: list[Row], one: str, many: str) -> str:
    return one if len(rows) == 1 else many


def takeaway(rows: list[Row]) -> str:
    """One true sentence about ``rows``: which runs hold the least and the most model
    state per rank, and which have the highest and lowest throughput. Runs within
    ``MEMORY_TIE`` / ``SPEED_TIE`` of an extreme are named with it, as a tie; every run
    is named by its label in both halves (plus its rank count when the counts differ);
    throughput compares finished runs only."""
    measured = [r for r in rows if r.model_bytes]
    if not measured:
        return "No memory was measured (telemetry off, or no optimizer step ran)."
    mixed = len({r.world_size for r in rows}) > 1

    def name(r: Row) -> str:
        return f"{r.label} on {r.world_size} ranks" if mixed else r.label

    if len(rows) == 1:
        r = rows[0]
        rate = f", {r.samples_per_s:,.0f} samples/s" if r.samples_per_s else ""
        return f"{name(r)}: {format_bytes(r.model_bytes)} of model state per rank{rate}."
    low = min(measured, key=lambda r: r.model_bytes).model_bytes
    high = max(measured, key=lambda r: r.model_bytes).model_bytes
    if len(measured) == 1:
        text = f"{name(measured[0])}: {format_bytes(low)} of model state per rank"
    elif high <= low * (1 + MEMORY_TIE):
        text = (f"{_names(measured, name)} hold the same model state per rank "
                f"({format_bytes(low)})")
    else:
        least = [r for r in measured if r.model_bytes <= low * (1 + MEMORY_TIE)]
        most = [r for r in measured if r.model_bytes >= high / (1 + MEMORY_TIE)]
        text = (f"{_names(least, name)} {_verb(least, 'holds', 'hold')} {high / low:.1f}× "
                f"less model state per rank than {_names(most, name)} ({format_bytes(low)} vs "
                f"{format_bytes(high)})")
    timed = [r for r in rows if r.samples_per_s and r.status == "done"]
    if len(timed) > 1:
        fast = max(r.samples_per_s for r in timed)
        slow = min(r.samples_per_s for r in timed)
        if fast <= slow * (1 + SPEED_TIE):
            text += (f"; {_names(timed, name)} run at the same throughput (within "
                     f"{SPEED_TIE:.0%})")
        else:
            fastest = [r for r in timed if r.samples_per_s >= fast / (1 + SPEED_TIE)]
            slowest = [r for r in timed if r.samples_per_s <= slow * (1 + SPEED_TIE)]
            text += (f"; {_names(fastest, name)} {_verb(fastest, 'is', 'are')} the fastest, "
                     f"{fast / slow:.2f}× the throughput of {_names(slowest, name)}")
    return text + "."


class Comparison:
    def __init__(self, runs: list[Run], n_params: int | None = None, optimizer: str = "adam",
                 show_progress: bool = False, plan=None):
        for run in runs:
            if not hasattr(run, "history") or not hasattr(run, "strategy"):
                raise TypeError(f"compare() takes runs from nbtrain.launch(); got "
                                f"{type(run).__name__}.")
        if n_params is not None and (isinstance(n_params, bool) or not isinstance(n_params, int)
                                     or n_params < 1):
            raise ValueError(f"n_params={n_params!r} must be a positive parameter count.")
        self.runs = list(runs)
        self.optimizer = optimizer
        self.rows = self._rows(show_progress)
        self.n_params = n_params if n_params is not None else self._derive_n_params()
        for row in self.rows:
            if self.n_params:
                with contextlib.suppress(ValueError):  # a strategy without a theory line
                    row.theory = theoretical_bytes(row.chosen, self.n_params,
                                                   row.world_size, optimizer=optimizer,
                                                   precision="fp32")
        # nbtrain.plan()'s rows, where given, instead of the formulas (activations too)
        self.beside = "plan" if plan is not None else "theory"
        for row in self.rows if plan is not None else ():
            planned = next((p for p in plan.rows if p.strategy == row.chosen.name and
                            p.checkpointing == bool(row.chosen.activation_checkpointing)), None)
            row.theory = None if planned is None else {
                k: getattr(planned, k) for k in ("params", "grads", "optimizer", "activations")}

    def _rows(self, show_progress: bool = False) -> list[Row]:
        from .progress import Progress

        rows, seen = [], {}
        # Summarising many long histories takes a while: a line once it passes a second.
        for run in Progress(self.runs, "compare", delay=1.0, display=show_progress):
            summary: Summary = run.summary()
            label = run.strategy.summary() if hasattr(run.strategy, "summary") else str(run.strategy)
            seen[label] = seen.get(label, 0) + 1
            if seen[label] > 1:
                label = f"{label} #{seen[label]}"
            times = [r.step_time for r in summary.ranks if r.step_time]
            comm = {op: f["bytes"] for op, f in (summary.ranks[0].comm_per_step
                                                 if summary.ranks else {}).items()}
            rows.append(Row(label, getattr(run.strategy, "name", str(run.strategy)),
                            run.world_size, [dict(r.memory) for r in summary.ranks],
                            sum(times) / len(times) if times else None,
                            summary.samples_per_s or None, comm, status=run.status,
                            chosen=run.strategy, comm_share=summary.comm_share,
                            fn=getattr(run, "fn_name", ""),
                            accelerator=getattr(run, "accelerator", "cpu"),
                            metrics=dict(summary.ranks[0].metrics) if summary.ranks else {},
                            summary=summary))
        return rows

    def _derive_n_params(self) -> int | None:
        # a run that keeps the parameters whole says Ψ exactly; shards are padded
        ranked = sorted(self.rows, key=lambda r: "params" in getattr(r.chosen, "sharded",
                                                                     frozenset)())
        for row in ranked:
            if any(m.get("params") for m in row.memory):
                n = n_params_from_memory(row.chosen, [m.get("params", 0) for m in row.memory])
                if n:
                    return n
        return None

    # -- reading -----------------------------------------------------------------------
    def takeaway(self) -> str:
        return takeaway(self.rows)

    def metric_names(self) -> list[str]:
        """What every run logged (its last value on rank 0 goes beside the figures: the
        same loss under every strategy says the sharding changed nothing), at most 3."""
        first = self.rows[0].metrics if self.rows else {}
        return [n for n in first if all(n in r.metrics for r in self.rows)][:3]

    def table(self) -> str:
        host = any(r.host_bytes for r in self.rows)
        names = self.metric_names()
        header = ["strategy", "ranks", "model state/rank", *(["in host memory"] if host else []),
                  f"{self.beside}/rank", "step ms", "samples/s", "comm/step", "comm wait", *names]
        lines = [header]
        for r in self.rows:
            theory = sum(r.theory.values()) if r.theory else None
            lines.append([r.label, str(r.world_size), r.per_rank(),
                          *([format_bytes(r.host_bytes) if r.host_bytes else "-"] if host else []),
                          format_bytes(theory) if theory is not None else "-",
                          f"{r.step_time * 1000:.1f}" if r.step_time else "-",
                          f"{r.samples_per_s:,.0f}" if r.samples_per_s else "-",
                          format_bytes(sum(r.comm.values())) if r.comm else "-",
                          f"{r.comm_share:.0%}" if r.comm_share is not None else "-",
                          *(f"{r.metrics[n]:.4g}" for n in names)])
        widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
        out = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(out)

    def notes(self) -> list[str]:
        """Why ranks of one run held different amounts (the table shows the range; the
        takeaway compares each run's largest rank)."""
        out = []
        for r in self.rows:
            if not r.uneven:
                continue
            why = getattr(r.chosen, "uneven", "")
            why = f" {why}" if why else ""
            out.append(f"{r.label}: ranks held {format_bytes(r.least_bytes)} to "
                       f"{format_bytes(r.model_bytes)} of model state (the largest is "
                       f"compared).{why}")
        return out + self.scaling_notes()

    def scaling_notes(self) -> list[str]:
        """For each run on several ranks beside a one-rank run of the same function: its
        speed-up and scaling efficiency, and what would help when it does not pay."""
        out = []
        for r in self.rows:
            one = next((b for b in self.rows if b.world_size == 1 and b.fn == r.fn
                        and b.summary is not None), None)
            if r.world_size < 2 or one is None or r.summary is None:
                continue
            scaling = scaling_of(r.summary, one.summary)
            if scaling is None:
                continue
            fewer = r.chosen.fewer_bytes(r.accelerator) if hasattr(r.chosen, "fewer_bytes") \
                else []
            sentence, remedies = verdict(r.world_size, r.comm_share, None, scaling, fewer)
            out.append(f"{r.label}: {advice_text(sentence, remedies)}")
        return out

    def __str__(self) -> str:
        psi = f"Ψ = {self.n_params:,} parameters" if self.n_params else "Ψ unknown"
        notes = "".join(f"\n{n}" for n in self.notes())
        return (f"{self.table()}\n{self.takeaway()}{notes}\n({psi}; fp32 master weights, "
                f"{self.optimizer})")

    def __repr__(self) -> str:
        return str(self)

    def html(self) -> str:
        psi = f"Ψ = {self.n_params:,} parameters" if self.n_params else "Ψ unknown"
        return (f'<div style="font-family:sans-serif;font-size:13px"><b>'
                f'{html.escape(self.takeaway())}</b><pre style="font-size:12px">'
                f'{html.escape(self.table())}</pre>'
                + "".join(f'<div style="font-size:12px">{html.escape(n)}</div>'
                          for n in self.notes())
                + f'<small>{html.escape(psi)}. '
                f'{html.escape(FOOTNOTE)}</small></div>')

    def figure(self, height: int = 620):
        """Memory per rank by category (grouped stacked bars, theory beside), then step
        time, throughput and communication per step per strategy."""
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        biggest = max([max((sum(m.get(c, 0) for c in MEASURED) for m in r.memory), default=0)
                       for r in self.rows] + [sum(r.theory.values()) for r in self.rows if r.theory]
                      + [1])
        unit, size = unit_for(biggest)
        fig = make_subplots(rows=2, cols=3, specs=[[{"colspan": 3}, None, None], [{}, {}, {}]],
                            subplot_titles=[f"Memory per rank by category ({unit}): measured "
                                            f"vs {self.beside}", "Step time (ms)",
                                            "Throughput (samples/s, all ranks)",
                                            "Communication per step (MB)"],
                            vertical_spacing=0.18, horizontal_spacing=0.08)
        groups, bars = [], []
        for r in self.rows:
            for rank, _ in enumerate(r.memory):
                groups.append(r.label)
                bars.append(f"rank {rank}")
            if r.theory:
                groups.append(r.label)
                bars.append(self.beside)
        for cat in MEASURED:
            ys = []
            for r in self.rows:
                ys += [m.get(cat, 0) / size for m in r.memory]
                if r.theory:
                    ys.append(r.theory.get(cat, 0) / size)
            if not any(ys):
                continue
            fig.add_trace(go.Bar(x=[groups, bars], y=ys, name=category_label(cat),
                                 marker=category_marker(cat),
                                 hovertemplate=f"%{{x}}<br>{category_label(cat)}: %{{y:.3g}} {unit}"
                                               "<extra></extra>"), row=1, col=1)
        labels = [r.label for r in self.rows]
        fig.add_trace(go.Bar(x=labels, y=[(r.step_time or 0) * 1000 for r in self.rows],
                             name="step time", showlegend=False, marker_color="#72B7B2"),
                      row=2, col=1)
        fig.add_trace(go.Bar(x=labels, y=[r.samples_per_s or 0 for r in self.rows],
                             name="samples/s", showlegend=False, marker_color="#EECA3B"),
                      row=2, col=2)
        for op in sorted({op for r in self.rows for op in r.comm}):
            fig.add_trace(go.Bar(x=labels, y=[r.comm.get(op, 0) / 2**20 for r in self.rows],
                                 name=op, legendgroup="comm",
                                 marker_color=collective_color(op)), row=2, col=3)
        fig.update_yaxes(title_text=unit, row=1, col=1)
        fig.update_yaxes(title_text="ms", row=2, col=1)
        fig.update_yaxes(title_text="samples/s", row=2, col=2)
        fig.update_yaxes(title_text="MB per step", row=2, col=3)
        # No title: the takeaway is the line above the figure wherever it is shown
        # (html(), the report, the picker); printed in the figure too, it read twice.
        fig.update_layout(barmode="stack", height=height, template="plotly_white",
                          margin={"l": 50, "r": 20, "t": 40, "b": 40})
        return fig

    def bundles(self) -> list[dict]:
        from .static import figure_bundle

        out = [{"text/html": self.html(), "text/plain": str(self)}]
        if self.rows:
            out.append(figure_bundle(self.figure(), self.takeaway()))
        return out

    def _ipython_display_(self) -> None:
        from IPython.display import display

        if shown_here(self):
            return

        for bundle in self.bundles():
            display(bundle, raw=True)


def compare(*runs: Run, n_params: int | None = None, optimizer: str = "adam",
            display: bool = True, plan=None) -> Comparison:
    """Compare finished runs: memory by category per rank beside theory, step time,
    throughput, communication per step, and a one-line takeaway.

    ``n_params``: the model's parameter count Ψ for the theory bars (default: derived
    from a DDP run's measured parameter bytes, else an FSDP run's). ``display=False``
    returns the ``Comparison`` without showing it (``.figure()``, ``.table()``,
    ``.takeaway()``). ``plan``: an ``nbtrain.plan()`` of the same function, whose rows
    (activations too) go beside each run instead of the formulas.
    """
    if len(runs) == 1 and isinstance(runs[0], (list, tuple)):
        runs = tuple(runs[0])
    if not runs:
        raise ValueError("compare() needs at least one run: nbtrain.compare(run_a, run_b).")
    unfinished = [r for r in runs if not getattr(r, "done", True)]
    if unfinished:
        raise ValueError(f"{len(unfinished)} run(s) are still going; compare finished runs "
                         "(call run.wait() first).")
    result = Comparison(list(runs), n_params=n_params, optimizer=optimizer,
                        show_progress=display, plan=plan)
    if display:
        try:
            from IPython import get_ipython

            if get_ipython() is not None:
                result._ipython_display_()
                mark_shown(result)
            else:
                print(result)
        except ImportError:
            print(result)
    return result
