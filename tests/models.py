"""The models users bring, built from small configs (random weights, nothing downloaded),
and one training function that runs any of them under any strategy, beside the same
training in one process.

- ``gpt2``: transformers' GPT-2 (tied ``wte``/``lm_head``), a causal LM;
- ``llama``: transformers' Llama (RMSNorm, rotary embeddings, grouped-query attention);
- ``vit``: transformers' ViT image classifier (timm's needs torchvision, which does not
  import beside the CPU torch here; the same kind of model: patch embedding, blocks of
  attention with LayerNorm, a class token);
- ``cnn``: a small ResNet written by hand (BatchNorm everywhere, residual blocks in
  ``Sequential`` stages), as torchvision's would be;
- ``mistral``: transformers' Mistral with sliding-window attention (window 4 < SEQ),
  whose training forward fills a cache unless told not to;
- ``t5``: transformers' T5, an encoder-decoder (self- and cross-attention caches);
- ``moe``: a mixture of experts written by hand, each expert a module of its own (as in
  most hand-written MoEs and transformers 4.x): tokens go to experts by their id, so
  each step leaves some experts without a token on one rank and some on every rank;
- ``mixtral``: transformers' Mixtral, experts fused into 3-D parameters made with
  ``torch.empty`` (for ``init_module()``).

Every step each rank trains on its slice of one global batch. The one-process reference
(``reference``) runs the same slices one after the other and averages their gradients,
which is what DDP and FSDP compute; a BatchNorm layer there keeps the running
statistics of rank 0's slice, as DDP's (and nbtrain's FSDP's) broadcast from rank 0 does.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

KINDS = ("gpt2", "llama", "vit", "cnn")
MORE = ("mistral", "t5", "moe", "mixtral")  # models with a cache or with experts
LMS = ("gpt2", "llama", "mistral", "t5", "moe", "mixtral")
VOCAB, SEQ, PER_RANK = 96, 12, 4
EXPERTS = 6


class Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout))
                      if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.short(x))


class ResNet(nn.Module):
    def __init__(self, classes: int = 10, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(Basic(width, width), Basic(width, width))
        self.layer2 = nn.Sequential(Basic(width, 2 * width, 2), Basic(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(x.mean((2, 3)))


class Expert(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-1 routing by token id (hash routing), weighted by the router's probability of
    that expert, so the router learns too. An expert no token went to takes no part in
    forward, so it gets no gradient on that rank."""

    def __init__(self, width: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, x, ids):
        h = self.norm(x)
        gate = self.router(h).softmax(-1)
        route = ids % len(self.experts)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            hit = route == e
            if hit.any():
                out[hit] = (expert(h[hit]) * gate[hit][:, e:e + 1]).to(out.dtype)
        return x + out


class MoE(nn.Module):
    def __init__(self, width: int = 32, layers: int = 2, experts: int = EXPERTS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(MoELayer(width, experts) for _ in range(layers))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, ids)
        return self.head(x)


def make(kind: str) -> nn.Module:
    if kind == "cnn":
        return ResNet()
    if kind == "moe":
        return MoE()
    import transformers as tf

    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))  # dropout draws differ per rank
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
            pad_token_id=0))
    if kind == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=SEQ, sliding_window=4, bos_token_id=0,
            eos_token_id=0, pad_token_id=0))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=32, vocab_size=VOCAB,
            max_position_embeddings=SEQ, num_local_experts=4, num_experts_per_tok=2,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    if kind == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, num_labels=10))
    raise ValueError(kind)


def batch(kind: str, step: int, rank: int, world_size: int = 2):
    """Rank ``rank``'s slice of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    n = PER_RANK * world_size
    if kind == "moe":  # which experts each rank's tokens reach changes every step
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        # rank 0's tokens go to 3 experts, rank 1's to 2 others and one of rank 0's;
        # the last expert of each step's rotation gets no token on any rank
        turn = step % EXPERTS
        mine = [(turn + e) % EXPERTS for e in ((0, 1, 2) if rank == 0 else (0, 3, 4))]
        pick = torch.tensor(mine)[ids[rank::world_size] % 3]
        base = ids[rank::world_size] - ids[rank::world_size] % EXPERTS
        return {"input_ids": base + pick}  # < VOCAB: 90 + 5
    if kind in LMS:
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        return {"input_ids": ids[rank::world_size].contiguous()}
    images = torch.randn(n, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    return {"x": images[rank::world_size], "y": labels[rank::world_size]}


def loss_of(kind: str, model: nn.Module, b: dict) -> torch.Tensor:
    if kind == "moe":
        ids = b["input_ids"]
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    if kind in LMS:
        return model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
    if kind == "vit":
        return model(pixel_values=b["x"], labels=b["y"]).loss
    return nn.functional.cross_entropy(model(b["x"]), b["y"])


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # SGD with momentum: an exact comparison (Adam turns fp32 noise in a near-zero
    # gradient into a full-size step)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _to(b: dict, device) -> dict:
    return {k: v.to(device) for k, v in b.items()}


def fit(ctx, kind: str, steps: int = 3, meta: bool = False, save: str | None = None,
        save_at: int | None = None, every: int | None = None, die_at: int | None = None):
    """Train ``kind`` for ``steps`` steps; with ``ctx.resume_from``, go on from that
    checkpoint. ``every``: ``ctx.checkpoint_every(every, save)`` instead, and rank 1 is
    SIGKILLed at step ``die_at`` of a run that started from step 0. Returns the losses, the
    full state dict (rank 0) and this rank's norm statistics."""
    # fp32 means fp32 here: cuDNN's convolutions run in TF32 by default on Ampere and
    # later (the CNN's first conv weight differed from the CPU reference by more than
    # 1e-4 on an H100), and the comparison is of the strategy, not of the arithmetic
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    if meta:
        with ctx.init_module():
            model = make(kind)
    else:
        model = make(kind)
    opt = _optimizer(model)
    model, opt = ctx.setup(model, opt)
    start = 0
    if every:
        start = ctx.checkpoint_every(every, save, model=model, optimizer=opt)["step"]
    elif ctx.resume_from:
        state = ctx.load(ctx.resume_from, {"model": model, "optimizer": opt, "step": 0})
        start = state["step"] + 1
    losses = []
    for step in range(start, steps):
        ctx.step = step
        if step == die_at and start == 0 and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_of(kind, model, _to(batch(kind, step, ctx.rank, ctx.world_size),
                                        ctx.device))
        ctx.backward(loss)
        opt.step()
        opt.zero_grad()
        ctx.log(loss=loss)
        losses.append(loss.item())
        if save and step == save_at:
            ctx.save(save, {"model": model, "optimizer": opt, "step": step})
    full = ctx.full_state_dict(model)
    inner = getattr(model, "module", model)
    stats = {n: b.detach().clone() for n, b in inner.named_buffers() if "running" in n}
    return {"losses": losses, "full": full, "stats": stats}


def reference(kind: str, steps: int = 3, world_size: int = 2, split: bool = True) -> dict:
    """The same training in one process (see the module docstring). ``split=False``:
    each step's whole global batch at once (what SyncBatchNorm's ranks compute
    together); its losses are then the batch's, once per step."""
    if not split:
        torch.manual_seed(0)
        model = make(kind)
        opt = _optimizer(model)
        losses = []
        for step in range(steps):
            parts = [batch(kind, step, r, world_size) for r in range(world_size)]
            whole = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            loss = loss_of(kind, model, whole)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "full": {k: v.detach().clone()
                                           for k, v in model.state_dict().items()}}
    torch.manual_seed(0)
    model = make(kind)
    opt = _optimizer(model)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    losses = []
    for step in range(steps):
        per_rank = []
        for rank in range(world_size):
            saved = None
            if rank > 0:  # DDP keeps rank 0's running statistics
                saved = [(m, m.momentum, m.num_batches_tracked.clone()) for m in norms]
                for m in norms:
                    m.momentum = 0.0
            loss = loss_of(kind, model, batch(kind, step, rank, world_size))
            (loss / world_size).backward()
            per_rank.append(loss.item())
            for m, momentum, count in saved or []:
                m.momentum = momentum
                m.num_batches_tracked.copy_(count)
        opt.step()
        opt.zero_grad()
        losses.append(per_rank)
    return {"losses": losses, "full": {k: v.detach().clone()
                                       for k, v in model.state_dict().items()}}
