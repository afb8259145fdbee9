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

Here: the recording. What it records, and the replay, are in ``meta_values.py``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .meta_values import CPU, SELF, Op, Recording, build

aten = torch.ops.aten
_META = torch.device("meta")


# In-place ops that set every element of their target without reading it.
_FILLS = {aten.uniform_.default, aten.normal_.default, aten.fill_.Scalar, aten.fill_.Tensor,
          aten.zero_.default, aten.copy_.default, aten.random_.default, getattr(aten.random_, "from"),
          aten.random_.to, aten.exponential_.default, aten.bernoulli_.float,
          aten.log_normal_.default, aten.cauchy_.default, aten.geometric_.default}


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
                return SELF
            if _is_meta(x):
                return self.rec.ref(x)
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            return CPU if _is_meta_device(x) else x

        rargs, rkwargs = tree_map(keep, args), tree_map(keep, kwargs)
        if target is not None:
            entry = self.rec.entry(target)
            if target.dtype != entry.dtype:
                raise RuntimeError(
                    f"ctx.init_module(): {func} writes a {target.dtype} view of a "
                    f"{entry.dtype} tensor, which cannot be replayed after sharding. Build "
                    "the model outside ctx.init_module().")
            view = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
            entry.ops.append(Op(func, rargs, rkwargs, rng, target=view,
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
            entry.creator = Op(func, rargs, kw, rng, out_index=k)
            entry.dtype = o.dtype
        return out

    def _advance(self, func, args, kwargs, target) -> None:
        """Run a random op once on real CPU tensors so the generator moves as it would."""
        def real(x):
            if x is target:
                scratch = torch.empty(self.rec.entry(x).numel, dtype=x.dtype, device=CPU)
                return scratch.as_strided(x.shape, x.stride(), x.storage_offset())
            if _is_meta(x):
                return build(self.rec.ref(x))
            return CPU if _is_meta_device(x) else x

        func(*tree_map(real, args), **tree_map(real, kwargs))


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
        scratch = torch.empty(entry.numel, dtype=tensor.dtype, device=CPU)
        view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        original(scratch.as_strided(*view), **rest)  # the generator moves as it would
        entry.ops.append(Op(original, (SELF,), rest, (gen, state), target=view,
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
            return func(*args, **{**kwargs, "device": CPU}).to(_META)
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


