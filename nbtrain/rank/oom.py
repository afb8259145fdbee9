"""What a rank knows when its device runs out of memory, said with the error.

"CUDA out of memory. Tried to allocate 512.00 MiB" is the most common failure on a 16 GB
T4, and torch's message says nothing about what filled the memory. The rank does know:
the model, optimizers and strategy ``ctx.setup`` gave it (their bytes by category, read
from the tensors as the dashboard's memory chart is), and the allocator's figures. So the
failure carries, as its hint, this rank's memory at that moment by category, and the
remedies ranked by what each would save here: sharding what the strategy keeps whole
(``fsdp`` holds 1/N of parameters, gradients and optimizer state), offloading them
(``fsdp_offload``), recomputing activations (``activation_checkpointing="auto"``), half
precision, a smaller batch.
"""

from __future__ import annotations

import torch

from ..telemetry.probes import memory_by_category
from ..units import format_bytes


def out_of_memory(exc: BaseException) -> bool:
    """Is ``exc`` a device running out of memory (torch's own error, or its message as
    an older torch or another library words it)?"""
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None),
                              getattr(torch.cuda, "OutOfMemoryError", None)) if k)
    return isinstance(exc, kinds) or (isinstance(exc, RuntimeError) and
                                      "CUDA out of memory" in str(exc))


def diagnose(ctx) -> str:
    """The hint for an out-of-memory failure on ``ctx``'s rank (a best effort: a rank
    short of memory must still report)."""
    try:
        return _diagnose(ctx)
    except Exception as err:  # the measurement itself failed: say the essentials
        return (f"nbtrain: rank {ctx.rank} ran out of memory on {ctx.device} (its memory "
                f"could not be measured: {type(err).__name__}: {err}).")


def _diagnose(ctx) -> str:
    model, optimizers, device = ctx._model, ctx._optimizers, ctx.device
    held = memory_by_category(model, optimizers, device) if model is not None else {}
    state = {k: held.get(k, 0) for k in ("params", "grads", "optimizer")}
    figures = []
    total = sum(state.values())
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
        capacity = torch.cuda.get_device_properties(device).total_memory
        rest = max(0, allocated - total)
        figures.append(f"allocator: {format_bytes(allocated)} allocated, peak "
                       f"{format_bytes(peak)}, of {format_bytes(capacity)} on the device")
        total = max(total, allocated)
    else:
        rest = 0
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
    parts = [f"{names[k]} {format_bytes(v)} ({v / total:.0%})" for k, v in state.items()
             if v and total]
    if rest:
        parts.append(f"activations and temporaries {format_bytes(rest)} ({rest / total:.0%})")
    lines = [f"nbtrain: rank {ctx.rank} ran out of memory on {ctx.device} under "
             f"{ctx.strategy.summary()}."]
    if parts:
        lines.append("Held at that moment: " + ", ".join(parts) +
                     (f"; {figures[0]}." if figures else "."))
    elif figures:
        lines.append(f"At that moment: {figures[0]} (no model was set up with ctx.setup).")
    remedies = _remedies(ctx, state, rest)
    if remedies:
        lines.append("What would help here, the most first:")
        lines += [f"  - {text}" for _, text in remedies]
    return "\n".join(lines)


def _remedies(ctx, state: dict[str, int], rest: int) -> list[tuple[float, str]]:
    """(bytes it would save, advice), most first."""
    n = ctx.world_size
    strategy = ctx.strategy
    whole = [k for k in ("params", "grads", "optimizer") if k not in strategy.sharded()]
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
    out: list[tuple[float, str]] = []
    if n > 1 and whole and any(state[k] for k in whole):
        saved = sum(state[k] for k in whole) * (1 - 1 / n)
        what = ", ".join(f"{names[k]} ({format_bytes(state[k])})" for k in whole if state[k])
        out.append((saved, f"strategy='fsdp': each of the {n} ranks holds 1/{n} of the "
                           f"{what} it keeps whole now; about {format_bytes(saved)} less "
                           "here"))
    model_state = sum(state.values())
    if ctx.device.type == "cuda" and model_state:  # (offloaded state is not on the device)
        out.append((model_state * (1 - 1 / max(n, 1)) if n > 1 else model_state * 0.9,
                    f"strategy='fsdp_offload': parameters, gradients and optimizer state in "
                    f"host memory (the GPU keeps what one layer needs); up to "
                    f"{format_bytes(model_state)} less here, at the cost of speed"))
    if rest:
        if not strategy.activation_checkpointing:
            out.append((rest * 0.6, f"activation_checkpointing='auto': recompute each block's "
                                    f"activations in backward instead of keeping them (most "
                                    f"of {format_bytes(rest)} here)"))
        if strategy.mixed_precision is None:
            out.append((rest * 0.4, "mixed_precision='bf16' (on T4s 'fp16'): activations in "
                                    "half precision, about half of them"))
        out.append((rest * 0.5, f"a smaller batch per rank (activations grow with it: half "
                                f"the batch, about {format_bytes(rest / 2)} less), with "
                                f"ctx.accumulate to keep the global batch"))
    elif ctx.device.type != "cuda":  # no allocator to say what else filled the memory
        out.append((0.0, "activation_checkpointing='auto' or a smaller batch per rank, if "
                         "activations are what fills it (not measured on the CPU)"))
    if n == 1 and model_state:
        out.append((0.0, "more devices: with devices=N and strategy='fsdp' each holds 1/N "
                         "of the model's state"))
    return sorted(out, key=lambda item: -item[0])
