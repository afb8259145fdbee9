"""What a worker is told at start: the explicit, plain-data snapshot both sides read.

The kernel's launcher builds one ``WorkerSpec`` per rank; the worker's ``main`` and its
``Context`` read it. It lives apart from both, so neither side imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .telemetry.settings import Telemetry

# Set in nbtrain's own ranks: they are no torchrun ranks (scaleout/torchrun.py), and they
# start no ranks of their own (launch/start.py)
WORKER_ENV = "NBTRAIN_WORKER"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to know, handed over explicitly at start."""

    rank: int
    local_rank: int
    world_size: int
    accelerator: str  # "cpu" or "cuda"
    device_index: int | None
    backend: str  # "gloo", or "cpu:gloo,cuda:nccl" on CUDA
    store_host: str
    store_port: int | None  # None: rank 0 hosts the store and the kernel relays its port
    telemetry_address: tuple[str, int] | None
    telemetry_token: str
    num_threads: int | None  # torch threads; None: leave as the user set them
    pg_timeout_s: float
    parent_pid: int
    die_with_parent: bool  # PR_SET_PDEATHSIG: launched from the main thread
    telemetry: Telemetry = Telemetry()
    resume_from: str | None = None  # launch(resume=...): the checkpoint to go on from
    seed: int = 0  # the launch's base seed; this rank starts from seed + rank (seeding.py)
    data_seed: int = 0  # ctx.dataloader's shuffle seed, the same on every rank
    pool: bool = False  # a RankPool worker: wait for commands instead of running one function
    # A worker forked by the fork server takes the kernel's environment of its launch
    # (the server holds the one of its own start); None: the process's own is right.
    environ_of_kernel: dict[str, str] | None = None
    # sys.argv in the rank (what argparse reads); None: the process's own is right
    argv: tuple[str, ...] | None = None
    shell: bool = False  # launched from an IPython kernel: its displays go to the cell

    def environ(self) -> dict[str, str]:
        env = {
            "MASTER_ADDR": self.store_host,
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": "0", WORKER_ENV: "1",
        }
        if self.store_port is not None:  # else set once rank 0's store is up
            env["MASTER_PORT"] = str(self.store_port)
        if self.num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.num_threads)
        return env
