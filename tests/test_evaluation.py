"""Evaluating inside the training function: a pass over ``ctx.dataloader`` begun after
``model.eval()`` is no training step (steps, their times and communication are the
training loop's alone), and ``loader.gather`` puts the ranks' per-sample results
together, each sample once, in the dataset's order, as one process computes them."""

from __future__ import annotations

import itertools
import time

import models
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbtrain
from nbtrain.telemetry.events import Evaluation, Step, decode, encode
from nbtrain.telemetry.timing import StepClock
from nbtrain.ui.header import progress_parts
from nbtrain.ui.state import LiveState

N_VAL = 101  # odd: DistributedSampler repeats a sample so that both ranks get 51


def _data():
    g = torch.Generator().manual_seed(0)
    train_set = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g),
                                               torch.randint(0, 4, (256,), generator=g))
    x = torch.randn(N_VAL, 16, generator=g)
    x[:, 0] = torch.arange(N_VAL)  # each sample says which it is
    return train_set, torch.utils.data.TensorDataset(x, torch.randint(0, 4, (N_VAL,),
                                                                      generator=g))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train_and_evaluate(ctx, epochs=2, shuffle_val=True):
    train_set, val_set = _data()
    model = _model()
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.dataloader(train_set, batch_size=16, shuffle=True)
    val = ctx.dataloader(val_set, batch_size=16, shuffle=shuffle_val)
    seen = []
    for _ in loader.epochs(epochs):
        model.train()
        for x, y in loader:
            ctx.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        model.eval()
        losses, ids = [], []
        with torch.no_grad():
            for x, y in val:
                losses.append(F.cross_entropy(model(x), y, reduction="none"))
                ids.append(x[:, 0])
        val_loss = val.gather(losses)
        ctx.log(val_loss=val_loss.mean())
        seen.append(ctx.step)
    return {"steps": seen, "ids": val.gather(ids), "losses": val_loss,
            "state": ctx.full_state_dict(model)}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_evaluation_is_no_step_and_gather_gives_what_one_process_computes(strategy):
    run = nbtrain.launch(train_and_evaluate, devices=2, strategy=strategy, dashboard=False)
    per_epoch = 256 // 2 // 16
    first, second = run.results
    # ctx.step counts training batches only, on every rank
    assert first["steps"] == second["steps"] == [per_epoch - 1, 2 * per_epoch - 1]
    for rank in (0, 1):
        steps = run.history.events("step", rank=rank)
        assert [s.step for s in steps] == list(range(2 * per_epoch))
        assert {s.epoch_steps for s in steps} == {per_epoch}
        assert {s.samples for s in steps} == {16}
        for s in steps:  # the evaluation's forwards went to no step
            assert sum(s.phases.values()) <= s.duration + len(s.phases) * 0.5e-6
    if strategy == "ddp":  # one bucket's all-reduce a step: none from the evaluation
        assert {tuple(c.counts.items()) for c in run.history.events("comm")} == {
            (("all_reduce", 1),)}
    # every sample once, in the dataset's order, on every rank
    for result in run.results:
        assert torch.equal(result["ids"], torch.arange(N_VAL, dtype=torch.float32))
    model = _model()
    model.load_state_dict(first["state"])
    x, y = _data()[1].tensors
    with torch.no_grad():
        expected = F.cross_entropy(model(x), y, reduction="none")
    torch.testing.assert_close(first["losses"], expected)
    torch.testing.assert_close(second["losses"], expected)
    logged = run.history.metric("val_loss", rank=1)
    assert logged[-1] == (2 * per_epoch - 1, pytest.approx(expected.mean().item(), rel=1e-6))
    # each pass said when it began and ended (4 batches of 16 of the 51 samples a rank)
    for rank in (0, 1):
        passes = [(e.step, e.done, e.batches) for e in run.history.events("evaluation", rank)]
        assert passes == [(per_epoch - 1, 0, 4), (per_epoch - 1, 4, 4),
                          (2 * per_epoch - 1, 0, 4), (2 * per_epoch - 1, 4, 4)]
    assert "evaluation: 2 passes on rank 0, " in str(run.summary())


def gather_misuse(ctx, what):
    model = _model()
    model = ctx.setup(model)
    val = ctx.dataloader(_data()[1], batch_size=16, drop_last=what == "drop_last")
    model.eval()
    values = [x[:, 0] for x, _ in val]
    if what == "one batch":
        values = values[0]
    elif what == "dtype on rank 1" and ctx.rank == 1:
        values = [v.double() for v in values]
    elif what == "a number":
        values = 1.0
    return val.gather(values)


@pytest.mark.parametrize("what, error, match", [
    ("one batch", ValueError, r"loader.gather takes one row per sample of this "
                              r"rank's pass over the loader, 51; got 16"),
    ("drop_last", ValueError, r"drops the last ones \(drop_last=True\)"),
    ("dtype on rank 1", ValueError, r"differ in shape or dtype \(rank 0: \(51,\) torch.float32, "
                                    r"rank 1: \(51,\) torch.float64\)"),
    ("a number", TypeError, r"takes a tensor with one row per sample .* got float"),
])
def test_gather_misuse_fails_with_a_remedy(what, error, match):
    with pytest.raises(nbtrain.WorkerError, match=match) as failed:
        nbtrain.launch(gather_misuse, devices=2, dashboard=False, what=what)
    assert failed.value.exc_type == error.__name__


def test_time_between_two_steps_goes_to_neither():
    """An evaluation's forwards and the waits in it, timed while no step is open, are
    forgotten when the next step begins."""
    clock = StepClock()
    model = nn.Linear(8, 8)
    clock.watch(model, [])
    try:
        with torch.no_grad():
            for _ in range(50):
                model(torch.randn(256, 8))
        clock.data(0.5)
        clock.forget()
        phases = clock.take(0.01)
    finally:
        clock.uninstall()
    assert phases["forward"] == phases["data"] == phases["comm"] == 0
    assert phases["other"] == pytest.approx(0.01)


def slow_evaluation(ctx, seconds_a_batch=0.3, batches=6):
    model = ctx.setup(_model())
    val = ctx.dataloader(_data()[1], batch_size=-(-N_VAL // 2 // batches))
    model.eval()
    for _ in val:
        time.sleep(seconds_a_batch)
    return len(val)


def test_a_long_evaluation_shows_its_progress_about_once_a_second():
    run = nbtrain.launch(slow_evaluation, devices=2, dashboard=False)
    assert run.results == [6, 6]
    for rank in (0, 1):
        sent = run.history.events("evaluation", rank)
        assert [e.done for e in sent][0] == 0 and [e.done for e in sent][-1] == 6
        between = sent[1:-1]  # 1.8 s of batches or more: at least one in between
        assert between, [(e.done, e.t - sent[0].t) for e in sent]
        assert all(0 < e.done < 6 for e in between)
        assert all(b.t - a.t >= 0.99 for a, b in itertools.pairwise(sent[:-1]))  # a second apart


def test_the_header_says_a_rank_is_evaluating_until_it_trains_or_ends():
    event = Evaluation(rank=0, step=7, t=1.0, done=3, batches=10)
    assert decode(encode(event)) == event
    state = LiveState(2)
    state.update([Evaluation(0, 7, 1.0, 0, 10), Evaluation(1, 7, 1.0, 0, 10), event])
    assert "evaluating 3/10" in progress_parts(state)
    assert "evaluating 3/10" in state.progress_line()
    state.update([Evaluation(0, 7, 2.0, 10, 10)])  # rank 0 done, rank 1 still at it
    assert "evaluating 0/10" in progress_parts(state)
    state.update([Step(1, 8, 3.0, duration=0.1, samples=16)])  # rank 1 trains again
    assert not any(p.startswith("evaluating") for p in progress_parts(state))


def forgets_train(ctx):
    train_set, val_set = _data()
    model = _model()
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.dataloader(train_set, batch_size=16, shuffle=True)
    val = ctx.dataloader(val_set, batch_size=16)
    for _ in loader.epochs(2):
        for x, y in loader:
            ctx.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            for x, _ in val:
                model(x)
        # model.train() forgotten: the next epoch trains in eval mode
    return ctx.step


def test_a_forgotten_model_train_is_named_and_the_pass_trains_from_its_next_batch(capfd):
    run = nbtrain.launch(forgets_train, devices=2, dashboard=False)
    per_epoch = 256 // 2 // 16
    # the first batch of the second epoch went by as an evaluation's; the rest are steps
    assert run.results == [2 * per_epoch - 2] * 2
    assert len(run.history.events("step", rank=0)) == 2 * per_epoch - 1
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert (f"[rank {rank}] nbtrain: an optimizer step ran during a pass over "
                "ctx.dataloader begun with every model in eval mode") in err, err
    assert "Call model.train() before training" in err


def _val_set(kind: str):
    g = torch.Generator().manual_seed(7)
    if kind == "gpt2":
        return torch.utils.data.TensorDataset(torch.randint(1, models.VOCAB, (11, models.SEQ),
                                                            generator=g))
    return torch.utils.data.TensorDataset(torch.randn(11, 3, 16, 16, generator=g),
                                          torch.randint(0, 10, (11,), generator=g))


def _per_sample(kind: str, model: nn.Module, b) -> torch.Tensor:
    if kind == "gpt2":
        (ids,) = b
        logits = model(input_ids=ids).logits[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(),
                               reduction="none").view(len(ids), -1).mean(1)
    x, y = b
    return F.cross_entropy(model(x), y, reduction="none")


def evaluate_a_model(ctx, kind):
    torch.manual_seed(0)
    model = models.make(kind)
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for step in range(2):  # train a little: weights and batch norm's statistics move
        ctx.backward(models.loss_of(kind, model, {k: v.to(ctx.device) for k, v in
                                                  models.batch(kind, step, ctx.rank).items()}))
        opt.step()
        opt.zero_grad()
    val = ctx.dataloader(_val_set(kind), batch_size=2)  # 11 samples: 6 a rank, one repeated
    model.eval()
    with torch.no_grad():
        losses = val.gather([_per_sample(kind, model, b) for b in val])
    return losses, ctx.full_state_dict(model)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["gpt2", "cnn"])  # tied embeddings; batch norm's statistics
def test_a_real_model_evaluates_as_in_one_process(kind, strategy):
    """The model that evaluates is one model on every rank, the one full_state_dict
    gives: under FSDP each rank's batch norm had updated its own statistics in the last
    training forward, and evaluating with them gave rank 1's samples losses up to 1e-3
    apart (DDP syncs them at every forward)."""
    if kind == "gpt2":
        pytest.importorskip("transformers")  # a dev extra: the hosted legs have none
    run = nbtrain.launch(evaluate_a_model, devices=2, strategy=strategy, dashboard=False,
                         kind=kind)
    (losses, state), (other, _) = run.results
    model = models.make(kind)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        expected = _per_sample(kind, model, _val_set(kind).tensors)
    torch.testing.assert_close(losses, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(other, losses)


def evaluates_at_the_top_of_the_loop(ctx, every=3, seconds=1.0):
    """The common pattern: ``if step % every == 0: evaluate()`` before the batch's own
    training, a pass that takes ``seconds``."""
    train_set, val_set = _data()
    model = _model()
    model, opt = ctx.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = ctx.dataloader(train_set, batch_size=16)
    val = ctx.dataloader(val_set, batch_size=64)
    for i, (x, y) in enumerate(loader):
        if i % every == 1:
            model.eval()
            with torch.no_grad():
                for vx, _ in val:
                    model(vx)
                    time.sleep(seconds / len(val))
            model.train()
        ctx.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        if i == 6:
            break  # the last step stays open: the evaluation below pauses it too
    model.eval()
    with torch.no_grad():
        out = [model(vx).sum(1) for vx, _ in val]
        time.sleep(seconds)  # the last step ends with its optimizer step, not after this
        return val.gather(out).shape


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_evaluation_inside_a_step_pauses_it(strategy):
    """The step an evaluation interrupts keeps its own work (its forward, backward and
    optimizer step) and not the evaluation's forwards or collectives (nor its second:
    the next test, with the times given)."""
    run = nbtrain.launch(evaluates_at_the_top_of_the_loop, devices=2, strategy=strategy,
                         dashboard=False, telemetry=nbtrain.Telemetry(timing="every step"))
    assert run.results == [torch.Size([N_VAL])] * 2
    for rank in (0, 1):
        steps = run.history.events("step", rank)
        assert [s.step for s in steps] == list(range(7))
        paused = [s for s in steps if s.step % 3 == 1]
        for s in paused:
            assert s.phases["forward"] > 0 and s.phases["backward"] > 0, s
            assert sum(s.phases.values()) <= s.duration + len(s.phases) * 0.5e-6, s
        if strategy == "ddp":  # the step's own all-reduce, none of the evaluation's or gather's
            assert {tuple(c.counts.items()) for c in run.history.events("comm", rank)} == {
                (("all_reduce", 1),)}
        assert len(run.history.events("evaluation", rank)) == 3 * 2  # begun, ended: 3 times


def test_an_evaluation_is_no_part_of_the_step_it_pauses(given_times):
    """The step an evaluation runs in lasts its own work: the pass's seconds move its
    start later. Its progress goes out as it begins and ends, not at each batch; the
    last step ends with its optimizer step, not with what follows the loop."""
    recorder, sent, clock = given_times(nbtrain.Telemetry(timing=False, comm=False,
                                                          memory_every=0))
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder.watch(model, [opt])

    def at(t, then, *args):
        clock[0] = t
        then(*args)

    at(0.0, recorder.on_batch, 0, 16)
    at(0.5, opt.step)
    at(1.0, recorder.on_batch, 1, 16)
    at(1.25, recorder.on_evaluation, 0, 4)  # a 5-second pass begins inside step 1
    at(1.5, recorder.on_evaluation, 1, 4)
    at(6.25, recorder.on_evaluation, 4, 4)
    at(6.75, opt.step)
    at(7.0, recorder.on_batch, 2, 16)
    at(7.5, opt.step)
    at(60.0, recorder.close)
    assert [(e.step, e.duration) for e in sent if isinstance(e, Step)] == [
        (0, 1.0), (1, 1.0), (2, 0.5)]
    assert [(e.t, e.done) for e in sent if isinstance(e, Evaluation)] == [(1.25, 0), (6.25, 4)]


def test_lightnings_validation_metrics_arrive_once_a_validation(monkeypatch):
    """nbtrain's Lightning callback, driven as Lightning drives it over two epochs: the
    training step's loss at every step, the validation's loss once after each validation
    (the last one too), never re-sent at the steps between, nothing from the sanity check."""
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from nbtrain.integrations import lightning as adapter

    sent = []
    monkeypatch.setattr(adapter.active, "log", lambda step, values: sent.append((step, *values)))
    callback = adapter.NbtrainCallback()
    trainer = SimpleNamespace(callback_metrics={}, global_step=0, sanity_checking=True)
    trainer.callback_metrics = {"val_loss": torch.tensor(9.0)}
    callback.on_validation_end(trainer, None)  # the sanity check: not sent (nor, kept
    trainer.sanity_checking = False  # in callback_metrics, at the training steps after)
    for epoch in range(2):
        for _ in range(3):
            trainer.global_step += 1
            trainer.callback_metrics["train_loss"] = torch.tensor(float(trainer.global_step))
            callback.on_train_batch_end(trainer, None, None, None, 0)
        trainer.callback_metrics["val_loss"] = torch.tensor(10.0 + epoch)
        callback.on_validation_end(trainer, None)
    assert sent == [(0, "train_loss"), (1, "train_loss"), (2, "train_loss"), (2, "val_loss"),
                    (3, "train_loss"), (4, "train_loss"), (5, "train_loss"), (5, "val_loss")]
