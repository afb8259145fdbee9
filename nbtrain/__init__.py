"""nbtrain: interactive distributed training (DDP, FSDP) from inside a Jupyter kernel.

    run = nbtrain.launch(train, devices=2, strategy="fsdp")
    run.results, run.history
"""

from . import strategies
from .context import Context
from .errors import RunStoppedError, RunTimeoutError, WorkerError
from .launch import launch
from .run import Run, last_run
from .telemetry.options import Telemetry
from .ui import StrategyPicker, compare, progress

__all__ = ["Context", "Run", "RunStoppedError", "RunTimeoutError", "StrategyPicker",
           "Telemetry", "WorkerError", "compare", "last_run", "launch", "progress",
           "strategies"]
__version__ = "0.1.0"
