"""``nbtrain.bandwidth()``: what the link between the ranks gives, measured as nccl-tests
measures it: an all-reduce of each message size, timed over several iterations after a
warm-up, on the backend a launch would use (NCCL on GPUs, gloo on CPUs).

For each size: the time of one all-reduce (the slowest rank's mean), the *algorithm
bandwidth* (bytes / time) and the *bus bandwidth* (algorithm bandwidth × 2(n-1)/n: what
each link carries in a ring all-reduce, comparable across rank counts and with the
hardware's figure). Small messages show the latency, large ones the ceiling.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .launch import launch
from .launch.starting.devices import parse_devices
from .units import format_bytes

DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(0, 9))  # 1 KB .. 64 MB


def _sweep(ctx, sizes: list[int], iters: int, warmup: int) -> list[tuple[int, float]]:
    """Runs in each rank: (bytes, seconds per all-reduce, the slowest rank's) per size."""
    on_gpu = ctx.device.type == "cuda"
    out = []
    for size in sizes:
        buffer = torch.ones(max(1, size // 4), dtype=torch.float32, device=ctx.device)
        for _ in range(warmup):
            dist.all_reduce(buffer)
        if on_gpu:
            torch.cuda.synchronize(ctx.device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buffer)
        if on_gpu:
            torch.cuda.synchronize(ctx.device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64,
                               device=ctx.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        out.append((buffer.numel() * 4, float(elapsed.item())))
        del buffer
    return out


@dataclass(frozen=True)
class Row:
    bytes: int
    seconds: float  # one all-reduce, the slowest rank's mean
    algbw: float  # bytes per second
    busbw: float  # bytes per second


@dataclass(frozen=True)
class Bandwidth:
    """An all-reduce sweep: ``rows`` by size, ``peak_busbw`` (bytes/s), and where it ran."""

    rows: tuple[Row, ...]
    world_size: int
    backend: str
    device: str

    @property
    def peak_busbw(self) -> float:
        return max(r.busbw for r in self.rows)

    @property
    def latency(self) -> float:
        """Seconds of the smallest message's all-reduce: the link's fixed cost per call."""
        return min(self.rows, key=lambda r: r.bytes).seconds

    def seconds_for(self, nbytes: float) -> float:
        """The time an all-reduce of ``nbytes`` takes here, read off the sweep (linear
        between the sizes measured; beyond the largest, at its bandwidth)."""
        rows = sorted(self.rows, key=lambda r: r.bytes)
        if nbytes <= rows[0].bytes:
            return rows[0].seconds
        for a, b in zip(rows, rows[1:], strict=False):
            if nbytes <= b.bytes:
                f = (nbytes - a.bytes) / (b.bytes - a.bytes)
                return a.seconds + f * (b.seconds - a.seconds)
        return nbytes / rows[-1].algbw

    def _table(self) -> list[tuple[str, ...]]:
        return [(format_bytes(r.bytes), f"{r.seconds * 1e6:.1f}", f"{r.algbw / 1e9:.3f}",
                 f"{r.busbw / 1e9:.3f}") for r in self.rows]

    def _title(self) -> str:
        return (f"all-reduce on {self.device} ({self.backend}): "
                f"peak bus bandwidth {self.peak_busbw / 1e9:.2f} GB/s, "
                f"{self.latency * 1e6:.0f} µs for the smallest message")

    def __repr__(self) -> str:
        head = ("size", "time us", "algbw GB/s", "busbw GB/s")
        rows = [head, *self._table()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join([self._title(), *lines])

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:right'>{h}</th>"
                       for h in ("size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)"))
        body = "".join("<tr>" + "".join(f"<td style='text-align:right'>{c}</td>" for c in row)
                       + "</tr>" for row in self._table())
        return (f"<table class='nbtrain-bandwidth'><caption style='text-align:left'>"
                f"{html.escape(self._title())}</caption><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table>")

    def figure(self):
        """Bus bandwidth by message size (log scale), as a plotly figure."""
        import plotly.graph_objects as go

        x = [r.bytes for r in self.rows]
        fig = go.Figure(go.Scatter(
            x=x, y=[r.busbw / 1e9 for r in self.rows], mode="lines+markers",
            name="bus bandwidth", customdata=[r.seconds * 1e6 for r in self.rows],
            hovertemplate="%{x:.3s}B: %{y:.3g} GB/s (%{customdata:.1f} µs)<extra></extra>"))
        fig.update_layout(title=self._title(), template="plotly_white", height=360,
                          xaxis={"type": "log", "title": "message size (bytes)"},
                          yaxis={"title": "GB/s", "rangemode": "tozero"})
        return fig


def bandwidth(devices: int | str | list[int] = "auto", accelerator: str = "auto",
              sizes: tuple[int, ...] | list[int] | None = None, iters: int = 20,
              warmup: int = 5, start_method: str = "auto",
              timeout: float | None = 300) -> Bandwidth:
    """Measure the all-reduce bandwidth between ``devices`` ranks over message ``sizes``
    (bytes; by default 1 KB to 64 MB, ×4 each), ``iters`` timed all-reduces per size.

        bw = nbtrain.bandwidth(devices=2)
        bw                 # a table: size, time, algorithm and bus bandwidth
        bw.figure()        # bus bandwidth by size
        bw.peak_busbw      # bytes/s, the ceiling this machine reached
    """
    if sizes is None:
        sizes = DEFAULT_SIZES
    sizes = list(sizes)
    if not sizes or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 4
                            for s in sizes):
        raise ValueError(f"sizes={sizes!r}: give message sizes in bytes, each an int >= 4.")
    for name, value, low in (("iters", iters, 1), ("warmup", warmup, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}.")
    plan = parse_devices(devices, accelerator)
    if plan.world_size < 2:
        raise ValueError(f"bandwidth() measures the link between ranks, and devices="
                         f"{devices!r} gives {plan.world_size}: give devices=2 or more.")
    run = launch(_sweep, sorted(sizes), iters, warmup, devices=devices,
                 accelerator=accelerator, start_method=start_method,
                 telemetry=False, dashboard=False, timeout=timeout)
    n = run.world_size
    factor = 2 * (n - 1) / n
    rows = tuple(Row(b, s, b / s, b / s * factor) for b, s in run.results[0])
    where = f"{n} {'GPUs' if run.accelerator == 'cuda' else 'CPU processes'}"
    return Bandwidth(rows, n, "nccl" if run.accelerator == "cuda" else "gloo", where)
