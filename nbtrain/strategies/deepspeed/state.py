"""What DeepSpeed holds, read from its partitions: the tensors of each memory category,
and torch's state dicts of the model and its optimizer.

The state dicts have the keys torch's distributed-checkpoint helpers give a DDP or FSDP
model and its optimizer (parameter names; optimizer state flattened to
``state.<name>.<key>`` and ``param_groups.<name>.<option>``), so a checkpoint moves
between DeepSpeed, the other strategies and a plain model. Each call is a collective:
every rank gathers the whole tensors, one parameter at a time, with DeepSpeed's
``safe_get_full_*`` functions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


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

