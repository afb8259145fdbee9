import os

import pytest

from nbtrain.launch.starting import devices
from nbtrain.launch.starting.devices import parse_devices, threads_per_worker


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this kernel sees N GPUs (the count is all the parser asks of CUDA)."""
    def set_count(n):
        monkeypatch.setattr(devices, "cuda_device_count", lambda: n)
    return set_count


def test_cpu_counts_mean_processes():
    plan = parse_devices(2, "cpu")
    assert plan.accelerator == "cpu" and plan.world_size == 2 and plan.backend == "gloo"
    assert parse_devices("3", "cpu").world_size == 3
    assert parse_devices("auto", "cpu").world_size == 1  # Lightning's meaning on CPU
    assert parse_devices(-1, "cpu").world_size == os.cpu_count()


@pytest.mark.parametrize("bad, match", [
    (0, "no devices"), (-2, "negative"), ([], "no devices"), ("x", "give a count"),
    ([0, 1], "GPU indices, but the accelerator is CPU"),
])
def test_bad_cpu_devices_say_what_to_do(bad, match):
    with pytest.raises(ValueError, match=match):
        parse_devices(bad, "cpu")


def test_types_are_checked():
    with pytest.raises(TypeError, match="not a bool"):
        parse_devices(True, "cpu")
    with pytest.raises(TypeError):
        parse_devices(2.5, "cpu")


def test_auto_accelerator_without_gpu_is_cpu(gpus):
    gpus(0)
    assert parse_devices(2).accelerator == "cpu"
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        parse_devices(1, "cuda")


def test_gpu_lists_and_counts(gpus):
    gpus(4)
    assert parse_devices("auto").indices == (0, 1, 2, 3)
    assert parse_devices(-1, "cuda").indices == (0, 1, 2, 3)
    assert parse_devices([0, 2], "cuda").indices == (0, 2)
    assert parse_devices("1,3", "gpu").indices == (1, 3)
    assert parse_devices(2, "cuda").backend == "cpu:gloo,cuda:nccl"  # CPU tensors too
    with pytest.raises(ValueError, match="sees 4"):
        parse_devices(8, "cuda")
    with pytest.raises(ValueError, match="no GPU with index 7"):
        parse_devices([0, 7], "cuda")
    with pytest.raises(ValueError, match="twice"):
        parse_devices([1, 1], "cuda")


def test_unknown_accelerator():
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        parse_devices(1, "tpu")


def test_threads_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == cores
    assert threads_per_worker(cores * 4) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_per_worker(2) is None  # the user's setting wins


def test_more_gpus_than_the_kernel_sees_offers_cpu_ranks(gpus):
    gpus(1)  # Colab: one GPU
    with pytest.raises(ValueError, match=r"sees 1\. Use devices=1 .* accelerator='cpu' to run "
                                         r"2 ranks as CPU processes"):
        parse_devices(2, "cuda")


def test_bf16_on_gpus_without_it_fails_before_launch_and_fp16_is_offered(gpus, monkeypatch,
                                                                          no_leftovers):
    import nbtrain
    from nbtrain import strategies

    gpus(2)  # Kaggle: two T4s, compute capability 7.5, no bf16
    monkeypatch.setattr(devices, "gpu_capabilities",
                        lambda indices: {i: ("Tesla T4", 7, 5) for i in indices})
    plan = parse_devices(2, "cuda")
    assert plan.gpus_without_bf16() == ["GPU 0 (Tesla T4, compute capability 7.5)",
                                        "GPU 1 (Tesla T4, compute capability 7.5)"]
    for precision in ("bf16", "bf16-mixed"):
        with pytest.raises(ValueError, match=r"GPU 0 \(Tesla T4.*mixed_precision='fp16'"):
            nbtrain.launch(lambda ctx: None, devices=2, accelerator="cuda",
                           mixed_precision=precision, dashboard=False)
    with pytest.raises(ValueError, match="Tesla T4"):
        nbtrain.launch(lambda ctx: None, devices=2, accelerator="cuda", strategy="fsdp",
                       precision="bf16-mixed", dashboard=False)
    strategies.get("ddp", mixed_precision="fp16").check(plan)  # what T4s train with
    strategies.get("fsdp", precision="16-mixed").check(plan)
    monkeypatch.setattr(devices, "gpu_capabilities",
                        lambda indices: {i: ("NVIDIA A100", 8, 0) for i in indices})
    strategies.get("fsdp", mixed_precision="bf16").check(parse_devices(2, "cuda"))


def test_gpu_capabilities_without_a_driver_say_nothing(monkeypatch):
    monkeypatch.setattr(devices, "nvidia_driver_present", lambda: False)
    assert devices.gpu_capabilities((0, 1)) == {}
    assert parse_devices(2, "cpu").gpus_without_bf16() == []
