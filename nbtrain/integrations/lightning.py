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
    """After each training batch, the metrics its step logged; after each validation (not
    the sanity check), the validation's, the last epoch's too (no training batch follows
    it). ``trainer.callback_metrics`` holds every metric's latest value: a metric first
    seen after a validation is the validation's, and is not sent again at every step."""

    def __init__(self):
        self._training: set[str] = set()
        self._validation: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        names = set(trainer.callback_metrics) - self._validation
        self._training |= names
        _log(trainer, names)

    def on_validation_end(self, trainer, pl_module):
        names = set(trainer.callback_metrics) - self._training
        self._validation |= names  # the sanity check's too, should Lightning keep them
        if not trainer.sanity_checking:
            _log(trainer, names)


def _log(trainer, names: set[str]) -> None:
    values = {}
    for name, value in trainer.callback_metrics.items():
        try:
            if name in names and value.numel() == 1:
                values[name] = value.detach()
        except AttributeError:
            continue
    if values:  # global_step counts the optimizer step just taken
        active.log(max(trainer.global_step - 1, 0), values)
