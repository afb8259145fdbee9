"""The devices a run uses: ``DevicePlan``, one value the kernel, the strategies, the
scale-out backends and the UI all read (``launch/starting/devices.py`` makes it from
``accelerator=`` and ``devices=``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Accelerator = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class DevicePlan:
    """Which accelerator and which device indices the run uses (one rank per entry)."""

    accelerator: Accelerator
    indices: tuple[int, ...]  # GPU indices on CUDA; 0..N-1 on CPU (one process each)
    # {index: (name, major, minor)} of the plan's GPUs as NVML told when the plan was
    # made (never CUDA: that would make forking unsafe); empty where it could not tell
    gpus: Mapping[int, tuple[str, int, int]] = field(default_factory=dict, compare=False,
                                                     hash=False)

    @property
    def world_size(self) -> int:
        return len(self.indices)

    def gpus_without_bf16(self) -> list[str]:
        """The plan's GPUs that cannot compute in bf16 (before Ampere: T4, V100), named;
        empty on CPU or when the driver could not tell."""
        if self.accelerator != "cuda":
            return []
        return [f"GPU {i} ({name}, compute capability {major}.{minor})"
                for i, (name, major, minor) in self.gpus.items() if major < 8]

    @property
    def backend(self) -> str:
        """The process group's backend. On CUDA, NCCL serves GPU tensors and gloo serves
        CPU ones (object collectives, checkpoint planning, a user's CPU metrics)."""
        return "cpu:gloo,cuda:nccl" if self.accelerator == "cuda" else "gloo"
