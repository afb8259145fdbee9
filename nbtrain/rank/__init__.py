"""What runs inside a rank's process: the worker's entry and its one function
(``worker.py``), a ``RankPool`` worker's command loop (``pool_worker.py``). The kernel
starts these (``nbtrain.launch``); they speak to it only through the pipes and messages
of ``nbtrain.wire`` and the telemetry channel, and import no notebook machinery."""
