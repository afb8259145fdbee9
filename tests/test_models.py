"""The models users bring (Hugging Face GPT-2 and Llama, a ViT, a ResNet with BatchNorm;
models with a cache: Mistral with sliding-window attention, T5; models with experts: a
hand-written mixture of experts whose experts some ranks leave unused, Mixtral's fused
experts; all built from configs, see ``models.py``) train under every strategy as they
do in one process, with no class name given: default FSDP wrapping, activation
checkpointing ``"auto"``, ``ctx.init_module()``, a checkpoint saved under fsdp and
resumed under ddp, and bf16. DDP is told to find unused parameters where a model has
them, with Lightning's name for it."""

from __future__ import annotations

import pytest
import torch
from models import KINDS, MORE, fit, make, reference

import nbtrain

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("no_leftovers")

STEPS = 3
# Strategy name and options, all given to launch() itself (they reach the strategy).
CASES = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "fsdp_grad_op": ("fsdp_grad_op", {}),
    "zero1": ("zero1", {}),
    "fsdp+ac": ("fsdp", {"activation_checkpointing": "auto"}),
    "ddp+ac": ("ddp", {"activation_checkpointing": True}),
}


ALL = KINDS + MORE
# Models some of whose parameters get no gradient on some steps: DDP must look for them
UNUSED = {"moe"}


@pytest.fixture(scope="module")
def references():
    return {kind: reference(kind, STEPS) for kind in ALL}


def launch(kind, strategy="ddp", **options):
    if kind in UNUSED and strategy == "ddp":
        strategy = "ddp_find_unused_parameters_true"  # Lightning's name
    if kind in UNUSED and strategy == "zero1":
        options["find_unused_parameters"] = True
    return nbtrain.launch(fit, kind, steps=STEPS, devices=2, accelerator="cpu",
                          strategy=strategy, dashboard=False, **options)


def check(run, ref, kind, what, first_step=0):
    for rank in (0, 1):
        expected = [per_rank[rank] for per_rank in ref["losses"][first_step:]]
        assert run.results[rank]["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6), \
            f"{kind} {what}: rank {rank}'s losses differ from one process"
    full = run.result["full"]
    missing = set(ref["full"]) - set(full)
    assert not missing, f"{kind} {what}: the full state dict lacks {sorted(missing)[:5]}"
    for name, value in ref["full"].items():
        torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5,
                                   msg=f"{kind} {what}: {name} differs from one process")
    stats = [run.results[r]["stats"] for r in (0, 1)]
    for name in stats[0]:  # every rank holds rank 0's running statistics
        assert torch.equal(stats[0][name], stats[1][name]), f"{kind} {what}: {name}"


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("case", list(CASES))
def test_a_model_trains_under_a_strategy_as_in_one_process(kind, case, references):
    strategy, options = CASES[case]
    check(launch(kind, strategy, **options), references[kind], kind, case)


@pytest.mark.parametrize("kind", ALL)
def test_init_module_gives_the_weights_of_plain_construction(kind, references):
    # the weights ctx.init_module() materialises under fsdp are plain construction's
    # (transformers' own _init_weights included), so the training is the same
    run = launch(kind, "fsdp", meta=True)
    check(run, references[kind], kind, "init_module under fsdp")


@pytest.mark.parametrize("kind", ALL)
def test_a_checkpoint_saved_under_fsdp_goes_on_under_ddp(kind, references, tmp_path):
    path = tmp_path / "ckpt"
    saved = launch(kind, "fsdp", save=str(path), save_at=1)
    resumed = launch(kind, "ddp", resume=path)
    check(resumed, references[kind], kind, "saved under fsdp, resumed under ddp",
          first_step=2)
    # the checkpoint holds what full_state_dict gave at that step, on every rank alike
    state = nbtrain.checkpoint.load(path, {"model": make(kind), "step": 0})
    assert state["step"] == 1
    assert saved.status == "done"


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_restart_from_checkpoint_every_trains_as_one_process(kind, strategy, references,
                                                               tmp_path):
    """GPT-2 (tied embeddings) and a BatchNorm ResNet, saved by ctx.checkpoint_every after
    each step, rank 1 SIGKILLed at step 2: the restart goes on from step 2 and ends with
    one process's weights, losses and running statistics."""
    run = launch(kind, strategy, save=str(tmp_path / "ck"), every=1, die_at=2,
                 max_restarts=1)
    assert len(run.attempts) == 1 and "SIGKILL" in run.attempts[0].cause
    check(run, references[kind], kind, f"restarted under {strategy}", first_step=2)


@pytest.mark.parametrize("kind", ALL)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_bf16_trains_close_to_fp32(kind, strategy, references):
    run = launch(kind, strategy, mixed_precision="bf16")
    ref = references[kind]
    for rank in (0, 1):
        expected = [per_rank[rank] for per_rank in ref["losses"]]
        assert run.results[rank]["losses"] == pytest.approx(expected, rel=0.05), \
            f"{kind} bf16 {strategy}: rank {rank}"
    for name, value in ref["full"].items():
        got = run.result["full"][name]
        assert got.dtype == value.dtype  # fp32 master weights
        torch.testing.assert_close(got, value, rtol=0.05, atol=0.02,
                                   msg=f"{kind} bf16 {strategy}: {name}")


@pytest.mark.parametrize("kind", ["mistral", "t5"])
def test_checkpointing_by_class_turns_the_cache_off(kind, references):
    # the blocks named by class (as a user would) recompute against no cache: with the
    # cache on, Mistral's sliding window and T5's cross-attention fail in backward
    from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
    from transformers.models.t5.modeling_t5 import T5Block

    block = MistralDecoderLayer if kind == "mistral" else T5Block
    check(launch(kind, "fsdp", activation_checkpointing=(block,)), references[kind], kind,
          "fsdp + activation_checkpointing=(block,)")


def test_experts_some_ranks_leave_unused_under_hybrid_sharding(references):
    check(launch("moe", "fsdp_hybrid"), references["moe"], "moe", "fsdp_hybrid")


def test_fsdp_without_finding_unused_parameters_moves_only_unused_experts(references):
    # find_unused_parameters=False: every rank still reduces every parameter (no abort),
    # but an expert no rank used gets a zero gradient, and momentum moves it
    run = launch("moe", "fsdp", find_unused_parameters=False)
    ref, full = references["moe"]["full"], run.result["full"]
    differ = [n for n, v in ref.items() if not torch.allclose(full[n], v, rtol=1e-4,
                                                                atol=1e-5)]
    assert differ and all(".experts." in n for n in differ), differ


def test_ddp_names_the_unused_parameters_and_the_option():
    with pytest.raises(nbtrain.WorkerError) as err:
        nbtrain.launch(fit, "moe", steps=STEPS, devices=2, accelerator="cpu",
                       strategy="ddp_notebook", dashboard=False)
    text = str(err.value)
    assert "Expected to have finished reduction" in text  # torch's own words, kept
    assert "gave no gradient to layers.0.experts." in text, text
    assert "strategy='ddp_notebook_find_unused_parameters_true'" in text, text
    assert "find_unused_parameters=True" in text


def test_lightning_names_for_finding_unused_parameters():
    for base, method in [("ddp", None), ("ddp_notebook", "fork"), ("ddp_fork", "fork"),
                         ("ddp_spawn", "spawn")]:
        for find in (True, False):
            s = nbtrain.strategies.get(f"{base}_find_unused_parameters_{str(find).lower()}")
            assert s.find_unused_parameters is find and s.start_method == method
    shown = nbtrain.strategies.names(aliases=False)
    assert "ddp" in shown and not [n for n in shown if "unused" in n or n == "ddp_fork"]
