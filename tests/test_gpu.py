"""CUDA/NCCL paths. CI has no GPU: these skip there and run with `pytest -m gpu` on a GPU
machine. Anything that initialises CUDA runs in a subprocess, so it cannot make forking
unsafe for the tests that follow."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from workloads import param_count, train, train_single

import nbtrain

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftovers")]


def _ranks() -> int:
    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=__file__.rsplit("/", 1)[0])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_grad_op"])
def test_nccl_runs_match_one_process(strategy):
    n = _ranks()
    run = nbtrain.launch(train, devices=n, accelerator="cuda", strategy=strategy,
                         telemetry=nbtrain.Telemetry(memory_every=1))
    assert all(r["device"] == f"cuda:{i}" for i, r in enumerate(run.results))
    single = train_single(world_size=n)
    for name, value in single.items():
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-3, atol=1e-4)
    mem = run.history.events("memory", 0)[-1].values
    for key in ("cuda_allocated", "cuda_reserved", "cuda_peak"):
        assert mem[key] > 0
    per_rank = {"ddp": 16, "fsdp": 16 / n, "fsdp_grad_op": 16 / n}[strategy]
    model = mem["params"] + mem["grads"] + mem["optimizer"]
    assert per_rank * param_count() <= model <= 1.05 * per_rank * param_count()


def test_offload_keeps_the_shards_off_the_gpu():
    run = nbtrain.launch(train, devices=_ranks(), accelerator="cuda", strategy="fsdp_offload",
                         telemetry=nbtrain.Telemetry(memory_every=1))
    assert run.result["loss"] < 2.0
    mem = run.history.events("memory", 0)[-1].values  # the shards live in host memory
    n = _ranks()
    assert mem["params"] == mem["grads"] == mem["optimizer"] == 0, mem
    assert mem["params_host"] >= 4 * param_count() / n and mem["optimizer_host"] > 0, mem
    assert "params (host) MB" in str(run.summary())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_mixed_precision_trains(strategy, precision):
    chosen = nbtrain.strategies.get(strategy, mixed_precision=precision)
    run = nbtrain.launch(train, devices=_ranks(), accelerator="cuda", strategy=chosen)
    # The same recipe in one process (fp16: the loss scaler skips the same steps).
    single = train_single(world_size=_ranks(), precision=precision, device="cuda")
    for name, value in single.items():  # half precision: close, not equal
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-2, atol=5e-3)


def test_fork_after_cuda_init_falls_back_to_spawn_or_refuses():
    done = _python("""
        import warnings, torch, nbtrain
        from workloads import fail_on
        torch.zeros(1, device="cuda")          # CUDA initialised in the "kernel"
        try:
            nbtrain.launch(fail_on, "none", devices=1, accelerator="cuda", start_method="fork")
        except RuntimeError as err:
            print("refused:", "start_method='spawn'" in str(err))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = nbtrain.launch(fail_on, "none", devices=1, accelerator="cuda")
        print("method:", run.start_method, any("spawn instead of fork" in str(w.message) for w in caught))
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: True" in done.stdout
    assert "method: spawn True" in done.stdout


def test_driver_initialised_behind_torch_means_spawn():
    done = _python("""
        import ctypes, torch
        from nbtrain.launch import guards
        cuda = ctypes.CDLL("libcuda.so.1")
        assert cuda.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        print("torch knows:", torch.cuda.is_initialized())
        print("reason:", guards.fork_unsafe_reason())
    """)
    assert done.returncode == 0, done.stderr
    assert "torch knows: False" in done.stdout
    assert "reason: the CUDA driver was initialised in this kernel by a library other than " \
           "torch" in done.stdout or "reason: a forked child hung" in done.stdout, done.stdout


def test_is_available_means_spawn_with_the_true_reason():
    done = _python("""
        import torch
        from nbtrain.launch import guards
        print("available:", torch.cuda.is_available(), torch.cuda.is_initialized())
        print("reason:", guards.fork_unsafe_reason())
    """)
    assert done.returncode == 0, done.stderr
    assert "available: True False" in done.stdout
    assert "reason: CUDA was queried through torch" in done.stdout, done.stdout


def test_counting_gpus_keeps_fork_safe():
    done = _python("""
        import torch, nbtrain
        from nbtrain.launch import guards
        from nbtrain.launch.devices import parse_devices
        plan = parse_devices("auto")
        print("plan:", plan.accelerator, len(plan.indices))
        print("safe:", guards.fork_unsafe_reason())
        run = nbtrain.launch(lambda ctx: torch.ones(4, device=ctx.device).sum().item(),
                             devices=1, dashboard=False)
        print("forked:", run.start_method, run.result)
    """)
    assert done.returncode == 0, done.stderr
    assert "plan: cuda" in done.stdout and "safe: None" in done.stdout
    assert "forked: fork 4.0" in done.stdout


def test_pool_frees_a_runs_cuda_memory_before_the_next():
    """Two runs on the same warm CUDA workers: after each, the allocator holds nothing of
    it and its cache is emptied, and the second run's peak is its own."""
    n = _ranks()
    with nbtrain.RankPool(devices=n, accelerator="cuda", start_method="spawn") as pool:
        base = pool.status
        first = pool.launch(train, telemetry=nbtrain.Telemetry(memory_every=1))
        after_first = pool.status
        second = pool.launch(train, telemetry=nbtrain.Telemetry(memory_every=1))
        after_second = pool.status
        for rows in (after_first, after_second):
            for row, b in zip(rows, base, strict=True):
                assert row["cuda_allocated"] - b["cuda_allocated"] < 1 << 20, (row, b)
                assert row["cuda_reserved"] <= b["cuda_reserved"] + (2 << 20), (row, b)
        peaks = [run.history.events("memory", 0)[-1].values["cuda_peak"]
                 for run in (first, second)]
        assert peaks[1] <= peaks[0] * 1.05, peaks
        for name, value in first.result["full"].items():
            torch.testing.assert_close(second.result["full"][name], value)
