"""CUDA/NCCL paths. CI has no GPU: these skip there and run with `pytest -m gpu` on a GPU
machine. The test process never initialises CUDA (GPUs are counted through NVML, and
anything else that needs CUDA runs in a worker or a subprocess), so its launches fork
the way a user's first launch in a fresh kernel does, and each test says which way
it went."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from kernel import Kernel
from models import fit, reference
from test_evaluation import N_VAL, train_and_evaluate
from torch import nn
from workloads import cpu_and_gpu_collectives, every_train, param_count, single_in_worker, train

import nbtrain
from nbtrain.checkpoint import exists
from nbtrain.deviceplan import DevicePlan
from nbtrain.launch.starting.devices import cuda_device_count

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_leftovers")]


def _ranks() -> int:
    return min(2, cuda_device_count())


def _call(ctx, fn, args, kwargs):
    return fn(*args, **kwargs)


def on_the_cpu(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (one-process training on the CPU) in a forked CPU worker:
    in this process its first backward would count the GPUs (torch's autograd engine),
    initialising the driver, and every later launch would lose its fork."""
    return nbtrain.launch(_call, fn, args, kwargs, devices=1, accelerator="cpu",
                          dashboard=False, telemetry=False).result


def _single(precision=None) -> dict:
    """The same training in one process, on a GPU, in a forked worker."""
    run = nbtrain.launch(single_in_worker, precision, _ranks(), devices=1,
                         accelerator="cuda", dashboard=False)
    return run.result


two_gpus = pytest.mark.skipif(cuda_device_count() < 2,
                              reason=f"needs two GPUs; this machine has {cuda_device_count()}")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, cwd=__file__.rsplit("/", 1)[0])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp_grad_op"])
def test_nccl_runs_match_one_process(strategy):
    n = _ranks()
    run = nbtrain.launch(train, devices=n, accelerator="cuda", strategy=strategy,
                         telemetry=nbtrain.Telemetry(memory_every=1))
    assert run.start_method == "fork"  # nothing in this process touched CUDA
    assert all(r["device"] == f"cuda:{i}" for i, r in enumerate(run.results))
    single = _single()
    for name, value in single.items():
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-3, atol=1e-4)
    mem = run.history.events("memory", 0)[-1].values
    for key in ("cuda_allocated", "cuda_reserved", "cuda_peak"):
        assert mem[key] > 0
    per_rank = {"ddp": 16, "fsdp": 16 / n, "fsdp_grad_op": 16 / n}[strategy]
    model = mem["params"] + mem["grads"] + mem["optimizer"]
    assert per_rank * param_count() <= model <= 1.05 * per_rank * param_count()


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_compression_hooks_train_on_nccl(hook):
    """torch's DDP communication hooks on NCCL (bf16 and PowerSGD are refused on CPU
    ranks): fp16 and bf16 stay close to one process; PowerSGD (rank 1) trains."""
    run = nbtrain.launch(train, devices=_ranks(), accelerator="cuda", comm_hook=hook)
    assert run.start_method == "fork"
    if hook == "powersgd":
        assert run.result["loss"] < 2.0
        return
    for name, value in _single().items():
        torch.testing.assert_close(run.result["full"][name], value, rtol=0, atol=5e-3)


def test_the_time_breakdown_comes_from_a_gpu_run_without_breaking_it():
    """Every step of a GPU run has its phases (from CUDA events), none negative, and
    together no longer than the step."""
    run = nbtrain.launch(train, devices=_ranks(), accelerator="cuda")
    steps = run.history.events("step", 0)
    assert steps and all(set(e.phases) >= {"forward", "backward", "optimizer", "comm"}
                         for e in steps)
    assert all(min(e.phases.values()) >= 0 and sum(e.phases.values()) <= e.duration * 1.01
               for e in steps)
    assert "where a step's" in str(run.summary())


def test_a_gpu_steps_phases_are_the_devices_time_not_the_hosts():
    """Large matmuls the host queues in microseconds and waits for at ``.item()``: the
    host's view would put the step in "other"; the CUDA events put it in forward,
    backward and the optimizer, where the device spent it."""
    from workloads import device_bound

    run = nbtrain.launch(device_bound, devices=1, accelerator="cuda", dashboard=False)
    steps = run.history.events("step", 0)[1:]  # the first: cuBLAS's warm-up
    assert len(steps) >= 4, steps
    for e in steps:
        work = e.phases["forward"] + e.phases["backward"] + e.phases["optimizer"]
        assert work > 0.5 * e.duration and e.phases["backward"] > e.phases["forward"], e
        assert sum(e.phases.values()) <= e.duration * 1.01, e


def _evaluate_on_cuda(ctx):
    """test_evaluation's training with its evaluations, brought back on the CPU (a CUDA
    tensor read in this process would end its fork)."""
    out = train_and_evaluate(ctx)
    return {"steps": out["steps"], "ids": out["ids"].cpu(), "losses": out["losses"].cpu(),
            "device": out["ids"].device.type, "state": out["state"]}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_evaluation_on_cuda_is_no_step_and_gathers_each_sample_once(strategy):
    n = _ranks()
    run = nbtrain.launch(_evaluate_on_cuda, devices=n, accelerator="cuda", strategy=strategy,
                         dashboard=False)
    per_epoch = 256 // n // 16
    assert [len(run.history.events("step", r)) for r in range(n)] == [2 * per_epoch] * n
    for result in run.results:
        assert result["device"] == "cuda" and result["steps"] == [per_epoch - 1, 2 * per_epoch - 1]
        assert torch.equal(result["ids"], torch.arange(N_VAL, dtype=torch.float32))
    assert "evaluation: 2 passes on rank 0" in str(run.summary())


@two_gpus
def test_bandwidth_sweeps_nccl():
    bw = nbtrain.bandwidth(devices=2, accelerator="cuda", sizes=[2**10, 2**20, 2**26],
                           iters=5)
    assert bw.backend == "nccl" and bw.peak_busbw > 1e9, bw  # any GPU link gives > 1 GB/s


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
    single = _single(precision)
    for name, value in single.items():  # half precision: close, not equal
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("strategy", [*nbtrain.strategies.names(aliases=False),
                                      "ddp_find_unused_parameters_true"])
def test_cpu_tensors_and_objects_travel_beside_nccl(strategy, tmp_path):
    """The process group is cpu:gloo,cuda:nccl on every strategy: CPU tensors, Python
    objects and a sharded checkpoint's planning go through gloo, GPU tensors through NCCL.
    Lightning's other spellings are left out but one (they differ from a listed name only
    by a start method or DDP's unused-parameter search), to keep `.ci/gpu all` within its
    8 minutes: the full list took 23 launches, two of them spawned (7 s each on an H200)."""
    n = _ranks()
    why = nbtrain.strategies.unavailable(DevicePlan("cuda", tuple(range(n))), [strategy])
    if why:
        pytest.skip(why[strategy])
    run = nbtrain.launch(cpu_and_gpu_collectives, str(tmp_path / "ckpt"), devices=n,
                         accelerator="cuda", strategy=strategy, dashboard=False)
    total = n * (n + 1) / 2
    for rank, r in enumerate(run.results):
        assert r["cpu"] == r["gpu"] == total and r["device"] == f"cuda:{rank}", r
        assert r["objects"] == [{"rank": i} for i in range(n)]
    assert exists(tmp_path / "ckpt")


@two_gpus
def test_two_gpus_hold_half_the_model_each_under_fsdp():
    run = nbtrain.launch(train, devices=2, accelerator="cuda", strategy="fsdp",
                         telemetry=nbtrain.Telemetry(memory_every=1))
    for rank in (0, 1):
        mem = run.history.events("memory", rank)[-1].values
        assert mem["params"] <= 0.55 * 4 * param_count(), mem
        assert run.results[rank]["device"] == f"cuda:{rank}"


def test_fork_after_cuda_init_falls_back_to_the_fork_server_or_refuses():
    """After a tensor on the GPU, fork is refused and the default starts from the fork
    server, naming the line. What matters of the server is that its children can still
    initialise CUDA (checked: two launches from it train on the GPU), not that libcuda is
    mapped in it: importing torch maps it (seen on an H100, torch 2.11) without
    initialising the driver, and forks of such a process use CUDA fine."""
    done = _python("""
        import warnings, torch, nbtrain
        from workloads import on_device
        torch.zeros(1, device="cuda")          # CUDA initialised in the "kernel"
        try:
            nbtrain.launch(on_device, devices=1, accelerator="cuda", start_method="fork")
        except RuntimeError as err:
            print("refused:", "start_method='forkserver'" in str(err))
        for launch in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run = nbtrain.launch(on_device, devices=1, accelerator="cuda", dashboard=False)
            print("method:", run.start_method, run.result, [str(w.message) for w in caught])
    """)
    assert done.returncode == 0, done.stderr
    assert "refused: True" in done.stdout
    lines = [line for line in done.stdout.splitlines() if line.startswith("method:")]
    assert len(lines) == 2 and all("method: forkserver 3.0" in line for line in lines), lines
    assert "a GPU was first used at <string>:4" in lines[0], lines[0]  # the line that did it


def test_driver_initialised_behind_torch_is_seen():
    """A library that initialises the driver itself (ctypes here, as CuPy or JAX would),
    before nbtrain's import: torch does not know, the canary does, and the reason says
    when."""
    done = _python("""
        import ctypes
        cuda = ctypes.CDLL("libcuda.so.1")
        assert cuda.cuInit(0) == 0
        ctx = ctypes.c_void_p()
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        import torch
        from nbtrain.launch.starting import guards
        print("torch knows:", torch.cuda.is_initialized())
        print("reason:", guards.fork_unsafe_reason())
    """)
    assert done.returncode == 0, done.stderr
    assert "torch knows: False" in done.stdout
    assert "reason: the CUDA driver was initialised in this kernel without torch.cuda " \
           "knowing, before nbtrain was imported" in done.stdout \
        or "reason: a forked child hung" in done.stdout, done.stdout


def test_is_available_keeps_fork_after_importing_nbtrain_and_names_itself_if_not():
    """``import nbtrain`` sets PYTORCH_NVML_BASED_CUDA_CHECK=1 (unless set): the first
    cell of many notebooks, ``torch.cuda.is_available()``, then asks NVML and fork stays
    safe. A user who sets it to 0 gets the CUDA runtime's answer, a poisoned fork, and a
    reason that names the call."""
    for nvml in ("", "0"):
        done = _python(f"""
            import os
            if {nvml!r}:
                os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = {nvml!r}
            import torch, nbtrain
            from nbtrain.launch.starting import guards
            print("available:", torch.cuda.is_available(), torch.cuda.is_initialized())
            print("reason:", guards.fork_unsafe_reason())
        """)
        assert done.returncode == 0, done.stderr
        assert "available: True False" in done.stdout
        if nvml:
            assert "reason: CUDA was queried through torch in this kernel (torch.cuda." \
                   "is_available() or device_count() asked the CUDA runtime at <string>:7" \
                in done.stdout, done.stdout
        else:
            assert "reason: None" in done.stdout, done.stdout


def test_counting_gpus_keeps_fork_safe():
    done = _python("""
        import torch, nbtrain
        from nbtrain.launch.starting import guards
        from nbtrain.launch.starting.devices import parse_devices
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


def test_checkpoint_every_restores_the_cuda_generator(tmp_path):
    """A restart on the GPU goes on exactly: the noise each step draws comes from the
    CUDA generator, which the checkpoint keeps per rank."""
    n = _ranks()
    kw = dict(devices=n, accelerator="cuda", dashboard=False, die_rank=n - 1)
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    run = nbtrain.launch(every_train, str(tmp_path / "b"), die_at=20, max_restarts=1, **kw)
    assert len(run.attempts) == 1 and run.results[0]["first"] == 18
    for name, value in whole.results[0]["full"].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6)


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


FIRST_STEP = """
import sys, warnings
from torch import nn

def first_step(ctx):
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randint(0, 10, (64,)))
    for x, y in ctx.dataloader(data, batch_size=16):
        ctx.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        break
    return sorted(set(sys.modules) - KERNEL_MODULES)

def launched():
    global KERNEL_MODULES
    KERNEL_MODULES = set(sys.modules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = nbtrain.launch(first_step, devices=N, accelerator="cuda")
    # the fork server's warnings (after torch ran on the CPU in the kernel, forked workers
    # are also told they get one OpenMP thread)
    return run.start_method, run.results[0], [str(w.message) for w in caught
                                              if "fork server" in str(w.message)]
"""

# What users do in cells before a launch: build a Hugging Face model from a config and try
# it on the CPU (transformers asks whether a CUDA graph is being captured in every
# forward, which initialised the driver behind torch's back), then take a training step
# (torch's autograd engine counts the GPUs at the first backward).
TRY_ON_CPU = """
import transformers
config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32)
hf = transformers.GPT2LMHeadModel(config)
ids = torch.randint(0, 128, (2, 16))
loss = hf(input_ids=ids, labels=ids).loss
"""
STEP_ON_CPU = """
loss.backward()
torch.optim.AdamW(hf.parameters()).step()
"""


def test_a_fresh_kernel_forks_starts_warm_and_names_what_made_it_stop():
    """What a user sees on a GPU machine: a fresh kernel's launches fork and later ones
    import next to nothing in the workers; ``torch.cuda.is_available()`` and a transformers
    model built and run forward on the CPU leave fork safe; a training step on the CPU
    leaves it safe, or the warning names its cell; a tensor put on the GPU in a cell makes
    the next launch start from the fork server, and the warning names that cell, line and
    code."""
    pytest.importorskip("transformers")
    kernel = Kernel(startup=f"import nbtrain, torch; N = {_ranks()}")
    try:
        assert kernel.run(FIRST_STEP).error is None
        for launch in range(3):
            method, new, warned = kernel.value("launched()")
            assert method == "fork" and not warned, (method, warned)
            if launch:  # the first launch's workers import what the kernel had not
                assert len(new) < 40 and not any(m.startswith("torch._dynamo") for m in new), \
                    (len(new), new[:60])
        assert kernel.value("torch.cuda.is_available()") is True
        reply = kernel.run(TRY_ON_CPU)
        assert reply.error is None, reply.error
        for _ in range(2):
            method, _, warned = kernel.value("launched()")
            assert method == "fork" and not warned, (method, warned)
        stepped = kernel.run(STEP_ON_CPU)
        assert stepped.error is None, stepped.error
        method, _, warned = kernel.value("launched()")
        assert method == "fork" and not warned or any(
            f"during Cell In[{stepped.execution_count}]" in w for w in warned), (method, warned)
        touched = kernel.run("x = 1\ny = torch.ones(2, device='cuda')")
        assert touched.error is None, touched.error
        number = touched.execution_count
        method, _, warned = kernel.value("launched()")
        assert method == "forkserver", method
        assert any(f"a GPU was first used at Cell In[{number}], line 2: `y = torch.ones(2, "
                   "device='cuda')`" in w for w in warned), warned
    finally:
        kernel.shutdown()


# Every model with every strategy, and every precision twice (pairwise: 6 launches, not
# 18, so that the suite fits a short loan of a GPU; fp32/bf16/fp16 on each strategy with
# the small model are in test_mixed_precision_trains).
ZOO = [("gpt2", "ddp", "bf16"), ("gpt2", "fsdp", "fp16"), ("cnn", "ddp", "fp16"),
       ("cnn", "fsdp", None), ("moe", "ddp", None), ("moe", "fsdp", "bf16")]


@pytest.mark.parametrize(("kind", "strategy", "precision"), ZOO)
def test_models_users_bring_train_on_cuda(kind, strategy, precision):
    """A transformers GPT-2 (tied weights), a BatchNorm ResNet and a mixture of experts
    some ranks leave unused (FSDP's used-parameter flags go over gloo beside NCCL) from
    configs, against the same training in one process on the CPU (models.py). The
    reference trains in this process before the next case launches: it must not cost
    the next launch its fork."""
    pytest.importorskip("transformers")
    n = _ranks()
    if kind == "moe" and strategy == "ddp":
        strategy = "ddp_find_unused_parameters_true"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = nbtrain.launch(fit, kind, devices=n, accelerator="cuda", strategy=strategy,
                             mixed_precision=precision, dashboard=False)
    assert run.start_method == "fork", [str(w.message) for w in caught]
    ref = on_the_cpu(reference, kind, world_size=n)
    tight = precision is None
    for rank in range(n):
        expected = [per_rank[rank] for per_rank in ref["losses"]]
        assert run.results[rank]["losses"] == pytest.approx(
            expected, rel=1e-3 if tight else 0.05), f"rank {rank}"
    for name, value in ref["full"].items():
        got = run.result["full"][name]
        assert got.dtype == value.dtype
        if tight:
            torch.testing.assert_close(got, value, rtol=1e-3, atol=1e-4, msg=name)


def test_fsdp_offload_trains_a_transformers_model():
    pytest.importorskip("transformers")
    n = _ranks()
    run = nbtrain.launch(fit, "gpt2", devices=n, accelerator="cuda", strategy="fsdp_offload",
                         dashboard=False, telemetry=nbtrain.Telemetry(memory_every=1))
    ref = on_the_cpu(reference, "gpt2", world_size=n)
    assert run.result["losses"] == pytest.approx([r[0] for r in ref["losses"]], rel=1e-3)
    mem = run.history.events("memory", 0)[-1].values
    assert mem["params"] == 0 and mem["params_host"] > 0, mem


@two_gpus
def test_sync_batchnorm_normalises_with_the_whole_batch():
    """With SyncBatchNorm, two ranks with half a batch each train what one process with
    the whole batch trains (plain BatchNorm would normalise each half on its own)."""
    run = nbtrain.launch(fit, "cnn", devices=2, accelerator="cuda", strategy="ddp",
                         sync_batchnorm=True, dashboard=False)
    ref = on_the_cpu(reference, "cnn", world_size=2, split=False)
    for name, value in ref["full"].items():
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-3, atol=1e-4,
                                   msg=name)


FRAMEWORKS = ("transformers", "accelerate", "lightning")


def launch_after_importing(library: str, n: int, workload: str = "torchrun_style_cuda",
                           accelerator: str = "cuda"):
    """A fresh kernel imports ``library``, then launches ``workload`` (workloads.py);
    the cell's reply."""
    kernel = Kernel(startup=f"import {library}, torch, nbtrain\nfrom workloads import "
                            f"{workload}")
    try:
        return kernel.run(f"run = nbtrain.launch({workload}, devices={n}, "
                          f"accelerator={accelerator!r})\nprint(run.start_method, "
                          "run.results, torch.cuda.is_initialized())", timeout=300)
    finally:
        kernel.shutdown()


@pytest.fixture(scope="module")
def after_frameworks():
    """Each framework's kernel and launch, side by side: their imports and first launches
    take seconds each on a GPU machine, 41 s of `.ci/gpu all`'s 8 minutes one after
    another. Futures: a kernel that failed raises in its own test."""
    have = [lib for lib in FRAMEWORKS if importlib.util.find_spec(lib) is not None]
    with ThreadPoolExecutor(max(1, len(have))) as pool:
        return {lib: pool.submit(launch_after_importing, lib, _ranks()) for lib in have}


@pytest.mark.parametrize("library", FRAMEWORKS)
def test_code_written_for_torchrun_runs_on_nccl_after_importing_a_framework(
        library, after_frameworks):
    """In a fresh kernel: importing the framework must not initialise CUDA (that would
    force spawn, or make notebook_launcher refuse), and a tutorial-style NCCL function
    runs unchanged."""
    pytest.importorskip(library)
    n = _ranks()
    reply = after_frameworks[library].result()
    assert reply.error is None, reply.error
    expected = [(r, n, f"cuda:{r}") for r in range(n)]
    assert f"fork {expected} False" in reply.stdout, reply.stdout


@pytest.mark.parametrize("strategy", ["deepspeed_stage_3", "deepspeed_stage_2_offload"])
def test_deepspeed_trains_on_cuda_as_one_process(strategy):
    """DeepSpeed ZeRO on NCCL from a forked kernel (its import happens in the workers,
    so the kernel's fork stays usable)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    n = _ranks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = nbtrain.launch(fit, "gpt2", devices=n, accelerator="cuda", strategy=strategy,
                             dashboard=False)
    assert run.start_method == "fork" and run.note is None, [str(w.message) for w in caught]
    ref = on_the_cpu(reference, "gpt2", world_size=n)
    for rank in range(n):
        expected = [per_rank[rank] for per_rank in ref["losses"]]
        assert run.results[rank]["losses"] == pytest.approx(expected, rel=1e-3)


def test_deepspeed_accumulates_clips_and_checkpoints_on_cuda(tmp_path):
    """ctx.accumulate, ctx.clip_grad_norm_ and a stage-3 checkpoint resumed under ddp,
    on NCCL, against the same training in one CPU process."""
    pytest.importorskip("deepspeed")
    from workloads import ckpt_train, technique_single, technique_train

    n = _ranks()
    want = on_the_cpu(technique_single, clip=0.05, world_size=n)
    run = nbtrain.launch(technique_train, devices=n, accelerator="cuda",
                         strategy="deepspeed_stage_3", accumulate=2, clip=0.05,
                         dashboard=False)
    for result in run.results:
        torch.testing.assert_close(result["norms"], want["norms"], rtol=1e-3, atol=1e-5)
    for name, value in want["full"].items():
        torch.testing.assert_close(run.result["full"][name], value, rtol=1e-3, atol=1e-4)
    path = tmp_path / "ckpt"
    nbtrain.launch(ckpt_train, path=str(path), save_every=4, stop_after=3, devices=n,
                   accelerator="cuda", strategy="deepspeed_stage_3", dashboard=False)
    resumed = nbtrain.launch(ckpt_train, load_from=str(path), devices=n,
                             accelerator="cuda", strategy="ddp", dashboard=False)
    whole = nbtrain.launch(ckpt_train, devices=n, accelerator="cuda", strategy="ddp",
                           dashboard=False)
    for name, value in whole.result["full"].items():
        torch.testing.assert_close(resumed.result["full"][name], value, rtol=1e-3, atol=1e-4)


# What a CUDA rank does that only a GPU shows: a model compiled by inductor (Triton
# kernels) inside a run the clock watches, a failing rank's metrics (its ctx.log tensors
# are batched on the device and read at the end), a hang in an NCCL collective, and a
# forked CUDA rank's displays in the launch cell.

def test_an_inductor_compiled_model_trains_on_cuda_as_the_uncompiled_one_and_is_timed():
    """torch.compile's default backend on the GPU, compiled after ctx.setup (the hooks of
    the time breakdown inside the compiled call, its CUDA events between graph breaks)."""
    from workloads import compile_train

    def launch(where):
        return nbtrain.launch(compile_train, where, "inductor", devices=_ranks(),
                              accelerator="cuda", strategy="fsdp", dashboard=False)

    plain, compiled = launch(None), launch("after")
    assert all(r["graphs"] > 0 for r in compiled.results)
    for name, value in plain.results[0]["full"].items():
        torch.testing.assert_close(compiled.results[0]["full"][name], value, rtol=1e-4,
                                   atol=1e-4, msg=name)
    steps = compiled.history.events("step", 0)
    assert len(steps) == len(plain.history.events("step", 0)), steps
    for step in steps[2:]:  # after the compile
        work = (step.phases["forward"], step.phases["backward"], step.phases["optimizer"])
        assert min(work) > 0 and sum(step.phases.values()) <= step.duration * 1.01, step


def logs_on_cuda_then_fails(ctx):
    model = ctx.setup(nn.Linear(4, 1))
    for i in range(5):
        loss = model(torch.randn(8, 4, device=ctx.device)).pow(2).mean()
        ctx.log(loss=loss, i=torch.tensor(float(i), device=ctx.device))
    if ctx.rank == 0:
        raise ValueError("after logging")
    return ctx.rank


def test_a_failing_cuda_rank_still_sends_what_it_logged():
    """A CUDA rank's ctx.log tensors wait on the device, to be read together; a rank that
    fails closes its context, which reads and sends them."""
    with pytest.raises(nbtrain.WorkerError, match=r"rank 0.*after logging"):
        nbtrain.launch(logs_on_cuda_then_fails, devices=_ranks(), accelerator="cuda",
                       dashboard=False)
    run = nbtrain.last_run()
    logged = [e.values["i"] for e in run.history.events("metric", 0) if "i" in e.values]
    assert logged == [0.0, 1.0, 2.0, 3.0, 4.0], logged


def hangs_on_nccl(ctx):
    t = torch.ones(1, device=ctx.device)
    dist.all_reduce(t)
    if ctx.rank == 1:
        time.sleep(3600)
    dist.all_reduce(t)  # rank 0 waits here for rank 1
    torch.cuda.synchronize()
    return ctx.rank


@two_gpus
def test_a_hang_on_nccl_ends_at_the_timeout_saying_where_each_rank_was():
    """NCCL waits on the device: the waiting rank's host thread is in synchronize, and the
    timeout still names both ranks and where each one was."""
    with pytest.raises(nbtrain.RunTimeoutError) as info:
        nbtrain.launch(hangs_on_nccl, devices=2, accelerator="cuda", timeout=8,
                       dashboard=False)
    assert info.value.ranks == [0, 1]
    where = info.value.where
    assert "time.sleep(3600)" in where[1], where
    assert "hangs_on_nccl" in where[0], where


DISPLAYS = """
from IPython.display import HTML, display

def shows(ctx):
    x = torch.ones(2, device=ctx.device)
    handle = display(HTML(f"<b>rank {ctx.rank} on {x.device}</b>"), display_id=True)
    handle.update(HTML(f"<b>rank {ctx.rank} done</b>"))
    return str(x.device)

run = nbtrain.launch(shows, devices=N, accelerator="cuda", dashboard=False)
run.start_method, run.results
"""


def test_a_forked_cuda_ranks_display_and_its_update_show_in_the_launch_cell():
    kernel = Kernel(startup=f"import nbtrain, torch; N = {_ranks()}")
    try:
        reply = kernel.run(DISPLAYS)
        assert reply.error is None, reply.error
        ranks = range(_ranks())
        assert reply.results == [repr(("fork", [f"cuda:{r}" for r in ranks]))]
        shown = sorted(d["text/html"] for d in reply.displays if "text/html" in d)
        assert shown == [f"<b>rank {r} on cuda:{r}</b>" for r in ranks], reply.displays
        updates = sorted(c["data"]["text/html"] for kind, c in reply.others
                         if kind == "update_display_data")
        assert updates == [f"<b>rank {r} done</b>" for r in ranks], reply.others
    finally:
        kernel.shutdown()
