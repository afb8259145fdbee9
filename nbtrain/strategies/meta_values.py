"""What ``ctx.init_module()`` recorded (``meta_init.py``) and how values are rebuilt from
it: each meta storage's creating op and the in-place ops applied to it (``Op``,
``Storage``, ``Ref``, kept in a ``Recording``), replayed on CPU tensors with each random
op's saved generator state (``build``); ``sources`` takes, before the strategy shards
the model, where each meta parameter and buffer gets its values, and ``materialize``
allocates the (sharded) model and fills it, one full tensor at a time."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
CPU = torch.device("cpu")


@dataclass
class Op:
    """One recorded op: ``func(*args, **kwargs)`` with meta tensors replaced by
    ``Ref``s (or ``SELF``, the tensor it writes) and real tensors by copies."""

    func: Any
    args: tuple
    kwargs: dict
    rng: tuple | None = None  # (generator or None for the default one, its state before)
    target: tuple | None = None  # in-place: (size, stride, storage_offset) written
    out_index: int = 0  # creator: which flattened output made the storage
    overwrites: bool = False  # writes every element of the storage without reading it


@dataclass
class Storage:
    storage: Any  # the meta untyped storage, kept alive so its address is not reused
    dtype: torch.dtype
    numel: int
    creator: Op | None = None  # None: made on the meta device outside the block
    ops: list[Op] = field(default_factory=list)


@dataclass(frozen=True)
class Ref:
    """A meta tensor as it was at one point: its storage after ``version`` in-place ops."""

    entry: Storage
    version: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


class _Self:
    def __repr__(self) -> str:
        return "<self>"


SELF = _Self()

@dataclass
class Recording:
    storages: dict[int, Storage] = field(default_factory=dict)  # key: the storage's address
    registered: list = field(default_factory=list)  # weakrefs: tensors given to modules
    versions: dict[int, tuple] = field(default_factory=dict)  # id -> (weakref, _version at exit)

    def snapshot(self) -> None:
        """Note each registered tensor's version counter as the block closes: an
        in-place op after the block (not recorded) moves it."""
        for r in self.registered:
            t = r()
            if t is not None:
                self.versions[id(t)] = (r, t._version)

    def changed_after(self, t: torch.Tensor) -> bool:
        r, version = self.versions.get(id(t), (None, None))
        return r is not None and r() is t and t._version != version

    def entry(self, t: torch.Tensor) -> Storage:
        s = t.untyped_storage()
        key = s._cdata
        if key not in self.storages:
            self.storages[key] = Storage(s, t.dtype, s.nbytes() // t.element_size())
        return self.storages[key]

    def ref(self, t: torch.Tensor) -> Ref:
        e = self.entry(t)
        return Ref(e, len(e.ops), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _run(op: Op, self_tensor: torch.Tensor | None = None):
    """Replay ``op`` on CPU tensors, with the random state it had when recorded."""
    def real(x):
        if x is SELF:
            return self_tensor
        if isinstance(x, Ref):
            return build(x)
        return x

    args, kwargs = tree_map(real, op.args), tree_map(real, op.kwargs)
    if op.rng is None:
        return op.func(*args, **kwargs)
    gen, state = op.rng
    if gen is not None:  # a generator of the user's: replay on a copy in that state
        copy = torch.Generator(device=gen.device)
        copy.set_state(state)
        args, kwargs = tree_map(lambda x: copy if x is gen else x, (args, kwargs))
        return op.func(*args, **kwargs)
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return op.func(*args, **kwargs)
    finally:
        torch.set_rng_state(saved)


def build(ref: Ref) -> torch.Tensor:
    """The values ``ref`` had, as a new CPU tensor."""
    e = ref.entry
    if e.creator is None:
        raise RuntimeError(
            "ctx.init_module(): a meta tensor was created outside the `with "
            "ctx.init_module():` block, so its values are unknown. Build the whole model "
            "inside the block (or without meta tensors).")
    ops = e.ops[:ref.version]
    start = max((i for i, op in enumerate(ops) if op.overwrites), default=-1)
    if start >= 0:  # everything before is overwritten: skip it, draws included
        base = torch.empty(e.numel, dtype=e.dtype, device=CPU)
    else:
        base = tree_flatten(_run(e.creator))[0][e.creator.out_index]
        start = 0
    with torch.no_grad():
        for op in ops[start:]:
            _run(op, base.as_strided(*op.target))
    return base.as_strided(ref.size, ref.stride, ref.offset)


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def sources(module: nn.Module, rec: Recording | None) -> dict[tuple[int, str], Ref]:
    """Where each meta parameter and buffer of ``module`` gets its values, by (id of its
    module, name): taken before the strategy replaces them with shards."""
    out = {}
    for m in module.modules():
        tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
        for name, t in tensors:
            if t is None or not t.is_meta:
                continue
            if rec is None or t.untyped_storage()._cdata not in rec.storages:
                raise RuntimeError(
                    f"ctx.setup(): {type(m).__name__}.{name} is on the meta device but was "
                    "not created inside `with ctx.init_module():`, so its values are "
                    "unknown. Build the model inside that block, or on a real device.")
            if rec.changed_after(t):
                raise RuntimeError(
                    f"ctx.setup(): {type(m).__name__}.{name} was changed in place after the "
                    "`with ctx.init_module():` block; only what happens inside the block "
                    "is replayed. Move that initialisation inside the block.")
            ref = rec.ref(t)
            if _uninitialised(ref):
                raise RuntimeError(
                    f"ctx.setup(): {type(m).__name__}.{name} was created with torch.empty "
                    "inside `with ctx.init_module():` and nothing wrote its values, so it "
                    "would hold whatever memory it got. Initialise it (e.g. "
                    "nn.init.normal_ in the module's __init__ or reset_parameters), or build "
                    "the model outside ctx.init_module().")
            out[(id(m), name)] = ref
    return out


_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
          aten.new_empty.default, aten.new_empty_strided.default}


def _uninitialised(ref: Ref) -> bool:
    """Made by an ``empty`` op and never written (before ``ref``'s version)."""
    e = ref.entry
    return e.creator is not None and e.creator.func in _EMPTY and not e.ops[:ref.version]


def materialize(module: nn.Module, device: torch.device, sources: dict) -> None:
    """Allocate ``module``'s (possibly sharded) tensors on ``device`` and fill them with
    the values recorded in ``sources`` (from ``sources()``)."""
    shared: dict[int, list[tuple[dict, str]]] = {}  # a tensor held by several modules
    for m in module.modules():
        for where in (m._parameters, m._buffers):
            for name, t in where.items():
                if t is not None:
                    shared.setdefault(id(t), []).append((where, name))
    module.to_empty(device=device)
    for places in shared.values():  # to_empty gives each holder its own copy: tie again
        first_where, first_name = places[0]
        for where, name in places[1:]:
            where[name] = first_where[first_name]
    with torch.no_grad():
        for m in module.modules():
            tensors = [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
            for name, t in tensors:
                ref = sources.get((id(m), name))
                if ref is not None and t is not None:
                    copy_into(t, build(ref))


@functools.cache
def _distribute():
    from torch.distributed.tensor import DTensor, distribute_tensor

    return DTensor, distribute_tensor


def copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Fill ``target`` from the whole tensor ``full``; a DTensor takes only its shard."""
    DTensor, distribute_tensor = _distribute()
    if isinstance(target, DTensor):  # keep only this rank's shard (no communication)
        shard = distribute_tensor(full, target.device_mesh, target.placements,
                                  src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)
