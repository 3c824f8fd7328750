"""Vocabulary parallelism for a Hugging Face model's embeddings and ``lm_head`` on a tensor stage
(LANGUAGE.md, "Hugging Face models"; Megatron's vocabulary-parallel embedding and cross-entropy).

On a stage whose ``tensor`` axis has size k > 1, the input embedding's table of V rows is padded to P rows
(plan.json ``train.model.hf.vocab``: a multiple of k, of the least common multiple of every holder's
degree when the table is tied across stages) and tensor rank r keeps rows [r P/k, (r + 1) P/k): the real
ones drawn by the plan-independent rule (the whole table drawn, then cut), the padding zeros. A token
outside its rows looks up nothing, and the partial embeddings are summed over the group (Megatron's g).
``lm_head`` keeps the same rows of its weight (column-parallel: the input through f), so the stage's output
is the rank's slice of the padded logits; the causal-LM loss is then :func:`parallel_cross_entropy`,
which never gathers them: padded columns are −inf (no probability, no gradient), the max, the sum of
exponentials and the target's logit are all-reduced over the group, each a float per token. A loss the
user wrote gets the gathered logits cut to the V real columns.

A split parameter is a ``TensorParallel`` shard (``planc_shard``) and, padded, carries
``planc_shard_size`` = V: checkpoints and exports hold exactly the V real rows (ckpt_dcp), the padding
rows are zero and their gradient is zero, so every optimizer leaves them zero.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .hf_tp import _GatherLast
from .tensor_parallel import TensorParallel, reduce_from_region

__all__ = ["table_and_head", "padded_rows", "shard_rows", "split_embedding", "split_head", "parallel_cross_entropy",
           "loss_for", "VOCAB_ATTR"]

VOCAB_ATTR = "planc_vocab"   # on a split module and on the Head layer: (tp, lo, hi, vocabulary size)


def table_and_head(layers):
    """(embedding module, lm_head) of the pipeline ``layers``, the parameters a tensor stage splits by
    vocabulary; None when the model has no such pair. The one rule of the runtime's build and the probe."""
    emb = next((m for m in layers[0].modules() if isinstance(m, nn.Embedding)), None)
    head = getattr(layers[-1], "lm_head", None)
    if emb is None or not isinstance(head, nn.Linear):
        return None
    return emb, head


def padded_rows(vocab: int, degree: int, record=None, part: str = "embedding") -> int:
    """The rows the table is padded to on a holder of ``degree``: plan.json's ``record`` (a
    ``VocabSplit``) where there is one, else the least multiple of ``degree`` >= ``vocab``."""
    if record is not None:
        padded = int(record.padded(part) if hasattr(record, "padded") else record[part])
        if padded % degree or padded < vocab:
            raise ValueError(f"plan.json's vocabulary split pads the {part} to {padded} rows, which do not split "
                             f"over a tensor group of {degree} (vocabulary {vocab})")
        return padded
    return -(-vocab // degree) * degree


def _rows(padded: int, tp: TensorParallel) -> tuple[int, int]:
    n = padded // tp.size
    return tp.rank * n, (tp.rank + 1) * n


def shard_rows(weight: torch.Tensor, tp: TensorParallel, padded: int) -> nn.Parameter:
    """Rank ``tp.rank``'s rows of ``weight`` (dimension 0, V real rows) padded to ``padded`` rows: its real
    rows' values, zeros after them; a ``TensorParallel`` shard, with ``planc_shard_size`` = V when padded."""
    vocab = weight.shape[0]
    lo, hi = _rows(padded, tp)
    real = weight.detach()[min(lo, vocab):min(hi, vocab)]
    if hi > vocab:
        pad = torch.zeros((hi - max(lo, vocab), *weight.shape[1:]), dtype=weight.dtype, device=weight.device)
        real = torch.cat([real, pad])
    p = nn.Parameter(real.clone(), requires_grad=weight.requires_grad)
    p.planc_shard = (0, tp.rank, tp.size)
    if padded != vocab:
        p.planc_shard_size = int(vocab)
    return p


class _VocabEmbedding:
    """Mixed into the embedding's own class: the table's own rows, out-of-range tokens looked up as 0 and
    zeroed, the partial embeddings summed over the group."""

    def forward(self, ids):
        tp, lo, hi, _ = getattr(self, VOCAB_ATTR)
        outside = (ids < lo) | (ids >= hi)
        local = (ids - lo).masked_fill(outside, 0)
        out = self._planc_base_forward(local)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return reduce_from_region(out, tp)


def split_embedding(emb: nn.Embedding, tp: TensorParallel, padded: int | None = None) -> None:
    """``emb`` in place: its rows of the table padded to ``padded`` (:func:`shard_rows`), forward as above."""
    vocab = emb.weight.shape[0]
    padded = padded or padded_rows(vocab, tp.size)
    lo, hi = _rows(padded, tp)
    emb.weight = shard_rows(emb.weight, tp, padded)
    if emb.padding_idx is not None:
        emb.padding_idx = emb.padding_idx - lo if lo <= emb.padding_idx < hi else None
    emb.num_embeddings = hi - lo
    base = type(emb)
    emb._planc_base_forward = lambda ids, _m=emb, _b=base: _b.forward(_m, ids)
    emb.__class__ = type(f"VocabParallel{base.__name__}", (_VocabEmbedding, base), {})
    setattr(emb, VOCAB_ATTR, (tp, lo, hi, vocab))


class _ColumnHead(nn.Linear):
    """``lm_head`` split by vocabulary: the input through f, the rank's slice of the logits out."""

    def forward(self, x):
        tp = getattr(self, VOCAB_ATTR)[0]
        return F.linear(tp.copy_to_region(x), self.weight, self.bias)


def split_head(head: nn.Linear, tp: TensorParallel, weight: nn.Parameter | None = None, padded: int | None = None,
               vocab: int | None = None) -> None:
    """``head`` in place: its rows of the weight padded to ``padded`` (``weight``: the split embedding's when
    they are tied; ``vocab``: the real rows, when ``head`` no longer knows them)."""
    vocab = vocab or head.out_features
    padded = padded or padded_rows(vocab, tp.size)
    lo, hi = _rows(padded, tp)
    head.weight = weight if weight is not None else shard_rows(head.weight, tp, padded)
    if head.bias is not None:
        head.bias = shard_rows(head.bias, tp, padded)
    head.out_features = hi - lo
    head.__class__ = _ColumnHead
    setattr(head, VOCAB_ATTR, (tp, lo, hi, vocab))


class _ParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary over ``tp`` (rank r holds columns [lo, hi))."""

    @staticmethod
    def forward(ctx, logits, target, tp, lo):
        n = logits.shape[-1]
        top = logits.max(dim=-1).values
        if tp.size > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        shifted = logits - top.unsqueeze(-1)
        inside = (target >= lo) & (target < lo + n)
        local = (target - lo).masked_fill(~inside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        both = torch.stack([picked, total])
        tp.all_reduce(both)
        picked, total = both[0], both[1]
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows[inside], local[inside]] -= 1.0
        return g * grad.unsqueeze(-1), None, None, None


def _no_padding(logits, lo: int, vocab: int):
    """The rank's logits (columns [lo, lo + n) of the padded vocabulary) with the padded columns −inf."""
    n = logits.shape[-1]
    if lo + n <= vocab:
        return logits
    pad = torch.arange(lo, lo + n, device=logits.device) >= vocab
    return logits.masked_fill(pad, float("-inf"))


def parallel_cross_entropy(logits, labels, tp: TensorParallel, lo: int, vocab: int | None = None):
    """HF's causal-LM loss (labels shifted, -100 ignored, mean over predicted tokens) on split logits;
    columns at or past ``vocab`` (padding) take no probability."""
    logits = logits.float()
    if vocab is not None:
        logits = _no_padding(logits, lo, vocab)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    keep = shifted != -100
    per_token = _ParallelCrossEntropy.apply(flat[keep], shifted[keep], tp, lo)
    return per_token.sum() / keep.sum().clamp(min=1)


def loss_for(layers, loss, builtin: bool):
    """The loss the last stage runs: ``loss`` itself, unless its Head is split by vocabulary: then the
    parallel cross-entropy in place of the built-in causal-LM loss, or ``loss`` on the gathered logits
    cut to the real vocabulary (the padded columns dropped: they take no probability)."""
    vocab = getattr(layers[-1], VOCAB_ATTR, None) if layers else None
    if vocab is None:
        return loss
    tp, lo, _, size = vocab
    if builtin:
        return lambda logits, labels: parallel_cross_entropy(logits, labels, tp, lo, size)
    # rank r's slice is the r-th
    return lambda logits, labels: loss(_GatherLast.apply(logits, tp)[..., :size], labels)
