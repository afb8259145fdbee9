"""``nbtrain.StrategyPicker(fn, devices=2)``: choose a strategy, run it, watch it, compare.

A dropdown of the registered strategies that can run on the accelerator (its description
below it, with the options that apply: mixed precision, CPU offload; the strategies left
out are listed with the reason their ``check`` gave), Run and Stop buttons, the live dashboard of the
current run and the comparison of every run made here. Runs go in the background, so
the buttons stay live; the dropdown only matters when Run is pressed, so changing it
during a run does not touch that run. The comparison is a static figure in an Output
widget (its outputs set as data, never drawn from a ``with`` block), so the page holds one
live figure.
"""

from __future__ import annotations

import dataclasses
import html
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import strategies
from ..cells import mark_shown, shown_here
from ..launch import launch, options
from ..units import format_bytes
from .compare import Comparison
from .header import twin_style

if TYPE_CHECKING:
    from ..run import Run

PRECISIONS = [("fp32", "fp32"), ("bf16 mixed", "bf16"), ("fp16 mixed", "fp16")]
# A saved notebook keeps the picker as a widget, which has no model once the kernel is
# gone ("model not found"). Its outputs after the widget are a static twin (what ran, the
# last run's charts and the comparison, updated after each run); while the picker
# renders, this style hides the twin, and where the widget cannot render, it hides the
# widget's error instead. A page open when the kernel goes retires the widget's output
# (keeper.py), so the file saved from it has no error to hide.
TWIN_STYLE = twin_style("nbtrain-picker", "nbtrain-twin")
# the run options the picker decides itself, with why
_FIXED = {"strategy": ("ddp", "the dropdown chooses it (strategies_shown= lists which)."),
          "background": (True, "its runs go in the background, so Stop stays live."),
          "dashboard": ("auto", "it shows the live dashboard of each run itself.")}


class StrategyPicker:
    """A dropdown of strategies with Run and Stop, the live dashboard of the run it
    started, and, once two or more runs have finished, their comparison (memory by
    category beside the ZeRO formulas, step time, throughput, communication)::

        picker = nbtrain.StrategyPicker(train, devices=2, lr=3e-4)

    ``fn``, ``*args``, ``devices`` and ``**kwargs`` are what ``nbtrain.launch`` takes; each
    Run launches them in the background with the chosen strategy, precision and offload,
    and the run's options given here (``timeout=``, ``seed=``, ``sinks=``, ...; the
    strategy, ``background`` and ``dashboard`` are the picker's own).
    Only the strategies that can run on the devices are offered (``not_offered`` says why
    the others are not). From code: ``picker.start("fsdp")``, ``picker.stop()``,
    ``picker.runs`` (every run started, in order), ``picker.run`` (the current or last).
    After a kernel restart its cell still shows its last run's charts and comparison.
    ``gpu="T4"`` (a name, or bytes; on CUDA the visible GPU by default): before Run, each
    strategy's planned peak per rank (``nbtrain.plan``), the ones that will not fit
    marked, and why (``picker.memory``: the plan).
    """

    @options.takes_run_options(fixed=_FIXED)
    def __init__(self, fn: Callable[..., Any], *args: Any, devices: int | str | list[int] = "auto",
                 strategies_shown: list[str] | None = None, display: bool = True,
                 gpu: str | float | None = None, **kwargs: Any):
        if not callable(fn):
            raise TypeError(f"StrategyPicker() takes the training function first; got "
                            f"{type(fn).__name__}.")
        given, _ = options.split("StrategyPicker()", kwargs, _FIXED)
        options.RunOptions.check(given)  # a bad option fails here, not at Run
        kwargs = {k: v for k, v in kwargs.items() if k not in _FIXED}
        from .dashboard import require_widgets

        widgets = require_widgets()
        names = strategies_shown or strategies.names(aliases=False)
        unknown = [n for n in names if n not in strategies.names()]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}; known: {strategies.names()}.")
        from ..launch.starting.devices import parse_devices

        # Offer only what can run here; the rest is listed with the reason.
        self.plan = parse_devices(devices, kwargs.get("accelerator", "auto"))
        self.not_offered = strategies.unavailable(self.plan, names)
        names = [n for n in names if n not in self.not_offered]
        if not names:
            raise ValueError(f"none of the strategies asked for can run on "
                             f"{self.plan.world_size}×{self.plan.accelerator}: "
                             f"{self.not_offered}. Choose others from "
                             f"{strategies.names()}.")
        self.fn, self.args, self.kwargs, self.devices = fn, args, kwargs, devices
        # nbtrain.plan()'s answer for the device (gpu=, or the visible GPU), else None;
        # one per precision chosen in the dropdown, made when it is first chosen
        self._gpu, self._names = gpu, names
        self._plans: dict[str, tuple] = {"fp32": self._memory_plan(gpu, names)}
        self.memory, planned = self._plans["fp32"]
        self.runs: list[Run] = []  # every run started here, in order
        self.run: Run | None = None  # the current (or last) one
        self.dashboard = None
        self._compared = threading.Event()  # set once the comparison shows the last run
        self._compared.set()
        self._descriptions = strategies.describe(aliases=True)
        self.dropdown = widgets.Dropdown(
            options=[(self._label(n), n) for n in names] if self.memory else names,
            value=names[0], description="strategy")
        self.precision = widgets.Dropdown(options=PRECISIONS, value="fp32",
                                          description="precision")
        self.offload = widgets.Checkbox(value=False, description="offload to CPU", indent=False)
        # N ranks, or one (the baseline the comparison measures scaling against)
        n = self.plan.world_size
        self.ranks = widgets.Dropdown(options=[(f"{n} ranks", n), ("1 rank", 1)]
                                      if n > 1 else [("1 rank", 1)], value=n,
                                      description="ranks", layout={"width": "150px"})
        self.run_button = widgets.Button(description="Run", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger",
                                          icon="stop", disabled=True)
        self.description = widgets.HTML()
        self.unavailable = widgets.HTML(self._not_offered_html())
        self.message = widgets.HTML(planned)
        self.live = widgets.VBox([])
        self.comparison_title = widgets.HTML()  # shown with the first comparison
        self.comparison_text = widgets.HTML()
        self.comparison_figure = widgets.Output()
        self.widget = widgets.VBox([
            widgets.HBox([self.dropdown, self.precision, self.ranks, self.offload,
                          self.run_button, self.stop_button]),
            self.description, self.unavailable, self.message, self.live,
            self.comparison_title, self.comparison_text, self.comparison_figure])
        self.widget.add_class("nbtrain-picker")
        self.dropdown.observe(lambda _: self._describe(), names="value")
        self.precision.observe(lambda _: self._replan(), names="value")
        self.run_button.on_click(lambda _: self._click_run())
        self.stop_button.on_click(lambda _: self._click_stop())
        self._describe()
        self._handles = None
        if display:
            from .keeper import KeptDisplay  # anywidget, with the widgets (not on import)

            # the static twin: see TWIN_STYLE; the widget's output is retired with the
            # kernel (keeper.py)
            self._handles = (KeptDisplay(self.widget), *(KeptDisplay(bundle, raw=True)
                                                  for bundle in self.static_bundles()))
            mark_shown(self)

    # -- actions -----------------------------------------------------------------------
    def start(self, strategy: str | None = None, ranks: int | None = None) -> Run:
        """Start a run of the chosen (or given) strategy in the background, on every
        device or (``ranks=1``) one, the baseline the comparison measures the speed-up
        and scaling efficiency against; returns the run."""
        if self.run is not None and not self.run.done:
            raise RuntimeError("a run is going; press Stop (or picker.stop()) before "
                               "starting another.")
        from .dashboard import Dashboard

        name = strategy or self.dropdown.value
        if name in self.not_offered:
            raise ValueError(f"{name!r} cannot run here: {self.not_offered[name]}")
        if strategy is not None and strategy in self.dropdown.options:
            self.dropdown.value = strategy
        if ranks is not None:
            if ranks not in (1, self.plan.world_size):
                raise ValueError(f"ranks={ranks!r}: the picker runs on "
                                 f"{self.plan.world_size} ranks or on 1.")
            self.ranks.value = ranks
        devices = self.devices if self.ranks.value > 1 else (
            [self.plan.indices[0]] if self.plan.accelerator == "cuda" else 1)
        options = self._options(name)
        chosen = strategies.get(name, **options)
        dashboard = Dashboard(display=False)
        kwargs = dict(self.kwargs)
        sinks = [*kwargs.pop("sinks", ()), dashboard]
        if "planned" not in kwargs and self._plan_is_of(chosen, options):
            kwargs["planned"] = self.memory  # its summary and memory panel show the plan
        run = launch(self.fn, *self.args, devices=devices, strategy=chosen,
                     background=True, dashboard=False, sinks=sinks, **kwargs)
        dashboard.bind(run)
        self.run, self.dashboard = run, dashboard
        self.runs.append(run)
        self.live.children = [dashboard.widget]
        self.stop_button.disabled = False
        self.message.value = ""
        self._compared = threading.Event()
        threading.Thread(target=self._watch, args=(run,), name="nbtrain-picker",
                         daemon=True).start()
        return run

    def stop(self) -> None:
        """Stop the current run (it stays in the comparison with what it logged)."""
        if self.run is not None:
            self.run.stop(reason="stopped from the strategy picker")

    def wait(self, timeout: float | None = None) -> None:
        """Block until the current run ends and the comparison shows it."""
        run = self.run
        if run is None:
            return
        try:
            run.wait(timeout)
        except Exception:
            pass
        self._compared.wait(timeout)

    def comparison(self) -> Comparison | None:
        done = [r for r in self.runs if r.done and len(r.history)]
        return Comparison(done) if done else None

    # -- widget plumbing ---------------------------------------------------------------
    def _plan_is_of(self, chosen, options: dict) -> bool:
        """Whether the plan shown before Run is of this run: its ranks, its strategy, its
        precision (the dropdown's), no offload asked for beside the row's."""
        if self.memory is None or self.ranks.value != self.memory.world_size or \
                set(options) - {"mixed_precision"}:
            return False
        try:
            self.memory.row(chosen.name, bool(chosen.activation_checkpointing))
        except KeyError:
            return False
        return True

    def _options(self, name: str) -> dict:
        options: dict[str, Any] = {}
        fields = self._fields(name)
        if "mixed_precision" in fields and self.precision.value != "fp32":
            options["mixed_precision"] = self.precision.value
        if "offload" in fields and self.offload.value and not self.offload.disabled:
            options["offload"] = True
        return options

    @staticmethod
    def _fields(name: str) -> set[str]:
        try:
            return {f.name for f in dataclasses.fields(strategies.get(name))}
        except Exception:
            return set()

    def _describe(self) -> None:
        name = self.dropdown.value
        fields = self._fields(name)
        why = self._no_offload(name) if "offload" in fields else "no offload option"
        self.offload.disabled = why is not None
        self.offload.tooltip = why or "keep parameters, gradients and optimizer state in CPU memory"
        if why is not None:
            self.offload.value = False
        self.precision.disabled = "mixed_precision" not in fields
        self.description.value = (f'<div style="font-size:13px;color:#444"><b>{html.escape(name)}'
                                  f"</b>: {html.escape(self._descriptions.get(name, ''))}"
                                  f"{self._planned(name)}</div>")

    # -- the plan before Run (nbtrain.plan) -------------------------------------------------
    def _replan(self) -> None:
        """The precision chosen: the plan of its steps (made the first time, a few
        seconds for a large model), in the labels, the description and the message."""
        value = self.precision.value
        if self._plans["fp32"] == (None, ""):  # no device to fit
            return
        if value not in self._plans:
            self.message.value = (f'<div style="font-size:13px;color:#666">Planning '
                                  f"{html.escape(value)} steps…</div>")
            self._plans[value] = self._memory_plan(self._gpu, self._names, value)
        self.memory, self.message.value = self._plans[value]
        chosen = self.dropdown.value
        self.dropdown.options = [(self._label(n), n) for n in self._names]
        self.dropdown.value = chosen
        self._describe()

    def _memory_plan(self, gpu, names: list[str], precision: str = "fp32"):
        """(the plan, a line saying it) when there is a device to fit: ``gpu=``, or the
        GPU NVML sees when the picker runs on CUDA; (None, "") otherwise."""
        from ..planner import plan, usable_bytes

        if gpu is None and (self.plan.accelerator != "cuda" or usable_bytes(None)[1] is None):
            return None, ""
        kwargs = dict(self.kwargs)
        if precision != "fp32":
            kwargs["mixed_precision"] = precision
            names = [n for n in names if _takes(n, precision)]  # DeepSpeed refuses fp16
        try:
            made = plan(self.fn, *self.args, devices=self.devices, gpu=gpu,
                        strategies=tuple(names), checkpointing=False, **kwargs)
        except Exception as err:  # the picker still runs what it cannot plan
            return None, ('<div style="font-size:12px;color:#666">No memory plan: '
                          f"{html.escape(type(err).__name__)}: {html.escape(str(err))}</div>")
        return made, f'<div style="font-size:13px">{html.escape(made.sentence())}</div>'

    def _row(self, name: str):
        return next((r for r in self.memory.rows if r.strategy == name), None) \
            if self.memory else None

    def _label(self, name: str) -> str:
        row = self._row(name)
        if row is None:
            return name
        return f"{name} ({format_bytes(row.peak)}{'' if row.fits else ', too big'})"

    def _planned(self, name: str) -> str:
        row = self._row(name)
        if row is None:
            return ""
        held = ", ".join(f"{k} {format_bytes(getattr(row, k))}" for k in
                         ("params", "grads", "optimizer", "activations"))
        verdict = (f"fits {self.memory.device} with {format_bytes(row.headroom)} to spare"
                   if row.fits else f"will not fit {self.memory.device}: "
                   f"{format_bytes(self.memory.usable)} usable")
        color = "#444" if row.fits else "#b71c1c"
        return (f'<br><span style="color:{color}">Planned per rank: {held}; peak '
                f"{format_bytes(row.peak)}, {html.escape(verdict)}.</span>")

    def _no_offload(self, name: str) -> str | None:
        """Why ``name`` cannot offload on this accelerator, or None when it can."""
        try:
            strategies.get(name, offload=True).check(self.plan)
        except (ValueError, TypeError) as err:
            return str(err)
        return None

    def _not_offered_html(self) -> str:
        if not self.not_offered:
            return ""
        items = "".join(f"<li><b>{html.escape(n)}</b>: {html.escape(why)}</li>"
                        for n, why in self.not_offered.items())
        return (f'<div style="font-size:12px;color:#666">Not offered on '
                f"{html.escape(self.plan.accelerator)}:<ul style=\"margin:2px 0\">{items}</ul></div>")

    def _click_run(self) -> None:
        try:
            self.start()
        except Exception as err:
            self.message.value = (f'<div style="color:#b71c1c">Could not start: '
                                  f"{html.escape(type(err).__name__)}: {html.escape(str(err))}</div>")

    def _click_stop(self) -> None:
        self.stop_button.disabled = True
        threading.Thread(target=self.stop, name="nbtrain-picker-stop", daemon=True).start()

    def _watch(self, run: Run) -> None:
        try:
            run.wait()
        except BaseException:
            pass  # the dashboard shows the failure; the picker stays usable
        try:
            self.stop_button.disabled = True
            self._show_comparison()
        finally:
            self._compared.set()

    def _show_comparison(self) -> None:
        comparison = self.comparison()
        if comparison is None:
            return
        self.comparison_title.value = "<b>Comparison of the runs made here</b>"
        self.comparison_text.value = comparison.html()
        # Set the Output widget's outputs directly: one trait update, from this thread,
        # without IPython's formatter (which would create a shell outside a kernel).
        self.comparison_figure.outputs = tuple(
            {"output_type": "display_data", "data": bundle, "metadata": {}}
            for bundle in comparison.bundles()[1:])
        if self._handles is not None:  # the static twin follows, in every page
            from .keeper import update  # loaded when the picker was shown

            update(list(zip(self._handles[1:], self.static_bundles(), strict=True)))

    def static_bundles(self) -> tuple[dict, dict, dict]:
        """The picker as a saved notebook keeps it: what ran and the comparison's table,
        the last run's charts, and the comparison's figure."""
        names = ", ".join(f"{r.strategy.summary()} ({r.status})" for r in self.runs) or "none yet"
        comparison = self.comparison()
        head = (f'<div class="nbtrain-twin" style="font-family:sans-serif;font-size:13px">'
                f"<b>nbtrain StrategyPicker</b> for "
                f"{html.escape(getattr(self.fn, '__name__', 'fn'))}: runs made: "
                f"{html.escape(names)}</div>{TWIN_STYLE}")
        text = f"StrategyPicker runs: {names}"
        empty = {"text/plain": ""}
        chart = empty
        if self.dashboard is not None and self.run is not None and self.run.done:
            from .figures import figure_body
            from .static import figure_bundle

            chart = figure_bundle(figure_body(self.dashboard.state),
                                  f"the last run: {self.run.strategy.summary()}")
        if comparison is None:
            return {"text/html": head, "text/plain": text}, chart, empty
        bundles = comparison.bundles()
        first = {"text/html": head + bundles[0]["text/html"],
                 "text/plain": text + "\n" + bundles[0]["text/plain"]}
        return first, chart, (bundles[1] if len(bundles) > 1 else empty)

    def _ipython_display_(self) -> None:
        from .keeper import KeptDisplay

        if not shown_here(self):
            KeptDisplay(self.widget)

    def __repr__(self) -> str:
        return (f"<StrategyPicker {getattr(self.fn, '__name__', 'fn')} "
                f"strategy={self.dropdown.value} runs={len(self.runs)}>")


def _takes(name: str, precision: str) -> bool:
    """Does strategy ``name`` train in ``precision``? (A refusal says why at Run.)"""
    try:
        strategies.get(name, mixed_precision=precision)
    except (ValueError, TypeError):
        return False
    return True
