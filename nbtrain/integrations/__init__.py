"""Adapters that let other frameworks' training loops feed nbtrain's dashboard from
inside a worker: the metrics a framework logs, per rank, as ``Metric`` events.

- Lightning: ``lightning.NbtrainCallback``, attached by itself (nbtrain registers a
  ``lightning.pytorch.callbacks_factory`` entry point, which Lightning's ``Trainer``
  reads); it adds nothing outside an nbtrain worker.
- transformers: ``transformers.NbtrainCallback``, one line:
  ``Trainer(..., callbacks=[nbtrain.integrations.transformers.NbtrainCallback()])``
  (transformers has no way to attach callbacks from outside).

Steps, step time, memory and the loss need neither: see ``hosting.py``.
Worker side: these import ``nbtrain.telemetry.active`` only.
"""
