"""Mixed precision in ``nbtrain.plan()``: the rehearsal's casts (``nbtrain/halfmeta.py``)
give each call the dtype torch's autocast gives it (CPU's, checked against the real
autocast here; CUDA's lists against the header of the torch installed), and a plan of a
bf16 run counts what the run measures: the model state exact, the activations within
10 %, under ddp (autocast) and fsdp (FSDP's ``param_dtype``), on GPT-2 and a BatchNorm
ResNet built from configs."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from models import fit
from test_plan import measured

import nbtrain
from nbtrain import halfmeta
from nbtrain.planner import default_strategies

pytestmark = pytest.mark.usefixtures("no_leftovers")


def _calls(device: str) -> dict:
    """Python-level calls models make, each on ``device``'s tensors."""
    g = torch.Generator().manual_seed(0)

    def x(*shape):
        return torch.randn(*shape, generator=g).to(device)

    a, b, img, w, q = x(4, 8), x(8, 8), x(2, 3, 8, 8), x(4, 3, 3, 3), x(2, 2, 4, 8)
    t = torch.tensor([0, 3, 5, 7], device=device)
    mha = (x(24, 8), x(24), b, x(8))
    return {
        "F.linear": lambda: F.linear(a, b), "@": lambda: a @ b, "mm": lambda: a.mm(b),
        "bmm": lambda: torch.bmm(a[None], b[None]), "addmm": lambda: torch.addmm(a, a, b),
        "baddbmm": lambda: torch.baddbmm(a[None], a[None], b[None]),
        "einsum": lambda: torch.einsum("ij,jk->ik", a, b),
        "tensordot": lambda: torch.tensordot(a, b, 1),
        "conv2d": lambda: F.conv2d(img, w),
        "sdpa": lambda: F.scaled_dot_product_attention(q, q, q),
        "mha": lambda: F.multi_head_attention_forward(
            a[:, None], a[:, None], a[:, None], 8, 2, mha[0], mha[1], None, None, False, 0.0,
            mha[2], mha[3], need_weights=False)[0],
        "layer_norm": lambda: F.layer_norm(a, (8,)), "rms_norm": lambda: F.rms_norm(a, (8,)),
        "group_norm": lambda: F.group_norm(img, 1),
        "batch_norm": lambda: F.batch_norm(img, None, None, training=True),
        "softmax": lambda: a.softmax(-1), "log_softmax": lambda: F.log_softmax(a, -1),
        "cross_entropy": lambda: F.cross_entropy(a, t), "mse_loss": lambda: F.mse_loss(a, a),
        "sum": lambda: a.sum(), "mean": lambda: a.mean(), "cumsum": lambda: a.cumsum(0),
        "exp": lambda: a.exp(), "pow": lambda: a ** 2, "rsqrt": lambda: a.abs().rsqrt(),
        "norm": lambda: a.norm(), "gelu": lambda: F.gelu(a), "silu": lambda: F.silu(a),
        "embedding": lambda: F.embedding(t, b),
        "interpolate": lambda: F.interpolate(img, scale_factor=2),
        "avg_pool2d": lambda: F.avg_pool2d(img, 2),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_call_gets_the_dtype_cpu_autocast_gives_it(dtype):
    with torch.autocast("cpu", dtype=dtype):
        real = {name: call().dtype for name, call in _calls("cpu").items()}
    mode = halfmeta.HalfMeta("autocast", dtype, "cpu")
    mode.depth = 1  # inside a forward
    with mode:
        rehearsed = {name: call().dtype for name, call in _calls("meta").items()}
    assert rehearsed == real
    assert real["F.linear"] == dtype and real["cross_entropy"] == torch.float32  # both kinds


def test_the_cuda_lists_hold_every_op_of_this_torchs_autocast_header():
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen",
                          "autocast_mode.h")
    if not os.path.exists(header):
        pytest.skip("this torch ships no C++ headers")
    text = open(header).read()

    def listed(macro: str) -> set[str]:
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S)
        assert body, f"{macro} not in {header}"
        return set(re.findall(r"_\((\w+)", body.group(1)))

    # reached from Python under another name, or only inside a call that is listed
    inner = {"native_layer_norm", "frobenius_norm", "nuclear_norm", "nll_loss2d",
             "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
             "_scaled_dot_product_flash_attention", "_upsample_nearest_exact1d",
             "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
             "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"}
    for macro, ours in (("AT_FORALL_LOWER_PRECISION_FP", halfmeta.CUDA_HALF),
                        ("AT_FORALL_FP32", halfmeta.CUDA_FP32),
                        ("AT_FORALL_FP32_SET_OPT_DTYPE", halfmeta.CUDA_FP32_DTYPE)):
        missing = listed(macro) - ours - inner
        assert not missing, f"halfmeta's lists lack {sorted(missing)} of {macro}"


def test_a_checkpointed_block_is_recomputed_in_the_precision_it_ran_in():
    # torch's checkpoint compares the recomputed tensors' dtypes with the saved ones'
    from torch.utils.checkpoint import checkpoint

    block = torch.nn.Linear(4, 4).to("meta")
    x = torch.empty(2, 4, device="meta", requires_grad=True)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    model = Model()
    with halfmeta.HalfMeta("autocast", torch.bfloat16, "cpu") as mode:
        mode.watch(model, [block])
        out = model(x)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
    assert block.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("kind", ["gpt2", "cnn"])
def test_a_bf16_plan_counts_what_a_bf16_run_measures(kind):
    if kind == "gpt2":
        pytest.importorskip("transformers")
    plan = nbtrain.plan(fit, kind, steps=3, devices=2, strategies=("ddp", "fsdp"),
                        checkpointing=False, mixed_precision="bf16")
    fp32 = nbtrain.plan(fit, kind, steps=3, devices=2, strategies=("ddp",),
                        checkpointing=False)
    assert plan.precision == "bf16" and "bf16" in str(plan)
    for strategy in ("ddp", "fsdp"):
        row = plan.row(strategy)
        got = measured(fit, kind, steps=3, strategy=strategy, mixed_precision="bf16")
        for k in ("params", "grads", "optimizer"):  # fp32 weights, gradients and state
            assert getattr(row, k) == got[k], f"{kind} {strategy} {k}"
        assert row.activations == pytest.approx(got["activations"], rel=0.10), strategy
    assert plan.row("ddp").activations < fp32.row("ddp").activations


def test_mixed_precision_is_taken_as_launch_takes_it_and_bf16_refused_where_there_is_none():
    from test_plan import mlp_train

    lightning = nbtrain.plan(mlp_train, devices=2, strategies=("ddp",), checkpointing=False,
                             precision="bf16-mixed")
    assert lightning.precision == "bf16"
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        nbtrain.plan(mlp_train, devices=2, gpu="T4", mixed_precision="bf16")
    t4 = nbtrain.plan(mlp_train, devices=2, gpu="T4", mixed_precision="fp16",
                      checkpointing=False)
    assert t4.precision == "fp16" and t4.pick.strategy == "ddp"
    assert "fp16 mixed precision" in str(t4)
    if any(name.startswith("deepspeed") for name in default_strategies()):
        # DeepSpeed refuses nbtrain's fp16: left out of the plan, and said
        assert "deepspeed" in t4.refused and "not planned: deepspeed" in str(t4)
    with pytest.raises(ValueError, match="refused under DeepSpeed"):  # named: refused
        nbtrain.plan(mlp_train, devices=2, strategies=("deepspeed",), mixed_precision="fp16")
    with pytest.raises(ValueError, match="16-mixed"):
        nbtrain.plan(mlp_train, devices=2, mixed_precision="float8")


def test_the_picker_plans_the_precision_chosen_and_gives_that_plan_to_its_run():
    from test_plan import mlp_train

    picker = nbtrain.StrategyPicker(mlp_train, devices=2, accelerator="cpu", display=False,
                                    strategies_shown=["ddp", "fsdp"], gpu="T4")
    fp32 = picker.memory
    assert fp32.precision is None
    picker.precision.value = "bf16"  # a T4 has none: no plan, and the remedy
    assert picker.memory is None and "with mixed_precision=&#x27;fp16&#x27;" in picker.message.value
    picker.precision.value = "fp16"
    half = picker.memory
    assert half.precision == "fp16" and "Use ddp" in picker.message.value
    labels = dict((value, label) for label, value in picker.dropdown.options)
    assert labels["ddp"].startswith("ddp (") and "Planned per rank" in picker.description.value
    run = picker.start("ddp")
    picker.wait(120)
    assert run.status == "done" and run.planned is half  # the plan of the run it shows
    picker.precision.value = "fp32"
    assert picker.memory is fp32  # made once
