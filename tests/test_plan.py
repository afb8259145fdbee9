"""``nbtrain.plan()`` against what runs measure: each strategy's per-rank parameters,
gradients and optimizer state exactly as a 2-rank run's memory events count them
(shared storage once, uneven shards), the activations as ``profile_memory`` measures them,
on an MLP and on models users bring (GPT-2 with its tied embedding, Llama); which
strategy fits a device and which to use; and a rehearsal that leaves the kernel as it was
and says what it needs."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from models import fit
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import nbtrain
from nbtrain.planner import CONTEXT, GPUS, MARGIN, STRATEGIES

pytestmark = pytest.mark.usefixtures("no_leftovers")
CATEGORIES = ("params", "grads", "optimizer", "activations")


def mlp_train(ctx, batch: int = 16, steps: int = 3):
    torch.manual_seed(0)
    # 255 rows: FSDP's two shards are uneven (128 and 127 rows)
    model = nn.Sequential(nn.Linear(64, 255), nn.ReLU(), nn.Linear(255, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.setup(model, opt)
    n = batch * steps * ctx.world_size
    data = torch.utils.data.TensorDataset(torch.randn(n, 64), torch.randint(0, 10, (n,)))
    for x, y in ctx.dataloader(data, batch_size=batch, shuffle=True):
        loss = nn.functional.cross_entropy(model(x), y)
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
        if loss.item() > 1e6:  # a value read: the rehearsal reads 1
            raise RuntimeError("diverged")
    return "trained"


def measured(fn, *args, strategy: str, **kwargs) -> dict[str, float]:
    """The fullest rank's bytes per category, from a 2-rank CPU run's last memory event."""
    run = nbtrain.launch(fn, *args, devices=2, accelerator="cpu", strategy=strategy,
                         dashboard=False, **kwargs,
                         telemetry=nbtrain.Telemetry(profile_memory=True, memory_every=1))
    last = [list(run.history.events("memory", rank))[-1].values for rank in (0, 1)]
    return {k: max(values.get(k, 0) for values in last) for k in CATEGORIES}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "fsdp_grad_op"])
def test_the_plan_counts_what_each_rank_holds_as_a_run_measures_it(strategy):
    plan = nbtrain.plan(mlp_train, devices=2, strategies=(strategy,), checkpointing=False)
    row = plan.row(strategy)
    got = measured(mlp_train, strategy=strategy)
    planned = {k: getattr(row, k) for k in CATEGORIES}
    for k in ("params", "grads", "optimizer"):
        assert planned[k] == got[k], f"{strategy} {k}: planned {planned[k]}, measured {got[k]}"
    assert planned["activations"] == pytest.approx(got["activations"], rel=0.10)
    assert row.peak >= sum(planned.values())  # the step's peak holds all of them, and more


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_plan_of_models_users_bring_matches_their_runs(kind):
    pytest.importorskip("transformers")
    plan = nbtrain.plan(fit, kind, steps=3, devices=2, strategies=("ddp", "fsdp"),
                        checkpointing=False)
    for strategy in ("ddp", "fsdp"):
        row = plan.row(strategy)
        got = measured(fit, kind, steps=3, strategy=strategy)
        for k in ("params", "grads", "optimizer"):
            assert getattr(row, k) == got[k], f"{kind} {strategy} {k}"
        assert row.activations == pytest.approx(got["activations"], rel=0.10)
        assert sum(getattr(row, k) for k in CATEGORIES) == pytest.approx(sum(got.values()),
                                                                        rel=0.10)
    if kind == "gpt2":  # the tied embedding counted once, as the run counts it
        whole = sum(p.numel() * 4 for p in _gpt2_unique_params())
        assert plan.row("ddp").params == whole


def _gpt2_unique_params():
    from models import make

    return list(make("gpt2").parameters())  # named once though two modules hold it


def test_checkpointing_rows_keep_fewer_activations():
    pytest.importorskip("transformers")
    plan = nbtrain.plan(fit, "gpt2", steps=3, devices=2, strategies=("ddp",))
    plain, recomputed = plan.row("ddp"), plan.row("ddp", checkpointing=True)
    assert recomputed.activations < plain.activations
    assert (recomputed.params, recomputed.optimizer) == (plain.params, plain.optimizer)


def test_a_plan_says_what_fits_a_device_and_which_to_use():
    bare = nbtrain.plan(mlp_train, devices=2, checkpointing=False)
    assert all(r.fits is None for r in bare.rows) and bare.pick is None
    assert "gpu=" in bare.sentence()
    ddp, fsdp = bare.row("ddp"), bare.row("fsdp")
    assert fsdp.peak < ddp.peak and fsdp.sent > ddp.sent  # less memory, more bytes sent
    usable = (ddp.peak + fsdp.peak) / 2  # a device between the two
    plan = nbtrain.plan(mlp_train, devices=2, checkpointing=False,
                        gpu=usable / (1 - MARGIN) + CONTEXT)
    assert plan.row("ddp").fits is False and plan.row("fsdp").fits is True
    fitting = {r.strategy for r in plan.rows if r.fits}
    assert plan.pick.strategy == next(s for s in STRATEGIES if s in fitting)  # in order
    assert plan.pick.headroom == pytest.approx(usable - plan.pick.peak)
    assert plan.sentence().startswith(f"Use {plan.pick.name}")
    text, page = str(plan), plan._repr_html_()
    assert all(r.name in text and r.name in page for r in plan.rows)
    assert "too big by" in text
    t4 = nbtrain.plan(mlp_train, devices=2, checkpointing=False, gpu="t4",
                      bandwidth=1e9)
    assert t4.pick.strategy == "ddp" and t4.usable == (GPUS["T4"] * 2**20 - CONTEXT) * 0.95
    assert "comm ≥" in str(t4)


def test_the_rehearsal_leaves_the_kernel_as_it_was():
    torch.manual_seed(123)
    random.seed(7)
    before = (torch.random.get_rng_state(), random.getstate())
    nbtrain.plan(mlp_train, devices=2, checkpointing=False, strategies=("ddp",))
    nbtrain.plan(mlp_train, devices=2, strategies=("ddp", "fsdp"), mixed_precision="bf16")
    assert not _get_current_function_mode_stack()  # mixed precision's casts are gone
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert not dist.is_initialized()  # no process group was made in the kernel
    assert not torch.cuda.is_initialized()


def test_what_a_plan_cannot_take_it_says():
    with pytest.raises(ValueError, match="T4"):
        nbtrain.plan(mlp_train, gpu="K80")
    with pytest.raises(ValueError, match="2 or more"):
        nbtrain.plan(mlp_train, devices=1)
    with pytest.raises(ValueError, match="bytes per second"):
        nbtrain.plan(mlp_train, bandwidth=0)

    def no_setup(ctx):
        return nn.Linear(2, 2)(torch.ones(2))

    with pytest.raises(ValueError, match=r"ctx.setup\(model, optimizer\)"):
        nbtrain.plan(no_setup)

    def one_step(ctx):
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ctx.setup(model, opt)
        model(torch.ones(1, 2, device=ctx.device)).sum().backward()
        opt.step()

    with pytest.raises(ValueError, match="second optimizer step"):
        nbtrain.plan(one_step)


def test_the_picker_marks_what_will_not_fit_before_run():
    bare = nbtrain.plan(mlp_train, devices=2, checkpointing=False, strategies=("ddp", "fsdp"))
    between = (bare.row("ddp").peak + bare.row("fsdp").peak) / 2
    picker = nbtrain.StrategyPicker(mlp_train, devices=2, accelerator="cpu", display=False,
                                    strategies_shown=["ddp", "fsdp"],
                                    gpu=between / (1 - MARGIN) + CONTEXT)
    labels = dict((value, label) for label, value in picker.dropdown.options)
    assert "too big" in labels["ddp"] and "too big" not in labels["fsdp"]
    picker.dropdown.value = "ddp"
    assert "will not fit" in picker.description.value
    picker.dropdown.value = "fsdp"
    assert "fits" in picker.description.value and "will not" not in picker.description.value
    assert "Use fsdp" in picker.message.value
    plain = nbtrain.StrategyPicker(mlp_train, devices=2, accelerator="cpu", display=False)
    assert plain.memory is None  # a CPU run and no gpu=: nothing to fit


def test_the_picker_runs_what_it_cannot_plan():
    def no_optimizer(ctx):
        return ctx.setup(nn.Linear(2, 2))

    picker = nbtrain.StrategyPicker(no_optimizer, devices=2, accelerator="cpu",
                                    display=False, gpu="T4")
    assert picker.memory is None and "No memory plan" in picker.message.value
    assert "optimizer" in picker.message.value


def test_a_run_and_its_comparison_put_the_plan_beside_what_was_measured():
    plan = nbtrain.plan(mlp_train, devices=2, checkpointing=False, strategies=("ddp", "fsdp"))
    runs = [nbtrain.launch(mlp_train, devices=2, accelerator="cpu", strategy=s, dashboard=False,
                           telemetry=nbtrain.Telemetry(profile_memory=True, memory_every=1))
            for s in ("ddp", "fsdp")]
    text = plan.beside(runs[1])
    assert text.startswith("fsdp, per rank: planned / measured")
    assert "params" in text and "(1.000)" in text and "activations" in text
    comparison = nbtrain.compare(*runs, plan=plan, display=False)
    assert "plan/rank" in comparison.table()
    for row in comparison.rows:
        planned = plan.row(row.chosen.name)
        assert row.theory["params"] == planned.params
        assert row.theory["activations"] == planned.activations
    assert "theory/rank" in nbtrain.compare(*runs, display=False).table()


def test_a_run_launched_with_its_plan_shows_it_in_its_summary_and_dashboard():
    from nbtrain.ui.figures import trace_specs
    from nbtrain.ui.state import LiveState

    plan = nbtrain.plan(mlp_train, devices=2, checkpointing=False, strategies=("ddp", "fsdp"))
    run = nbtrain.launch(mlp_train, devices=2, accelerator="cpu", strategy="fsdp",
                         dashboard=False, planned=plan)
    assert run.planned is plan
    summary = run.summary()
    assert summary.planned == plan.beside(run)
    assert "fsdp, per rank: planned / measured" in str(summary)
    assert "planned / measured" in summary._repr_html_()
    row = plan.row("fsdp")
    state = LiveState.from_run(run)
    assert state.planned == row.params + row.grads + row.optimizer
    [mark] = [s for s in trace_specs(state) if s.key == "memory:planned"]
    assert mark.data["x"] == ["rank 0", "rank 1"] and mark.props["name"] == "planned"
    # a plan that is not of this run says so before anything starts
    with pytest.raises(ValueError, match="plan is of 2 ranks and this run has 3"):
        nbtrain.launch(mlp_train, devices=3, accelerator="cpu", planned=plan)
    with pytest.raises(ValueError, match=r"no row for 'zero1'.*strategies=\['zero1'"):
        nbtrain.launch(mlp_train, devices=2, accelerator="cpu", strategy="zero1",
                       planned=plan)
    with pytest.raises(TypeError, match="what nbtrain.plan\\(\\) returned"):
        nbtrain.launch(mlp_train, devices=2, accelerator="cpu", planned={"ddp": 1})


def test_scaling_gives_the_plan_to_the_run_it_planned_not_to_its_baseline():
    plan = nbtrain.plan(mlp_train, devices=2, checkpointing=False, strategies=("ddp",))
    run = nbtrain.scaling(mlp_train, devices=2, accelerator="cpu", dashboard=False,
                          planned=plan)
    assert run.planned is plan and run.baseline.planned is None
    assert "ddp, per rank: planned / measured" in str(run.summary())


def test_the_picker_gives_its_runs_the_plan_it_showed():
    picker = nbtrain.StrategyPicker(mlp_train, devices=2, accelerator="cpu", display=False,
                                    strategies_shown=["ddp", "fsdp"], gpu="T4")
    run = picker.start("fsdp")
    picker.wait(120)
    assert run.status == "done" and run.planned is picker.memory
    assert "planned / measured" in str(run.summary())
    run = picker.start("ddp", ranks=1)  # the one-rank baseline: not what was planned
    picker.wait(120)
    assert run.planned is None
