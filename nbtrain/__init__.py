"""nbtrain: interactive distributed training (DDP, FSDP) from inside a Jupyter kernel.

    run = nbtrain.launch(train, devices=2, strategy="fsdp")
    run.results, run.history
    pool = nbtrain.RankPool(devices=2)       # warm workers: pool.launch(...), %%ranks cells
    watch = nbtrain.listen(host="0.0.0.0")   # watch a torchrun job: NBTRAIN_ATTACH=watch.address
"""

from . import checkpoint, strategies
from .bandwidth import bandwidth
from .context import Context
from .errors import RunStoppedError, RunTimeoutError, WorkerError, remember_cell_names
from .launch import launch
from .launch.pool.ranks import RankPool
from .launch.starting import culprit, warm
from .planner import plan
from .run import Run, last_run
from .scaleout import torchrun as _torchrun  # noqa: F401  (launch() under torchrun)
from .scaleout.listen import listen
from .scaleout.ray import Ray
from .scaleout.slurm import submit
from .scaling import scaling
from .telemetry.settings import Telemetry
from .ui import StrategyPicker, compare, progress
from .ui import preload as _preload_chart

__all__ = ["Context", "RankPool", "Ray", "Run", "RunStoppedError", "RunTimeoutError",
           "StrategyPicker", "Telemetry", "WorkerError", "bandwidth", "compare", "last_run",
           "launch", "plan", "scaling",
           "listen", "progress", "strategies", "checkpoint", "submit"]
__version__ = "0.1.0"

remember_cell_names()  # in an IPython 7 kernel, tracebacks name cells as IPython 8's do
culprit.install()  # from now on, whatever touches CUDA is named if fork becomes unsafe
# In a kernel, while it waits for the next cell: plotly.js to the page where the first
# dashboard will draw with it, then the first launch's imports. In that order: the page
# evaluates plotly.js (~1 s on 2 cores) while the kernel imports (1.5 s), not after.
warm.when_idle(_preload_chart, warm.warm_kernel)



def load_ipython_extension(ipython) -> None:
    """``%load_ext nbtrain``: the ``%%ranks`` cell magic (see ``nbtrain.magics``)."""
    from .magics import load_ipython_extension as load

    load(ipython)
