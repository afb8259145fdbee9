"""Bytes of model state one rank holds, as theory predicts — the ZeRO tables.

For Ψ parameters trained in fp32 with Adam (two fp32 moments), every rank of DDP keeps
4Ψ bytes of parameters, 4Ψ of gradients and 8Ψ of optimizer state. Sharding over N ranks
divides what is sharded by N:

    strategy            params    grads     optimizer   (ZeRO stage)
    ddp                 4Ψ        4Ψ        8Ψ          0
    zero1               4Ψ        4Ψ        8Ψ/N        1
    fsdp_grad_op        4Ψ        4Ψ/N      8Ψ/N        2
    fsdp                4Ψ/N      4Ψ/N      8Ψ/N        3
    fsdp_hybrid         divide by the shard group's size instead of N
    fsdp_offload        ~0 on the GPU: the sharded state lives in CPU memory
    deepspeed_stage_N   as ZeRO stage N, plus DeepSpeed's fp32 master partition (4Ψ/N)
                        with the optimizer

What a measurement shows differs from the table, on purpose or by nature (see
``FOOTNOTE``): FSDP pads each shard to a multiple of N, keeps the root module's own
parameters in the root unit, and gathers whole parameters for a while during each step;
nbtrain's ``fsdp_grad_op`` (FSDP2 with ``reshard_after_forward=False``) stores its
parameters sharded between steps and keeps the gathered copy only from forward to
backward, so the bytes measured after the optimizer step are 4Ψ/N, the ZeRO-2 row is the
in-step figure. nbtrain's DDP keeps its gradients as views into the all-reduce buckets
(``gradient_as_bucket_view``), so the buckets are the 4Ψ of gradients; torch's default
DDP keeps the buckets beside the gradients, another 4Ψ from backward to the step.
"""

from __future__ import annotations

# Bytes per parameter of (params, grads) for a precision; the optimizer's states are
# kept in the parameters' dtype.
_PRECISION_BYTES = {"fp32": 4, "mixed": 4, "bf16": 2, "fp16": 2}
# Optimizer states per parameter.
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1, "rmsprop": 1,
                     "adagrad": 1}

CATEGORIES = ("params", "grads", "optimizer")

FOOTNOTE = (
    "Theory: fp32 master weights with Adam: 4Ψ params + 4Ψ grads + 8Ψ optimizer state per "
    "rank, what is sharded divided by N (ZeRO stages 1-3). Measured after each optimizer "
    "step from the tensors themselves. They differ because FSDP pads shards to a multiple "
    "of N and keeps the root's own parameters in one unit; fsdp_grad_op stores params "
    "sharded between steps and holds the whole copy only from forward to backward (the "
    "theory bar is that in-step figure); nbtrain's DDP keeps its gradients as views into "
    "its all-reduce buckets (torch's default DDP keeps both, 4Ψ more); activations are not "
    "model state; fsdp_offload keeps the sharded state in CPU memory; DeepSpeed keeps an "
    "fp32 master partition (4Ψ/N, with the optimizer) and frees whole gradients once "
    "reduced, so its grads are the partition it steps on.")


def known() -> list[str]:
    """The strategies with a theory line: every registered one, and ``"single"`` (one
    process, nothing shared)."""
    from .. import strategies

    return ["single", *strategies.names()]


def _strategy(strategy):
    """A Strategy from a name or a Strategy; None for ``"single"``."""
    from .. import strategies

    if strategy == "single":
        return None
    if isinstance(strategy, str):
        if strategy.lower() not in strategies.names():
            raise ValueError(f"no theory for strategy {strategy!r}; known: "
                             f"{', '.join(known())}.")
        return strategies.get(strategy.lower())
    return strategy


def theoretical_bytes(strategy, n_params: int, world_size: int,
                      optimizer: str = "adam", precision: str = "fp32",
                      shard_size: int | None = None) -> dict[str, float]:
    """``{"params", "grads", "optimizer"}``: bytes one rank holds in theory.

    Args:
        strategy: a strategy (``run.strategy``) or its name (``known()``), e.g.
            ``"ddp"``, ``"fsdp"``; each strategy gives its own row (``Strategy.theory``).
        n_params: Ψ, the model's parameter count.
        world_size: N, the number of ranks.
        optimizer: ``"adam"``/``"adamw"`` (2 states), ``"sgd"`` (none),
            ``"sgd_momentum"``, ``"rmsprop"``, ``"adagrad"`` (1 state).
        precision: ``"fp32"`` or ``"mixed"`` (fp32 master weights; 4 bytes), ``"bf16"``
            or ``"fp16"`` (parameters stored in half precision; 2 bytes).
        shard_size: ranks per shard group, for a hybrid strategy given by name (default:
            the largest proper divisor of N, as nbtrain's hybrid strategy picks).
    """
    chosen = _strategy(strategy)
    if isinstance(n_params, bool) or not isinstance(n_params, int) or n_params < 0:
        raise TypeError(f"n_params={n_params!r} must be a parameter count (int >= 0).")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1.")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r}; known: {', '.join(_OPTIMIZER_STATES)}.")
    if precision not in _PRECISION_BYTES:
        raise ValueError(f"precision={precision!r}; known: {', '.join(_PRECISION_BYTES)}.")
    width = _PRECISION_BYTES[precision]
    full = {"params": width * n_params, "grads": width * n_params,
            "optimizer": _OPTIMIZER_STATES[optimizer] * width * n_params}
    if chosen is None:
        return {k: float(v) for k, v in full.items()}
    if shard_size is not None and hasattr(chosen, "shard_size"):
        import dataclasses

        chosen = dataclasses.replace(chosen, shard_size=shard_size)
    return chosen.theory(full, world_size, n_params)


def n_params_from_memory(strategy, params_bytes_per_rank: list[int],
                         precision: str = "fp32") -> int | None:
    """Ψ from measured parameter bytes: a replicated strategy's (DDP) bytes on one rank,
    or the sum of a sharded strategy's local shards over ranks (padding makes this a
    slight overestimate), divided by the bytes per parameter. None when it cannot tell."""
    try:
        chosen = _strategy(strategy)
    except ValueError:
        return None
    if not params_bytes_per_rank:
        return None
    width = _PRECISION_BYTES.get(precision, 4)
    world = len(params_bytes_per_rank)
    if chosen is not None and not chosen.theory(dict.fromkeys(CATEGORIES, 1.0), world,
                                                1)["params"]:
        return None  # its parameters live in host memory (offload)
    if chosen is None or "params" not in chosen.sharded():
        return round(params_bytes_per_rank[0] / width)
    if chosen.shards(world) != world:
        return None  # replicas hold the same shards; the sum would count them twice
    return round(sum(params_bytes_per_rank) / width)
