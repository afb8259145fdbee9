"""Checks that run before anything starts, and the choice between fork and spawn.

Forking a process whose CUDA driver is initialised gives children that die with
"Cannot re-initialize CUDA in forked subprocess" (or hang). ``torch.cuda.is_initialized()``
only knows about torch's own initialisation; another library (CuPy, Numba, JAX, a
``nvidia-smi`` binding) can initialise the driver behind torch's back. The driver-level
probe looks for what an initialised driver leaves in the process: an open
``/dev/nvidia-uvm`` handle, which ``cuInit`` opens and NVML (used to count GPUs) does not.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Literal

import torch

StartMethod = Literal["fork", "spawn"]
START_METHODS = ("auto", "fork", "spawn")

_UVM_DEVICES = ("/dev/nvidia-uvm",)


def torch_cuda_initialized() -> str | None:
    if torch.cuda.is_initialized():
        return "torch has initialised CUDA in this kernel (a tensor was moved to a GPU, or " \
               "torch.cuda was queried)"
    return None


def cuda_driver_initialized(fd_dir: str = "/proc/self/fd") -> str | None:
    """Driver-level probe: is a CUDA context's device handle open in this process?"""
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target in _UVM_DEVICES:
            return f"the CUDA driver is initialised in this kernel ({target} is open), " \
                   "possibly by a library other than torch"
    return None


# Named checks, each returning why forking is unsafe, or None. Tests add fakes here.
FORK_CHECKS: list[Callable[[], str | None]] = [torch_cuda_initialized, cuda_driver_initialized]


def fork_unsafe_reason() -> str | None:
    if sys.platform != "linux":
        return f"fork is not reliable on {sys.platform}"
    for check in FORK_CHECKS:
        reason = check()
        if reason:
            return reason
    return None


def choose_start_method(requested: str) -> StartMethod:
    """``"auto"``: fork when safe, else spawn with a one-line warning saying why."""
    if requested not in START_METHODS:
        raise ValueError(f"start_method={requested!r} is not one of {START_METHODS}.")
    reason = fork_unsafe_reason()
    if requested == "fork":
        if reason:
            raise RuntimeError(
                f"start_method='fork' is unsafe here: {reason}. Forked workers would fail with "
                "'Cannot re-initialize CUDA in forked subprocess'. Restart the kernel and launch "
                "before touching CUDA, or pass start_method='spawn' (slower to start, but safe).")
        return "fork"
    if requested == "spawn":
        return "spawn"
    if reason:
        warnings.warn(f"nbtrain: using spawn instead of fork because {reason}.",
                      RuntimeWarning, stacklevel=3)
        return "spawn"
    return "fork"


# Once a forked child has hung in OpenMP, every later fork of this process would too.
_openmp_hangs_after_fork = False


def openmp_works_after_fork(threads: int, timeout: float = 5.0) -> bool:
    """Can a forked child run torch ops on ``threads`` threads?

    GNU OpenMP (torch's CPU thread pool on Linux) is not fork-safe: once the kernel has
    run a parallel torch op, a forked child that starts a parallel region waits forever
    for pool threads that were not copied (DataLoader workers avoid it by using one
    thread). A forked canary runs one parallel op; if it does not finish, the answer is
    no, and stays no for this process.
    """
    global _openmp_hangs_after_fork
    if threads <= 1:
        return True
    if _openmp_hangs_after_fork:
        return False
    pid = os.fork()
    if pid == 0:  # the canary
        try:
            torch.set_num_threads(threads)
            (torch.ones(1 << 20) * 2).sum()
        finally:
            os._exit(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    _openmp_hangs_after_fork = True
    return False


def fork_threads(threads: int | None) -> int | None:
    """Threads each forked worker may use: 1 when more would hang in OpenMP."""
    wanted = threads if threads is not None else torch.get_num_threads()
    if openmp_works_after_fork(wanted):
        return threads
    warnings.warn(
        f"nbtrain: forked workers use 1 CPU thread instead of {wanted}: this kernel has run "
        "parallel torch ops, and OpenMP's thread pool does not survive a fork. For more "
        "threads per worker use start_method='spawn', or restart the kernel and launch "
        "before running torch in it.", RuntimeWarning, stacklevel=4)
    return 1
