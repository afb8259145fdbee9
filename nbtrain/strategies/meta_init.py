"""Fast, low-memory initialisation: build the model on the meta device, let the strategy
shard it, then materialise only each rank's shard — with the values ordinary
construction with the same seed gives, bit for bit.

While ``ctx.init_module()`` is open, tensors are created on the meta device (no memory)
and a dispatch mode records, for every meta storage, how it got its values: the op that
created it and the in-place ops applied to it since, in order (``empty`` then
``uniform_``; ``clone`` of another storage for ``copy.deepcopy``; ``copy_`` into a slice
for a ``pe[:, 0::2] = ...`` buffer), whoever ran them: ``reset_parameters``,
``MultiheadAttention._reset_parameters``, a parent's ``self.apply(self._init_weights)``,
``nn.Transformer``'s re-initialisation of its children.

Random ops are the delicate part. Before each one the generator's state is saved, and
the op is then run once on a scratch CPU tensor of the same layout (freed at once), so
the generator advances exactly as in ordinary construction: a ``torch.manual_seed``
inside the block, random numbers drawn on real tensors in between, and the state after
the block are all as without the block. After the strategy has wrapped (and, for FSDP,
sharded) the model, ``materialize`` allocates the storage (``to_empty``) and rebuilds
each parameter and buffer on a temporary full-size CPU tensor, replaying its ops with
each random op's saved state; each rank keeps only its shard. Ops whose every element a
later op overwrites (Linear's kaiming draw before ``_init_weights``'s normal draw) are
skipped. At most one tensor's full values (and those it was computed from) exist at a
time, and the global random state is left as it was.

What cannot be replayed fails with what to do: inside the block, an op that needs the
values of a meta tensor (``.item()``, data-dependent shapes) or writes two tensors at
once; in ``sources``, a meta tensor the block did not create and an in-place change after
the block to a tensor a module registered in it. Not seen: code that itself skips meta
tensors (besides the ``nn.init`` functions wrapped here) and changes after the block
through ``.data`` or to deep-copied modules.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")


@dataclass
class _Op:
    """One recorded op: ``func(*args, **kwargs)`` with meta tensors replaced by
    ``_Ref``s (or ``_SELF``, the tensor it writes) and real tensors by copies."""

    func: Any
    args: tuple
    kwargs: dict
    rng: tuple | None = None  # (generator or None for the default one, its state before)
    target: tuple | None = None  # in-place: (size, stride, storage_offset) written
    out_index: int = 0  # creator: which flattened output made the storage
    overwrites: bool = False  # writes every element of the storage without reading it


@dataclass
class _Storage:
    storage: Any  # the meta untyped storage, kept alive so its address is not reused
    dtype: torch.dtype
    numel: int
    creator: _Op | None = None  # None: made on the meta device outside the block
    ops: list[_Op] = field(default_factory=list)


@dataclass(frozen=True)
class _Ref:
    """A meta tensor as it was at one point: its storage after ``version`` in-place ops."""

    entry: _Storage
    version: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


class _Self:
    def __repr__(self) -> str:
        return "<self>"


_SELF = _Self()

# In-place ops that set every element of their target without reading it.
_FILLS = {aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.fill_.Tensor,
          aten.zero_.default, aten.copy_.default, aten.random_.default, getattr(aten.random_, "from"),
          aten.random_.to, aten.exponential_.default, aten.bernoulli_.float,
          aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default}


@dataclass
class Recording:
    storages: dict[int, _Storage] = field(default_factory=dict)  # key: the storage's address
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

    def entry(self, t: torch.Tensor) -> _Storage:
        s = t.untyped_storage()
        key = s._cdata
        if key not in self.storages:
            self.storages[key] = _Storage(s, t.dtype, s.nbytes() // t.element_size())
        return self.storages[key]

    def ref(self, t: torch.Tensor) -> _Ref:
        e = self.entry(t)
        return _Ref(e, len(e.ops), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _is_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _is_meta_device(x) -> bool:
    return isinstance(x, torch.device) and x.type == "meta"


def _whole(target: tuple, numel: int) -> bool:
    """Whether a (size, stride, offset) view covers its storage of ``numel`` elements."""
    size, stride, offset = target
    expect, contiguous = 1, True
    for n, s in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and s != expect:
            contiguous = False
        expect *= n
    return offset == 0 and contiguous and expect == numel


def _generator(func, args, kwargs):
    """The explicit generator an op was given, or None (the default CPU generator)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            return args[i] if i < len(args) else kwargs.get("generator")
    return None


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not any(_is_meta(x) or _is_meta_device(x) for x in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)
        schema = func._schema
        written = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        if len(written) > 1 or (written and not written[0].is_meta):
            raise RuntimeError(
                f"ctx.init_module(): {func} writes {len(written)} tensors at once (or a "
                "real tensor from a meta one), which cannot be replayed after sharding. "
                "Build the model outside ctx.init_module().")
        target = written[0] if written else None
        rng = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            gen = _generator(func, args, kwargs)
            state = (gen if gen is not None else torch.default_generator).get_state()
            rng = (gen, state)
            self._advance(func, args, kwargs, target)
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            if not isinstance(e, NotImplementedError) and func is not aten._local_scalar_dense.default:
                raise  # a mistake of the model's own (shapes...), not the meta device's
            raise RuntimeError(
                f"ctx.init_module(): building the model needed the values of a tensor "
                f"({func} on the meta device: {e}), which the meta device does not have "
                "(.item(), .tolist(), a data-dependent shape). Build the model outside "
                "ctx.init_module(), or compute that value from plain numbers.") from e

        def keep(x):
            if x is target:
                return _SELF
            if _is_meta(x):
                return self.rec.ref(x)
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            return _CPU if _is_meta_device(x) else x

        rargs, rkwargs = tree_map(keep, args), tree_map(keep, kwargs)
        if target is not None:
            entry = self.rec.entry(target)
            if target.dtype != entry.dtype:
                raise RuntimeError(
                    f"ctx.init_module(): {func} writes a {target.dtype} view of a "
                    f"{entry.dtype} tensor, which cannot be replayed after sharding. Build "
                    "the model outside ctx.init_module().")
            view = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
            entry.ops.append(_Op(func, rargs, rkwargs, rng, target=view,
                                 overwrites=func in _FILLS and _whole(view, entry.numel)))
            return out
        outs, rets = tree_flatten(out)[0], schema.returns
        if not rets:
            return out
        aliases = [r.alias_info for r in rets] if len(rets) > 1 else [rets[0].alias_info] * len(outs)
        for k, o in enumerate(outs):
            if not _is_meta(o) or (k < len(aliases) and aliases[k] is not None):
                continue  # a view shares its base's storage and recipe
            entry = self.rec.entry(o)
            kw = dict(rkwargs)
            if any(a.name == "dtype" and a.kwarg_only for a in schema.arguments) and kw.get("dtype") is None:
                kw["dtype"] = o.dtype  # not the default dtype of replay time
            entry.creator = _Op(func, rargs, kw, rng, out_index=k)
            entry.dtype = o.dtype
        return out

    def _advance(self, func, args, kwargs, target) -> None:
        """Run a random op once on real CPU tensors so the generator moves as it would."""
        def real(x):
            if x is target:
                scratch = torch.empty(self.rec.entry(x).numel, dtype=x.dtype, device=_CPU)
                return scratch.as_strided(x.shape, x.stride(), x.storage_offset())
            if _is_meta(x):
                return _build(self.rec.ref(x))
            return _CPU if _is_meta_device(x) else x

        func(*tree_map(real, args), **tree_map(real, kwargs))


def _run(op: _Op, self_tensor: torch.Tensor | None = None):
    """Replay ``op`` on CPU tensors, with the random state it had when recorded."""
    def real(x):
        if x is _SELF:
            return self_tensor
        if isinstance(x, _Ref):
            return _build(x)
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


def _build(ref: _Ref) -> torch.Tensor:
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
        base = torch.empty(e.numel, dtype=e.dtype, device=_CPU)
    else:
        base = tree_flatten(_run(e.creator))[0][e.creator.out_index]
        start = 0
    with torch.no_grad():
        for op in ops[start:]:
            _run(op, base.as_strided(*op.target))
    return base.as_strided(ref.size, ref.stride, ref.offset)


# nn.init functions that return at once on a meta tensor (their sampling loops need
# values): while the block is open they are wrapped and recorded as one in-place op.
_SKIP_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


def _wrap_init(name: str, rec: Recording):
    original = getattr(nn.init, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        tensor = bound.arguments["tensor"]
        if not _is_meta(tensor):
            return original(*args, **kwargs)
        gen = bound.arguments.get("generator")
        state = (gen if gen is not None else torch.default_generator).get_state()
        rest = {k: v for k, v in bound.arguments.items() if k != "tensor"}
        entry = rec.entry(tensor)
        scratch = torch.empty(entry.numel, dtype=tensor.dtype, device=_CPU)
        view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        original(scratch.as_strided(*view), **rest)  # the generator moves as it would
        entry.ops.append(_Op(original, (_SELF,), rest, (gen, state), target=view,
                             overwrites=_whole(view, entry.numel)))
        return tensor

    return wrapper


@contextlib.contextmanager
def _recorded_inits(rec: Recording):
    originals = {name: getattr(nn.init, name) for name in _SKIP_META}
    # transformers keeps torch's init functions in a table of its own, taken at import
    hf = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", None)
    hf_originals = {name: hf[name] for name in _SKIP_META if name in hf} if hf else {}
    try:
        for name in _SKIP_META:
            setattr(nn.init, name, _wrap_init(name, rec))
        for name in hf_originals:
            hf[name] = getattr(nn.init, name)
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)
        for name, fn in hf_originals.items():
            hf[name] = fn


@contextlib.contextmanager
def _transformers_initialise():
    """transformers 5 skips a model's own weight initialisation (``_init_weights``: the
    0.02 normal of GPT-2's embeddings, its scaled ``c_proj``) when it sees the meta
    device, which made ``init_module()`` give other weights than plain construction.
    Inside the block it is told there is no meta device, so the model initialises its
    meta tensors as it would real ones, and the recorder sees every draw, in order."""
    utils = sys.modules.get("transformers.modeling_utils")
    probe = getattr(utils, "get_torch_context_manager_or_global_device", None)
    if probe is None:  # not imported, or a version that initialises on meta anyway
        yield
        return
    utils.get_torch_context_manager_or_global_device = lambda: None
    try:
        yield
    finally:
        utils.get_torch_context_manager_or_global_device = probe


class _TensorData(torch.overrides.TorchFunctionMode):
    """``torch.tensor(data)`` on the meta device drops ``data`` before any op is seen:
    make it on CPU and move it, so the recorder sees the values."""

    _FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FROM_DATA and torch.device(kwargs.get("device") or _META).type == "meta":
            return func(*args, **{**kwargs, "device": _CPU}).to(_META)
        return func(*args, **kwargs)


@contextlib.contextmanager
def record(rec: Recording | None = None):
    """Create tensors on the meta device and record how to give them their values."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    rec = rec if rec is not None else Recording()

    def registered(module, name, value):
        if _is_meta(value):
            rec.registered.append(weakref.ref(value))

    handles = [register_module_parameter_registration_hook(registered),
               register_module_buffer_registration_hook(registered)]
    try:
        with torch.device(_META), _TensorData(), _Recorder(rec), _recorded_inits(rec), \
                _transformers_initialise():
            yield rec
    finally:
        for h in handles:
            h.remove()
    rec.snapshot()


def on_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def sources(module: nn.Module, rec: Recording | None) -> dict[tuple[int, str], _Ref]:
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


def _uninitialised(ref: _Ref) -> bool:
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
                    copy_into(t, _build(ref))


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
