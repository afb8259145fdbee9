"""``nbtrain.plan()``'s rehearsal: the function ``launch()`` would run, as rank 0 of N, on
the meta device, up to its second optimizer step (``planner.py`` reads what it found).

A ``Context`` whose ``ctx.setup`` moves the model to the meta device (tied parameters
kept tied) and whose ``ctx.dataloader`` hands out meta batches of one rank's shard.
Nothing is allocated, no GPU is touched (forking stays safe), no data is read: a value
read from a meta tensor (``loss.item()``, Adam's step count) reads as 1. The kernel's
random generators are as they were after it. In the second step, what the forward saves
for backward (the tensors ``Telemetry(profile_memory=True)`` measures in a run) and every
storage the step makes (``_Live``)."""

from __future__ import annotations

import contextlib
import os
import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .context import Context
from .halfmeta import half_meta
from .spec import WorkerSpec
from .strategies.base import ParamSize, Strategy
from .telemetry.probes import ActivationProbe
from .telemetry.settings import Telemetry


class Rehearsed(Exception):
    """Two optimizer steps done: the rehearsal ends here."""


@contextlib.contextmanager
def _fused_attention():
    """torch's attention on the meta device takes its unfused path, which keeps the
    sequence-by-sequence weights for backward; a GPU's (and a CPU's) fused kernels keep
    the query, key, value, output and log-sum-exp instead. While the rehearsal runs,
    ``F.scaled_dot_product_attention`` of meta tensors keeps those (models call it by
    that name; activation checkpointing recomputes on autograd's thread, where a mode
    entered here would not reach)."""
    original = F.scaled_dot_product_attention

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                  scale=None, enable_gqa=False):
        if has_torch_function((query, key, value)):  # halfmeta's casts see it by name
            return handle_torch_function(
                attention, (query, key, value), query, key, value, attn_mask=attn_mask,
                dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if not (query.is_meta and torch.is_grad_enabled()):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return _Fused.apply(query, key, value, attn_mask, dropout_p, is_causal, scale,
                            enable_gqa, original)

    attention.__name__ = original.__name__
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, is_causal, scale, gqa, original):
        with torch.no_grad():
            out = original(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=is_causal, scale=scale,
                                                 enable_gqa=gqa)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors[:3]
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
                None, None, None, None, None, None)


class _MetaScalars(TorchDispatchMode):
    """A value read from a meta tensor is 1 (the rehearsal has shapes, not values)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            t = args[0]
            return True if t.dtype == torch.bool else 1.0 if t.is_floating_point() else 1
        return func(*args, **(kwargs or {}))


class _Live(TorchDispatchMode):
    """The bytes live at once during the second step, and their most: every storage an
    op makes counts from then until it is freed (its storage object dies: each op's
    outputs are the only way new memory appears). At each new most, what of it was
    gradients (the parameters' ``.grad``) and optimizer (made in an optimizer's step:
    its state and the step's temporaries); the parameters, whole, are there throughout.
    (torch's ``MemTracker`` does the same and more, with a cost per op that grows with
    the tensors alive: a 124M-parameter GPT-2's step took it 5 s.)"""

    def __init__(self, model: nn.Module, optimizers):
        super().__init__()
        self._params = list(model.parameters())
        self._sizes: dict[int, tuple[int, bool]] = {}  # storage -> (bytes, optimizer's)
        self.live = self.optimizer = 0.0
        self.stepping = False
        self.paused = False
        for t in (*self._params, *model.buffers(), *(p.grad for p in self._params)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.stepping = True  # the state the first step made
        for opt in optimizers:
            for state in opt.state.values():
                for t in state.values():
                    if isinstance(t, torch.Tensor):
                        self._track(t)
        self.stepping = False
        self.peak: dict[str, float] = {"total": self.live, "grad": 0.0, "opt": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not self.paused:
                self._track(t)
        if self.live > self.peak["total"]:
            self.peak = {"total": self.live, "opt": self.optimizer, "grad": sum(
                p.grad.untyped_storage().nbytes() for p in self._params if p.grad is not None)}
        return out

    @contextlib.contextmanager
    def aside(self):
        """What is made inside is not counted (FSDP's gathered parameters: the planner
        counts them by its units)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._sizes:
            return
        nbytes = storage.nbytes()
        self._sizes[key] = (nbytes, self.stepping)
        self.live += nbytes
        if self.stepping:
            self.optimizer += nbytes
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        nbytes, optimizer = self._sizes.pop(key, (0, False))
        self.live -= nbytes
        if optimizer:
            self.optimizer -= nbytes


@dataclass
class _Rehearsal(Strategy):
    """ctx.setup's strategy in a rehearsal: the model on the meta device, whole, its
    optimizers' steps counted, the second step's tensors followed (``_Live``)."""

    name: str = "rehearsal"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.model: nn.Module | None = None
        self.optimizers: tuple = ()
        self.steps = 0
        self.tracker = None
        self._probe = ActivationProbe()
        self.half = None  # halfmeta.HalfMeta when a precision is rehearsed
        self._blocks: list[nn.Module] = []

    def setup_module(self, module: nn.Module, ctx) -> nn.Module:
        _to_meta(module)
        self._blocks = [w._checkpoint_wrapped_module
                        for w in self.checkpoint_activations(module).values()]
        return module

    def aside(self):
        return self.tracker.aside() if self.tracker is not None else contextlib.nullcontext()

    def setup(self, module, optimizers, ctx, materialize=None):
        if self.model is not None:
            raise ValueError("nbtrain.plan rehearses one model: the function called "
                             "ctx.setup twice before its second optimizer step.")
        if not optimizers:
            raise ValueError("nbtrain.plan needs the optimizer: call ctx.setup(model, "
                             "optimizer) in the function.")
        wrapped, optimizers = super().setup(module, optimizers, ctx, None)
        self.model, self.optimizers = wrapped, optimizers
        for opt in optimizers:
            opt.register_step_pre_hook(self._steps)
            opt.register_step_post_hook(self._stepped)
        # the second step's forward: what it saves for backward (as profile_memory measures)
        wrapped.register_forward_pre_hook(self._forward_starts)
        wrapped.register_forward_hook(self._forward_ends)
        if self.half is not None:  # registered after: inside the probe's forward
            self.half.watch(wrapped, self._blocks)
        return wrapped, optimizers

    def _forward_starts(self, module, args) -> None:
        if self.steps == 1 and torch.is_grad_enabled():
            if self.tracker is None:  # the second step: followed from its forward on
                self.tracker = _Live(self.model, self.optimizers)
                self.tracker.__enter__()
            self._probe.start()

    def _forward_ends(self, module, args, output) -> None:
        self._probe.stop()

    def _steps(self, optimizer, args, kwargs) -> None:
        if self.tracker is not None:
            self.tracker.stepping = True

    def _stepped(self, optimizer, args, kwargs) -> None:
        if optimizer is not self.optimizers[0]:
            return
        self.steps += 1
        if self.steps == 2:
            raise Rehearsed

    def end(self) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)


class _PlanContext(Context):
    """Rank 0 of ``world_size``, on the meta device, without a process group."""

    def __init__(self, world_size: int, strategy: _Rehearsal, seed: int):
        spec = WorkerSpec(rank=0, local_rank=0, world_size=world_size, accelerator="cpu",
                          device_index=None, backend="gloo", store_host="", store_port=None,
                          telemetry_address=None, telemetry_token="", num_threads=None,
                          pg_timeout_s=0.0, parent_pid=os.getpid(), die_with_parent=False,
                          telemetry=Telemetry(enabled=False), seed=seed, data_seed=seed)
        super().__init__(spec, strategy)
        self.device = torch.device("meta")

    def barrier(self) -> None:
        """One process: nothing to wait for."""


def _to_meta(module: nn.Module) -> None:
    """``module`` on the meta device with its shared parameters still shared (a module's
    ``to`` makes one new parameter per module that holds it: GPT-2's tied embedding
    would count twice)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((m, name))
    module.to("meta")
    for (first, name), *rest in places.values():
        for m, other in rest:
            m._parameters[other] = first._parameters[name]


@dataclass
class Trace:
    model: nn.Module
    sizes: list[ParamSize]
    activations: float
    peak: dict[str, float]  # the step's most live bytes ("total"), of them "grad", "opt"


def rehearse(fn: Callable, args, kwargs, world_size: int, checkpointing, seed: int,
             half: tuple[str, torch.dtype, str] | None = None) -> Trace:
    """``half``: (how, dtype, device type) to rehearse mixed precision (``halfmeta``)."""
    rehearsal = _Rehearsal(activation_checkpointing=checkpointing)
    ctx = _PlanContext(world_size, rehearsal, seed)
    how, dtype, device_type = half or (None, None, "cpu")
    with torch.random.fork_rng(devices=[]):
        state = random.getstate()
        try:
            with _MetaScalars(), _fused_attention(), \
                    half_meta(how, dtype, device_type, rehearsal.aside) as mode:
                rehearsal.half = mode
                try:
                    fn(ctx, *args, **kwargs)
                except Rehearsed:
                    pass
                finally:
                    rehearsal.end()
        finally:
            random.setstate(state)
    if rehearsal.model is None or rehearsal.steps < 2:
        raise ValueError(
            "nbtrain.plan rehearses the function up to its second optimizer step, and "
            f"{'it never called ctx.setup(model, optimizer)' if rehearsal.model is None else 'it returned before'}"
            ": plan a function that trains with ctx.setup and steps its optimizer at least "
            "twice.")
    return _trace(rehearsal)


def _trace(rehearsal: _Rehearsal) -> Trace:
    model = rehearsal.model
    state = {}
    for opt in rehearsal.optimizers:
        state.update({id(p): s for p, s in opt.state.items()})
    sizes = []
    for p in model.parameters():  # shared ones once
        shaped = fixed = 0
        for v in state.get(id(p), {}).values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:  # as runs count (no step counts)
                nbytes = v.numel() * v.element_size()
                if v.shape == p.shape:
                    shaped += nbytes
                else:
                    fixed += nbytes
        nbytes = p.numel() * p.element_size()
        sizes.append(ParamSize(numel=p.numel(), rows=p.shape[0] if p.dim() else 1,
                               param_bytes=nbytes, grad_bytes=nbytes if p.requires_grad else 0,
                               state_bytes=shaped, state_fixed=fixed))
    return Trace(model, sizes, float(rehearsal._probe.bytes), rehearsal.tracker.peak)
