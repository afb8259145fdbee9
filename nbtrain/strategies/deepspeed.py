"""DeepSpeed ZeRO under Lightning's names (``deepspeed``, ``deepspeed_stage_1`` ...
``deepspeed_stage_3_offload``), run through nbtrain's ``ctx``.

``ctx.setup(model, opt)`` hands both to ``deepspeed.initialize`` and returns its engine
(an ``nn.Module``: call it as the model) and an optimizer whose ``step()`` is the
engine's step and whose ``zero_grad()`` the engine's; ``ctx.backward(loss)`` is the
engine's backward. The training function does not change.

The config is nbtrain's defaults with the user's own (``config=``, a dict or a JSON
path) merged over them: the stage, offload of the optimizer (stages 1-3) and of the
parameters (stage 3) to CPU memory, Lightning's bucket sizes (2e8; DeepSpeed's 5e8 makes
stage 3 allocate 2 GB up front), a torch optimizer allowed as it is (with offload too:
``zero_force_ds_cpu_optimizer`` off, so no native Adam is compiled). ``bf16`` computes
under ``torch.autocast`` with fp32 weights, as nbtrain's other strategies do
(DeepSpeed's ``torch_autocast``). DeepSpeed's shared-memory all-reduce op, which only its
own launcher uses and which costs a 100 s C++ build on first use, is turned off.

``ctx.accumulate`` and ``ctx.no_backward_sync`` move DeepSpeed's gradient-accumulation
boundary (stage 1 reduces once, at the last micro-step; stages 2 and 3 reduce-scatter
every backward, keeping only their partition). ``ctx.clip_grad_norm_`` returns the norm
of the whole model's reduced gradients, read from DeepSpeed's partitions, and DeepSpeed's
step clips with it. ``ctx.save``/``ctx.load`` write and read torch's keys (those of a
DDP/FSDP model and its optimizer), gathered from and scattered to DeepSpeed's
partitions one parameter at a time, so checkpoints move between DeepSpeed, the other
strategies and a plain model. fp16 is refused at setup (its loss scaling is not wired;
bf16 is). ``ctx.init_module()`` gives the values plain construction gives; the model is
materialised whole on each rank before DeepSpeed partitions it (stage 3's ``zero.Init``,
which never holds it whole, is not used yet).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from . import norms
from .base import Host, Strategy

if TYPE_CHECKING:
    from ..launch.devices import DevicePlan

INSTALL = 'pip install "nbtrain[deepspeed]"'
# Engines made in this process, for release(): DeepSpeed's gradient hooks on the
# parameters' autograd nodes hold its optimizer in a cycle Python cannot collect
_ENGINES: weakref.WeakSet = weakref.WeakSet()
BUCKET = int(2e8)  # Lightning's reduce and all-gather bucket sizes


MINIMUM = (0, 19, 8)  # pyproject's extra; tested with it


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def installed_version() -> tuple[int, ...]:
    """The installed DeepSpeed's release, as numbers (``(0, 19, 8)``)."""
    import importlib.metadata
    import re

    version = importlib.metadata.version("deepspeed")
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, nested dicts key by key."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class DeepSpeed(Strategy):
    stage: int = 2
    # Keep the optimizer state (and its fp32 weights) in CPU memory.
    offload_optimizer: bool = False
    # Keep the parameters in CPU memory between uses (stage 3 only).
    offload_parameters: bool = False
    # Your DeepSpeed config, a dict or a JSON file's path, merged over nbtrain's defaults.
    config: dict | str | None = None

    description: ClassVar[str] = (
        "DeepSpeed ZeRO stage 2: gradients and optimizer state sharded, parameters whole "
        "on every rank (needs nbtrain[deepspeed]).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage not in (1, 2, 3):
            raise ValueError(f"DeepSpeed stage={self.stage!r}: ZeRO stages are 1, 2 and 3.")
        if self.offload_parameters and self.stage != 3:
            raise ValueError("offload_parameters=True needs ZeRO stage 3 (stages 1 and 2 "
                             "keep whole parameters on every rank): use "
                             "'deepspeed_stage_3_offload'.")
        if isinstance(self.config, (str, os.PathLike)):
            path = Path(self.config)
            if not path.is_file():
                raise FileNotFoundError(f"DeepSpeed config={str(self.config)!r}: no such "
                                        "file. Give a dict or the path of a JSON file.")
            try:
                self.config = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"DeepSpeed config {str(path)!r} is not JSON: {err}") from None
        if self.config is not None and not isinstance(self.config, dict):
            raise TypeError(f"DeepSpeed config= takes a dict or a JSON file's path; got "
                            f"{type(self.config).__name__}.")
        if self.mixed_precision == "fp16":
            raise ValueError(
                "mixed_precision='fp16' is refused under DeepSpeed: with fp32 weights under "
                "autocast (nbtrain's fp16, as under ddp and fsdp) DeepSpeed 0.19.8's ZeRO "
                "skips every step once the first overflows (its overflow check returns "
                "before the loss scaler lowers its scale; measured: the weights never "
                "move). Use 'bf16', or DeepSpeed's own config={'fp16': {'enabled': True}} "
                "(fp16 weights: your inputs must then be fp16 too).")

    def warm_imports_for(self, accelerator: str) -> tuple[str, ...]:
        # On CPU the kernel imports DeepSpeed once (its CPU accelerator, chosen by name:
        # nothing asks CUDA), so forked workers start with it. On GPUs never: a bare
        # import asks torch.cuda.is_available(), after which the kernel cannot fork.
        if accelerator != "cpu" or not available():
            return ()
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return ("deepspeed",)

    def start_rank(self, device: torch.device) -> None:
        # before the function runs: an optimizer it builds before ctx.setup (DeepSpeed's
        # CPU Adam) compiles with the note, and without the shared-memory op
        if available():
            import_deepspeed(device.type)

    def check(self, plan: DevicePlan) -> None:
        super().check(plan)
        if not available():
            raise ValueError(f"strategy {self.name or 'deepspeed'!r} needs DeepSpeed, which "
                             f"is not installed: {INSTALL} (a pure-Python wheel; no compiler "
                             "needed for ZeRO stages 1-3).")
        found = installed_version()
        if found < MINIMUM:
            raise ValueError(f"strategy {self.name or 'deepspeed'!r} needs DeepSpeed >= "
                             f"{'.'.join(map(str, MINIMUM))} (the version nbtrain is tested "
                             f"with); this environment has {'.'.join(map(str, found))}: "
                             f"pip install -U {INSTALL.split(' ', 2)[2]}")
        if self.sync_batchnorm:
            raise ValueError("sync_batchnorm=True is not supported under DeepSpeed here.")

    def ds_config(self, ctx: Host) -> dict:
        zero: dict[str, Any] = {"stage": self.stage, "reduce_bucket_size": BUCKET,
                                "allgather_bucket_size": BUCKET}
        pin = ctx.device.type == "cuda"
        if self.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        if self.offload_parameters:
            zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
        if self.stage == 3:
            zero.update(stage3_prefetch_bucket_size=BUCKET,
                        stage3_param_persistence_threshold=0)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: you feed the batches
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,  # your torch optimizer, as it is
            "zero_force_ds_cpu_optimizer": False,  # offload without compiling CPU Adam
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 unless told; one process does not
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if self.mixed_precision == "bf16":
            config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
        return merge(config, self.config or {})

    def setup_module(self, module: nn.Module, ctx: Host) -> nn.Module:
        raise RuntimeError("DeepSpeed takes the model and its optimizer together: "
                           "ctx.setup(model, opt).")

    def setup_engine(self, module: nn.Module, optimizers: tuple, ctx: Host):
        """``(engine, (optimizer,))`` from ``deepspeed.initialize``."""
        if len(optimizers) > 1:
            raise ValueError(f"DeepSpeed trains a model with one optimizer; ctx.setup got "
                             f"{len(optimizers)}. Put the parameter groups in one optimizer.")
        deepspeed = import_deepspeed(ctx.device.type)
        module = module.to(ctx.device)
        self.checkpoint_activations(module)
        norms.broadcast_before_forward(module)  # DDP's rule for running statistics
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizers[0] if optimizers else None,
            model_parameters=None if optimizers else list(module.parameters()),
            config=self.ds_config(ctx))
        _ENGINES.add(engine)
        if self.stage == 3:
            _explain_module_order(engine)
        return engine, ((EngineOptimizer(engine, optimizer),) if optimizers else ())

    @contextlib.contextmanager
    def no_backward_sync(self, engine):
        """Backward inside accumulates gradients; the reduction waits for the first
        backward after the block (DeepSpeed's gradient-accumulation boundary). Stage 1
        keeps whole local gradients until then; stages 2 and 3 reduce-scatter every
        backward (a rank keeps only its partition) and add up the partitions."""
        if engine.gradient_accumulation_steps() > 1:
            raise ValueError(
                f"your DeepSpeed config sets gradient_accumulation_steps="
                f"{engine.gradient_accumulation_steps()}: DeepSpeed then accumulates by "
                "itself (every backward divided by it, a step every n-th opt.step()). Use "
                "that or ctx.accumulate / ctx.no_backward_sync, not both.")
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(True)

    def clip_grad_norm_(self, engine, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The 2-norm of the whole model's (reduced, unscaled) gradients, from
        DeepSpeed's partitions; the coming ``opt.step()`` clips them to ``max_norm``
        (DeepSpeed clips inside its step, with the same norm and the same factor as
        ``torch.nn.utils.clip_grad_norm_``)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type!r}: DeepSpeed clips by the 2-norm only.")
        opt = engine.optimizer
        if not engine.is_gradient_accumulation_boundary():
            raise RuntimeError("ctx.clip_grad_norm_ inside ctx.no_backward_sync: the "
                               "gradients are not reduced yet; clip after the last "
                               "micro-step's backward.")
        if engine.zero_optimization_stage() == 3:  # per group; DeepSpeed marks inf/NaN -1
            groups = torch.stack([torch.as_tensor(n, dtype=torch.float32).reshape(())
                                  for n in opt._get_norm_groups()])
            scaled = torch.linalg.vector_norm(groups)
            if not bool(torch.isfinite(groups).all() and (groups >= 0).all()):
                scaled = torch.full_like(scaled, float("inf"))
        else:
            scaled = opt.scaled_global_norm()
        opt.clip_grad = float(max_norm)  # for this step; EngineOptimizer.step restores it
        scale = getattr(opt, "loss_scale", 1.0)
        return (scaled / scale).detach().float().reshape(())

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        engine = module
        norms.sync_statistics(engine.module)
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if getattr(engine, "zero_optimization_partition_weights", lambda: False)():
            full = engine._zero3_consolidated_16bit_state_dict()  # a collective
        else:
            full = engine.module.state_dict()
        if not rank0:
            return {}
        return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in (full or {}).items()}

    def summary(self) -> str:
        extras = [f"stage={self.stage}"]
        if self.offload_optimizer:
            extras.append("offload_optimizer")
        if self.offload_parameters:
            extras.append("offload_parameters")
        if self.mixed_precision:
            extras.append(f"mixed_precision={self.mixed_precision}")
        return self.name + f" ({', '.join(extras)})"


STAGE3_ORDER = (
    "nbtrain: DeepSpeed's stage 3 found that this rank ran other modules than rank 0 (a "
    "mixture of experts whose router sent no token to an expert here, or a branch one "
    "rank took alone). Stage 3 gathers parameters in the order the first step ran the "
    "modules and needs every rank to run the same ones. Use strategy='fsdp' (nbtrain "
    "gives the parameters a rank left unused zero gradients there and steps them as one "
    "process does); 'deepspeed' and 'deepspeed_stage_1' run such a model but step those "
    "parameters with zero gradients (one process skips them).")


def _explain_module_order(engine) -> None:
    """Add ``STAGE3_ORDER`` to DeepSpeed's "disagreement on list contents" error, raised
    in a forward when the ranks ran different modules. Through a weak reference: the
    engine holds this wrapper, and its release must not wait for the cycle collector."""
    forward, ref = type(engine).forward, weakref.ref(engine)

    def forward_explained(*args, **kwargs):
        try:
            return forward(ref(), *args, **kwargs)
        except RuntimeError as err:
            if "disagreement on list contents" in str(err):
                err.add_note(STAGE3_ORDER)
            raise

    engine.forward = forward_explained


class EngineOptimizer:
    """What the training function holds as its optimizer: ``step()`` steps the engine
    (optimizer step, then its gradients cleared), ``zero_grad()`` clears them;
    ``param_groups`` and ``state_dict`` are DeepSpeed's optimizer's (an LR scheduler
    built on this object's ``param_groups`` drives it)."""

    def __init__(self, engine, optimizer):
        self.engine, self.optimizer = engine, optimizer

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DeepSpeed's step takes no closure.")
        try:
            self.engine.step()
        finally:  # a ctx.clip_grad_norm_ clips this step only
            if hasattr(self.optimizer, "clip_grad"):
                self.optimizer.clip_grad = self.engine.gradient_clipping()

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return getattr(self.optimizer, "state", {})

    def state_dict(self):
        return self.optimizer.state_dict()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer DeepSpeed steps (on this rank's partition)."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def register_step_post_hook(self, hook):
        return self.torch_optimizer.register_step_post_hook(
            lambda opt, args, kwargs: hook(self, args, kwargs))

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.optimizer).__name__})"


def is_engine(model) -> bool:
    return callable(getattr(model, "zero_optimization_stage", None))


def memory_tensors(engine) -> dict[str, list[torch.Tensor]]:
    """The tensors of each memory category on this rank, from DeepSpeed's partitions:
    params (stage 3: this rank's partition ``ds_tensor``; else the whole parameters),
    grads (the partition of gradients the optimizer steps on; DeepSpeed frees the
    whole ones after reducing), optimizer (the fp32 master partition DeepSpeed keeps
    even in fp32 training, and the torch optimizer's state). Offloaded ones are on
    the CPU, which the probe reports apart on a GPU run."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        params = [p.ds_tensor for p in engine.module.parameters()
                  if getattr(p, "ds_tensor", None) is not None]
        masters = list(getattr(opt, "fp32_partitioned_groups_flat", []) or [])
    else:
        params = list(engine.module.parameters())
        masters = list(getattr(opt, "single_partition_of_fp32_groups", []) or [])
    grads = [m.grad for m in masters if getattr(m, "grad", None) is not None]
    inner = getattr(opt, "optimizer", opt)
    state = [v for per_param in getattr(inner, "state", {}).values()
             for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": params, "grads": grads, "optimizer": masters + state}


# -- checkpoints: torch's state dicts, read from and written to DeepSpeed's partitions --
# The same keys torch's distributed-checkpoint helpers give a DDP or FSDP model and its
# optimizer (parameter names; optimizer state flattened to ``state.<name>.<key>`` and
# ``param_groups.<name>.<option>``), so a checkpoint moves between DeepSpeed, the other
# strategies and a plain model. Each call is a collective: every rank gathers the whole
# tensors, one parameter at a time, with DeepSpeed's ``safe_get_full_*`` functions.
def _partitions(engine) -> list[tuple[int, torch.Tensor, list[nn.Parameter]]]:
    """(param group, flat fp32 partition, the parameters it holds) for each partition
    DeepSpeed's torch optimizer steps and keeps its state for."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() == 3:
        return [(opt.sub_group_to_group_id[sub], opt.fp32_partitioned_groups_flat[sub], group)
                for sub, group in enumerate(opt.fp16_groups)]
    return [(i, opt.single_partition_of_fp32_groups[i], group)
            for i, group in enumerate(opt.bit16_groups)]


def _by_param(engine) -> dict[int, tuple[int, torch.Tensor]]:
    """``id(param)`` -> (its param group, its flat fp32 partition)."""
    return {id(p): (group, flat) for group, flat, params in _partitions(engine) for p in params}


def model_state_dict(engine) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank, on the CPU: each trained parameter's
    fp32 master copy, frozen ones and buffers as they are."""
    from deepspeed.utils import safe_get_full_fp32_param

    stage3 = engine.zero_optimization_stage() == 3
    owned = _by_param(engine)
    out, seen = {}, {}
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if id(value) in seen:  # a tied weight: once
            out[name] = seen[id(value)]
            continue
        if isinstance(value, nn.Parameter) and id(value) in owned:
            full = safe_get_full_fp32_param(value)
        elif isinstance(value, nn.Parameter) and stage3:  # frozen, still partitioned
            import deepspeed

            with deepspeed.zero.GatheredParameters([value]):
                full = value.detach().clone()
        else:
            full = value.detach() if isinstance(value, torch.Tensor) else value
        if isinstance(full, torch.Tensor):
            full = full.to("cpu", copy=True)
        out[name] = seen[id(value)] = full
    return out


def load_model_state_dict(engine, state: dict[str, Any], strict: bool = True) -> None:
    """Every rank copies its part of ``state`` into the master copies and the
    partitions of the parameters, and the buffers whole."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    stage3 = engine.zero_optimization_stage() == 3
    owned = _by_param(engine)
    current = engine.module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(current) - set(state))
        unexpected = sorted(set(state) - set(current))
        if missing or unexpected:
            raise KeyError(f"the checkpoint's model does not match: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]} (strict=False loads what matches).")
    done = set()
    with torch.no_grad():
        for name, target in current.items():
            if name not in state or id(target) in done or not isinstance(target, torch.Tensor):
                continue
            done.add(id(target))
            value = state[name]
            if id(target) in owned:  # the fp32 master copy
                safe_set_full_fp32_param(target, value.to(owned[id(target)][1].device,
                                                          torch.float32))
            if isinstance(target, nn.Parameter) and stage3:  # this rank's partition
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    target.data.copy_(value.reshape(target.shape))
            else:
                target.data.copy_(value.reshape(target.shape))


def _init_optimizer_state(engine) -> None:
    """Give DeepSpeed's torch optimizer its state for every flat partition that has
    none yet (before the first step; as torch's ``set_optimizer_state_dict`` does): a
    step with zero gradients and a learning rate of 0, which changes no weight. Then
    stages 1 and 2 map each parameter into the state (lazily, as after a step)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    empty = [(group, flat) for group, flat, _ in _partitions(engine) if not inner.state.get(flat)]
    if empty:
        saved = [(group["params"], group["lr"]) for group in inner.param_groups]
        grads = [flat.grad for _, flat in empty]  # offload keeps its gradient buffers there
        for i, group in enumerate(inner.param_groups):
            # DeepSpeed's stage 3 puts a partition in its group only while stepping it
            group["params"] = [flat for g, flat in empty if g == i]
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else group["lr"] * 0
        for _, flat in empty:
            flat.grad = torch.zeros_like(flat)
        try:
            inner.step()
        finally:
            for (_, flat), grad in zip(empty, grads, strict=True):
                flat.grad = grad
            for group, (params, lr) in zip(inner.param_groups, saved, strict=True):
                group["params"], group["lr"] = params, lr
    link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def optimizer_state_dict(engine) -> dict[str, Any]:
    """The optimizer's state, whole, on every rank, keyed as torch's
    ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` keys it."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    owned = _by_param(engine)
    _init_optimizer_state(engine)  # as torch's get_optimizer_state_dict does
    out: dict[str, Any] = {}
    for name, param in engine.module.named_parameters():
        if id(param) not in owned:
            continue
        group, flat = owned[id(param)]
        for key, value in inner.state[flat].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                full = safe_get_full_optimizer_state(param, key)
                out[f"state.{name}.{key}"] = full.to("cpu", copy=True)
            else:  # the step count, the same for the whole partition
                out[f"state.{name}.{key}"] = (value.detach().to("cpu", copy=True)
                                              if isinstance(value, torch.Tensor) else value)
        for key, value in inner.param_groups[group].items():
            if key != "params":
                out[f"param_groups.{name}.{key}"] = value
    return out


def load_optimizer_state_dict(engine, state: dict[str, Any]) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    _init_optimizer_state(engine)
    owned = _by_param(engine)
    params = [(name, p) for name, p in engine.module.named_parameters() if id(p) in owned]
    # a tensor state the optimizer lacks so far (SGD's momentum before its first step):
    # made beside the partition it belongs to, then mapped to the parameters again
    added = False
    for name, param in params:
        flat = owned[id(param)][1]
        prefix = f"state.{name}."
        for key, value in state.items():
            if (key.startswith(prefix) and isinstance(value, torch.Tensor) and value.dim() > 0
                    and key[len(prefix):] not in inner.state[flat]):
                inner.state[flat][key[len(prefix):]] = torch.zeros_like(flat)
                added = True
    if added and hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    with torch.no_grad():
        for name, param in params:
            group, flat = owned[id(param)]
            for key, value in state.items():
                if key.startswith(f"param_groups.{name}."):
                    inner.param_groups[group][key[len(f"param_groups.{name}."):]] = value
                if not key.startswith(f"state.{name}."):
                    continue
                key = key[len(f"state.{name}."):]
                old = inner.state[flat].get(key)
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    safe_set_full_optimizer_state(param, value.to(old.device, old.dtype), key)
                else:  # the step count, one for the whole partition
                    inner.state[flat][key] = (value.to(old.device, old.dtype).clone()
                                              if isinstance(old, torch.Tensor) else value)


def import_deepspeed(device_type: str):
    """``import deepspeed``, quietly, with its CPU accelerator on CPU and without the
    shared-memory op only its own launcher uses (a 100 s C++ build)."""
    import logging
    import sys

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
    import shutil
    import time

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
    import sys

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
    import torch.distributed as dist

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
