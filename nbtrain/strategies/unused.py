"""Parameters that some rank leaves without a gradient, under FSDP and DDP.

A mixture of experts whose experts are modules of their own, or any conditional branch,
leaves a parameter without a gradient on a rank whose batch never reached it. Then:

- FSDP2 reduce-scatters only the parameters that got a gradient, so two ranks enter the
  collective with buffers of different sizes (gloo aborts the process; NCCL can hang),
  or, with equal sizes, add one expert's gradient into another's. torch's
  ``set_reduce_scatter_unused_params(True)`` makes every rank reduce every parameter
  (zeros for those it did not use): nbtrain always sets it.
- That alone is not one-process training: a parameter that no rank used gets a zero
  gradient instead of none, and an optimizer with momentum or weight decay moves it.
  With ``find_unused_parameters=True`` (FSDP's default; DDP's option of that name does
  the same for DDP) each rank notes which parameters it gave a gradient, the ranks
  agree in one small all-reduce before the optimizer steps (one byte per parameter
  tensor, over gloo where the process group has it, so no GPU sync), and the parameters
  no rank used get no gradient, as in one process.
- DDP without ``find_unused_parameters`` fails as torch designs it; ``explain_unused``
  adds to torch's error the parameter names and the option to use.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d


def reduce_every_parameter(module: nn.Module) -> None:
    """Every FSDP unit of ``module`` reduce-scatters all its parameters, zeros for those
    this rank did not use (older torch: the zeros are given in ``UsedParameters``)."""
    setter = getattr(module, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(True)


def _groups(module: nn.Module):
    """Every FSDP parameter group in ``module``: torch 2.13 keeps a list per FSDP state
    (``_fsdp_param_groups``), earlier releases one group or None (``_fsdp_param_group``)."""
    for m in module.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            one = getattr(state, "_fsdp_param_group", None)
            groups = [one] if one is not None else []
        yield from groups


class UsedParameters:
    """Which of an FSDP model's parameters some rank gave a gradient since the last
    optimizer step; ``before_step`` drops the gradients of those no rank used."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.used = torch.zeros(len(self.params), dtype=torch.uint8)
        backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
        self.device = torch.device("cpu") if "gloo" in backend else device
        self.zeros = not hasattr(module, "set_reduce_scatter_unused_params")
        # A step with no backward before it (torch's checkpoint loader initialises an
        # optimizer's state with one, on zero gradients) is left alone: every rank runs
        # FSDP's backward together, so every rank agrees on whether there was one.
        self.backward_seen = False
        for group in _groups(module):
            self._watch(group)

    def _watch(self, group) -> None:
        post_backward = group.post_backward
        index, used, zeros = self.index, self.used, self.zeros

        def noting_post_backward(*args, **kwargs):
            self.backward_seen = True
            for fp in group.fsdp_params:
                i = index.get(id(fp.sharded_param))
                if i is None or not hasattr(fp, "_unsharded_param"):
                    continue
                param = fp.unsharded_param
                if fp.unsharded_accumulated_grad is not None or param.grad is not None:
                    used[i] = 1
                elif zeros and param.requires_grad:  # torch without the setter
                    param.grad = torch.zeros_like(param)
            return post_backward(*args, **kwargs)

        group.post_backward = noting_post_backward  # FSDP calls it through the instance

    def before_step(self, optimizer, args, kwargs) -> None:
        """Optimizer step pre-hook: agree on what was used, drop the others' gradients."""
        if not self.backward_seen:
            return
        self.backward_seen = False
        flags = self.used.to(self.device)
        # torch's own function, not the name telemetry counts: bookkeeping, a byte per
        # tensor, kept out of the communication panel (FSDP's is all-gather and
        # reduce-scatter)
        c10d.all_reduce(flags, op=dist.ReduceOp.MAX)
        for param, flag in zip(self.params, flags.tolist(), strict=True):
            if not flag:
                param.grad = None
        self.used.zero_()


def track(module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Give ``optimizer`` (built on FSDP ``module``) one-process semantics for unused
    parameters (see the module docstring)."""
    used = getattr(module, "_nbtrain_used", None)
    if used is None:
        used = UsedParameters(module, device)
        module._nbtrain_used = used
    optimizer.register_step_pre_hook(used.before_step)


FIND_UNUSED = "Expected to have finished reduction in the prior iteration"


def explain_unused(ddp: nn.Module, strategy: str) -> None:
    """Add to DDP's unused-parameter error which parameters they are and how to say so
    in nbtrain."""
    forward = ddp.forward
    names = [n for n, p in ddp.module.named_parameters() if p.requires_grad]

    def forward_explained(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except RuntimeError as err:
            if FIND_UNUSED in str(err):
                err.add_note(unused_hint(str(err), names, strategy))
            raise

    ddp.forward = forward_explained


def unused_hint(message: str, names: list[str], strategy: str) -> str:
    found = re.search(r"did not receive grad for rank (\d+): ([\d ]+)", message)
    which = ""
    if found:
        picked = [names[int(i)] for i in found.group(2).split() if int(i) < len(names)]
        shown = ", ".join(picked[:8]) + (f" and {len(picked) - 8} more" if len(picked) > 8
                                         else "")
        which = f"rank {found.group(1)} gave no gradient to {shown}. "
    name = ("ddp_find_unused_parameters_true" if strategy in ("", "ddp")
            else f"{strategy}_find_unused_parameters_true"
            if strategy in ("ddp_notebook", "ddp_spawn", "ddp_fork") else None)
    how = (f"strategy={name!r}, or " if name else "") + \
        f"launch(..., strategy={strategy or 'ddp'!r}, find_unused_parameters=True)"
    return (f"nbtrain: {which}Some parameters take no part in the loss on some steps "
            f"(experts no token reached, a branch not taken): tell DDP to look for them "
            f"with {how}. FSDP ('fsdp' and the other FSDP names) handles them by itself.")
