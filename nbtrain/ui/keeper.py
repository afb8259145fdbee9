"""Outputs that every page showing the notebook brings up to date, a reloaded one too.

A display handle's update reaches only the page that ran the cell: a page reloaded since
rebuilt the cell's outputs from the saved file and routes no update to them. So a live
view re-created by a reload could never become the static figure a saved notebook keeps,
and after a later kernel restart it read "model not found".

Each output nbtrain replaces later is a ``KeptDisplay``: its metadata names a slot and a
version. ``update`` replaces such outputs through their display handles (the page that
ran the cell, any frontend) and also records the new outputs in the kernel's one
``Keeper`` widget.
The keeper's module runs in every page whose widget manager holds its model — the first
page and any reloaded one, which restores every model from the kernel — and replaces
each output of that page's notebook whose slot it holds at an older version, as the
display update would have. It reaches the notebook through the widget manager's
document context (JupyterLab, Notebook 7), or through the classic Notebook's
``Jupyter.notebook`` (Notebook 6, with ipywidgets 7); where there is neither it does
nothing and the handle's update is all there is. The keeper holds the last ``KEEP`` slots' outputs.

A widget shown as a ``KeptDisplay`` (the picker, a run's live view) names a model that
lives in the kernel. When that kernel restarts, dies or is shut down, the keeper's module
in each open page retires the output: its model id emptied, which the widget renderer
draws as nothing, in the page and in the file saved from it. Its static twin then stands
alone, where before the page (and the reopened notebook) said "Error displaying widget:
model not found" wherever the twin's CSS did not apply (a browser without ``:has()``).
"""

from __future__ import annotations

import threading
import uuid

import anywidget
import traitlets

KEY = "nbtrain"  # the outputs' metadata: {"slot": ..., "version": n}
# Slots whose last output the keeper holds: a run's dashboard takes two (a static figure
# is up to ~300 KB), and every reloaded page receives them all. A page needs the outputs
# of the runs that ended since the notebook was last saved, a few at most.
KEEP = 12

_ESM = """
const KEY = "nbtrain";
const stale = (output, kept) => {
  const mark = ((output && output.metadata) || {})[KEY];
  const newer = mark && kept[mark.slot];
  return newer && newer.metadata[KEY].version !== mark.version ? newer : null;
};
// The classic Notebook: each cell's output area holds its outputs as JSON; a cell with a
// stale one is drawn again from the replaced list.
function applyClassic(kept) {
  const notebook = window.Jupyter && window.Jupyter.notebook;
  if (!notebook || !notebook.get_cells) return false;
  for (const cell of notebook.get_cells()) {
    const area = cell.output_area;
    if (!area || !Array.isArray(area.outputs)) continue;
    let changed = false;
    const outputs = area.outputs.map((output) => {
      const newer = stale(output, kept);
      changed = changed || newer !== null;
      return newer || output;
    });
    if (changed) {
      area.clear_output(false, true);
      area.fromJSON(outputs);
      notebook.set_dirty(true);
    }
  }
  return true;
}
async function apply(model) {
  const context = model.widget_manager && model.widget_manager.context;
  if (!context || !context.model) {  // not JupyterLab's document: the classic Notebook?
    applyClassic(model.get("outputs"));
    return;
  }
  if (context.ready) await context.ready;
  const kept = model.get("outputs");
  const cells = context.model.cells;
  for (let c = 0; c < cells.length; c++) {
    const outputs = cells.get(c).outputs;
    if (!outputs) continue;  // a markdown or raw cell
    for (let i = 0; i < outputs.length; i++) {
      const newer = stale(outputs.get(i), kept);
      if (newer) outputs.set(i, newer);
    }
  }
}
// A widget output of nbtrain (marked by its metadata) names a model that lives in the
// kernel. Once that kernel restarts, dies or is shut down, the output is retired: its
// model id emptied, which the widget renderer draws as nothing, in this page and in the
// file saved from it, whatever the browser's CSS ("model not found" otherwise). The
// static outputs after it (the picker's twin, a run's snapshot) then stand alone.
const WIDGET = "application/vnd.jupyter.widget-view+json";
const GONE = ["restarting", "autorestarting", "dead"];
// Each nbtrain widget output of the notebook, as [outputs, index, output, view].
function widgetOutputs(context) {
  const found = [];
  const cells = context && context.model && context.model.cells;
  if (!cells) return found;
  for (let c = 0; c < cells.length; c++) {
    const outputs = cells.get(c).outputs;
    if (!outputs) continue;
    for (let i = 0; i < outputs.length; i++) {
      const output = outputs.get(i);
      const view = output && output.data && output.data[WIDGET];
      if (view && view.model_id && ((output.metadata || {})[KEY])) {
        found.push([outputs, i, output, view]);
      }
    }
  }
  return found;
}
function retire(context) {
  for (const [outputs, i, output, view] of widgetOutputs(context)) {
    outputs.set(i, {output_type: "display_data", metadata: output.metadata,
                    data: {[WIDGET]: {...view, model_id: ""}, "text/plain": ""}});
  }
}
// A page loaded while the kernel lives (a reload) restores every widget model from the
// kernel in one go, then spends its main thread creating them (plotly.js's module among
// them). A renderer that began waiting for its model before that waits 2 s in 100 ms
// sleeps and gives up without a last look: when its last sleep spans the busy second, the
// model arrives and the restore ends meanwhile, and the renderer says "model not found"
// for good (a slow machine's reload, every time). So after each restore, when this keeper
// arrives and whenever it brings outputs, every nbtrain widget output whose model is here
// and shows in no view is drawn again, from the same output.
const HEALED = Symbol.for("nbtrain.heal");
async function heal(model) {
  const manager = model.widget_manager;
  if (!manager || !manager.has_model) return;
  for (const [outputs, i, output, view] of widgetOutputs(manager.context)) {
    if (!manager.has_model(view.model_id)) continue;
    const widget = await manager.get_model(view.model_id);
    if (widget && widget.views && Object.keys(widget.views).length) continue;  // shown
    if (outputs.get(i) === output) {  // unchanged meanwhile: the same output, drawn anew
      outputs.set(i, {output_type: "display_data", metadata: output.metadata,
                      data: output.data});
    }
  }
}
const healing = (model) => heal(model).catch(
  (err) => console.warn("nbtrain: could not draw a widget again:", err));
function watchRestores(model) {
  const manager = model.widget_manager;
  // the renderers of this page's outputs may still be waiting for the model: a moment
  healing(model);
  setTimeout(() => healing(model), 1500);
  if (manager && manager.restored && manager.restored.connect && !manager[HEALED]) {
    manager[HEALED] = true;  // once per page and notebook
    manager.restored.connect(() => setTimeout(() => healing(model), 500));
  }
}
const WATCHED = Symbol.for("nbtrain.retire");
function watch(model) {
  const context = model.widget_manager && model.widget_manager.context;
  const session = context && context.sessionContext;
  if (!session || !session.statusChanged || session[WATCHED]) return;
  session[WATCHED] = true;  // once per page and notebook, whatever the kernels since
  const check = (_, status) => { if (GONE.includes(status)) retire(context); };
  session.statusChanged.connect(check);
  session.kernelChanged.connect(() => retire(context));
}
export default {
  initialize({ model }) {
    const run = () => apply(model).catch(
      (err) => console.warn("nbtrain: could not bring an output up to date:", err));
    run();
    model.on("change:outputs", () => run().then(() => healing(model)));
    watch(model);
    watchRestores(model);
  },
};
"""


class Keeper(anywidget.AnyWidget):
    """The last outputs of nbtrain's slots, which each page's copy applies to its
    notebook (never shown: a widget's module runs when its model reaches a page)."""

    _esm = _ESM
    outputs = traitlets.Dict().tag(sync=True)


_KEEPER: Keeper | None = None
_lock = threading.Lock()


def keeper() -> Keeper:
    """The kernel's keeper (made on first use; it lasts as long as the kernel)."""
    global _KEEPER
    with _lock:
        if _KEEPER is None:
            _KEEPER = Keeper()
        return _KEEPER


def keep(outputs: dict[str, dict]) -> None:
    """Record each slot's current output (``{slot: output}``), for every page to apply:
    one message to the pages, whatever the number of slots. The newest last, and only
    the last ``KEEP``."""
    widget = keeper()
    with _lock:
        kept = {slot: out for slot, out in widget.outputs.items() if slot not in outputs}
        kept.update(outputs)
        widget.outputs = dict(list(kept.items())[-KEEP:])


def show(obj, raw: bool = False, metadata: dict | None = None):
    """IPython's ``display`` with a display id (and ``metadata``), for widgets too: on
    ipywidgets 7 (Colab) a widget shows itself through ``_ipython_display_``, which takes
    neither, so a later update would reach no output; its bundle is shown raw instead."""
    from IPython.display import display

    if not raw and not hasattr(obj, "_repr_mimebundle_") and hasattr(obj, "_model_id"):
        bundle = {"text/plain": repr(obj)[:110],
                  "application/vnd.jupyter.widget-view+json": {
                      "version_major": 2, "version_minor": 0, "model_id": obj._model_id}}
        handle = display(bundle, raw=True, display_id=True, metadata=metadata or {})
        obj._handle_displayed()
        return handle
    return display(obj, raw=raw, display_id=True, metadata=metadata or {})


class KeptDisplay:
    """A display whose updates reach every page showing the notebook (see the module)."""

    def __init__(self, obj, raw: bool = False):
        self.slot = uuid.uuid4().hex
        self.version = 0
        if not raw:  # a widget: the keeper's module, in each page, retires it with the kernel
            keeper()
        self.handle = show(obj, raw=raw, metadata=self._metadata())

    def _metadata(self) -> dict:
        return {KEY: {"slot": self.slot, "version": self.version}}

    def _replace(self, bundle: dict) -> dict:
        """Update through the handle; returns the output for the keeper."""
        self.version += 1
        metadata = self._metadata()
        self.handle.update(bundle, raw=True, metadata=metadata)
        return {"output_type": "display_data", "data": bundle, "metadata": metadata}


def update(changes: list[tuple[KeptDisplay, dict]]) -> None:
    """Replace each display's output with its bundle, in every page."""
    keep({display.slot: display._replace(bundle) for display, bundle in changes})
