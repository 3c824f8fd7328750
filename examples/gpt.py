"""A small GPT as a list of pipeline layers: embedding, transformer blocks, head.

``build(layers, hidden, heads, seq, vocab)`` returns ``layers + 2`` modules
(layer 0 the embedding, 1..layers the blocks, the last the head), so a plan
with ``layers = 4`` cuts them e.g. ``0..3`` and ``3..6``. Every layer maps one
tensor ``[batch, seq, hidden]`` to the next; the head returns logits
``[batch, seq, vocab]``. Deterministic: no dropout.

``build(..., tensor_parallel=tp)`` (planc passes a ``TensorParallel`` for the
rank's tensor group; planc/runtime/tensor_parallel.py) first builds the full
layers exactly as without it (same seed, same initial weights), then splits
each block in place, Megatron-style: attention ``qkv`` column-parallel by heads
(q, k and v each split by heads alike), its output projection row-parallel, MLP
``fc1`` column-parallel and ``fc2`` row-parallel; each row-parallel bias is
added once, after the all-reduce. Embeddings, layer norms and the head stay
replicated. The forward is mathematically the unsplit model's.
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

        self.tp = None

    def shard(self, tp):
        """Keep this rank's part of the block over tensor group ``tp`` (in place)."""
        if self.heads % tp.size:
            raise ValueError(f"heads = {self.heads} do not divide over a tensor group of {tp.size}")
        fc1, fc2 = self.mlp[0], self.mlp[2]
        self.qkv.weight = tp.shard(self.qkv.weight, 0, blocks=3)   # rows [q | k | v], each by heads
        self.qkv.bias = tp.shard(self.qkv.bias, 0, blocks=3)
        self.proj.weight = tp.shard(self.proj.weight, 1)            # row-parallel: input columns
        fc1.weight = tp.shard(fc1.weight, 0)                        # column-parallel: output rows
        fc1.bias = tp.shard(fc1.bias, 0)
        fc2.weight = tp.shard(fc2.weight, 1)
        self.qkv.out_features, self.proj.in_features = self.qkv.weight.shape[0], self.proj.weight.shape[1]
        fc1.out_features, fc2.in_features = fc1.weight.shape[0], fc2.weight.shape[1]
        self.tp = tp
        return self

    def attention_partial(self, x):
        """This rank's heads through its columns of the output projection (no bias, before the sum)."""
        b, t, _ = x.shape
        heads = self.heads // self.tp.size
        local = self.qkv.weight.shape[0] // 3
        q, k, v = self.qkv(self.tp.copy_to_region(self.ln1(x))).split(local, dim=2)
        q, k, v = (z.view(b, t, heads, local // heads).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return nn.functional.linear(y.transpose(1, 2).reshape(b, t, local), self.proj.weight)

    def mlp_partial(self, x):
        """This rank's MLP columns through its rows of fc2 (no bias, before the sum)."""
        fc1, act, fc2 = self.mlp
        return nn.functional.linear(act(fc1(self.tp.copy_to_region(self.ln2(x)))), fc2.weight)

    def forward(self, x):
        if self.tp is not None:
            x = x + (self.tp.reduce_from_region(self.attention_partial(x)) + self.proj.bias)
            return x + (self.tp.reduce_from_region(self.mlp_partial(x)) + self.mlp[2].bias)
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


def build(layers=4, hidden=64, heads=4, seq=32, vocab=256, tensor_parallel=None):
    model = [Embedding(vocab, hidden, seq)] + [Block(hidden, heads) for _ in range(layers)] + [Head(hidden, vocab)]
    if tensor_parallel is not None and tensor_parallel.size > 1:
        if heads % tensor_parallel.size:
            raise ValueError(f"heads = {heads} do not divide over a tensor group of {tensor_parallel.size}")
        for block in model[1:-1]:
            block.shard(tensor_parallel)
    return model


def loss(output, target):
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def batches(micro_batch, seed, seq=32, vocab=256, **_):
    """Endless seeded synthetic language: each next token is a fixed function of the current one."""
    g = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        ids[:, 1:] = (ids[:, :-1] * 7 + 3) % vocab
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
