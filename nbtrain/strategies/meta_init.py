"""Fast, low-memory initialisation: build the model on the meta device, let the strategy
shard it, then materialise only each rank's shard — with the values ordinary
initialisation with the same seed gives.

While ``ctx.init_module()`` is open, modules are created on the meta device (no memory,
no random numbers drawn) and a global parameter-registration hook records the order in
which modules got their parameters, with the CPU random state at entry. After the
strategy has wrapped (and, for FSDP, sharded) the model, ``materialize`` allocates the
storage (``to_empty``) and replays the initialisation: the random state is restored and
each module's ``reset_parameters()`` runs, in the recorded order, on a temporary full-size
CPU copy of that module's own tensors; each rank keeps only its shard of the result.
So at most one module's full parameters exist at a time, and the draws are the very
draws ordinary construction makes. This holds when a module's initialisation is its
``reset_parameters()`` (true of torch's layers); a module that draws random numbers in
``__init__`` outside it, or owns parameters and has no ``reset_parameters``, fails with a
message saying so.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Recording:
    rng_state: torch.Tensor
    order: list = field(default_factory=list)  # weakrefs to modules, first-registration order


@contextlib.contextmanager
def record():
    """Create modules on the meta device and record how to initialise them later."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    rec = Recording(rng_state=torch.get_rng_state())
    seen: set[int] = set()

    def hook(module, name, value):
        if id(module) not in seen:
            seen.add(id(module))
            rec.order.append(weakref.ref(module))

    handles = [register_module_parameter_registration_hook(hook),
               register_module_buffer_registration_hook(hook)]
    try:
        with torch.device("meta"):
            yield rec
    finally:
        for h in handles:
            h.remove()


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device, rec: Recording | None) -> None:
    """Allocate ``module``'s (possibly sharded) tensors on ``device`` and initialise them."""
    module.to_empty(device=device)
    inside = {id(m): m for m in module.modules()}
    order: list[nn.Module] = []
    if rec is not None:
        torch.set_rng_state(rec.rng_state)
        order = [m for m in (r() for r in rec.order) if m is not None and id(m) in inside]
    listed = {id(m) for m in order}
    order += [m for m in module.modules() if id(m) not in listed]
    for m in order:
        own = dict(m.named_parameters(recurse=False))
        bufs = {n: b for n, b in m.named_buffers(recurse=False) if b is not None}
        if not own and not bufs:
            continue
        reset = getattr(m, "reset_parameters", None)
        if reset is None:
            if own:
                raise RuntimeError(
                    f"ctx.init_module(): {type(m).__name__} owns parameters "
                    f"({', '.join(own)}) but has no reset_parameters(), so its "
                    "initialisation cannot be replayed after sharding. Give it a "
                    "reset_parameters() that initialises them, or build the model "
                    "outside ctx.init_module().")
            continue  # buffers with no initialiser (e.g. constants): leave them to the user
        _replay(m, reset, own, bufs, device)


def _replay(m: nn.Module, reset, own: dict, bufs: dict, device: torch.device) -> None:
    full_p = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
              for n, p in own.items()}
    full_b = {n: torch.empty(b.shape, dtype=b.dtype) for n, b in bufs.items()}
    m._parameters.update(full_p)
    m._buffers.update(full_b)
    try:
        with torch.device("cpu"):
            reset()
        made_p = {n: m._parameters[n] for n in own}
        made_b = {n: m._buffers[n] for n in bufs}
    finally:
        m._parameters.update(own)
        m._buffers.update(bufs)
    with torch.no_grad():
        for n, p in own.items():
            copy_into(p, made_p[n].detach())
        for n, b in bufs.items():
            copy_into(b, made_b[n])


def copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Fill ``target`` from the whole tensor ``full``; a DTensor takes only its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):  # keep only this rank's shard (no communication)
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)
