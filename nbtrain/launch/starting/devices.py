"""Turn ``accelerator=`` and ``devices=`` into a concrete plan, with Lightning's meanings.

GPUs are counted with ``torch.cuda.device_count()``, which asks NVML and does not
initialise CUDA in the kernel (initialising it would make forking unsafe). Where NVML is
missing, torch falls back to the CUDA runtime, which marks every later fork as unable to
use CUDA: so without NVIDIA's driver (a CUDA build of torch on a machine with no GPU,
such as a hosted CPU session) the count is 0 without asking torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os

import torch

from ...deviceplan import Accelerator, DevicePlan

ACCELERATORS = ("auto", "cpu", "cuda", "gpu")


@functools.cache
def nvidia_driver_present() -> bool:
    """NVIDIA's driver is installed here (its NVML library loads)."""
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def cuda_device_count() -> int:
    """GPUs visible to this process, counted without initialising CUDA and without
    making later forks unable to use it."""
    if not torch.backends.cuda.is_built() or not nvidia_driver_present():
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU
        return 0


def gpu_capabilities(indices) -> dict[int, tuple[str, int, int]]:
    """``{index: (name, major, minor)}`` for the visible GPUs ``indices``, from NVML (no
    CUDA initialisation); ``{}`` when NVML cannot tell (no driver, GPUs named by UUID in
    ``CUDA_VISIBLE_DEVICES``)."""
    if not nvidia_driver_present():
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        physical = None if visible is None else [int(x) for x in visible.split(",") if x.strip()]
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return {}
        found = {}
        for i in indices:
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            name = ctypes.create_string_buffer(96)
            index = i if physical is None else physical[i]
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle))
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                               ctypes.byref(minor))):
                continue
            nvml.nvmlDeviceGetName(handle, name, len(name))
            found[i] = (name.value.decode(errors="replace"), major.value, minor.value)
        return found
    except (ValueError, IndexError, OSError, AttributeError):
        return {}


def gpu_memory(index: int = 0) -> tuple[str, int] | None:
    """(name, total bytes) of visible GPU ``index``, from NVML (no CUDA initialisation);
    None where NVML cannot tell."""
    if not nvidia_driver_present():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        physical = index if visible is None else [int(x) for x in visible.split(",")
                                                  if x.strip()][index]
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
        memory = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
        if (nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(physical,
                                                                      ctypes.byref(handle))
                or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))):
            return None
        nvml.nvmlDeviceGetName(handle, name, len(name))
        return name.value.decode(errors="replace"), int(memory[0])
    except (ValueError, IndexError, OSError, AttributeError):
        return None


def resolve_accelerator(accelerator: str) -> Accelerator:
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not one of {ACCELERATORS}.")
    accelerator = accelerator.lower()
    if accelerator == "auto":
        return "cuda" if cuda_device_count() > 0 else "cpu"
    if accelerator in ("cuda", "gpu"):
        if cuda_device_count() == 0:
            raise RuntimeError(
                "accelerator='cuda' was asked for, but no CUDA GPU is visible to this kernel "
                "(torch.cuda.device_count() == 0"
                + (", and this torch build has no CUDA" if not torch.backends.cuda.is_built() else "")
                + "). Use accelerator='cpu' to train on CPU processes with gloo.")
        return "cuda"
    return "cpu"


def parse_devices(devices: int | str | list[int] | tuple[int, ...],
                  accelerator: str = "auto") -> DevicePlan:
    """Resolve ``devices`` for ``accelerator``.

    - ``int`` N: N devices (on CPU: N processes); ``-1``: all GPUs (on CPU, one per core).
    - ``"auto"``: all GPUs on CUDA, 1 process on CPU (Lightning's meaning).
    - a list or ``"0,2"``: those GPU indices.
    - a string of digits: the count.
    """
    acc = resolve_accelerator(accelerator)
    available = cuda_device_count() if acc == "cuda" else (os.cpu_count() or 1)
    what = "GPU" if acc == "cuda" else "CPU process"

    if isinstance(devices, bool):
        raise TypeError(f"devices={devices!r}: give a count (2), a list of GPU indices "
                        "([0, 1]), 'auto' or -1, not a bool.")
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            count = available if acc == "cuda" else 1
            return _plan(acc, tuple(range(count)))
        if "," in text:
            try:
                devices = [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise ValueError(f"devices={devices!r} is not a list of GPU indices like '0,1'.") from None
        else:
            try:
                devices = int(text)
            except ValueError:
                raise ValueError(f"devices={devices!r}: give a count ('2'), indices ('0,1'), "
                                 "'auto' or '-1'.") from None

    if isinstance(devices, int):
        if devices == -1:
            return _plan(acc, tuple(range(available)))
        if devices == 0:
            raise ValueError("devices=0 asks for no devices; give at least 1 (or -1 for all).")
        if devices < 0:
            raise ValueError(f"devices={devices} is negative; give a count >= 1, or -1 for all.")
        if acc == "cuda" and devices > available:
            raise ValueError(
                f"devices={devices} asks for {devices} GPUs, but this kernel sees {available}. "
                f"Use devices={available} (or -1 for all), or accelerator='cpu' to run "
                f"{devices} ranks as CPU processes (gloo): the same DDP and FSDP, to learn "
                "and test with. If there should be more GPUs, check CUDA_VISIBLE_DEVICES.")
        return _plan(acc, tuple(range(devices)))

    if isinstance(devices, (list, tuple)):
        if not devices:
            raise ValueError("devices=[] asks for no devices; list at least one GPU index.")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
            raise TypeError(f"devices={devices!r}: every entry must be an int GPU index.")
        if acc == "cpu":
            raise ValueError(f"devices={list(devices)} lists GPU indices, but the accelerator "
                             f"is CPU. On CPU give a count: devices={len(devices)}.")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices={list(devices)} names a GPU twice; one rank per GPU.")
        bad = [i for i in devices if i < 0 or i >= available]
        if bad:
            raise ValueError(f"devices={list(devices)}: no {what} with index {bad[0]}; this "
                             f"kernel sees {available} (indices 0..{available - 1}).")
        return _plan(acc, tuple(devices))

    raise TypeError(f"devices={devices!r} ({type(devices).__name__}): give an int, a list of "
                    "ints, 'auto' or -1.")


def _plan(accelerator: Accelerator, indices: tuple[int, ...]) -> DevicePlan:
    """A plan, with what NVML says of its GPUs (their names and compute capability)."""
    gpus = gpu_capabilities(indices) if accelerator == "cuda" else {}
    return DevicePlan(accelerator, indices, gpus)


_SHARE_OF = [1]  # threads_as_one_of(n): the cores are shared as among at least n workers


def threads_per_worker(world_size: int) -> int | None:
    """Torch threads per CPU worker so N workers do not oversubscribe the cores.

    ``None`` when the user set ``OMP_NUM_THREADS`` (their choice wins).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, world_size, _SHARE_OF[0]))


@contextlib.contextmanager
def threads_as_one_of(world_size: int):
    """Launches in here give each CPU worker the threads one of ``world_size`` workers
    gets: ``scaling()``'s one-rank run measures one of its N ranks, not the whole machine."""
    before, _SHARE_OF[0] = _SHARE_OF[0], world_size
    try:
        yield
    finally:
        _SHARE_OF[0] = before
