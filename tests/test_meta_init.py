"""Meta-device initialisation in one process: ``record`` / ``sources`` / ``materialize``
against ordinary construction with the same seed, bit for bit, for torch's own modules
and the init patterns GPT-style code uses. The 2-rank runs are in test_techniques.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from workloads import TinyGPT

from nbtrain.strategies import meta_init, meta_values


class SinusoidalNet(nn.Module):
    """A computed buffer (slices written with copy_), a scalar from torch.tensor, an
    orthogonal init with the user's generator and a randn-made parameter."""

    def __init__(self, width=8, length=6):
        super().__init__()
        pe = torch.zeros(length, width)
        pos = torch.arange(length).unsqueeze(1)
        div = torch.exp(torch.arange(0, width, 2) * (-math.log(10000.0) / width))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.temperature = nn.Parameter(torch.tensor(0.07))
        self.proj = nn.Linear(width, width)
        nn.init.orthogonal_(self.proj.weight, generator=torch.Generator().manual_seed(3))
        self.noise = nn.Parameter(torch.randn(width) * 0.02)


MODELS = {
    "MultiheadAttention": lambda: nn.MultiheadAttention(16, 4),
    "MultiheadAttention kdim/vdim, bias_kv": lambda: nn.MultiheadAttention(
        16, 4, kdim=8, vdim=12, add_bias_kv=True),
    "TransformerDecoderLayer": lambda: nn.TransformerDecoderLayer(16, 4, 32),
    "Transformer": lambda: nn.Transformer(16, 4, 2, 2, 32),
    "Embedding padding_idx, LayerNorm": lambda: nn.Sequential(
        nn.Embedding(10, 4, padding_idx=2), nn.LayerNorm(4), nn.Linear(4, 3)),
    "TinyGPT": TinyGPT,
    "SinusoidalNet": SinusoidalNet,
}


def build_on_meta(make, seed_inside: bool):
    rec = meta_values.Recording()
    torch.manual_seed(1234 if seed_inside else 0)
    with meta_init.record(rec):
        if seed_inside:
            torch.manual_seed(0)
        model = make()
    return model, rec


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
@pytest.mark.parametrize("seed_inside", [False, True], ids=["seed before", "seed inside"])
@pytest.mark.parametrize("name", MODELS)
def test_replay_gives_what_ordinary_construction_gives(name, seed_inside):
    torch.manual_seed(0)
    want = MODELS[name]()
    want_next = torch.rand(5)
    model, rec = build_on_meta(MODELS[name], seed_inside)
    got_next = torch.rand(5)
    assert meta_values.on_meta(model)
    before = torch.get_rng_state()
    meta_values.materialize(model, torch.device("cpu"), meta_values.sources(model, rec))
    assert torch.equal(torch.get_rng_state(), before)  # materialising draws nothing
    assert not meta_values.on_meta(model)
    want_state, got_state = want.state_dict(), model.state_dict()
    assert list(got_state) == list(want_state)
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    assert torch.equal(got_next, want_next)  # the stream after construction goes on the same


def test_a_reseed_between_two_models_in_one_block_is_honoured():
    def make_two():
        torch.manual_seed(1)
        a = nn.Linear(4, 4)
        torch.manual_seed(2)
        return a, nn.Linear(4, 4)

    want = make_two()
    rec = meta_values.Recording()
    with meta_init.record(rec):
        got = make_two()
    for w, g in zip(want, got, strict=True):
        meta_values.materialize(g, torch.device("cpu"), meta_values.sources(g, rec))
        assert torch.equal(w.weight, g.weight) and torch.equal(w.bias, g.bias)


def test_a_tied_weight_stays_one_parameter():
    model, rec = build_on_meta(TinyGPT, seed_inside=True)
    meta_values.materialize(model, torch.device("cpu"), meta_values.sources(model, rec))
    assert model.wte.weight is model.head.weight


def test_init_functions_are_restored_after_the_block():
    original = nn.init.trunc_normal_
    with meta_init.record():
        assert nn.init.trunc_normal_ is not original
    assert nn.init.trunc_normal_ is original


class Experts(nn.Module):
    """Parameters made with torch.empty (transformers 5's fused experts, routers)."""

    def __init__(self, init: bool):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(4, 8, 16))
        self.router = nn.Linear(8, 4)
        if init:
            nn.init.normal_(self.gate_up, std=0.02)


def test_a_parameter_nothing_initialised_is_named_not_trained_on():
    with meta_init.record() as rec:
        model = Experts(init=False)
    with pytest.raises(RuntimeError, match=r"Experts\.gate_up was created with torch\.empty"):
        meta_values.sources(model, rec)
    with meta_init.record() as rec:
        torch.manual_seed(0)
        model = Experts(init=True)
    sources = meta_values.sources(model, rec)
    meta_values.materialize(model, torch.device("cpu"), sources)
    torch.manual_seed(0)
    assert torch.equal(model.gate_up, Experts(init=True).gate_up)
