"""Telemetry from real 2-rank runs: every event arrives, memory by category is exact,
communication shows each strategy's collectives."""

from __future__ import annotations

import json
import time

import pytest
from workloads import log_many, param_count, train

import nbtrain
from nbtrain.telemetry.events import Comm, Memory, Step

pytestmark = pytest.mark.usefixtures("no_leftovers")

EVERY_STEP = nbtrain.Telemetry(memory_every=1)


@pytest.fixture(scope="module")
def runs():
    """One run per strategy, shared by the memory and communication tests."""
    return {s: nbtrain.launch(train, devices=2, strategy=s, telemetry=EVERY_STEP)
            for s in ("ddp", "fsdp", "fsdp_grad_op")}


def _last_memory(run, rank) -> dict[str, int]:
    return [e for e in run.history.events("memory", rank) if isinstance(e, Memory)][-1].values


def test_ddp_holds_16_bytes_per_parameter_on_every_rank(runs):
    n = param_count()
    for rank in (0, 1):
        mem = _last_memory(runs["ddp"], rank)
        assert mem["params"] == 4 * n
        assert mem["grads"] == 4 * n
        assert mem["optimizer"] == 8 * n  # Adam: two fp32 moments
        assert "cuda_allocated" not in mem  # no allocator figures on CPU, and no RSS


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_grad_op"])
def test_sharding_halves_the_bytes_per_rank(runs, strategy):
    n = param_count()
    for rank in (0, 1):
        mem = _last_memory(runs[strategy], rank)
        for category, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):
            half = per_param * n / 2
            assert half <= mem[category] <= 1.02 * half, (category, mem[category], half)


def _comm_per_step(run, rank) -> dict[str, tuple[int, int]]:
    events = [e for e in run.history.events("comm", rank) if isinstance(e, Comm)]
    steps = sorted(e.step for e in run.history.events("step", rank))
    # identical steps travel as one event (a run of them): each step is in exactly one
    assert len(steps) == 8 and sorted(s for e in events for s in range(e.step, e.last + 1)) == steps
    ops = {op for e in events for op in e.counts}
    return {op: (sum(e.counts.get(op, 0) * e.steps for e in events) // len(steps),
                 sum(e.bytes.get(op, 0) * e.steps for e in events) // len(steps)) for op in ops}


def test_ddp_communicates_by_all_reduce_only(runs):
    n = param_count()
    for rank in (0, 1):
        per_step = _comm_per_step(runs["ddp"], rank)
        assert set(per_step) == {"all_reduce"}
        calls, size = per_step["all_reduce"]
        assert calls >= 1 and size == 4 * n  # every gradient, once


def test_fsdp_gathers_parameters_and_scatters_gradients(runs):
    n = param_count()
    full = _comm_per_step(runs["fsdp"], 0)
    grad_op = _comm_per_step(runs["fsdp_grad_op"], 0)
    assert set(full) == set(grad_op) == {"all_gather", "reduce_scatter"}
    assert full["all_gather"][1] == 2 * 4 * n  # gathered for forward and again for backward
    assert grad_op["all_gather"][1] == 4 * n  # kept from forward to backward
    assert full["reduce_scatter"][1] == grad_op["reduce_scatter"][1] == 4 * n
    assert full["all_gather"][0] == 2 * grad_op["all_gather"][0]


def test_steps_carry_time_and_samples(runs):
    run = runs["ddp"]
    steps = [e for e in run.history.events("step", 0) if isinstance(e, Step)]
    assert [e.step for e in steps] == list(range(8))
    assert all(e.samples == 16 and e.duration > 0 for e in steps)
    summary = run.summary()
    assert summary.ranks[0].steps == 8 and summary.ranks[0].samples_per_s > 0
    assert summary.ranks[0].model_bytes == 16 * param_count()
    text = str(summary)
    assert "params MB" in text and "all_reduce/step" in text and "loss" in text
    # in a notebook: a column per rank, a row per figure (the same cells, never wrapping)
    page = summary._repr_html_()
    assert page.count("<tr>") == len(summary._columns())  # the header, then a row each
    for name, cells in summary._columns()[1:]:
        assert f"<th style='text-align:left'>{name}</th>" in page, name
        assert all(f">{cell}</td>" in page for cell in cells)
    assert "total throughput" in page


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_every_event_arrives_in_order(start_method):
    run = nbtrain.launch(log_many, 300, devices=2, start_method=start_method)
    for rank in (0, 1):
        logged = run.history.metric("i", rank)
        assert [v for _, v in logged] == list(range(300))
        assert [s for s, _ in logged] == list(range(300))
        assert [e.step for e in run.history.events("step", rank)] == list(range(300))
        states = [e.state for e in run.history.events("lifecycle", rank)]
        assert states == ["started", "finished"]


class SlowSink:
    def __init__(self, delay):
        self.delay, self.calls, self.events, self.closed = delay, 0, 0, None

    def on_events(self, events):
        time.sleep(self.delay)
        self.calls += 1
        self.events += len(events)

    def close(self, run):
        self.closed = run.status


def test_a_slow_consumer_never_stalls_the_workers():
    sink = SlowSink(delay=0.05)  # slower than a step: would cost 15 s if steps waited
    run = nbtrain.launch(log_many, 300, devices=2, sinks=[sink])
    steps = [e.duration for e in run.history.events("step")]
    assert len(steps) == 600
    assert sum(steps) / len(steps) < 0.04  # a step that waited for the sink takes >= 0.05 s
    assert len(run.history.metric("i", 1)) == 300  # the history has everything
    assert sink.calls < sink.events and sink.closed == "done"  # batched, and told the end


def test_telemetry_settings():
    run = nbtrain.launch(log_many, 20, devices=2, telemetry=False)
    assert len(run.history.events()) == 0 and run.results == [20, 20]
    run = nbtrain.launch(log_many, 20, devices=2,
                         telemetry=nbtrain.Telemetry(memory_every=0, comm=False))
    kinds = {e.kind for e in run.history.events()}
    assert {"metric", "step", "lifecycle"} <= kinds and not kinds & {"memory", "comm"}
    run = nbtrain.launch(log_many, 20, devices=2)  # default: memory every 10 steps
    assert [e.step for e in run.history.events("memory", 0)] == [0, 10]
    with pytest.raises(ValueError, match="memory_every"):
        nbtrain.Telemetry(memory_every=-1)
    with pytest.raises(TypeError, match="telemetry="):
        nbtrain.launch(log_many, devices=2, telemetry="yes")


def test_history_exports(runs, tmp_path):
    history = runs["fsdp"].history
    rows = history.records()
    assert {"kind", "rank", "step", "t", "loss"} <= set(rows[0])
    history.to_csv(tmp_path / "h.csv")
    assert (tmp_path / "h.csv").read_text().splitlines()[0].startswith("kind,rank,step,t")
    history.to_json(tmp_path / "h.json")
    kinds = {r["kind"] for r in json.loads((tmp_path / "h.json").read_text())}
    assert {"metric", "step", "memory", "comm", "lifecycle"} <= kinds
    comm = history.records("comm")  # calls and bytes both kept (bytes overwrote calls)
    moved = sum(r["all_gather_bytes"] * r["steps"] for r in comm if r["rank"] == 0)
    assert moved == 8 * 2 * 4 * param_count() and all(r["all_gather_calls"] for r in comm)


def test_accumulation_micro_steps_do_not_all_reduce():
    from workloads import accumulate_steps

    run = nbtrain.launch(accumulate_steps, devices=2, dashboard=False)
    comm = {e.step: e for e in run.history.events("comm", 0) if isinstance(e, Comm)}
    assert sorted(comm) == [1, 3, 5, 7]  # the last micro-step of each pair
    assert all(e.steps == 1 for e in comm.values())  # not consecutive: no run of them
    assert all(e.bytes["all_reduce"] == 4 * param_count() for e in comm.values())


def test_host_resident_bytes_are_reported_apart_on_a_gpu_run():
    import torch

    from nbtrain.telemetry.probes import memory_by_category
    from nbtrain.telemetry.summary import summarize

    model = torch.nn.Linear(100, 10)  # 1010 parameters, in host memory
    model(torch.randn(4, 100)).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    on_cpu = memory_by_category(model, [opt], torch.device("cpu"))
    assert on_cpu == {"params": 4040, "grads": 4040, "optimizer": 8080}  # the host is the device
    # What an offloaded shard looks like to a CUDA run: nothing on the GPU, all on the host.
    offloaded = memory_by_category(model, [opt], torch.device("cuda", 0))
    assert offloaded == {"params": 0, "grads": 0, "optimizer": 0, "params_host": 4040,
                         "grads_host": 4040, "optimizer_host": 8080}
    from nbtrain.telemetry.history import History

    history = History()
    history.append(Memory(rank=0, step=1, t=0.0, values=offloaded))
    text = str(summarize(history, 1))
    assert "params (host) MB" in text and "optimizer (host) MB" in text


def optimizer_steps(ctx, steps=5):
    """Optimizer steps without ctx.dataloader."""
    import torch

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    for _ in range(steps):
        ctx.backward(model(torch.ones(1, 2)).sum())
        opt.step()


def test_without_a_dataloader_each_optimizer_step_is_one_step():
    run = nbtrain.launch(optimizer_steps, devices=2)
    for rank in (0, 1):
        steps = run.history.events("step", rank)
        assert [e.step for e in steps] == [0, 1, 2, 3, 4]
        assert all(e.duration > 0 for e in steps), steps


def test_without_a_dataloader_a_step_runs_from_one_optimizer_step_to_the_next(given_times):
    """Step 0 from ``ctx.setup`` to the first optimizer step, each next one to the next;
    what the function does after its last (gathering, evaluating) is in no step."""
    import torch

    recorder, sent, clock = given_times(nbtrain.Telemetry(timing=False, comm=False,
                                                          memory_every=0))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder.watch(model, [opt])  # at 0
    for at in (0.5, 1.0, 2.0, 2.25, 3.0):
        clock[0] = at
        opt.step()
    clock[0] = 60.0  # the tail after the loop
    recorder.close()
    assert [(e.step, e.duration) for e in sent if isinstance(e, Step)] == [
        (0, 0.5), (1, 0.5), (2, 1.0), (3, 0.25), (4, 0.75)]


def test_the_summary_shows_the_bytes_a_step_really_moves():
    from nbtrain.telemetry.history import History
    from nbtrain.telemetry.summary import summarize

    history = History()
    mb = 2**20
    # DDP: the first step's buckets are rebuilt, so calls per step are not whole
    for step, (calls, size) in enumerate([(1, int(20.5 * mb)), (2, int(20.5 * mb))]):
        history.append(Step(rank=0, step=step, t=float(step), duration=0.1, samples=8))
        history.append(Comm(rank=0, step=step, t=float(step), counts={"all_reduce": calls},
                            bytes={"all_reduce": size}))
    text = str(summarize(history, 1))
    assert "20.50 MB in 1.5 calls" in text, text  # it read "2 × 13.67 MB"
    one = History()
    one.append(Step(rank=0, step=0, t=0.0, duration=0.1, samples=8))
    one.append(Comm(rank=0, step=0, t=0.0, counts={"all_reduce": 1}, bytes={"all_reduce": mb}))
    assert "1.00 MB in 1 call" in str(summarize(one, 1)) and " 1 calls" not in str(summarize(one, 1))

    # a run of three identical steps is each of them: the same per step as three events
    run = History()
    run.append(Step(rank=0, step=0, t=0.0, duration=0.1, samples=8))
    for step in (1, 2, 3):
        run.append(Step(rank=0, step=step, t=float(step), duration=0.1, samples=8))
    run.append(Comm(rank=0, step=0, t=0.0, counts={"all_reduce": 3}, bytes={"all_reduce": mb}))
    run.append(Comm(rank=0, step=1, t=3.0, counts={"all_reduce": 1}, bytes={"all_reduce": mb},
                    steps=3))
    assert summarize(run, 1).ranks[0].comm_per_step == {"all_reduce": {"calls": 1.5,
                                                                       "bytes": mb}}


def test_identical_steps_travel_as_one_comm_event(given_times):
    """A tiny step's third event was most of what telemetry cost it on the wire: a rank
    sends one ``Comm`` for a run of consecutive steps with the same collectives, which
    ends at a different step, a gap, ``COMM_EVERY_S``, a checkpoint or the end."""
    from nbtrain.telemetry.recorder import COMM_EVERY_S

    recorder, sent, _ = given_times(nbtrain.Telemetry(timing=False))

    def step(n, t, calls=1, size=64):
        recorder._count(n, t, {"all_reduce": calls}, {"all_reduce": size})

    try:
        step(0, 0.0, calls=3)  # DDP's first step: its buckets rebuilt
        for n in range(1, 5):
            step(n, 0.01 * n)
        recorder._count(5, 0.05, {}, {})  # an accumulating micro-step: no collective
        step(6, 0.06)
        step(7, 0.07, size=32)  # other bytes
        step(8, 0.08, size=32)
        step(9, 0.07 + COMM_EVERY_S, size=32)  # the run is old enough: it goes with this step
        step(10, 0.08 + COMM_EVERY_S, size=32)
        step(11, 0.09 + COMM_EVERY_S, size=32)
        recorder.checkpoint(11, "ckpt", report=False)  # out before the save is reported
        step(12, 0.10 + COMM_EVERY_S, size=32)
    finally:
        recorder.close()
    runs = [(e.step, e.steps, e.counts["all_reduce"], e.bytes["all_reduce"], round(e.t, 6))
            for e in sent if isinstance(e, Comm)]
    late = round(0.07 + COMM_EVERY_S, 6)
    assert runs == [(0, 1, 3, 64, 0.0), (1, 4, 1, 64, 0.04), (6, 1, 1, 64, 0.06),
                    (7, 3, 1, 32, late), (10, 2, 1, 32, round(late + 0.02, 6)),
                    (12, 1, 1, 32, round(late + 0.03, 6))]

def trains_then_fails(ctx):
    import torch

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    for _ in range(3):  # no ctx.dataloader: each optimizer step is a step
        ctx.backward(torch.nn.functional.mse_loss(model(torch.randn(4, 4)), torch.randn(4, 1)))
        opt.step()
        opt.zero_grad()
    if ctx.rank == 0:
        raise ValueError("after training")


def test_a_failing_rank_still_sends_its_last_step():
    """The last step is sent as the function ends, also when it ends by failing (the
    step-time chart had a gap there)."""
    with pytest.raises(nbtrain.WorkerError):
        nbtrain.launch(trains_then_fails, devices=2, dashboard=False)
    run = nbtrain.last_run()
    assert [e.step for e in run.history.events("step", 0)] == [0, 1, 2]


def test_a_failing_rank_closes_its_context_so_its_recorder_sends_what_it_held(
        tmp_path, monkeypatch):
    """What ctx._close sends (a CUDA rank's batched ctx.log tensors, its device clock's
    last steps) exists only on a GPU; that a failing rank closes its context shows here:
    the forked ranks run the kernel's Context._close, which leaves a mark."""
    from nbtrain.context import Context

    close = Context._close

    def marked(self):
        (tmp_path / f"closed-{self.rank}").touch()
        close(self)

    monkeypatch.setattr(Context, "_close", marked)
    with pytest.raises(nbtrain.WorkerError):
        nbtrain.launch(trains_then_fails, devices=2, start_method="fork", dashboard=False)
    assert (tmp_path / "closed-0").exists()  # rank 0 failed, and closed its context


def averages_the_model(ctx):
    """An EMA of the model as torch's swa_utils keeps one (it deep-copies the model)."""
    import torch
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.setup(model, opt)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for _ in range(3):
        ctx.backward(model(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        opt.zero_grad()
        ema.update_parameters(model)
    with torch.no_grad():
        return ema(torch.ones(1, 8)).tolist()


@pytest.mark.parametrize("telemetry", [True, nbtrain.Telemetry(profile_memory=True)],
                         ids=["default", "profile_memory"])
def test_a_watched_model_can_be_deep_copied_for_an_ema(telemetry):
    """AveragedModel (and timm's, Lightning's EMA) deep-copies the model: with telemetry's
    hooks bound to its recorder (a lock inside), that failed in every rank with
    "cannot pickle '_thread.lock' object"."""
    run = nbtrain.launch(averages_the_model, devices=2, strategy="ddp", telemetry=telemetry,
                         dashboard=False)
    assert run.results[0] == run.results[1] and len(run.results[0][0]) == 2, run.results
    assert [e.step for e in run.history.events("step", 0)] == [0, 1, 2]
