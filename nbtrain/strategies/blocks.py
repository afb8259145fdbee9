"""What a model's blocks are, without a class name from the user, and which parameters
it ties together.

The blocks of a model are what FSDP wraps as units and what activation checkpointing
recomputes. In order:

1. the model's own declaration: transformers models (and others that follow it) list
   their block classes in ``_no_split_modules``;
2. else the repeated block: the class of modules made of other modules whose
   instances sit in a ``ModuleList``, ``ModuleDict`` or ``Sequential`` at least twice
   and hold the most parameters (a ResNet's ``BasicBlock``, a ViT's ``Block``; not a
   plain ``Linear`` of an MLP);
3. else none (FSDP falls back to its size rule).

Tied parameters (GPT-2's ``wte`` and ``lm_head`` share one weight) must live in one FSDP
unit: ``untie_units`` drops any unit that holds a tied parameter without every module
that holds it, so the parameter goes to the unit around them all (often the root).
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def declared(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The block classes the model declares (``_no_split_modules``), those it has."""
    names: set[str] = set()
    for m in model.modules():
        found = getattr(m, "_no_split_modules", None)
        if found:
            names.update(found)
    if not names:
        return ()
    classes: dict[str, type[nn.Module]] = {}
    for m in model.modules():
        if m is not model and type(m).__name__ in names:
            classes.setdefault(type(m).__name__, type(m))
    return tuple(classes.values())


def repeated(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The class repeated in the model's containers that holds the most parameters."""
    count: dict[type, int] = defaultdict(int)
    size: dict[type, int] = defaultdict(int)
    for m in model.modules():
        if not isinstance(m, _CONTAINERS):
            continue
        for child in m.children():
            if isinstance(child, _CONTAINERS) or not any(True for _ in child.children()) \
                    or not any(True for _ in child.parameters()):
                continue
            count[type(child)] += 1
            size[type(child)] += sum(p.numel() for p in child.parameters())
    candidates = [c for c, n in count.items() if n >= 2]
    if not candidates:
        return ()
    best = max(candidates, key=lambda c: size[c])
    return (best,)


def find(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The model's block classes (declared, else repeated); ``()`` when it has none."""
    return declared(model) or repeated(model)


def describe(classes: tuple[type[nn.Module], ...]) -> str:
    return ", ".join(c.__name__ for c in classes)


def tied(model: nn.Module) -> dict[int, list[nn.Module]]:
    """``{id(parameter): modules that register it}`` for parameters held by more than
    one module (tied weights)."""
    owners: dict[int, list[nn.Module]] = defaultdict(list)
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and m not in owners[id(p)]:
                owners[id(p)].append(m)
    return {k: v for k, v in owners.items() if len(v) > 1}


def untie_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """``units`` without those that would split a tied parameter from another of its
    modules (FSDP refuses a parameter managed by two units)."""
    ties = tied(model)
    if not ties:
        return units
    kept = list(units)
    while True:
        bad = []
        for unit in kept:
            inside = set(map(id, unit.modules()))
            for owners in ties.values():
                held = [o for o in owners if id(o) in inside]
                if held and len(held) < len(owners):
                    bad.append(unit)
                    break
        if not bad:
            return kept
        kept = [u for u in kept if u not in bad]
