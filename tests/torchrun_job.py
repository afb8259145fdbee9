"""A script torchrun runs in the tests: ``launch(train)`` as this process's rank.

    torchrun ... tests/torchrun_job.py STRATEGY OUT_DIR

A first launch() of a small function shows a second one in the same script reuses the
process group. Then a training that checkpoints and stops at step 3, one that goes on
from that checkpoint with ``resume=``, and a function written for torchrun itself (its
own init_process_group and destroy_process_group). Rank 0 saves what its ``Run`` holds (results,
summary rows, seed; the resumed results) to OUT_DIR/run.pt; every rank saves what
``launch`` returned it to OUT_DIR/rank{RANK}.txt.
"""

from __future__ import annotations

import os
import sys

import torch
from workloads import ckpt_train, fail_on, torchrun_style, train

import nbtrain

strategy, out = sys.argv[1], sys.argv[2]
first = nbtrain.launch(fail_on, "none", strategy="ddp", accelerator="cpu", dashboard=False)
run = nbtrain.launch(train, strategy=strategy, accelerator="cpu", seed=7)
ckpt = os.path.join(out, "ckpt")
nbtrain.launch(ckpt_train, path=ckpt, save_every=4, stop_after=3, strategy=strategy,
               accelerator="cpu", telemetry=False)
resumed = nbtrain.launch(ckpt_train, strategy=strategy, accelerator="cpu", resume=ckpt,
                         telemetry=False)
# code written for torchrun itself, inside launch(): its init and destroy are the job's
own = nbtrain.launch(torchrun_style, accelerator="cpu", dashboard=False)
with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
    f.write(type(run).__name__)
if run is not None:
    torch.save({"first": first.results, "results": run.results, "summary": run.summary().rows(), "seed": run.seed,
                "ranks": run.history.ranks, "status": run.status,
                "resumed": resumed.results, "own": own.results,
                "loss_steps": {r: [s for s, _ in run.history.metric("loss", r)] for r in (0, 1)}},
               os.path.join(out, "run.pt"))
