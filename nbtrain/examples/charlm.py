"""A small character-level transformer and its data: the quickstart model.

The text ships with nbtrain (``tiny.txt``), so nothing is downloaded. ``train_charlm`` is
an ordinary nbtrain training function; ``sample`` runs the trained weights in the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

TEXT_PATH = Path(__file__).with_name("tiny.txt")


def load_text() -> str:
    return TEXT_PATH.read_text()


class Vocab:
    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharDataset(torch.utils.data.Dataset):
    """Every window of ``block`` characters, with the next character as the target."""

    def __init__(self, ids: torch.Tensor, block: int):
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return len(self.ids) - self.block

    def __getitem__(self, i: int):
        chunk = self.ids[i:i + self.block + 1]
        return chunk[:-1], chunk[1:]


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    block: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(),
                                 nn.Linear(4 * cfg.dim, cfg.dim))
        self.heads = cfg.heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharLM(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.block, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 if p.shape[0] == cfg.dim else 1))

    def forward(self, idx):
        """Logits for every position, flattened to ``(batch * time, vocab)``."""
        b, t = idx.shape
        x = self.embed(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).reshape(b * t, -1))


def train_charlm(ctx, steps: int = 60, batch_size: int = 32, lr: float = 3e-3,
                 cfg: Config | None = None, seed: int = 0):
    """Train ``CharLM`` on the shipped text for ``steps`` steps; return the losses and, on
    rank 0, the full trained weights."""
    text = load_text()
    vocab = Vocab(text)
    cfg = cfg or Config(vocab=len(vocab))
    torch.manual_seed(seed)
    model = CharLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = ctx.setup(model, opt)
    loader = ctx.dataloader(CharDataset(vocab.encode(text), cfg.block), batch_size=batch_size,
                            shuffle=True, drop_last=True, seed=seed)
    step, losses = 0, []
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y.reshape(-1))
            ctx.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctx.log(loss=loss)
            losses.append(loss.detach())
            step += 1
            if step == steps:
                break
    return {"losses": [float(v) for v in losses], "state_dict": ctx.full_state_dict(model),
            "config": cfg}


@torch.no_grad()
def sample(state_dict: dict, cfg: Config, prompt: str = "The ", length: int = 200,
           temperature: float = 0.8, seed: int = 0) -> str:
    """Generate text in the kernel from weights brought back by ``ctx.full_state_dict``."""
    vocab = Vocab(load_text())
    model = CharLM(cfg)
    model.load_state_dict(state_dict)
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = vocab.encode(prompt).unsqueeze(0)
    for _ in range(length):
        window = ids[:, -cfg.block:]
        logits = model(window)[-1:] / temperature
        ids = torch.cat([ids, torch.multinomial(F.softmax(logits, -1), 1, generator=g)], dim=1)
    return vocab.decode(ids[0])
