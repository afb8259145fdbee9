"""A run's options, defined once: ``launch()``, ``RankPool.launch()``, ``scaling()``,
``submit()`` and the ``StrategyPicker`` take them alike.

Each option is a field of ``RunOptions``: its name, its default, what it means (the text
``help()`` shows), and its check in ``RunOptions.check``. The entry points take the
options in ``**kwargs`` and say so in their signature (``takes_run_options`` writes it,
and their docstrings' ``{run options}`` line); ``split`` picks them out of a call's
keywords, the rest being the function's own. A new option is a field here (and its check)
plus its use: nothing else spells it. An entry point that decides an option itself (the
picker's strategy, ``submit``'s background) names it in ``fixed`` with the reason, and a
different value given there fails with that reason.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
from typing import Any

from .. import seeding
from ..run import DASHBOARDS
from ..strategies import Strategy
from ..telemetry.settings import Telemetry

MARK = "{run options}"  # the line of an entry point's docstring the options' texts replace


def _option(default: Any, doc: str, ranks: bool = False) -> Any:
    """A field of ``RunOptions``: ``ranks``, it travels to ranks that run ``launch()``
    themselves (torchrun's, a submitted job's: ``RunOptions.for_ranks``)."""
    return dataclasses.field(default=default, metadata={"doc": " ".join(doc.split()),
                                                        "ranks": ranks})


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run goes, whatever starts its ranks (checked by ``check``)."""

    strategy: str | Strategy = _option("ddp", """a registered name
        (``nbtrain.strategies.names()``) or a Strategy, e.g.
        ``nbtrain.strategies.get("fsdp", mixed_precision="bf16")``.""")
    background: bool = _option(False, """return the ``Run`` at once instead of blocking
        until it ends.""")
    timeout: float | None = _option(None, """seconds after which the run is ended
        (restarts included) and an error names the ranks still running (a hang in a
        collective, for instance).""")
    telemetry: bool | Telemetry = _option(True, """what ranks stream to ``run.history``:
        ``True`` (metrics, step times, memory by category every 10 steps, communication
        per step), ``False`` (nothing), or ``nbtrain.Telemetry(memory_every=...,
        comm=...)``.""", ranks=True)
    sinks: tuple = _option((), """extra outputs that receive the events (objects with
        ``on_events(events)`` and ``close(run)``; see ``nbtrain.telemetry.sinks``).""")
    dashboard: bool | str = _option("auto", """the run's live view in the cell.
        ``"auto"``/``True``: the live widget dashboard where a widget frontend is
        connected (JupyterLab, Notebook 7), a static figure refreshed every few seconds in
        other kernels (nbclient, VS Code or Colab without widgets), text progress in a
        terminal; ``"widget"``, ``"static"``, ``"text"`` force one; ``False`` shows nothing.
        The environment variable ``NBTRAIN_DASHBOARD`` (same values, or ``off``) overrides
        ``"auto"``.""")
    resume: str | os.PathLike | None = _option(None, """a checkpoint written by
        ``ctx.save``; every rank finds it in ``ctx.resume_from`` (None without it) and goes
        on from it with ``ctx.load(ctx.resume_from, state)``.""", ranks=True)
    seed: int | None = _option(None, """the base seed (0 to 2**32 - 1). Rank r seeds torch,
        ``random`` and numpy with ``seed + r`` before ``fn`` runs, after fork and spawn
        alike, and ``ctx.dataloader`` shuffles with ``seed`` on every rank. None
        (default): a fresh base seed per launch (``run.seed`` keeps it; pass it to repeat
        the run) and shuffling with seed 0. Seeding inside ``fn`` overrides it, as
        usual.""", ranks=True)
    max_restarts: int = _option(0, """when a rank dies (a signal such as the OOM killer's,
        an exit without returning, a collective that timed out), end every rank and start
        again, on the same devices, up to this many times; each attempt finds the last
        checkpoint that can resume in ``ctx.resume_from`` (``ctx.checkpoint_every``'s, or
        ``ctx.save(..., resume=True)``; else the one given as ``resume``, or None). An
        exception raised by ``fn`` is not retried. The same ``Run`` goes on;
        ``run.attempts`` lists the restarts.""")
    collective_timeout: float | None = _option(None, """seconds a collective may wait
        before the process group ends it (a rank that stopped answering: the others' wait
        ends in a communication error, which ``max_restarts`` retries). None: 600 s, or
        with ``timeout=`` a share of it that leaves the restarts their time (``timeout /
        (max_restarts + 1)``, 60 to 600 s). A value below the slowest first collective
        (a model built on rank 0 alone, an evaluation on one rank) ends healthy runs.""",
        ranks=True)
    planned: Any = _option(None, """what ``nbtrain.plan()`` said of this function on these
        devices: the run's summary puts the plan's row for its strategy beside what the
        ranks measured, and the dashboard's memory panel marks the planned model state
        per rank.""")

    @classmethod
    def check(cls, given: dict[str, Any]) -> RunOptions:
        """The options as given, checked (the strategy is bound to the function by
        ``start.check``, which knows which keywords are its): a bad value fails here,
        before anything starts, saying what to give instead."""
        options = cls(**given)
        timeout, restarts = options.timeout, options.max_restarts
        if timeout is not None and (isinstance(timeout, bool)
                                    or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
        if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
            raise ValueError(f"max_restarts={restarts!r} must be an int >= 0 (how many times "
                             "a run whose rank died starts again).")
        if options.dashboard not in DASHBOARDS:
            raise ValueError(f"dashboard={options.dashboard!r}: use 'auto' (the default), "
                             "True, False, or force one view: 'widget', 'static' or 'text'.")
        if not isinstance(options.background, bool):
            raise TypeError(f"background={options.background!r}: give True or False.")
        wait = options.collective_timeout
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float))
                                 or wait <= 0):
            raise ValueError(f"collective_timeout={wait!r} must be a positive number of "
                             "seconds (or None: chosen from timeout= and max_restarts).")
        planned = options.planned
        if planned is not None and not (callable(getattr(planned, "row", None))
                                         and hasattr(planned, "world_size")):
            raise TypeError(f"planned={type(planned).__name__}: give what nbtrain.plan() "
                            "returned for this function.")
        if options.seed is not None:
            seeding.base_seed(options.seed)  # raises for a seed out of range
        return dataclasses.replace(options, telemetry=Telemetry.from_arg(options.telemetry),
                                   sinks=tuple(options.sinks),
                                   resume=_resume_path(options.resume))

    def for_ranks(self) -> dict[str, Any]:
        """The options a rank that runs ``launch()`` itself takes from the kernel's (a
        submitted job's: the launcher's own, the view and the sinks stay here)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunOptions)
                if f.metadata.get("ranks")}


NAMES = tuple(f.name for f in dataclasses.fields(RunOptions))


def split(who: str, kwargs: dict[str, Any],
          fixed: dict[str, tuple[Any, str]] | None = None) -> tuple[dict[str, Any], dict]:
    """A call's keywords as (the run options given, the function's own). An option
    ``fixed`` by ``who`` given with another value fails with the reason."""
    given = {k: v for k, v in kwargs.items() if k in NAMES}
    for name, (value, reason) in (fixed or {}).items():
        if name in given and given[name] != value:
            raise ValueError(f"{who} does not take {name}={given[name]!r}: {reason}")
    return given, {k: v for k, v in kwargs.items() if k not in NAMES}


def takes_run_options(fixed: dict[str, tuple[Any, str]] | None = None):
    """Decorate an entry point whose ``**kwargs`` take the run options (less ``fixed``):
    its signature (``help()``, Shift+Tab, ``inspect``) lists them as keywords with their
    defaults, and its docstring's ``{run options}`` line becomes their texts."""
    fixed = fixed or {}

    def decorate(api):
        sig = inspect.signature(api)
        params = list(sig.parameters.values())
        rest = [p for p in params if p.kind is p.VAR_KEYWORD]
        own = [p for p in params if p.kind is not p.VAR_KEYWORD]
        taken = [f for f in dataclasses.fields(RunOptions)
                 if f.name not in fixed and f.name not in sig.parameters]
        added = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                                   annotation=f.type) for f in taken]
        api.__signature__ = sig.replace(parameters=own + added + rest)
        if api.__doc__ and MARK in api.__doc__:
            api.__doc__ = "\n".join(_documented(line, taken) if line.strip() == MARK
                                    else line for line in api.__doc__.split("\n"))
        api.run_options = tuple(f.name for f in taken)
        return api

    return decorate


def _documented(line: str, fields) -> str:
    indent = line[:len(line) - len(line.lstrip())]
    return "\n".join(textwrap.fill(f"{f.name}: {f.metadata['doc']}", 88,
                                   initial_indent=indent, subsequent_indent=indent + "    ")
                     for f in fields)


def _resume_path(resume) -> str | None:
    if resume is None:
        return None
    from ..checkpoint import exists  # (torch.distributed.checkpoint: only when asked)

    if not isinstance(resume, (str, os.PathLike)):
        raise TypeError(f"resume={resume!r}: give the path of a checkpoint written by ctx.save.")
    path = os.path.abspath(os.fspath(resume))
    if not exists(path):
        raise ValueError(f"resume={os.fspath(resume)!r}: no checkpoint there (ctx.save writes "
                         "a directory with a .metadata file, or one file with full=True). "
                         "Start without resume=, or check nbtrain.checkpoint.exists(path).")
    return path
