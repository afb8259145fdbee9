"""Lightning: the metrics a ``LightningModule`` logs (``self.log(...)``), per rank, on
nbtrain's dashboard. Lightning loads ``callbacks()`` through nbtrain's
``lightning.pytorch.callbacks_factory`` entry point for every ``Trainer``; outside a
launched function it returns nothing."""

from __future__ import annotations

from ..telemetry import active


def callbacks() -> list:
    if not active.active():
        return []
    return [NbtrainCallback()]


def _base():
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:  # the older package name
        from pytorch_lightning.callbacks import Callback
    return Callback


class NbtrainCallback(_base()):
    """After each training batch: the metrics logged on the step (``on_step``) so far."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        values = {}
        for name, value in trainer.callback_metrics.items():
            try:
                if value.numel() == 1:
                    values[name] = value.detach()
            except AttributeError:
                continue
        if values:  # global_step counts the optimizer step just taken
            active.log(max(trainer.global_step - 1, 0), values)
