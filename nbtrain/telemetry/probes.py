"""Worker-side probes: memory by category, read from the tensors themselves, and a count
of the collectives each step issues.

Memory. Process RSS does not move with the strategy on CPU (and the allocator's
figures do not exist there), so the categories come from the tensors: parameters,
gradients and optimizer state, on the run's device; on a GPU run, bytes in host memory
(FSDP's CPU offload) are reported apart as ``<category>_host``. A DTensor (FSDP2) counts its local shard's storage, which
includes FSDP's padding; a storage shared by several tensors (tied weights, DDP's bucket
views) counts once. Optimizer step counters (0-d tensors, 4 bytes each) are left out.
A ``ZeroRedundancyOptimizer`` (zero1) keeps this rank's partition of the state in its
inner optimizer (``.optim``): that is what is counted.

Activations (opt-in, ``Telemetry(profile_memory=True)``): during one forward, torch's
``saved_tensors_hooks`` see every tensor autograd keeps for backward; their storages,
deduplicated, are the activation bytes. Parameters (leaf tensors that require grad, and
views of them, FSDP's gathered copies included) are not activations and are left out.
With activation checkpointing only the checkpointed blocks' inputs are kept, and that is
what is counted. ``peak`` is params + grads + optimizer + activations: the tensor-level
high-water mark of a step, without temporaries, FSDP's in-flight gathered units or DDP's
buckets (on CUDA, ``cuda_peak`` is the allocator's exact figure). torch's ``MemTracker``
sees all of those too but intercepts every operator; the hooks cost one Python call per
saved tensor, on the sampled steps only.

Communication. ``torch.distributed``'s collective functions are wrapped in the worker
so every call made through them (FSDP2's all-gathers and reduce-scatters, DDP's
the user's own) adds
its op type and logical bytes to a per-step tally. The wrappers cost one Python call
per collective; torch's ``CommDebugMode`` sees the same ops but intercepts every
operator, which slows a small model's step by ~2.5x (measured on CPU/gloo). DDP's
bucket all-reduces run in C++ and are read from DDP's bookkeeping (the strategy's
``collective_probe``: ``strategies/ddp.py``).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..strategies import owner_of


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set,
                   host: list[int] | None = None) -> int:
    """Bytes of the distinct storages; with ``host``, CPU-resident bytes go there instead
    (a CUDA run's offloaded shards live in host memory, not on the GPU)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() == 0 or key in seen:
            continue
        seen.add(key)
        if host is not None and t.device.type == "cpu":
            host[0] += storage.nbytes()
        else:
            total += storage.nbytes()
    return total


def memory_by_category(model: nn.Module | None,
                       optimizers: Iterable[torch.optim.Optimizer],
                       device: torch.device | None = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer"}`` bytes held by this rank on its device.

    On a GPU run, what lives in host memory instead (FSDP's CPU offload) is reported
    apart as ``params_host``, ``grads_host`` and ``optimizer_host``, when there is any.
    """
    tensors = owner_of(model).memory_tensors(model, optimizers)
    return _by_category(tensors, set(), device is not None and device.type != "cpu")


def _by_category(groups: dict[str, list], seen: set, on_gpu: bool) -> dict[str, int]:
    values: dict[str, int] = {}
    for name, tensors in groups.items():
        host = [0] if on_gpu else None
        values[name] = _storage_bytes(tensors, seen, host)
        if host and host[0]:
            values[f"{name}_host"] = host[0]
    return values


class ActivationProbe:
    """Bytes autograd saves for backward during one forward (see the module docstring)."""

    def __init__(self):
        self.bytes = 0
        self._seen: set = set()
        self._hooks = None

    def start(self) -> None:
        self.bytes = 0
        self._seen = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def stop(self) -> int | None:
        if self._hooks is None:
            return None
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(None, None, None)
        self._seen = set()
        return self.bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if not (base.requires_grad and base.grad_fn is None):  # not a parameter
            local = _local(t)
            try:
                storage = local.untyped_storage()
                # a meta tensor's storage has no address (nbtrain.plan's rehearsal)
                key = (local.device, storage._cdata if local.is_meta else storage.data_ptr())
                if key[1] and key not in self._seen:
                    self._seen.add(key)
                    self.bytes += storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without storage
                self.bytes += local.numel() * local.element_size()
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def cuda_memory(device: torch.device) -> dict[str, int]:
    """The allocator's figures since the last call (peak reset), and the driver's view."""
    values = {
        "cuda_allocated": torch.cuda.memory_allocated(device),
        "cuda_reserved": torch.cuda.memory_reserved(device),
        "cuda_peak": torch.cuda.max_memory_allocated(device),
    }
    torch.cuda.reset_peak_memory_stats(device)
    try:  # NVML: what nvidia-smi shows for the whole GPU
        values["device_used"] = int(torch.cuda.device_memory_used(device))
    except Exception:
        pass
    return values


# op type -> (names in torch.distributed, the payload's position and keyword names)
_COLLECTIVES = {
    "all_reduce": (("all_reduce",), 0, ("tensor",)),
    "all_gather": (("all_gather_into_tensor", "all_gather_single", "all_gather"), 0,
                   ("output_tensor", "output", "tensor_list")),
    "reduce_scatter": (("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter"), 1,
                       ("input", "input_tensor", "input_list")),
    "broadcast": (("broadcast",), 0, ("tensor",)),
    "reduce": (("reduce",), 0, ("tensor",)),
    "all_to_all": (("all_to_all_single",), 1, ("input",)),
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return _local(obj).numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class CommCounter:
    """Tallies collectives by op type between ``take()`` calls."""

    def __init__(self):
        self.counts: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        for op, (names, position, keywords) in _COLLECTIVES.items():
            for name in names:
                original = getattr(dist, name, None)
                if original is None or name in self._originals:
                    continue
                self._originals[name] = original
                setattr(dist, name, self._wrap(original, op, position, keywords))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, fn, op: str, position: int, keywords: tuple[str, ...]):
        counts, sizes = self.counts, self.bytes

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            counts[op] += 1
            if len(args) > position:
                payload = args[position]
            else:
                payload = next((kwargs[k] for k in keywords if k in kwargs), None)
            sizes[op] += _nbytes(payload)
            return fn(*args, **kwargs)

        return counted

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        if not self.counts:  # most steps of DDP (its all-reduces are C++'s)
            return {}, {}
        counts, sizes = dict(self.counts), dict(self.bytes)
        self.counts.clear()
        self.bytes.clear()
        return counts, sizes

    def restore(self, taken: tuple[dict[str, int], dict[str, int]]) -> None:
        """The tally as ``take()`` gave it, what was counted since dropped."""
        for mine, kept in zip((self.counts, self.bytes), taken, strict=True):
            mine.clear()
            mine.update(kept)
