"""The dashboard's and compare()'s colours and styles: one colour per rank, palettes for
memory categories, collectives and the phases of a step that share no colour with the
ranks, and the byte units that keep numbers readable."""

from __future__ import annotations

PHASE_COLORS = {"data": "#A6761D", "forward": "#7FC97F", "backward": "#BEAED4",
                "optimizer": "#FDC086", "comm": "#E7298A", "other": "#D9D9D9"}
PHASE_LABELS = {"data": "data loading", "optimizer": "optimizer step",
                "comm": "communication (waited)"}
# Model state in host memory on a GPU run (FSDP's CPU offload): drawn hatched, "(host)".
HOST_CATEGORIES = ("params_host", "grads_host", "optimizer_host")
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", *HOST_CATEGORIES)
CUDA_CATEGORIES = ("cuda_allocated", "cuda_reserved", "cuda_peak")
# Ranks: strong colours; categories and collectives: softer or darker ones of other hues.
RANK_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2",
               "#17becf", "#bcbd22")
CATEGORY_COLORS = {"params": "#8DA0CB", "grads": "#FC8D62", "optimizer": "#66C2A5",
                   "activations": "#E5C494", "cuda_allocated": "#A6D854",
                   "cuda_reserved": "#B3B3B3", "cuda_peak": "#FFD92F"}
CATEGORY_COLORS.update({f"{c}_host": CATEGORY_COLORS[c] for c in ("params", "grads",
                                                                   "optimizer")})


def category_label(cat: str) -> str:
    """``params_host`` -> ``params (host)``; others as they are."""
    return cat.removesuffix("_host") + " (host)" if cat.endswith("_host") else cat


def category_marker(cat: str) -> dict:
    """The bar marker of a memory category: its colour, hatched when in host memory."""
    marker: dict = {"color": CATEGORY_COLORS[cat]}
    if cat.endswith("_host"):
        marker["pattern"] = {"shape": "/"}
    return marker


COLLECTIVE_COLORS = ("#4D4D4D", "#E69F00", "#0072B2", "#CC79A7", "#7F3B08", "#35978F")
DASHES = ("solid", "dot", "dash", "dashdot", "longdash")


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


# One colour, dash and marker per collective, by name, in the live view and in compare():
# two collectives that move the same bytes per step (zero1's all_reduce and broadcast,
# fsdp_grad_op's all_gather and reduce_scatter) draw one line on the other, and the
# dashes and markers keep both visible.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
               "reduce", "gather", "scatter", "send", "recv", "barrier")
COLLECTIVE_SYMBOLS = ("circle", "diamond", "square", "x", "triangle-up", "star")


def _collective_index(op: str) -> int:
    if op in COLLECTIVES:
        return COLLECTIVES.index(op)
    return len(COLLECTIVES) + sum(map(ord, op))  # others: stable, not by arrival


def collective_color(op: str) -> str:
    return COLLECTIVE_COLORS[_collective_index(op) % len(COLLECTIVE_COLORS)]


def collective_style(op: str) -> dict:
    """A collective's line: its colour, dash and marker."""
    i = _collective_index(op)
    return {"line": {"color": collective_color(op), "dash": DASHES[i % len(DASHES)]},
            "marker": {"symbol": COLLECTIVE_SYMBOLS[i % len(COLLECTIVE_SYMBOLS)], "size": 7},
            "mode": "lines+markers"}
