"""transformers: what a ``Trainer`` logs (loss every ``logging_steps``, learning rate,
gradient norm), per rank, on nbtrain's dashboard::

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[nbtrain.integrations.transformers.NbtrainCallback()])

Outside a launched function it does nothing."""

from __future__ import annotations

from transformers import TrainerCallback

from ..telemetry import active


class NbtrainCallback(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {k: v for k, v in (logs or {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:  # global_step counts the optimizer step just taken
            active.log(max(state.global_step - 1, 0), values)
