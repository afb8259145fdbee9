"""``nbtrain.scaling()``: does a function train faster on N devices than on one? It runs
the function on one device, then on N, and returns the N-device run measured against
the one-device run: its summary says the speed-up, the scaling efficiency, where the step
time went, and, when more devices do not pay, why and what would help
(``telemetry/advice.py``: like for like, in samples when they are counted, steady state,
a superlinear result flagged). On CPU ranks the one-device run gets the threads one of
the N ranks gets, so the figure is what N ranks add, not one process on every core
against N on a share each. A short function (less than ``STEADY_SECONDS`` of steady
steps a side) is measured again, one device and N alternately, and the rounds pooled:
on a shared machine one round of a few dozen short steps is a sample of the neighbours
as much as of the code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .launch import launch, options
from .launch.starting.devices import parse_devices, threads_as_one_of
from .run import Run
from .telemetry.advice import MAX_ROUNDS, STEADY_SECONDS

_FIXED = {"background": (False, "it runs its two launches one after the other.")}


@options.takes_run_options(fixed=_FIXED)
def scaling(fn: Callable[..., Any], *args: Any, devices: int | str | list[int] = "auto",
            accelerator: str = "auto", rounds: int | None = None, **kwargs: Any) -> Run:
    """Run ``fn(ctx, *args, **kwargs)`` on one device, then on ``devices``; returns the
    second run with ``run.baseline`` set to the first, so ``run.summary()`` (and the
    summary shown when the run ends) compares them. ``rounds``: how many times to run
    the two, alternately (the later rounds without a dashboard or sinks, in
    ``run.rounds``), their steps pooled; by default one, or up to five while either
    side has less than 2 s of steady steps (``telemetry/advice.py``). The run's options
    (each run's), as ``launch()``'s:

        {run options}

    For example::

        run = nbtrain.scaling(train, devices=2)
        run.summary().scaling.speedup       # e.g. 0.83: two ranks were slower than one
        print(run.summary().advice)          # the verdict, and what would help
    """
    given, _ = options.split("scaling()", kwargs, _FIXED)
    options.RunOptions.check(given)  # a bad option fails before the baseline starts
    if rounds is not None and (type(rounds) is not int or rounds < 1):
        raise ValueError(f"scaling(rounds={rounds!r}): give a whole number, 1 or more, or "
                         f"None (the default: more rounds only while a side has less than "
                         f"{STEADY_SECONDS:g} s of steady steps, {MAX_ROUNDS} at most).")
    plan = parse_devices(devices, accelerator)
    if plan.world_size < 2:
        raise ValueError(f"scaling() compares several devices with one, and devices="
                         f"{devices!r} gives {plan.world_size}: give devices=2 or more.")
    one = [plan.indices[0]] if plan.accelerator == "cuda" else 1

    def both(opts: dict) -> tuple[Run, Run]:
        # on CPU ranks, one of the N: its share of the cores, not the whole machine's
        with threads_as_one_of(plan.world_size):
            # (a plan, planned=, is of the N ranks: the baseline is not what it planned)
            alone = {k: v for k, v in opts.items() if k != "planned"}
            baseline = launch(fn, *args, devices=one, accelerator=plan.accelerator, **alone)
        return baseline, launch(fn, *args, devices=devices, accelerator=plan.accelerator,
                                **opts)

    baseline, run = both(kwargs)
    run.baseline = baseline
    quiet = {**kwargs, "dashboard": False, "sinks": ()}
    while more_rounds(1 + len(run.rounds), measured := _measured(run), rounds):
        if not run.rounds:
            print(f"nbtrain.scaling(): {measured:.2f} s of steady steps a side; "
                  f"measuring again, one device and {plan.world_size} alternately "
                  f"(up to {(rounds or MAX_ROUNDS) - 1} more rounds)", flush=True)
        run.rounds.append(both(quiet))
    return run


def _measured(run: Run) -> float:
    """Seconds of steady steps on the side with fewer, over every round so far."""
    sides = ([run.baseline, *(b for b, _ in run.rounds)], [run, *(n for _, n in run.rounds)])
    summaries = [[r.summary() for r in side] for side in sides]
    return min(sum(d for s in side for d, _ in s.ranks[rank].steady)
               for side in summaries for rank in range(len(side[0].ranks)))


def more_rounds(done: int, measured: float, rounds: int | None) -> bool:
    """Whether to run the pair again after ``done`` rounds that measured ``measured``
    seconds of steady steps on their shorter side: ``rounds`` if given, else while under
    ``STEADY_SECONDS`` and ``MAX_ROUNDS`` (never when no step was measured: nothing to
    pool)."""
    if rounds is not None:
        return done < rounds
    return done < MAX_ROUNDS and 0 < measured < STEADY_SECONDS
