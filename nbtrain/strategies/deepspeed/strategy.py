"""The DeepSpeed strategy: its options and config, and its hooks, through which
``ctx`` trains, clips, accumulates, checkpoints and measures a DeepSpeed engine."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from .. import norms
from ..base import Host, Strategy, repoint
from . import state
from .optimizer import EngineOptimizer, is_engine
from .runtime import (
    INSTALL,
    MINIMUM,
    available,
    import_deepspeed,
    installed_version,
    release,
    remember,
)

if TYPE_CHECKING:
    from ...deviceplan import DevicePlan

# Lightning's reduce and all-gather bucket sizes, in elements. Every ZeRO stage allocates
# a gradient bucket of reduce_bucket_size fp32 elements for the backward (stage 3 keeps
# it), whatever the model's size: 800 MB a rank at 2e8, measured beside a model of 4k
# parameters. nbtrain asks for no more than the trainable parameters (all of them in one
# bucket, as 2e8 puts a smaller model), unless your config sets it.
BUCKET = int(2e8)


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

    def sharded(self) -> frozenset[str]:
        return frozenset(("optimizer", "grads", "params")[:self.stage])

    def theory(self, state: dict[str, float], world_size: int,
               n_params: int) -> dict[str, float]:
        # DeepSpeed keeps an fp32 master partition beside the optimizer's moments (4Ψ/N,
        # counted with the optimizer as the ZeRO paper does), even when training in fp32
        with_master = {**state, "optimizer": state["optimizer"] + 4 * n_params}
        return super().theory(with_master, world_size, n_params)

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

    def installed(self) -> bool:
        return available()

    @property
    def offload(self) -> bool:
        """Model state kept in CPU memory (``nbtrain.plan`` counts it off the device and
        picks it last)."""
        return self.offload_optimizer or self.offload_parameters

    def reduce_bucket(self, module: nn.Module | None = None) -> int:
        """The elements of the gradient bucket DeepSpeed allocates (``BUCKET``'s note):
        your config's, else the trainable parameters' up to ``BUCKET``."""
        given = ((self.config or {}).get("zero_optimization") or {}).get("reduce_bucket_size")
        if given is not None:
            return int(given)
        if module is None:
            return BUCKET
        return max(1, min(BUCKET, sum(p.numel() for p in module.parameters()
                                      if p.requires_grad)))

    def held(self, sizes, world_size: int) -> dict[str, float]:
        """What a run measures on a rank's device between steps (``state.memory_tensors``):
        the parameters whole (stage 3: each one's 1/N, as ``ds_tensor``), the fp32
        gradients of the rank's partition, and in the optimizer the fp32 master partition
        beside the optimizer's state of it; what is offloaded, nothing."""
        trained = [s for s in sizes if s.grad_bytes and s.numel]
        if self.stage == 3:  # each parameter's ceil(numel / N) elements
            share = {id(s): -(-s.numel // world_size) / s.numel for s in sizes if s.numel}
            params = sum(s.param_bytes * share[id(s)] for s in sizes if s.numel)
            part = sum(s.numel * share[id(s)] for s in trained)
            state = sum(s.state_bytes * share[id(s)] for s in trained)
        else:  # one flat buffer, padded to a multiple of 2N elements (its NCCL alignment;
            # per parameter group, so under 2N elements a group more than this)
            n = sum(s.numel for s in trained)
            padded = -(-n // (2 * world_size)) * 2 * world_size
            size = trained[0].param_bytes / trained[0].numel if trained else 4
            params = sum(s.param_bytes for s in sizes) + (padded - n) * size
            part = padded / world_size
            state = sum(s.state_bytes for s in trained) * part / n if n else 0.0
        return {"params": 0.0 if self.offload_parameters else float(params),
                "grads": 0.0 if self.offload_optimizer else 4.0 * part,
                "optimizer": 0.0 if self.offload_optimizer else 4.0 * part + state}

    def gathered(self, model: nn.Module, world_size: int) -> float:
        """At the peak, beyond ``held``: the fp32 gradient bucket (``reduce_bucket``); at
        stage 3 also the parameters gathered for the modules running and prefetched (up
        to ``stage3_prefetch_bucket_size`` elements ahead: for most models a notebook
        trains, all of them), less the rank's own share."""
        total = sum(p.numel() for p in model.parameters())
        extra = 4.0 * self.reduce_bucket(model)
        if self.stage == 3:
            size = max((p.element_size() for p in model.parameters()), default=4)
            largest = max((sum(p.numel() for p in m.parameters(recurse=False))
                           for m in model.modules()), default=0)
            live = min(total, BUCKET + largest) * size
            extra += live * (1.0 if self.offload_parameters else 1 - 1 / world_size)
        return extra

    def sent(self, model: nn.Module, world_size: int) -> float:
        """As the ZeRO paper counts it: the gradients reduced to their partitions' owners
        and the updated parameters gathered back (stages 1 and 2, DDP's bytes); at stage 3
        the parameters gathered twice, for forward and for backward."""
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return (world_size - 1) / world_size * (grads + params * (2 if self.stage == 3 else 1))

    def ds_config(self, ctx: Host, module: nn.Module | None = None) -> dict:
        bucket = self.reduce_bucket(module)
        zero: dict[str, Any] = {"stage": self.stage, "reduce_bucket_size": bucket,
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

    def setup(self, module: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...],
              ctx: Host, materialize: Callable[[nn.Module, torch.device], None] | None = None,
              ) -> tuple[nn.Module, tuple]:
        """``(engine, (optimizer,))`` from ``deepspeed.initialize``; a model built on the
        meta device is materialised whole first, and DeepSpeed partitions it."""
        if len(optimizers) > 1:
            raise ValueError(f"DeepSpeed trains a model with one optimizer; ctx.setup got "
                             f"{len(optimizers)}. Put the parameter groups in one optimizer.")
        if materialize is not None:
            names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            materialize(module, ctx.device)
            current = dict(module.named_parameters(remove_duplicate=False))
            for opt in optimizers:
                repoint(opt, names, current)
        deepspeed = import_deepspeed(ctx.device.type)
        module = module.to(ctx.device)
        self.checkpoint_activations(module)
        norms.broadcast_before_forward(module)  # DDP's rule for running statistics
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizers[0] if optimizers else None,
            model_parameters=None if optimizers else list(module.parameters()),
            config=self.ds_config(ctx, module))
        remember(engine)
        if self.stage == 3:
            _explain_module_order(engine)
        return engine, ((EngineOptimizer(engine, optimizer),) if optimizers else ())

    def grad_scaler(self, ctx: Host):
        return None  # DeepSpeed scales in its own backward (fp16 is refused above)

    # -- the hooks: DeepSpeed's engine does what torch's wrappers leave to ctx
    @classmethod
    def owns(cls, obj: Any) -> bool:
        return is_engine(obj) or isinstance(obj, EngineOptimizer)

    def backward(self, model, loss: torch.Tensor, scaler=None) -> None:
        if is_engine(model):  # DeepSpeed scales and reduces in its backward
            model.backward(loss)
        else:
            super().backward(model, loss, scaler)

    @contextlib.contextmanager
    def no_backward_sync(self, model):
        """Backward inside accumulates gradients; the reduction waits for the first
        backward after the block (DeepSpeed's gradient-accumulation boundary). Stage 1
        keeps whole local gradients until then; stages 2 and 3 reduce-scatter every
        backward (a rank keeps only its partition) and add up the partitions."""
        if not is_engine(model):
            with super().no_backward_sync(model):
                yield
            return
        engine = model
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

    def clip_grad_norm_(self, model, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The 2-norm of the whole model's (reduced, unscaled) gradients, from
        DeepSpeed's partitions; the coming ``opt.step()`` clips them to ``max_norm``
        (DeepSpeed clips inside its step, with the same norm and the same factor as
        ``torch.nn.utils.clip_grad_norm_``)."""
        if not is_engine(model):
            raise TypeError(f"ctx.clip_grad_norm_ under DeepSpeed takes the model "
                            f"ctx.setup() returned (DeepSpeed's engine); got "
                            f"{type(model).__name__}.")
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type!r}: DeepSpeed clips by the 2-norm only.")
        engine, opt = model, model.optimizer
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

    # State dicts under torch's keys, whole on every rank (``full`` changes nothing).
    def model_state_dict(self, model, full: bool = False) -> dict[str, Any]:
        return state.model_state_dict(model)

    def load_model_state_dict(self, model, values, strict: bool = True) -> None:
        state.load_model_state_dict(model, values, strict=strict)

    def optimizer_state_dict(self, model, optimizer, full: bool = False) -> dict[str, Any]:
        return state.optimizer_state_dict(optimizer.engine)

    def load_optimizer_state_dict(self, model, optimizer, values, strict: bool = True) -> None:
        state.load_optimizer_state_dict(optimizer.engine, values)

    def memory_tensors(self, model, optimizers) -> dict[str, list[torch.Tensor]]:
        if not is_engine(model):
            return super().memory_tensors(model, optimizers)
        return state.memory_tensors(model)

    def release(self) -> None:
        release()

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
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

