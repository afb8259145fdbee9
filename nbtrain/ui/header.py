"""The dashboard's header and error panel as small HTML strings (and their text twins).

Status per rank as coloured badges (a failed rank is red, with its error below),
progress (steps, epoch when logged as a metric, elapsed, ETA when the step count is
known: the run's total steps), and what the run used: strategy, devices, start method.
"""

from __future__ import annotations

import html

from .state import LiveState

STATUS_COLORS = {"starting": "#9e9e9e", "running": "#1e88e5", "done": "#43a047",
                 "failed": "#e53935", "stopped": "#fb8c00"}


def _badge(text: str, status: str) -> str:
    color = STATUS_COLORS.get(status, "#9e9e9e")
    return (f'<span style="background:{color};color:white;border-radius:3px;'
            f'padding:1px 6px;margin-right:4px;font-size:12px">{html.escape(text)}</span>')


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_parts(state: LiveState, total_steps: int | None = None) -> list[str]:
    steps = max(state.steps.values(), default=0)
    epoch, epoch_steps, planned = state.plan
    total_steps = total_steps or planned or None
    parts = [f"step {steps}" + (f"/{total_steps}" if total_steps else "")]
    logged_epoch = (state.last_metrics.get(0) or {}).get("epoch")
    if epoch_steps:
        done_in_epoch = state.last_step + 1 - epoch * epoch_steps
        parts.append(f"epoch {epoch + 1} ({max(done_in_epoch, 0)}/{epoch_steps})")
    elif logged_epoch is not None:
        parts.append(f"epoch {logged_epoch:g}")
    parts += state.evaluation_part()
    parts.append(f"elapsed {_duration(state.elapsed)}")
    # An ETA only for the run's total (ctx.total_steps, or what the dataloader plans):
    # the end of an epoch said little, and a short epoch read "ETA 0s" all along.
    left = total_steps - steps if total_steps else 0
    busy = state.busy.get(0, 0.0)
    timed = max(state.steps.get(0, 0) - 1, 0)  # the first (warm-up) step is not timed
    if left > 0 and timed and state.outcome is None:
        parts.append(f"ETA {_duration(left * busy / timed)}")
    rate = sum(r for k in state.ranks if (r := state.samples_per_s(k)))
    if rate:
        parts.append(f"{rate:,.0f} samples/s")
    return parts


def header_html(state: LiveState, total_steps: int | None = None) -> str:
    """Call with ``state.lock`` held or on a state no one updates."""
    overall = state.overall
    badges = "".join(_badge(f"rank {r}: {state.status.get(r, 'starting')}",
                            state.status.get(r, "starting")) for r in state.ranks)
    info = state.info
    used = " · ".join(html.escape(x) for x in (
        info.get("strategy", ""), info.get("devices", ""),
        f"start: {info['start_method']}" if info.get("start_method") else "") if x)
    per_rank = ", ".join(f"r{r} {s:,.0f}/s" for r in state.ranks
                         if (s := state.samples_per_s(r)))
    return (f'<div style="font-family:sans-serif;font-size:13px;line-height:1.6">'
            f'<b>nbtrain</b> {html.escape(info.get("fn", ""))} {_badge(overall, overall)} '
            f'{used}<br>{badges}<br>{" · ".join(progress_parts(state, total_steps))}'
            + (f" ({per_rank})" if per_rank else "") + "</div>")


def error_html(state: LiveState) -> str:
    if not state.errors and not state.error:
        return ""
    blocks = []
    for rank, detail in sorted(state.errors.items()):
        lines = detail.strip().splitlines()
        text = "\n".join(lines[-15:])
        blocks.append(f"<b>rank {rank} failed</b><pre style=\"white-space:pre-wrap;"
                      f"margin:2px 0\">{html.escape(text)}</pre>")
    if not blocks:
        blocks.append(f"<pre style=\"white-space:pre-wrap\">{html.escape(state.error or '')}</pre>")
    return ('<div style="border:2px solid #e53935;background:#ffebee;color:#b71c1c;'
            f'padding:6px;font-size:12px">{"".join(blocks)}</div>')


def header_text(state: LiveState) -> str:
    lines = [state.progress_line()]
    for rank, detail in sorted(state.errors.items()):
        last = detail.strip().splitlines()[-1] if detail.strip() else ""
        lines.append(f"  rank {rank} failed: {state.briefs.get(rank) or last}")
    return "\n".join(lines)


def twin_style(live: str, twin: str) -> str:
    """A style for a widget (CSS class ``live``) followed by static outputs that stand in
    for it once its kernel is gone (the first one marked with class ``twin``): in
    JupyterLab and Notebook 7 the twins stay hidden while the widget renders, and where
    it cannot ("model not found" after a restart) the widget's error is hidden instead."""
    return f"""<style>
.jp-OutputArea:has(.{live}) > .jp-OutputArea-child:has(.{twin}),
.jp-OutputArea:has(.{live}) > .jp-OutputArea-child:has(.{twin})
  ~ .jp-OutputArea-child {{ display: none; }}
.jp-OutputArea:not(:has(.{live})):has(.{twin})
  > .jp-OutputArea-child:has(> .jupyter-widgets) {{ display: none; }}
</style>"""
