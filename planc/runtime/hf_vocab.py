"""Vocabulary parallelism for a Hugging Face model's embeddings and ``lm_head`` on a tensor stage
(LANGUAGE.md, "Hugging Face models"; Megatron's vocabulary-parallel embedding and cross-entropy).

On a stage whose ``tensor`` axis has size k > 1, the input embedding keeps rows [r V/k, (r + 1) V/k) of
its table (r the rank's tensor coordinate): a token outside them looks up nothing, and the partial
embeddings are summed over the group (Megatron's g). ``lm_head`` keeps the same rows of its weight
(column-parallel: the input through f), so the stage's output is the rank's slice of the logits; the
causal-LM loss is then :func:`parallel_cross_entropy`, which never gathers them: the max, the sum of
exponentials and the target's logit are all-reduced over the group, each a float per token. A loss the
user wrote gets the gathered logits instead.

When it applies (:func:`splits`): k > 1 and V divisible by k, and the weight is not tied to a layer of
another stage (a tie across stages keeps both copies whole: their gradients are summed whole). A
vocabulary that does not divide, and such ties, stay replicated (``planc explain`` shows the per-device
parameters the memory model counts).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .hf_tp import _GatherLast
from .tensor_parallel import TensorParallel, reduce_from_region

__all__ = ["splits", "table_and_head", "split_embedding", "split_head", "parallel_cross_entropy", "loss_for", "VOCAB_ATTR"]

VOCAB_ATTR = "planc_vocab"   # on a split module and on the Head layer: (tp, lo, hi, vocabulary size)


def splits(vocab: int, degree: int, tied_across_stages: bool) -> bool:
    return degree > 1 and vocab % degree == 0 and not tied_across_stages


def table_and_head(layers, degree: int, one_stage_holds_both: bool):
    """(embedding module, lm_head) of the pipeline ``layers`` that a tensor stage of ``degree`` splits by
    vocabulary (:func:`splits`; a tie counts as across stages unless one stage holds layer 0 and the last
    layer), else None. The one rule of the runtime's build and the compiler's probe."""
    emb = next((m for m in layers[0].modules() if isinstance(m, nn.Embedding)), None)
    head = getattr(layers[-1], "lm_head", None)
    if emb is None or not isinstance(head, nn.Linear):
        return None
    tied = head.weight is emb.weight
    return (emb, head) if splits(emb.weight.shape[0], degree, tied and not one_stage_holds_both) else None


def _rows(vocab: int, tp: TensorParallel) -> tuple[int, int]:
    n = vocab // tp.size
    return tp.rank * n, (tp.rank + 1) * n


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


def split_embedding(emb: nn.Embedding, tp: TensorParallel) -> None:
    """``emb`` in place: its rows of the table (``TensorParallel.shard`` along dim 0), forward as above."""
    vocab = emb.weight.shape[0]
    lo, hi = _rows(vocab, tp)
    emb.weight = tp.shard(emb.weight, 0)
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


def split_head(head: nn.Linear, tp: TensorParallel, weight: nn.Parameter | None = None) -> None:
    """``head`` in place: its rows of the weight (``weight``: the split embedding's when they are tied)."""
    vocab = head.out_features
    lo, hi = _rows(vocab, tp)
    head.weight = weight if weight is not None else tp.shard(head.weight, 0)
    if head.bias is not None:
        head.bias = tp.shard(head.bias, 0)
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


def parallel_cross_entropy(logits, labels, tp: TensorParallel, lo: int):
    """HF's causal-LM loss (labels shifted, -100 ignored, mean over predicted tokens) on split logits."""
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    keep = shifted != -100
    per_token = _ParallelCrossEntropy.apply(flat[keep], shifted[keep], tp, lo)
    return per_token.sum() / keep.sum().clamp(min=1)


def loss_for(layers, loss, builtin: bool):
    """The loss the last stage runs: ``loss`` itself, unless its Head is split by vocabulary: then the
    parallel cross-entropy in place of the built-in causal-LM loss, or ``loss`` on the gathered logits."""
    vocab = getattr(layers[-1], VOCAB_ATTR, None) if layers else None
    if vocab is None:
        return loss
    tp, lo, _, _ = vocab
    if builtin:
        return lambda logits, labels: parallel_cross_entropy(logits, labels, tp, lo)
    return lambda logits, labels: loss(_GatherLast.apply(logits, tp), labels)   # rank r's slice is the r-th
