"""Checkpoints across strategies and world sizes (real CPU/gloo runs), into a plain model
in this process, and an interrupted run in a real kernel resumed with launch(resume=)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from workloads import Deep, ckpt_train, technique_single

import nbtrain
from nbtrain import checkpoint

pytestmark = pytest.mark.usefixtures("no_leftovers")


def launch(fn, strategy, devices=2, **kwargs):
    return nbtrain.launch(fn, devices=devices, accelerator="cpu", strategy=strategy,
                          dashboard=False, **kwargs)


def assert_same(got: dict, want: dict, what: str, atol=1e-5) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=atol,
                                   msg=f"{what}: {name}")


@pytest.fixture(scope="module")
def single():
    return technique_single()["full"]  # 8 steps of the same training in one process


@pytest.mark.parametrize("first,then,full", [
    (("fsdp", 2), ("ddp", 1), False),
    (("ddp", 2), ("fsdp", 2), False),
    (("zero1", 2), ("fsdp", 2), False),
    (("fsdp", 2), ("zero1", 2), False),
    (("fsdp", 2), ("ddp", 2), True),
    (("zero1", 2), ("ddp", 1), True),
])
def test_a_checkpoint_goes_on_in_another_strategy_and_world_size(tmp_path, single, first,
                                                                 then, full):
    path = tmp_path / ("ckpt.pt" if full else "ckpt")
    a = launch(ckpt_train, first[0], first[1], path=str(path), save_every=4, stop_after=3,
               full=full, telemetry=False)
    assert checkpoint.exists(path) and os.path.isdir(path) != full
    assert not os.path.exists(f"{path}.saving")
    b = launch(ckpt_train, then[0], then[1], load_from=str(path), telemetry=False)
    assert [r["first"] for r in b.results] == [4] * then[1]
    # 4 steps on one strategy + 4 on the other = 8 steps of 1-process training, so the
    # optimizer state came across too
    assert_same(b.result["full"], single, f"{first} -> {then}", atol=1e-4)
    assert a.result["first"] == 0


def test_a_sharded_checkpoint_loads_into_a_plain_model_in_the_notebook(tmp_path):
    path = tmp_path / "ckpt"
    run = launch(ckpt_train, "fsdp", path=str(path), save_every=8, telemetry=False)
    model = Deep()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = checkpoint.load(path, {"model": model, "optimizer": opt, "step": -1})
    assert state["step"] == 7
    assert_same(model.state_dict(), run.result["full"], "notebook load")
    assert len(opt.state) == len(list(model.parameters()))  # Adam's moments came too
    # and the single-file form reads with plain torch.load
    checkpoint.save(tmp_path / "one.pt", state, full=True)
    saved = torch.load(tmp_path / "one.pt", weights_only=False)
    assert_same(saved["model"], run.result["full"], "full file")


@pytest.mark.parametrize("full", [False, True])
def test_a_scheduler_is_loaded_in_place(tmp_path, full):
    """An LR scheduler (any object with state_dict/load_state_dict) comes back into the
    object the code steps, in both formats, not as a pickled copy bound to nothing."""
    def made():
        model = Deep()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    model, opt, sched = made()
    for _ in range(3):
        opt.step()
        sched.step()
    path = tmp_path / ("c.pt" if full else "c")
    checkpoint.save(path, {"model": model, "optimizer": opt, "scheduler": sched}, full=full)
    model, opt, sched = made()
    state = checkpoint.load(path, {"model": model, "optimizer": opt, "scheduler": sched})
    assert state["scheduler"] is sched and sched.last_epoch == 3
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5 ** 4


def test_saving_and_loading_in_the_notebook_warns_of_nothing(tmp_path):
    """In one process (the kernel) a sharded checkpoint is what DCP's no_dist asks for:
    torch's warning that it 'assumes' one process would show under every save."""
    model = Deep()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.save(tmp_path / "c", {"model": model})
        checkpoint.load(tmp_path / "c", {"model": Deep()})
    assert [str(w.message) for w in caught] == []


def test_checkpoint_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        checkpoint.load(tmp_path / "missing", {"model": Deep()})
    with pytest.raises(ValueError, match="no checkpoint there"):
        nbtrain.launch(ckpt_train, devices=2, resume=tmp_path / "missing")
    with pytest.raises(TypeError, match="dict"):
        checkpoint.save(tmp_path / "x", [Deep()])
    opt = torch.optim.SGD(Deep().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="which model it trains"):
        checkpoint.save(tmp_path / "x", {"a": Deep(), "b": Deep(), "opt": opt})


CELL = """
import nbtrain, torch
from workloads import ckpt_train
STEPS = 40
kw = dict(steps=STEPS, save_every=4, sleep=0.15, dashboard=False)
"""


@pytest.mark.kernel
def test_an_interrupted_run_resumes_where_its_last_checkpoint_was(kernel_clean, tmp_path):
    k = kernel_clean
    assert k.run(CELL).error is None
    path = str(tmp_path / "run")
    msg = k.submit(f"nbtrain.launch(ckpt_train, devices=2, strategy='fsdp', path={path!r}, **kw)")
    k.collect(msg, timeout=120, until="[rank 0] saved 11")
    k.interrupt_group()
    reply = k.collect(msg, timeout=30)
    assert reply.ename == "KeyboardInterrupt"
    saved = [int(line.split()[-1]) for line in reply.stdout.splitlines() if "saved" in line]
    last = max(saved)
    assert last >= 11 and last < 39  # interrupted before the end
    reply = k.run(f"""
        run = nbtrain.launch(ckpt_train, devices=2, strategy='fsdp', path={path!r},
                             resume={path!r}, **kw)
        ref = nbtrain.launch(ckpt_train, devices=2, strategy='fsdp',
                             path={path + '-ref'!r}, **kw)
        got = run.history.metric("loss", 0)
        want = dict(ref.history.metric("loss", 0))
        print("first", run.results[0]["first"], got[0][0])
        print("diff", max(abs(v - want[s]) for s, v in got))
        print("steps", [s for s, _ in got] == list(range(got[0][0], STEPS)))
    """, timeout=240)
    assert reply.error is None, reply.error
    assert f"first {last + 1} {last + 1}" in reply.stdout  # the step after the checkpoint
    diff = float(reply.stdout.split("diff ")[1].split()[0])
    assert diff < 1e-4, reply.stdout  # the loss curve goes on as if never interrupted
    assert "steps True" in reply.stdout


def snapshot_then_train(ctx):
    model, opt = ctx.setup(torch.nn.Linear(4, 4), torch.optim.SGD(
        torch.nn.Linear(4, 4).parameters(), lr=0.1))
    before = ctx.full_state_dict(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.backward(model(torch.ones(2, 4)).sum())
    opt.step()
    after = ctx.full_state_dict(model)
    return ctx.rank == 0 and not torch.equal(before["weight"], after["weight"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_full_state_dict_is_a_snapshot(strategy, no_leftovers):
    # on CPU under ddp it returned the live parameters: the "before" changed with the step
    run = nbtrain.launch(snapshot_then_train, devices=2, accelerator="cpu", strategy=strategy,
                         dashboard=False)
    assert run.results == [True, False]


def test_what_the_resume_error_names_is_reachable(tmp_path):
    with pytest.raises(ValueError, match=r"nbtrain\.checkpoint\.exists\(path\)"):
        nbtrain.launch(snapshot_then_train, devices=2, resume=tmp_path / "none")
    assert nbtrain.checkpoint.exists(tmp_path / "none") is False  # after `import nbtrain`
