"""DeepSpeed itself: whether and which version is installed, importing it quietly for
the rank's device, a word before it compiles a native op, and letting go of its
engines and process groups after a run in a warm worker."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import re
import shutil
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch.distributed as dist

INSTALL = 'pip install "nbtrain[deepspeed]"'
# Engines made in this process, for release(): DeepSpeed's gradient hooks on the
# parameters' autograd nodes hold its optimizer in a cycle Python cannot collect
_ENGINES: weakref.WeakSet = weakref.WeakSet()


def remember(engine) -> None:
    """Keep ``engine`` (weakly) for ``release()``."""
    _ENGINES.add(engine)

MINIMUM = (0, 19, 8)  # pyproject's extra; tested with it


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def installed_version() -> tuple[int, ...]:
    """The installed DeepSpeed's release, as numbers (``(0, 19, 8)``)."""
    version = importlib.metadata.version("deepspeed")
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def import_deepspeed(device_type: str):
    """``import deepspeed``, quietly, with its CPU accelerator on CPU and without the
    shared-memory op only its own launcher uses (a 100 s C++ build)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    elif os.environ.get("DS_ACCELERATOR") == "cpu":  # set by a CPU run in this kernel
        del os.environ["DS_ACCELERATOR"]
        real = sys.modules.get("deepspeed.accelerator.real_accelerator")
        if real is not None:
            real.ds_accelerator = None  # chosen again, here, for the GPU

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import deepspeed
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    _say_when_building()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # torch 2.13 deprecates the collectives DeepSpeed calls; one warning per call and rank
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)
    return deepspeed


def _say_when_building() -> None:
    """A config that needs one of DeepSpeed's native ops (its CPU Adam, say) compiles it
    on first use: minutes with no output. Say so before, and how long it took after;
    with no C++ compiler, fail at once with what to do instead of deep in the build."""
    from deepspeed.ops.op_builder import builder

    original = builder.OpBuilder.jit_load
    if getattr(original, "nbtrain", False):
        return

    def jit_load(self, verbose=True):
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise RuntimeError(
                f"this DeepSpeed config needs DeepSpeed's native op {self.name!r}, which "
                f"it compiles on first use, and there is no C++ compiler ({compiler!r}) "
                "on PATH. Install one (apt install g++, or conda install gxx) and ninja, "
                "or keep a torch optimizer (nbtrain's default; nothing is compiled).")
        from torch.utils.cpp_extension import get_default_build_root

        built = Path(get_default_build_root()).glob(f"*/{self.name}/{self.name}.so")
        first = os.environ.get("LOCAL_RANK", "0") == "0" and next(built, None) is None
        if first:
            print(f"DeepSpeed is compiling its native op {self.name!r} (minutes the first "
                  "time; cached in torch's extensions directory after)...", flush=True)
        start = time.monotonic()
        module = original(self, verbose=verbose)
        if first:
            print(f"DeepSpeed's {self.name!r} op ready after {time.monotonic() - start:.0f} s.",
                  flush=True)
        return module

    jit_load.nbtrain = True
    builder.OpBuilder.jit_load = jit_load


def release() -> None:
    """After a run in a warm worker (a RankPool): destroy the process groups DeepSpeed
    made of the default one's ranks (their gloo threads outlive the run otherwise, and
    every run made new ones) and forget them, so the next run starts clean. First each
    engine's own ``destroy()``: it removes the gradient hooks whose cycle through the
    autograd graph kept the optimizer, the parameters and the groups alive."""
    for engine in list(_ENGINES):
        try:
            engine.destroy()
        except Exception:
            pass
        module = getattr(engine, "module", None)
        for param in module.parameters() if module is not None else ():
            # what DeepSpeed hangs on a parameter: its autograd node (which holds the
            # parameter: a cycle through C++) and, at stage 3, the optimizer itself
            for name in [n for n in vars(param) if n.startswith(("ds_", "_z3", "grad_acc"))]:
                delattr(param, name)
    _ENGINES.clear()
    # stage 3's module-level holds on the last model: the forward stack and a method
    # cache keyed by (coordinator, module)
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and isinstance(getattr(offload, "FWD_MODULE_STACK", None), list):
        offload.FWD_MODULE_STACK.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    cls = getattr(coordinator, "PartitionedParameterCoordinator", None)
    for fn in vars(cls).values() if cls is not None else ():
        # under DeepSpeed's NVTX decorator (a closure, no __wrapped__)
        for inner in [fn, *(c.cell_contents for c in getattr(fn, "__closure__", None) or ())]:
            if callable(getattr(inner, "cache_clear", None)):
                inner.cache_clear()
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    if not dist.is_initialized():
        return
    world = dist.GroupMember.WORLD
    made = []
    for name, value in vars(groups).items():
        if not (name.startswith("_") and name.endswith(("_GROUP", "_GROUPS"))):
            continue
        found = list(value.values()) if isinstance(value, dict) else [value]
        made += [g for g in found if isinstance(g, dist.ProcessGroup) and g is not world]
        setattr(groups, name, {} if isinstance(value, dict) else None)
    for group in {id(g): g for g in made}.values():
        try:
            dist.destroy_process_group(group)
        except Exception:
            pass
