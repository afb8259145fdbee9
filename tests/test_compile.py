"""torch.compile'd models under nbtrain's strategies (real CPU/gloo runs). Compiled before
ctx.setup (nanoGPT's order) or the model ctx.setup returns (accelerate's order), they train
as the same run uncompiled does, save checkpoints that load into a plain model, and the
time breakdown still sees their forward and backward. Telemetry adds no graph break,
compiled before setup or after (then its hooks are inside the compiled call, and run
between the graphs).

dynamo with the ``aot_eager`` backend: the graphs and the compiled autograd inductor
would get, without a C++ compiler's minutes on CI."""

from __future__ import annotations

import pytest
import torch
from workloads import D, Deep, compile_train

import nbtrain
from nbtrain import checkpoint

pytestmark = pytest.mark.usefixtures("no_leftovers")
STRATEGIES = ("ddp", "fsdp")


EVERY_STEP = nbtrain.Telemetry(timing="every step")  # each step's phases are checked


def launch(*args, **kwargs):
    kwargs.setdefault("telemetry", EVERY_STEP)
    return nbtrain.launch(compile_train, *args, devices=2, accelerator="cpu",
                          dashboard=False, **kwargs)


@pytest.fixture(scope="module")
def uncompiled():
    return {s: launch(None, strategy=s).results[0]["full"] for s in STRATEGIES}


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_compiled_model_trains_as_the_uncompiled_one(strategy, where, uncompiled):
    run = launch(where, strategy=strategy)
    assert all(r["graphs"] > 0 for r in run.results)  # dynamo did compile, on every rank
    for name, value in uncompiled[strategy].items():
        torch.testing.assert_close(run.results[0]["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=f"{strategy}, compiled {where} setup: {name}")
    for rank in (0, 1):
        steps = run.history.events("step", rank)
        assert len(steps) == 8, rank
        later = steps[2:]  # after the compile
        for phase in ("forward", "backward", "optimizer"):
            assert all(s.phases[phase] > 0 for s in later), (rank, phase, later)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compiled_before_setup_telemetry_adds_no_graph_break(strategy):
    on = launch("before", strategy=strategy).results
    off = launch("before", strategy=strategy, telemetry=False).results
    assert [r["breaks"] for r in on] == [r["breaks"] for r in off], (on[0]["reasons"],
                                                                      off[0]["reasons"])


def test_compiled_after_setup_telemetry_and_its_time_breakdown_add_no_graph_break(capfd):
    """fsdp, compiled after ctx.setup (torchtitan's order): the breakdown's hooks are
    inside the compiled call, run between the graphs (``timing.outside_graphs``), never
    traced. Traced, their clock reads broke the graph at the call's two ends (torch
    2.13 counted 2, torch 2.10 4) and dynamo warned in every rank's output that it
    cannot trace ``time.monotonic``; on CUDA a traced event's record left the event
    unrecorded. (DDP compiled after its wrap breaks its own graph, and its forward
    traced through a hook breaks once more at its logger: torch's, left as it is.)"""
    off = launch("after", strategy="fsdp", telemetry=False).results[0]
    timed = launch("after", strategy="fsdp")
    assert timed.results[0]["breaks"] == off["breaks"], timed.results[0]["reasons"]
    assert "time.monotonic" not in capfd.readouterr().err


def compiled_step_train(ctx, steps=4):
    """A model trained with its optimizer's step compiled (torch's recipe for a faster
    Adam): the step hooks run inside the compiled call."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = Deep()
    model, opt = ctx.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    step = torch.compile(opt.step, backend="aot_eager")
    for _ in range(steps):
        ctx.backward(model(torch.randn(8, D)).pow(2).mean())
        step()
        opt.zero_grad()
    return sum(counters["graph_break"].values())


def test_a_compiled_optimizer_step_is_still_each_steps_end_and_adds_no_graph_break(capfd):
    """The step hooks run between the graphs: traced, the recorder's clock reads broke
    a compiled Adam step 4 times (torch's own step breaks once) and dynamo warned."""
    off = nbtrain.launch(compiled_step_train, devices=2, accelerator="cpu", telemetry=False,
                         dashboard=False)
    on = nbtrain.launch(compiled_step_train, devices=2, accelerator="cpu", dashboard=False,
                        telemetry=EVERY_STEP)
    assert on.results[0] <= off.results[0], (on.results, off.results)  # torch's own: 1
    assert [e.step for e in on.history.events("step", 0)] == [0, 1, 2, 3]
    assert all(e.phases["optimizer"] > 0 for e in on.history.events("step", 0))
    assert "time.monotonic" not in capfd.readouterr().err


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_compiled_models_checkpoint_loads_into_a_plain_model(tmp_path, where):
    """The compiled wrapper's ``_orig_mod.`` is in no saved name."""
    path = str(tmp_path / "ck")
    run = launch(where, strategy="fsdp", save=path)
    model = Deep()
    opt = torch.optim.Adam(model.parameters())
    checkpoint.load(path, {"model": model, "optimizer": opt})
    for name, value in run.results[0]["full"].items():
        torch.testing.assert_close(model.state_dict()[name], value)
    assert len(opt.state) == len(list(model.parameters()))
