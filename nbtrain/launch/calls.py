"""How ``launch(fn, *args, **kwargs)`` calls ``fn``, decided in the kernel before anything
starts.

Whether ``fn`` takes ``ctx``: a function written for nbtrain takes it first
(``def train(ctx, lr)``); one written for torchrun or ``notebook_launcher`` does not
(``def main():``, ``def main(cfg):``) and is called as it is. The arguments decide: ``fn``
takes ``ctx`` when ``fn(ctx, *args, **kwargs)`` fits its signature and ``fn(*args,
**kwargs)`` does not, and is called without it in the opposite case. When both fit
(``def f(*args)``, defaults everywhere), a first parameter named ``ctx`` (or annotated
``Context``) means it takes ``ctx``. When neither fits, ``launch()`` fails with the
signature.

Where each keyword goes: to ``fn`` when its signature names it; else to the strategy
when it is one of the strategy's options (``activation_checkpointing="auto"``,
``mixed_precision="bf16"``, ``wrap=``, ``sync_batchnorm=True``, ...); else to ``fn`` when it
takes ``**kwargs``; else ``launch()`` fails, saying where it could go.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import warnings
from typing import Any

from ..rank.worker import CallWithoutCtx
from ..strategies import Strategy, get

_NOT_OPTIONS = ("name", "start_method")


def rank_argv() -> tuple[str, ...] | None:
    """The command line the ranks' code reads (argparse, transformers' HfArgumentParser):
    a kernel's own (``-f`` and its connection file) means nothing to it, and argparse
    stopped there ("unrecognized arguments: -f .../kernel-....json", SystemExit: 2). In
    a kernel the ranks see its program alone, as a script run without arguments; a
    command line a cell set (``sys.argv = ["train.py", "--lr", "0.1"]``) stays theirs.
    None: leave ``sys.argv`` as it is (no kernel)."""
    app = sys.modules.get("ipykernel.kernelapp")
    if app is None or not app.IPKernelApp.initialized():
        return None
    connection = os.path.basename(app.IPKernelApp.instance().connection_file or "")
    if not connection or not any(connection in arg for arg in sys.argv[1:]):
        return None
    return tuple(sys.argv[:1])


def options_of(strategy: Strategy) -> list[str]:
    return [f.name for f in dataclasses.fields(strategy) if f.name not in _NOT_OPTIONS]


def bind(who: str, fn, args: tuple, kwargs: dict, strategy: Strategy
         ) -> tuple[Any, dict, Strategy]:
    """``(what the workers call with ctx first, its keyword arguments, the strategy with
    the options given to launch())``."""
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: pass everything on
        return fn, kwargs, strategy
    params = signature.parameters
    named = {n for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    own, options = {}, {}
    known = options_of(strategy)
    for key, value in kwargs.items():
        if key in named:
            own[key] = value
        elif key in known or (key == "precision" and "mixed_precision" in known):
            options[key] = value  # precision: Lightning's name for mixed_precision
        elif takes_any:
            own[key] = value
        else:
            raise TypeError(
                f"{who}: {name}{signature} takes no argument {key!r}, and it is not an "
                f"option of strategy {strategy.name!r} (those are: {', '.join(known)}). "
                f"Pass it to {name} by adding it to its parameters, or give the strategy "
                f"one of its options.")
    if options:
        strategy = get(strategy, **options)
    with_ctx = _fits(signature, (None, *args), own)
    without = _fits(signature, args, own)
    if with_ctx and without:
        first = next(iter(params.values()), None)
        with_ctx = first is not None and first.kind is not first.VAR_POSITIONAL and (
            first.name == "ctx" or getattr(first.annotation, "__name__", first.annotation)
            in ("Context", "nbtrain.Context"))
    elif not with_ctx and not without:
        given = ", ".join([*(repr(a) for a in args), *(f"{k}=..." for k in own)])
        raise TypeError(
            f"{who}: {name}{signature} cannot be called with ({given}), with or without "
            f"ctx first. nbtrain calls fn(ctx, *args, **kwargs) for a function that takes "
            f"ctx, and fn(*args, **kwargs) for one that does not; give {who} the "
            f"arguments {name} takes.")
    return (fn if with_ctx else CallWithoutCtx(fn)), own, strategy


def given(api, **values: Any) -> dict[str, Any]:
    """Of ``values`` (``api``'s own keywords as it received them), those passed with
    something other than ``api``'s default."""
    params = inspect.signature(api).parameters

    def default(key, value):
        d = params[key].default
        return value is d or (type(value) is type(d) and value == d) or (
            isinstance(value, (list, tuple)) and not value and not d)

    return {k: v for k, v in values.items() if not default(k, v)}


def warn_shadowed(who: str, fn, given: dict[str, Any]) -> None:
    """``given``: the keywords of ``who``'s own (``timeout``, ``seed``, ``devices``, ...)
    passed with a value. When ``fn`` has a parameter of the same name it never receives
    that value (``who`` takes it), and it would silently keep its default: say so."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    name = getattr(fn, "__name__", type(fn).__name__)
    for key, value in given.items():
        p = params.get(key)
        if p is None or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        keeps = ("keeps its default " + repr(p.default) if p.default is not p.empty
                 else "gets no value")
        warnings.warn(
            f"{who}: {key}={value!r} is {who}'s own option, so {name}'s parameter {key!r} "
            f"does not receive it ({name} {keeps}). To give {name} a {key}, bind it first "
            f"(functools.partial({name}, {key}=...)) or rename the parameter.",
            RuntimeWarning, stacklevel=3)


def _fits(signature: inspect.Signature, args: tuple, kwargs: dict) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True
