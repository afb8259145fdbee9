"""The seeding rule: the same for fork, the fork server and spawn, different per rank, fresh per launch,
reproducible with ``launch(seed=N)``."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset
from workloads import draws

import nbtrain

pytestmark = pytest.mark.usefixtures("no_leftovers")


def launch(start_method, **kwargs):
    return nbtrain.launch(draws, devices=2, accelerator="cpu", start_method=start_method,
                          dashboard=False, **kwargs)


def expected(seed: int) -> dict:
    """What a process seeded by hand with ``seed`` draws, as the worker's function does."""
    state = random.getstate(), numpy.random.get_state()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        random.seed(seed)
        numpy.random.seed(seed)
        want = {"torch": torch.randn(3), "random": random.random(),
                "numpy": float(numpy.random.rand())}
    random.setstate(state[0])
    numpy.random.set_state(state[1])
    return want


def order(seed: int, rank: int) -> list[int]:
    return list(DistributedSampler(TensorDataset(torch.arange(16)), num_replicas=2, rank=rank,
                                   shuffle=True, seed=seed))


def test_fork_and_spawn_give_the_same_streams_for_the_same_seed():
    forked, spawned = launch("fork", seed=1234), launch("spawn", seed=1234)
    assert forked.seed == spawned.seed == 1234
    for rank in (0, 1):
        f, s, want = forked.results[rank], spawned.results[rank], expected(1234 + rank)
        torch.testing.assert_close(f["torch"], want["torch"], rtol=0, atol=0)
        torch.testing.assert_close(s["torch"], want["torch"], rtol=0, atol=0)
        assert f["random"] == s["random"] == want["random"]
        assert f["numpy"] == s["numpy"] == want["numpy"]
        assert f["seed"] == s["seed"] == 1234  # ctx.seed: the base, on every rank
        # the data order: one permutation seeded with 1234, each rank its half
        assert f["order"] == s["order"] == order(1234, rank)
    r0, r1 = forked.results
    assert not torch.equal(r0["torch"], r1["torch"])
    assert r0["random"] != r1["random"] and r0["numpy"] != r1["numpy"]
    assert sorted(r0["order"] + r1["order"]) == list(range(16))


def test_the_fork_server_gives_the_streams_fork_gives():
    forked, served = launch("fork", seed=77), launch("forkserver", seed=77)
    assert served.start_method == "forkserver"
    for f, s in zip(forked.results, served.results, strict=True):
        torch.testing.assert_close(f["torch"], s["torch"], rtol=0, atol=0)
        assert (f["random"], f["numpy"], f["seed"], f["order"]) == \
            (s["random"], s["numpy"], s["seed"], s["order"])


@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_without_a_seed_ranks_and_launches_differ(start_method):
    torch.manual_seed(0)  # the kernel's own state must not leak into forked ranks
    first, second = launch(start_method), launch(start_method)
    assert first.seed != second.seed
    draws_ = [r["torch"] for run in (first, second) for r in run.results]
    assert len({tuple(t.tolist()) for t in draws_}) == 4, draws_
    # each rank started from the run's seed + rank: run.seed repeats it
    for run in (first, second):
        for rank in (0, 1):
            torch.testing.assert_close(run.results[rank]["torch"],
                                       expected(run.seed + rank)["torch"], rtol=0, atol=0)
    # shuffling stays the same on every rank (seed 0, as DistributedSampler's default)
    assert [r["order"] for r in first.results] == [order(0, 0), order(0, 1)]
    assert [r["order"] for r in second.results] == [order(0, 0), order(0, 1)]


def test_a_bad_seed_fails_before_anything_starts():
    with pytest.raises(TypeError, match="give an int from 0 to 4294967295"):
        launch("fork", seed=1.5)
    with pytest.raises(TypeError, match="give an int"):
        launch("fork", seed=True)
    with pytest.raises(ValueError, match=r"outside 0\.\.4294967295.*e\.g\. seed=4294967295"):
        launch("fork", seed=-1)



@pytest.mark.parametrize("built", [(), ("cuda",), ("mps",), ("xpu",), ("mtia",),
                                   ("custom",), ("unknown xpu",)])
def test_only_a_torch_built_for_the_cpu_alone_skips_torch_manual_seed(monkeypatch, built):
    """torch.manual_seed formats the stack once per device kind not yet initialised (2-8 ms
    in a forked rank); a CPU-only build has nothing but the CPU generator to seed, any build
    with a device kind (or an older torch that cannot say) still goes through it."""
    from nbtrain import seeding

    with torch.random.fork_rng():
        torch.manual_seed(7)
        want = torch.rand(4)
        calls = []
        monkeypatch.setattr(torch, "manual_seed", calls.append)
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: "cuda" in built)
        monkeypatch.setattr(torch.backends.mps, "is_built", lambda: "mps" in built)
        monkeypatch.setattr(torch.xpu, "_is_compiled", lambda: "xpu" in built)
        monkeypatch.setattr(torch.mtia, "_is_compiled", lambda: "mtia" in built)
        if "custom" in built:
            monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "npu")
        if "unknown xpu" in built:
            monkeypatch.delattr(torch.xpu, "_is_compiled")
        torch.default_generator.manual_seed(0)
        seeding._seed_torch(7)
        assert calls == ([7] if built else [])
        if not built:  # the CPU generator as torch.manual_seed(7) leaves it
            assert torch.equal(torch.rand(4), want)
