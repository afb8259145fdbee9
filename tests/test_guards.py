import os
import warnings

import pytest

from nbtrain.launch import guards


def test_cpu_kernel_forks():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert guards.choose_start_method("auto") == "fork"
    assert guards.choose_start_method("fork") == "fork"
    assert guards.choose_start_method("spawn") == "spawn"
    with pytest.raises(ValueError, match="start_method='forkserver'"):
        guards.choose_start_method("forkserver")


@pytest.fixture
def cuda_initialised(monkeypatch):
    """A fake check standing in for a kernel where CUDA is initialised."""
    monkeypatch.setattr(guards, "FORK_CHECKS",
                        [lambda: "the CUDA driver is initialised in this kernel (simulated)"])


def test_auto_falls_back_to_spawn_with_a_reason(cuda_initialised):
    with pytest.warns(RuntimeWarning, match="using spawn instead of fork because the CUDA"):
        assert guards.choose_start_method("auto") == "spawn"


def test_forced_fork_refuses_with_the_remedy(cuda_initialised):
    with pytest.raises(RuntimeError, match="Restart the kernel .* start_method='spawn'"):
        guards.choose_start_method("fork")


def test_driver_probe_sees_an_open_uvm_handle(tmp_path):
    fds = tmp_path / "fd"
    fds.mkdir()
    os.symlink("/dev/null", fds / "0")
    os.symlink("/dev/nvidiactl", fds / "1")  # NVML (counting GPUs) opens this: still safe
    assert guards.cuda_driver_initialized(str(fds)) is None
    os.symlink("/dev/nvidia-uvm", fds / "7")  # cuInit opens this
    assert "nvidia-uvm" in guards.cuda_driver_initialized(str(fds))


def test_probes_are_clean_in_this_process():
    assert guards.torch_cuda_initialized() is None
    assert guards.cuda_driver_initialized() is None
