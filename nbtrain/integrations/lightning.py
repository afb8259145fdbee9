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
    """After each training batch, and after each validation (the last epoch's has no
    training batch after it): the metrics logged since (``trainer.callback_metrics``
    holds every metric's latest value; one that is the same tensor as last time, a
    validation's between two validations, is not sent again)."""

    def __init__(self):
        self._sent: dict[str, object] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._log(trainer)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:  # the two batches Lightning runs before training
            self._log(trainer)

    def _log(self, trainer) -> None:
        values = {}
        for name, value in trainer.callback_metrics.items():
            try:
                if value.numel() == 1 and self._sent.get(name) is not value:
                    values[name] = value.detach()
                    self._sent[name] = value
            except AttributeError:
                continue
        if values:  # global_step counts the optimizer step just taken
            active.log(max(trainer.global_step - 1, 0), values)
