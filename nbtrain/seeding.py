"""Random seeds, one rule for fork and spawn.

Every launch has a base seed: ``launch(seed=N)`` gives it, otherwise the kernel draws a
fresh one (``run.seed`` keeps it, so any run can be repeated). Before the user's function
runs, rank ``r`` seeds torch (CPU and every CUDA device), Python's ``random`` and numpy
(when installed) with ``(seed + r) mod 2**32``: ranks differ from one another, launches
differ from one another, and the same ``seed=`` gives the same streams whether the
workers were forked or spawned. A fork would otherwise hand every rank the kernel's
generator state (the same numbers on every rank and every launch), and a spawn a fresh
one (different numbers, never reproducible).

``ctx.dataloader(shuffle=True)`` needs the same order seed on every rank (each rank takes
its slice of one permutation): it uses ``launch(seed=N)`` when given, else 0, as
Lightning's ``seed_everything`` and torch's ``DistributedSampler`` do.
"""

from __future__ import annotations

import random
import secrets

MAX_SEED = 2**32 - 1  # numpy's limit, as Lightning's seed_everything


def base_seed(seed: int | None) -> int:
    """The launch's base seed: ``seed`` checked, or a fresh one when None."""
    if seed is None:
        return secrets.randbelow(MAX_SEED + 1)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r}: give an int from 0 to {MAX_SEED} (or None for a "
                        "fresh seed per launch; run.seed keeps it).")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed} is outside 0..{MAX_SEED} (numpy's range); e.g. "
                         f"seed={seed % (MAX_SEED + 1)}.")
    return seed


def rank_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank`` starts from."""
    return (seed + rank) % (MAX_SEED + 1)


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), ``random`` and numpy, if installed, with ``seed``."""
    random.seed(seed)
    _seed_torch(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def _seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, without its price where it does nothing more than seed
    the CPU generator. For each device kind not initialised yet (CUDA, XPU, MTIA; built or
    not) torch queues the seeding with ``traceback.format_stack()``, and a rank forked
    inside a cell stands ~50 frames deep in the kernel's stack: formatting them (their
    source lines read from disk) took 2-8 ms of every rank's start on 2 cores. A torch
    built for the CPU alone has no other generator to seed: there the CPU's is seeded
    directly. Any other build, or one this cannot tell, gets ``torch.manual_seed``."""
    import torch

    if _cpu_only_build(torch):
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)  # also every CUDA device, lazily


def _cpu_only_build(torch) -> bool:
    built = (torch.backends.cuda.is_built(), torch.backends.mps.is_built(),
             getattr(getattr(torch, "xpu", None), "_is_compiled", lambda: True)(),
             getattr(getattr(torch, "mtia", None), "_is_compiled", lambda: True)())
    custom = getattr(torch._C, "_get_privateuse1_backend_name", lambda: "?")()
    return not any(built) and custom == "privateuseone"
