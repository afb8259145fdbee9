"""``nbtrain.scaling()``: does a function train faster on N devices than on one? It runs
the function on one device, then on N, and returns the N-device run measured against
the one-device run: its summary says the speed-up, the scaling efficiency, where the step
time went, and, when more devices do not pay, why and what would help
(``telemetry/advice.py``: like for like, in samples when they are counted, steady state,
a superlinear result flagged). On CPU ranks the one-device run gets the threads one of
the N ranks gets, so the figure is what N ranks add, not one process on every core
against N on a share each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .launch import launch, options
from .launch.starting.devices import parse_devices, threads_as_one_of
from .run import Run

_FIXED = {"background": (False, "it runs its two launches one after the other.")}


@options.takes_run_options(fixed=_FIXED)
def scaling(fn: Callable[..., Any], *args: Any, devices: int | str | list[int] = "auto",
            accelerator: str = "auto", **kwargs: Any) -> Run:
    """Run ``fn(ctx, *args, **kwargs)`` on one device, then on ``devices``; returns the
    second run with ``run.baseline`` set to the first, so ``run.summary()`` (and the
    summary shown when the run ends) compares them. The run's options (both runs'), as
    ``launch()``'s:

        {run options}

    For example::

        run = nbtrain.scaling(train, devices=2)
        run.summary().scaling.speedup       # e.g. 0.83: two ranks were slower than one
        print(run.summary().advice)          # the verdict, and what would help
    """
    given, _ = options.split("scaling()", kwargs, _FIXED)
    options.RunOptions.check(given)  # a bad option fails before the baseline starts
    plan = parse_devices(devices, accelerator)
    if plan.world_size < 2:
        raise ValueError(f"scaling() compares several devices with one, and devices="
                         f"{devices!r} gives {plan.world_size}: give devices=2 or more.")
    one = [plan.indices[0]] if plan.accelerator == "cuda" else 1
    # on CPU ranks, one of the N: its share of the cores, not the whole machine's
    with threads_as_one_of(plan.world_size):
        # (a plan, planned=, is of the N ranks: the baseline is not what it planned)
        alone = {k: v for k, v in kwargs.items() if k != "planned"}
        baseline = launch(fn, *args, devices=one, accelerator=plan.accelerator, **alone)
    run = launch(fn, *args, devices=devices, accelerator=plan.accelerator, **kwargs)
    run.baseline = baseline
    return run
