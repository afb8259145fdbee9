"""The one registry of strategy names. The dropdown, the docs and the error for an
unknown name all read it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Strategy
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp import FSDP
from .zero import Zero1

if TYPE_CHECKING:
    from ..deviceplan import DevicePlan


@dataclass(frozen=True)
class Entry:
    name: str
    make: Callable[..., Strategy]
    description: str
    alias: bool = False  # another name for a listed one (Lightning's): not in the picker


_REGISTRY: dict[str, Entry] = {}
_CLASSES: dict[type[Strategy], None] = {}  # each registered strategy class once, in order


def register(name: str, make: Callable[..., Strategy], description: str,
             alias: bool = False) -> None:
    if name in _REGISTRY:
        raise ValueError(f"strategy {name!r} is registered already.")
    _REGISTRY[name] = Entry(name, make, description, alias)
    cls = getattr(make, "cls", make)
    if isinstance(cls, type) and issubclass(cls, Strategy):
        _CLASSES[cls] = None


def names(aliases: bool = True) -> list[str]:
    """Every registered name; ``aliases=False``: without Lightning's other spellings
    (``ddp_fork``, ``ddp_find_unused_parameters_true``, ...), as the picker lists them."""
    return [e.name for e in _REGISTRY.values() if aliases or not e.alias]


def describe(aliases: bool = False) -> dict[str, str]:
    """``{name: one-sentence description}`` for the registered strategies (with
    Lightning's other spellings when ``aliases``)."""
    return {e.name: e.description for e in _REGISTRY.values() if aliases or not e.alias}


def unavailable(plan: DevicePlan, names_: list[str] | None = None) -> dict[str, str]:
    """``{name: why}`` for the registered strategies (or ``names_``) whose ``check``
    refuses ``plan``, e.g. ``fsdp_offload`` on CPU. What a picker leaves out, and why."""
    why = {}
    for name in names_ if names_ is not None else names():
        try:
            get(name).check(plan)
        except (ValueError, TypeError) as err:
            why[name] = str(err)
    return why


def get(strategy: str | Strategy, **options) -> Strategy:
    """A configured strategy from a registered name (or a ``Strategy`` as it is).

    ``options`` are the strategy's fields, e.g. ``mixed_precision="bf16"`` or, for FSDP,
    ``wrap=(Block,)``; ``precision=`` (Lightning's name, with its values such as
    ``"16-mixed"``) is ``mixed_precision``.
    """
    if "precision" in options:
        if "mixed_precision" in options:
            raise TypeError("give precision= or mixed_precision=, not both (they are one "
                            "setting).")
        options["mixed_precision"] = options.pop("precision")
    if isinstance(strategy, Strategy):
        return dataclasses.replace(strategy, **options) if options else strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy={strategy!r}: give a name from {names()} or a Strategy.")
    entry = _REGISTRY.get(strategy.lower())
    if entry is None:
        raise ValueError(f"unknown strategy {strategy!r}; known strategies: "
                         f"{', '.join(names(aliases=False))} (and Lightning's other "
                         f"spellings: strategies.names()).")
    try:
        return entry.make(name=entry.name, **options)
    except TypeError as err:
        fields = [f.name for f in dataclasses.fields(entry.make(name=entry.name))
                  if f.name not in ("name", "start_method")]
        raise TypeError(f"strategy {entry.name!r} got an unknown option ({err}); its options "
                        f"are: {', '.join(fields)}.") from None


def _variant(cls: type[Strategy], **fixed) -> Callable[..., Strategy]:
    def make(**options) -> Strategy:
        return cls(**{**fixed, **options})

    make.cls = cls
    return make


@functools.cache
def _hooks(cls: type[Strategy]) -> Strategy:
    return cls()


def owner_of(obj) -> Strategy:
    """The strategy whose hooks handle ``obj``, a model or an optimizer: the one whose
    own object it is (DeepSpeed's engine and its optimizer), else torch's way, the base
    ``Strategy``'s hooks, which serve DDP, FSDP, ZeRO-1 and a plain model alike. For
    code that holds the object but not the run's strategy (checkpoints, telemetry)."""
    for cls in _CLASSES:
        if cls.owns(obj):
            return _hooks(cls)
    return _hooks(Strategy)


def release() -> None:
    """After a run in a warm worker: each strategy lets go of what it kept."""
    for cls in _CLASSES:
        _hooks(cls).release()


register("ddp", DDP, DDP.description)
register("ddp_notebook", _variant(DDP, start_method="fork"),
         "DDP started by forking the kernel: fastest to start, and sees every object "
         "defined in the notebook.")
register("ddp_spawn", _variant(DDP, start_method="spawn"),
         "DDP in freshly spawned processes: safe when CUDA is already initialised in the "
         "kernel, slower to start.")
register("ddp_fork", _variant(DDP, start_method="fork"), "Lightning's name for ddp_notebook.",
         alias=True)
# Lightning's names for DDP told (or not) to look for parameters without a gradient
for _base, _method in (("ddp", None), ("ddp_notebook", "fork"), ("ddp_fork", "fork"),
                       ("ddp_spawn", "spawn")):
    for _find in (True, False):
        register(f"{_base}_find_unused_parameters_{str(_find).lower()}",
                 _variant(DDP, start_method=_method, find_unused_parameters=_find),
                 f"{_base} with find_unused_parameters={_find}"
                 + (": for models where some parameters get no gradient on some steps "
                    "(a mixture of experts, a branch not taken)." if _find else "."),
                 alias=True)
register("zero1", Zero1, Zero1.description)
register("fsdp", FSDP, FSDP.description)
register("fsdp_grad_op", _variant(FSDP, reshard_after_forward=False),
         "FSDP that keeps gathered parameters from forward until backward (ZeRO-2 "
         "behaviour): gradients and optimizer state sharded, less communication than full "
         "sharding, more memory.")
register("fsdp_hybrid", _variant(FSDP, hybrid=True),
         "Hybrid sharding on a 2-D device mesh: shard within groups of ranks, replicate "
         "across groups (all-reduce between replicas).")
register("fsdp_offload", _variant(FSDP, offload=True),
         "Full sharding with parameters, gradients and optimizer state kept in CPU memory, "
         "moved to the GPU only when used (CUDA only).")
register("deepspeed", _variant(DeepSpeed, stage=2), DeepSpeed.description)
register("deepspeed_stage_1", _variant(DeepSpeed, stage=1),
         "DeepSpeed ZeRO stage 1: optimizer state sharded (needs nbtrain[deepspeed]).")
register("deepspeed_stage_2", _variant(DeepSpeed, stage=2),
         "DeepSpeed ZeRO stage 2: gradients and optimizer state sharded (needs "
         "nbtrain[deepspeed]).", alias=True)
register("deepspeed_stage_2_offload", _variant(DeepSpeed, stage=2, offload_optimizer=True),
         "DeepSpeed ZeRO stage 2 with the optimizer state in CPU memory (needs "
         "nbtrain[deepspeed]).")
register("deepspeed_stage_3", _variant(DeepSpeed, stage=3),
         "DeepSpeed ZeRO stage 3: parameters, gradients and optimizer state sharded (needs "
         "nbtrain[deepspeed]).")
register("deepspeed_stage_3_offload",
         _variant(DeepSpeed, stage=3, offload_optimizer=True, offload_parameters=True),
         "DeepSpeed ZeRO stage 3 with parameters and optimizer state in CPU memory (needs "
         "nbtrain[deepspeed]).")
