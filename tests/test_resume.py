"""ctx.checkpoint_every's parts: a loader that goes on from a saved position, the step
count, the checks at the edge, and a launch that goes on from such a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from workloads import Deep, ckpt_train, every_train

import nbtrain
from nbtrain import checkpoint
from nbtrain.loader import DeviceLoader, ResumableSampler

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _loader(n=12, batch=2, shuffle=True):
    data = TensorDataset(torch.arange(n))
    sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=shuffle, seed=3)
    calls = []
    loader = DeviceLoader(DataLoader(data, batch_size=batch, sampler=sampler), sampler,
                          torch.device("cpu"), on_batch=lambda *a: calls.append(a),
                          on_data_time=None, on_epoch_end=lambda: calls.append("end"))
    return loader, calls


def _epochs(loader, count):
    return [[b[0].tolist() for b in loader] for _ in range(count)]


def test_a_resumed_loader_yields_what_the_uninterrupted_one_had_left():
    whole, _ = _loader()
    want = _epochs(whole, 3)
    resumed, calls = _loader()
    resumed.resume_at(1, 4)  # epoch 1, 4 of its 6 batches done
    got = _epochs(resumed, 3)
    assert got[0] == []  # the loop over epochs runs as written: epoch 0 was done before
    assert got[1] == want[1][4:] and got[2] == want[2]
    assert len(calls) == 2 + 1 + 6 + 1  # batches and epoch ends only for what it yields
    assert resumed.position == (3, 0)


def test_loader_epochs_go_on_from_the_epoch_a_resumed_loader_is_in():
    """``for epoch in loader.epochs(n)``: the epochs already done are not looped over at
    all (no empty epochs), so once-an-epoch code runs once for each epoch in all."""
    whole, _ = _loader()
    want = {e: [b[0].tolist() for b in whole] for e in whole.epochs(3)}
    resumed, _ = _loader()
    resumed.resume_at(1, 4)
    got = {e: [b[0].tolist() for b in resumed] for e in resumed.epochs(3)}
    assert got == {1: want[1][4:], 2: want[2]}
    assert resumed.position == (3, 0)
    fresh, _ = _loader()
    assert list(fresh.epochs(2)) == [0, 1]
    with pytest.raises(ValueError, match=r"loader.epochs\(-1\): give the number"):
        fresh.epochs(-1)
    with pytest.raises(RuntimeError, match="call it before the loop"):
        fresh.resume_at(1, 0)  # checkpoint_every inside the loop: too late to go on


def test_the_loader_says_where_it_is_before_each_fetch():
    loader, _ = _loader(n=6, batch=2, shuffle=False)
    seen = []
    loader.on_fetch = lambda it: seen.append(it.position)
    _epochs(loader, 2)
    # before each of the 3 batches and before the fetch that ends the epoch
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_the_sampler_skips_once():
    data = TensorDataset(torch.arange(10))
    sampler = ResumableSampler(data, num_replicas=2, rank=1, shuffle=False)
    sampler.skip = 3
    assert list(sampler) == [7, 9] and list(sampler) == [1, 3, 5, 7, 9]


def _bad(ctx, how):
    model, opt = ctx.setup(torch.nn.Linear(2, 2), torch.optim.SGD(
        torch.nn.Linear(2, 2).parameters(), lr=0.1))
    if how == "zero":
        ctx.checkpoint_every(0, model=model)
    if how == "twice":
        ctx.checkpoint_every(2, "/tmp/unused", model=model)
        ctx.checkpoint_every(2, "/tmp/unused", model=model)


@pytest.mark.parametrize("how, message", [("zero", r"checkpoint_every\(0\): give the number"),
                                          ("twice", "already called")])
def test_bad_calls_say_what_to_do(how, message):
    with pytest.raises(nbtrain.WorkerError, match=message):
        nbtrain.launch(_bad, how, devices=1, accelerator="cpu", dashboard=False)


def test_launch_resume_goes_on_from_a_checkpoint_every_checkpoint(tmp_path):
    """launch(resume=path): the step, the loader's position and the streams come back, so
    a run stopped by hand after 24 steps and resumed ends as an uninterrupted one."""
    kw = dict(devices=2, accelerator="cpu", dashboard=False, strategy="ddp")
    whole = nbtrain.launch(every_train, str(tmp_path / "a"), **kw)
    path = str(tmp_path / "b")
    nbtrain.launch(every_train, path, epochs=1, every=8, **kw)  # 16 steps, saved at 8, 16
    assert {"step", "nbtrain.resume.0", "nbtrain.resume.1"} <= checkpoint.keys(path)
    done = nbtrain.launch(every_train, path, resume=path, **kw)
    assert done.results[0]["first"] == 16
    # the state handed back still says where the attempt began, saves since or not
    assert whole.results[0]["step_at_end"] == 0 and done.results[0]["step_at_end"] == 16
    for name, value in whole.results[0]["full"].items():
        torch.testing.assert_close(done.results[0]["full"][name], value, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_ctx_save_gives_what_it_has(tmp_path):
    """Without nbtrain's own entries (a ctx.save checkpoint) the model and optimizer load
    and the count starts at 0."""
    path = str(tmp_path / "plain")
    nbtrain.launch(ckpt_train, path=path, steps=4, save_every=4, devices=2,
                   accelerator="cpu", dashboard=False)

    def go_on(ctx):
        model = ctx.setup(Deep())
        state = ctx.checkpoint_every(5, str(tmp_path / "next"), model=model, step=-1)
        return state["step"], ctx.full_state_dict(model).get("head.bias")  # {} on rank 1

    run = nbtrain.launch(go_on, devices=2, accelerator="cpu", dashboard=False, resume=path)
    step, bias = run.results[0]
    saved = checkpoint.load(path, {"model": Deep()})["model"]
    assert step == 0 and torch.equal(bias, saved.head.bias.detach())


def test_the_default_directory_is_one_per_kernel_and_function():
    from nbtrain.resume import default_path

    a, b = default_path("train", 10), default_path("Trainer.<locals>.fit", 10)
    assert os.path.dirname(a) == os.path.dirname(b) and a != b
    assert os.path.basename(b) == "10-Trainer._locals_.fit"
