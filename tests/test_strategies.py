import pytest
import torch
from torch import nn
from workloads import grad_storages

import nbtrain
from nbtrain import strategies
from nbtrain.deviceplan import DevicePlan
from nbtrain.strategies import DDP, FSDP


def test_registry_names_and_descriptions():
    names = strategies.names()
    for name in ["ddp", "ddp_notebook", "ddp_spawn", "fsdp", "fsdp_grad_op", "fsdp_hybrid",
                 "fsdp_offload"]:
        assert name in names
    described = strategies.describe()
    assert all(len(text) > 20 and text.endswith(".") for text in described.values())


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        strategies.get("zero4")
    assert "fsdp_grad_op" in str(err.value) and "ddp" in str(err.value)


def test_variants_and_options():
    assert strategies.get("ddp_notebook").start_method == "fork"
    assert strategies.get("ddp_spawn").start_method == "spawn"
    assert strategies.get("fsdp_grad_op").reshard_after_forward is False
    assert strategies.get("fsdp").reshard_after_forward is True
    s = strategies.get("fsdp", mixed_precision="bf16", wrap=nn.Linear)
    assert s.name == "fsdp" and s.mixed_precision == "bf16" and s.wrap == (nn.Linear,)
    with pytest.raises(TypeError, match="its options are"):
        strategies.get("ddp", reshard_after_forward=True)
    with pytest.raises(ValueError, match="mixed_precision"):
        strategies.get("ddp", mixed_precision="fp8")
    with pytest.raises(TypeError, match="nn.Module classes"):
        strategies.get("fsdp", wrap=(int,))
    assert strategies.get(DDP(name="mine")).name == "mine"


def test_offload_needs_cuda():
    with pytest.raises(ValueError, match="nothing to offload"):
        strategies.get("fsdp_offload").check(DevicePlan("cpu", (0, 1)))
    strategies.get("fsdp_offload").check(DevicePlan("cuda", (0, 1)))


def test_unavailable_names_what_cannot_run_on_a_plan_and_why():
    from nbtrain.strategies import deepspeed

    # DeepSpeed's names need the extra (the hosted-stack legs run without it)
    no_deepspeed = [] if deepspeed.available() else \
        [n for n in strategies.names() if n.startswith("deepspeed")]
    cpu = strategies.unavailable(DevicePlan("cpu", (0, 1)))
    assert sorted(cpu) == sorted(["fsdp_offload", *no_deepspeed])
    assert "nothing to offload" in cpu["fsdp_offload"]
    assert all("pip install" in cpu[n] for n in no_deepspeed)
    assert sorted(strategies.unavailable(DevicePlan("cuda", (0, 1)))) == sorted(no_deepspeed)
    assert strategies.unavailable(DevicePlan("cpu", (0, 1)), ["ddp", "fsdp"]) == {}


def test_hybrid_mesh_shapes():
    s = strategies.get("fsdp_hybrid")
    assert s.mesh_shape(2) == (2, 1)
    assert s.mesh_shape(4) == (2, 2)
    assert s.mesh_shape(8) == (2, 4)
    assert strategies.get("fsdp_hybrid", shard_size=2).mesh_shape(8) == (4, 2)
    with pytest.raises(ValueError, match="divide the world size: 6 ranks / shard_size 4"):
        strategies.get("fsdp_hybrid", shard_size=4).mesh_shape(6)
    with pytest.raises(ValueError, match="only applies to hybrid"):
        strategies.get("fsdp", shard_size=2)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(x)


class Tiny(nn.Module):
    def __init__(self, d=32, n=4):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 2)


def test_wrap_by_class_is_children_first():
    model = Tiny()
    units = FSDP(wrap=(Block,)).units(model)
    assert units == list(reversed(list(model.blocks)))


def test_default_wrap_makes_one_unit_per_block():
    model = Tiny()
    units = FSDP().units(model)
    assert all(b in units for b in model.blocks)
    assert model not in units
    # nothing inside a wrapped block is wrapped separately at this size
    assert not any(u in units for b in model.blocks for u in b.modules() if u is not b)
    # a high threshold leaves everything to the root
    assert FSDP(min_wrap_params=10**9).units(model) == []


def test_default_wrap_keeps_blocks_of_a_short_stack_whole():
    from nbtrain.examples.charlm import CharLM, Config

    model = CharLM(Config(vocab=40, layers=2))  # each block holds ~half the model
    assert set(FSDP().units(model)) == set(model.blocks)


class Basic(nn.Module):  # a ResNet-style block: made of modules, repeated in a Sequential
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)


def test_the_repeated_block_class_is_found_without_a_name():
    from nbtrain.strategies import blocks

    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(Basic(8), Basic(8)),
                        nn.Sequential(Basic(8), Basic(8)), nn.Flatten(), nn.LazyLinear(2))
    assert blocks.find(cnn) == (Basic,)
    assert len(FSDP().units(cnn)) == 4
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert blocks.find(mlp) == ()  # plain layers are not blocks: the size rule applies


class Declares(Tiny):
    _no_split_modules = ["Block"]  # as transformers models declare their blocks


class TiedLM(nn.Module):
    def __init__(self, vocab=1000, d=32):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's


def test_declared_blocks_and_tied_weights_stay_in_one_unit():
    from nbtrain.strategies import blocks

    assert blocks.declared(Declares()) == (Block,)
    model = TiedLM()
    # the size rule alone would make wte and lm_head units of their own: one weight in two
    assert FSDP().units(model) == []  # both stay with the root
    assert FSDP(wrap=(nn.Embedding,)).units(model) == []


@pytest.mark.parametrize("given, meant", [
    ("16-mixed", "fp16"), ("16", "fp16"), (16, "fp16"), ("bf16-mixed", "bf16"),
    ("32-true", None), (32, None), ("fp16", "fp16"), (None, None),
])
def test_lightnings_precision_names_mean_nbtrains(given, meant):
    assert strategies.get("fsdp", mixed_precision=given).mixed_precision == meant
    assert strategies.get("ddp", precision=given).mixed_precision == meant


def test_pure_half_precision_is_refused_with_what_to_use():
    with pytest.raises(ValueError, match="'16-mixed' .* or 'bf16-mixed'"):
        strategies.get("ddp", precision="bf16-true")
    with pytest.raises(TypeError, match="not both"):
        strategies.get("ddp", precision="16-mixed", mixed_precision="fp16")


def test_fsdp_on_cpu_ranks_with_a_torch_whose_fsdp_cannot_says_so_at_launch(monkeypatch):
    """torch 2.6's FSDP2 fails in every CPU worker (no CPU stream events), 2.7's and 2.8's
    train other weights than one process: nbtrain says so before anything starts."""
    from nbtrain.strategies import fsdp

    assert [fsdp.cpu_fsdp_works(v) for v in ("2.6.0+cu124", "2.8.0", "2.9.1", "2.13.0",
                                              "3.0.0a0")] == [False, False, True, True, True]
    monkeypatch.setattr(fsdp, "cpu_fsdp_works", lambda: False)
    with pytest.raises(ValueError, match=r"needs torch 2\.9 or later.*use 'ddp'"):
        strategies.get("fsdp").check(DevicePlan("cpu", (0, 1)))
    strategies.get("fsdp").check(DevicePlan("cuda", (0, 1)))  # GPUs: fine
    strategies.get("ddp").check(DevicePlan("cpu", (0, 1)))


def test_owner_of_gives_the_hooks_of_the_strategy_whose_object_it_is(monkeypatch):
    """Checkpoints and telemetry hold objects, not the run's strategy: they ask
    ``owner_of``. Torch's objects get the base Strategy's hooks; DeepSpeed's engine and
    optimizer get DeepSpeed's; a registered strategy that owns a kind of object is asked."""
    import dataclasses

    import torch

    from nbtrain.strategies import registry
    from nbtrain.strategies.deepspeed import DeepSpeed, EngineOptimizer

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert type(strategies.owner_of(model)) is strategies.Strategy
    assert type(strategies.owner_of(opt)) is strategies.Strategy
    assert isinstance(strategies.owner_of(EngineOptimizer(None, opt)), DeepSpeed)
    hooks = strategies.owner_of(model)
    assert hooks.memory_tensors(model, [opt])["params"] == list(model.parameters())
    assert set(hooks.model_state_dict(model)) == {"weight", "bias"}

    class Tagged(nn.Linear):
        pass

    @dataclasses.dataclass
    class Own(DDP):
        @classmethod
        def owns(cls, obj):
            return isinstance(obj, Tagged)

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_CLASSES", dict(registry._CLASSES))
    strategies.register("own", Own, "a test strategy.")
    assert isinstance(strategies.owner_of(Tagged(2, 2)), Own)
    assert type(strategies.owner_of(model)) is strategies.Strategy


@pytest.mark.usefixtures("no_leftovers")
def test_ddp_keeps_its_gradients_in_its_buckets():
    """nbtrain's DDP: the gradients are views into DDP's all-reduce buckets (one storage per
    bucket), so a rank holds one gradient-sized buffer, not two; torch's default (asked
    for with gradient_as_bucket_view=False) keeps a storage per gradient beside them."""
    ours = nbtrain.launch(grad_storages, devices=2, accelerator="cpu", dashboard=False)
    theirs = nbtrain.launch(grad_storages, devices=2, accelerator="cpu", dashboard=False,
                            strategy=strategies.get("ddp", gradient_as_bucket_view=False))
    grads, storages = ours.result
    assert grads == 6 and storages == 1, ours.result  # a 5.5K-parameter net: one bucket
    assert theirs.result == (6, 6)
    assert ours.results[1] == ours.result


def test_the_pool_gives_back_what_cuda_kept_after_a_run(monkeypatch):
    """After a run on a warm CUDA rank: the caching allocator's cache and cuBLAS's
    workspaces (32 MiB per handle and stream on Hopper, 64 MiB seen left on an H100) go
    back, in an order that frees them (workspaces before the cache is emptied)."""
    from nbtrain.rank import pool_worker
    from nbtrain.spec import WorkerSpec

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces",
                        lambda: calls.append("workspaces"), raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("peak"))
    spec = WorkerSpec.__new__(WorkerSpec)
    object.__setattr__(spec, "accelerator", "cuda")
    pool_worker.free(spec)
    assert calls == ["synchronize", "workspaces", "empty_cache", "peak"]
