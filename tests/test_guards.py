"""Fork safety. The decision runs on CPU here with fakes where a GPU machine is needed: a
fake GPU count (NVML), a fake torch with CUDA built in, and children 'poisoned' the way
torch poisons them (a flag set by an at-fork handler, read in the forked canary)."""

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from conftest import descendants

from nbtrain.launch.starting import culprit, devices, guards, launchers
from nbtrain.launch.starting.devices import parse_devices


def test_cpu_kernel_forks():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launchers.choose_start_method("auto") == "fork"
    assert launchers.choose_start_method("fork") == "fork"
    assert launchers.choose_start_method("spawn") == "spawn"
    assert launchers.choose_start_method("forkserver") == "forkserver"
    with pytest.raises(ValueError, match="start_method='forkserve'"):
        launchers.choose_start_method("forkserve")


@pytest.fixture
def cuda_initialised(monkeypatch):
    """A fake check standing in for a kernel where CUDA is initialised."""
    monkeypatch.setattr(guards, "FORK_CHECKS",
                        [lambda: "the CUDA driver is initialised in this kernel (simulated)"])


def test_auto_falls_back_to_the_fork_server_with_a_reason(cuda_initialised):
    with pytest.warns(RuntimeWarning, match="from a fork server instead of forking the kernel, "
                                            "because the CUDA"):
        assert launchers.choose_start_method("auto") == "forkserver"


def test_forced_fork_refuses_with_the_remedy(cuda_initialised):
    with pytest.raises(RuntimeError, match="Restart the kernel .* start_method='forkserver'"):
        launchers.choose_start_method("fork")


# What torch does on `torch.cuda.is_available()`: it registers an at-fork handler that
# marks every later child as a bad fork. The fake does the same with a flag of its own.
_poisoned = {"parent": False, "child": False}
os.register_at_fork(after_in_child=lambda: _poisoned.update(child=_poisoned["parent"]))


def _fake_child_probe(driver_initialised: bool) -> str | None:
    return "CUDA was queried in this kernel (simulated)" if _poisoned["child"] else None


@pytest.fixture
def gpu_machine(monkeypatch):
    """A CUDA build of torch with two GPUs counted through NVML; the canary runs a fake."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(guards, "CHILD_PROBE", _fake_child_probe)
    yield
    _poisoned["parent"] = False


def test_counting_gpus_keeps_fork(gpu_machine):
    plan = parse_devices("auto")
    assert plan.accelerator == "cuda" and plan.world_size == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launchers.choose_start_method("auto") == "fork"


def test_a_poisoned_child_means_spawn_with_the_true_reason(gpu_machine):
    _poisoned["parent"] = True  # what torch.cuda.is_available() would have done
    assert not _poisoned["child"]  # the parent itself is not marked: only its children
    with pytest.warns(RuntimeWarning, match=r"fork server .* because CUDA was queried"):
        assert launchers.choose_start_method("auto") == "forkserver"
    with pytest.raises(RuntimeError, match="CUDA was queried"):
        launchers.choose_start_method("fork")


def test_ranks_on_the_cpu_fork_whatever_the_kernel_did_with_cuda(gpu_machine):
    # The CUDA guard is for ranks that will use CUDA: CPU ranks never touch it.
    _poisoned["parent"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launchers.choose_start_method("auto", "cpu") == "fork"
        assert launchers.choose_start_method("fork", "cpu") == "fork"
    with pytest.warns(RuntimeWarning, match="CUDA was queried"):
        assert launchers.choose_start_method("auto", "cuda") == "forkserver"


def test_a_cuda_torch_without_a_driver_counts_no_gpu_without_asking_torch(monkeypatch):
    """A hosted CPU session keeping the GPU image's CUDA torch: NVML is missing, and
    torch.cuda.device_count() would fall back to the CUDA runtime and poison every later
    fork. The count is 0 without that call, so launches fork on the CPU."""
    def runtime_count():
        raise AssertionError("asked torch: the CUDA runtime would poison later forks")

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", runtime_count)
    assert devices.cuda_device_count() == 0
    assert parse_devices("auto").accelerator == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        parse_devices(2, "cuda")


def test_the_canary_initialises_no_driver_the_kernel_has_not(monkeypatch):
    """While nothing in the kernel has called cuInit, a child's own cuInit works: the
    canary then asks only torch's bad-fork mark, instead of initialising the driver (and
    the autograd engine's GPU threads) at the cost of a worker's start on every launch."""
    def must_not_run():
        raise AssertionError("the canary initialised the driver")

    monkeypatch.setattr(guards, "libcuda_loaded", must_not_run)
    monkeypatch.setattr(guards, "autograd_probe", must_not_run)
    assert guards.cuda_probe(driver_initialised=False) is None
    with pytest.raises(AssertionError, match="initialised the driver"):
        guards.cuda_probe(driver_initialised=True)


def test_the_kernels_driver_state_is_read_before_the_fork(gpu_machine, monkeypatch):
    monkeypatch.setattr(guards, "CHILD_PROBE", lambda driver: f"driver initialised: {driver}")
    for state in (False, True):
        monkeypatch.setattr(culprit, "DRIVER_STATE", lambda state=state: state)
        assert guards.forked_child_cannot_use_cuda() == f"driver initialised: {state}"


def test_a_start_method_asked_for_by_name_forks_no_canary(gpu_machine, monkeypatch):
    def canary(accelerator="cuda"):
        raise AssertionError("forked a canary for a start method that does not fork")

    monkeypatch.setattr(guards, "fork_unsafe_reason", canary)
    assert launchers.choose_start_method("spawn") == "spawn"
    assert launchers.choose_start_method("forkserver", "cuda") == "forkserver"
    with pytest.raises(AssertionError, match="forked a canary"):
        launchers.choose_start_method("auto")


def test_the_driver_check_is_real_on_this_machine():
    # No NVIDIA driver on CPU machines (CI); where there is one, NVML loads.
    assert devices.nvidia_driver_present() == os.path.exists("/proc/driver/nvidia")


def test_the_canary_is_timed_out_and_reaped(no_leftovers):
    started = time.monotonic()
    reason = guards.forked_child_reason(lambda: time.sleep(60), timeout=0.3, hung="it hung")
    assert reason == "it hung"
    assert time.monotonic() - started < 5
    assert not descendants(os.getpid())  # (nbtrain's fork server, if one runs, is kept)


def test_a_failing_probe_is_a_reason_not_a_crash(no_leftovers):
    def probe():
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert guards.forked_child_reason(probe) == \
        "OSError: libcuda.so.1: cannot open shared object file"
    assert guards.forked_child_reason(lambda: None) is None


def test_the_real_probe_is_clean_in_a_fresh_process():
    # a process of its own: in this one another test may have asked CUDA (with a CUDA
    # build of torch, as on the hosted-stack legs, that marks forks bad)
    code = ("from nbtrain.launch.starting import guards\n"
            "print(guards.torch_cuda_initialized(), guards.forked_child_reason("
            "guards.cuda_probe), guards.fork_unsafe_reason('cuda'), "
            "guards.fork_unsafe_reason('cpu'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None"] * 4  # no bad fork, no libcuda


def test_libcuda_is_found_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1\n")
    assert not guards.libcuda_loaded(str(maps))  # NVML alone: counting GPUs
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libcuda.so.580.1\n")
    assert guards.libcuda_loaded(str(maps))
    assert not guards.libcuda_loaded(str(tmp_path / "missing"))


def test_cpu_ranks_fork_unless_a_forked_child_cannot_run_backward(gpu_machine, monkeypatch):
    """torch's autograd engine counts the GPUs at the kernel's first backward (which
    initialises the driver) and marks later forks unable to run backward at all: CPU ranks
    then start from the fork server too. The canary is forked only once the driver is
    initialised in the kernel; here a fake stands in for the backward it runs."""
    asked = []

    def backward_probe():
        asked.append(1)
        return "a forked child cannot run backward (simulated)" if _poisoned["child"] else None

    monkeypatch.setattr(guards, "BACKWARD_PROBE", backward_probe)
    monkeypatch.setattr(culprit, "DRIVER_STATE", lambda: False)
    _poisoned["parent"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert launchers.choose_start_method("auto", "cpu") == "fork"
    assert asked == []  # no driver, no GPU threads, no canary
    monkeypatch.setattr(culprit, "DRIVER_STATE", lambda: True)
    with pytest.warns(RuntimeWarning, match="cannot run backward"):
        assert launchers.choose_start_method("auto", "cpu") == "forkserver"
    _poisoned["parent"] = False
    assert launchers.choose_start_method("auto", "cpu") == "fork"


def test_the_real_backward_probe_runs_a_backward_in_a_fresh_process():
    code = ("from nbtrain.launch.starting import guards\n"
            "print(guards.autograd_probe(), guards.forked_child_reason(guards.autograd_probe))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]
