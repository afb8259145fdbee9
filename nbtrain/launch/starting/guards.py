"""Checks that run before anything starts: is forking the kernel safe for the ranks?
(``launchers.choose_start_method`` acts on the answer.)

A forked child of a process whose CUDA is initialised cannot use CUDA: it dies with
"Cannot re-initialize CUDA in forked subprocess" (torch) or gets errors from the driver.
What the parent's own state says is not enough on a real GPU machine:

- ``torch.cuda.is_available()`` poisons fork (torch asks the CUDA runtime for the device
  count and marks every later child as a bad fork), yet ``torch.cuda.is_initialized()``
  stays False;
- counting GPUs through NVML (``torch.cuda.device_count()``) opens ``/dev/nvidia-uvm`` on
  some drivers, yet a child forked after it uses CUDA fine;
- another library (CuPy, JAX, Numba) can initialise the driver behind torch's back, and
  so can torch's own C++: its autograd engine counts the GPUs at the first backward, even
  of a model on the CPU, and from then on a forked child cannot run backward at all
  ("Unable to handle autograd's threading in combination with fork-based
  multiprocessing"), on the CPU either.

So the check asks a forked child — the canary — what a worker would find: whether torch
sees a bad fork, and, only when the CUDA driver is initialised in the kernel (read
without changing it, ``culprit.driver_initialised``), whether ``cuInit`` and a backward
work there: a child of a kernel whose driver nobody initialised initialises its own. A
fork of the kernel costs milliseconds; it runs only when this torch has CUDA, for runs
whose ranks use CUDA (and not when a start method is asked for by name); for ranks on the
CPU only when the driver is initialised in the kernel (the autograd engine's GPU threads
come after that), and then the canary runs one backward. ``culprit.py`` says what did it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable

import torch

from . import culprit


def torch_cuda_initialized() -> str | None:
    if torch.cuda.is_initialized():
        return f"torch has initialised CUDA in this kernel ({culprit.torch_culprit()})"
    return None


def libcuda_loaded(maps: str = "/proc/self/maps") -> bool:
    """Is the CUDA driver library mapped into this process (someone may have inited it)?"""
    try:
        with open(maps) as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def cuda_probe(driver_initialised: bool = True) -> str | None:
    """Runs in the forked canary: can this child use CUDA as a worker would?

    ``driver_initialised`` is the kernel's driver state, read before the fork. While
    nothing in the kernel has called ``cuInit``, a child's own ``cuInit`` works and its
    autograd engine starts afresh, so only torch's bad-fork mark is asked: initialising
    the driver in the canary would cost every launch what a worker's start costs (about
    0.2 s on an H200), for an answer known in advance.
    """
    if torch.cuda._is_in_bad_fork():
        return (f"CUDA was queried through torch in this kernel ({culprit.torch_culprit()}), "
                "and forked children cannot use CUDA after that")
    if not driver_initialised:
        return None
    if libcuda_loaded():
        code = ctypes.CDLL("libcuda.so.1").cuInit(0)
        if code != 0:
            return ("the CUDA driver was initialised in this kernel without torch.cuda "
                    f"knowing, {culprit.driver_culprit()} (torch's autograd engine does so at "
                    "the first backward on a machine with GPUs, as do CuPy, JAX and Numba; "
                    f"cuInit in a forked child returned error {code})")
    return autograd_probe()


def autograd_probe() -> str | None:
    """Runs in the forked canary: can this child run a backward pass?"""
    x = torch.ones(2, requires_grad=True)
    try:
        (x * 2).sum().backward()
    except RuntimeError as err:
        if "fork" not in str(err):
            raise
        return ("torch's autograd engine started its GPU threads in this kernel (the first "
                f"backward on a machine with GPUs does, {culprit.driver_culprit()}), and a "
                "forked child cannot run backward after that")
    return None


@contextlib.contextmanager
def fork_quietly():
    """Python 3.12+ warns at every fork from a process with threads (a kernel always has
    them: its heartbeat, iopub and control threads). nbtrain forks knowingly: its
    children run no code that waits on another thread's lock (the reason for the
    warning; see the rendezvous decision in docs/decisions.md), so the warning would
    be one the user cannot act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\)",
                                category=DeprecationWarning)
        yield


def forked_child_reason(probe: Callable[[], str | None], timeout: float = 5.0,
                        hung: str = "a forked child hung") -> str | None:
    """Fork a canary that runs ``probe``; its answer, or ``hung`` when it does not finish
    within ``timeout`` seconds (it is then killed)."""
    read, write = os.pipe()
    with fork_quietly():
        pid = os.fork()
    if pid == 0:  # the canary: answer and leave without running anything of the parent's
        try:
            os.close(read)
            answer = probe()
            os.write(write, (answer or "").encode()[:4000])
        except BaseException as err:
            os.write(write, f"{type(err).__name__}: {err}".encode()[:4000])
        finally:
            os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.read(read, 4096).decode(errors="replace") or None
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return hung
    finally:
        os.close(read)


def forked_child_cannot_use_cuda() -> str | None:
    if not torch.backends.cuda.is_built():
        return None  # a CPU build of torch: no CUDA for a child to miss
    driver_initialised = culprit.DRIVER_STATE()
    return forked_child_reason(lambda: CHILD_PROBE(driver_initialised),
                               hung="a forked child hung trying to use CUDA")


def forked_child_cannot_run_backward() -> str | None:
    """For ranks on the CPU: only once the driver is initialised in the kernel can the
    autograd engine have started its GPU threads, so only then is a canary forked."""
    if not torch.backends.cuda.is_built() or not culprit.DRIVER_STATE():
        return None
    return forked_child_reason(BACKWARD_PROBE, hung="a forked child hung in a backward pass")


# The probes the canary runs; tests put fakes here.
CHILD_PROBE: Callable[[bool], str | None] = cuda_probe
BACKWARD_PROBE: Callable[[], str | None] = autograd_probe

# Named checks, each returning why forking is unsafe, or None; the cheap one first.
# CUDA_CHECKS apply to runs on CUDA (their canary runs a backward too), CPU_CHECKS to runs
# on the CPU; FORK_CHECKS to every run (tests and notebook 04 put simulated reasons there).
CUDA_CHECKS: list[Callable[[], str | None]] = [torch_cuda_initialized,
                                               forked_child_cannot_use_cuda]
CPU_CHECKS: list[Callable[[], str | None]] = [forked_child_cannot_run_backward]
FORK_CHECKS: list[Callable[[], str | None]] = []


def fork_unsafe_reason(accelerator: str = "cuda") -> str | None:
    """Why forking workers for ``accelerator`` ranks is unsafe here, or None."""
    if sys.platform != "linux":
        return f"fork is not reliable on {sys.platform}"
    for check in [*FORK_CHECKS, *(CUDA_CHECKS if accelerator == "cuda" else CPU_CHECKS)]:
        reason = check()
        if reason:
            return reason
    return None


def importing_main_in_spawned_worker() -> bool:
    """Is this a spawned worker still importing the script that started it? (Spawn runs
    the parent's main module again in each worker, as ``__mp_main__``.)"""
    for name in ("multiprocess.process", "multiprocessing.process"):
        module = sys.modules.get(name)
        if module is not None and getattr(module.current_process(), "_inheriting", False):
            return True
    return False


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

    def parallel_op() -> None:
        torch.set_num_threads(threads)
        (torch.ones(1 << 20) * 2).sum()

    if forked_child_reason(parallel_op, timeout, hung="hung") == "hung":
        _openmp_hangs_after_fork = True
        return False
    return True


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
