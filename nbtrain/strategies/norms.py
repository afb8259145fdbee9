"""BatchNorm under every strategy: running statistics are buffers, which the strategies
treat differently from parameters.

- ``sync_batchnorm=True`` (Lightning's name): torch's ``SyncBatchNorm`` normalises with
  the statistics of the whole batch across ranks. It runs only on GPUs (torch refuses
  CPU tensors), so on CPU the option fails at ``launch()`` and says so.
- DDP broadcasts buffers from rank 0 before every forward, so every rank trains on rank
  0's running statistics. FSDP never syncs buffers: each rank would keep its own.
  ``broadcast_before_forward`` gives FSDP DDP's rule. After the last forward each rank
  has updated its own copy once more (under DDP too), and a checkpoint held whichever
  rank's copy DCP wrote while ``full_state_dict`` gave rank 0's: ``sync_statistics``,
  run by both, makes it rank 0's everywhere.
- Mixed precision: FSDP's one policy casts a BatchNorm's weight to bf16 but not its
  fp32 running statistics, and ``batch_norm`` refuses the mix. ``fp32_policy`` makes
  each norm layer with statistics a unit of its own that computes in fp32 and hands
  its output on in the compute dtype.
"""

from __future__ import annotations

import torch
from torch import nn

_Norm = nn.modules.batchnorm._NormBase
_BUCKET = 250 * 2**20  # DDP's buffer-broadcast bucket size


def with_statistics(module: nn.Module) -> list[nn.Module]:
    """The norm layers of ``module`` that keep running statistics."""
    return [m for m in module.modules() if isinstance(m, _Norm) and m.track_running_stats]


def convert_to_sync(module: nn.Module) -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(module)


def broadcast_before_forward(module: nn.Module) -> None:
    """Before each training forward, every rank takes rank 0's running statistics (what
    DDP's ``broadcast_buffers`` does)."""
    import torch.distributed as dist

    norms = with_statistics(module)
    if not norms or not dist.is_initialized() or dist.get_world_size() == 1:
        return

    def before(root, args):
        if root.training:
            dist._broadcast_coalesced(dist.group.WORLD, _statistics(norms), _BUCKET, 0)

    module.register_forward_pre_hook(before)


def sync_statistics(module: nn.Module) -> None:
    """Every rank takes rank 0's running statistics now (a collective; a checkpoint and
    ``full_state_dict`` then agree, whichever rank's copy DCP writes)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = _statistics(with_statistics(module))
    if tensors:
        dist._broadcast_coalesced(dist.group.WORLD, tensors, _BUCKET, 0)


def _statistics(norms: list[nn.Module]) -> list[torch.Tensor]:
    return [b for m in norms for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None]


def fp32_policy(compute_dtype: torch.dtype):
    """FSDP's mixed-precision policy for a norm layer: fp32 inside, ``compute_dtype``
    out."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                output_dtype=compute_dtype, cast_forward_inputs=True)
