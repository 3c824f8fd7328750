"""A small GPT as a list of pipeline layers: embedding, transformer blocks, head.

``build(layers, hidden, heads, seq, vocab)`` returns ``layers + 2`` modules
(layer 0 the embedding, 1..layers the blocks, the last the head), so a plan
with ``layers = 4`` cuts them e.g. ``0..3`` and ``3..6``. Every layer maps one
tensor ``[batch, seq, hidden]`` to the next; the head returns logits
``[batch, seq, vocab]``. Deterministic: no dropout.
"""

import torch
from torch import nn


class Embedding(nn.Module):
    def __init__(self, vocab, hidden, seq):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Parameter(torch.randn(seq, hidden) * 0.02)

    def forward(self, ids):
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.ln(x))


def build(layers=4, hidden=64, heads=4, seq=32, vocab=256):
    return [Embedding(vocab, hidden, seq)] + [Block(hidden, heads) for _ in range(layers)] + [Head(hidden, vocab)]


def loss(output, target):
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def batches(micro_batch, seed, seq=32, vocab=256, **_):
    """Endless seeded synthetic language: each next token is a fixed function of the current one."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        ids[:, 1:] = (ids[:, :-1] * 7 + 3) % vocab
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
