"""Megatron-style tensor parallelism for models that opt in (imports only torch and the stdlib).

A model builder that takes a keyword ``tensor_parallel`` receives a
``TensorParallel`` for the rank's tensor group (plan.json ``tensor_groups``),
or ``None`` when the rank's stage has no mesh axis ``tensor`` of size > 1.
Builders without that keyword are called as before and hold replicas.

Public API (stable):

    TensorParallel(group, rank, size, members=())
        .group    the torch.distributed group of the rank's tensor group
        .rank     the rank's coordinate along the stage's ``tensor`` axis (0..size-1):
                  the shard it holds; data-parallel peers share it
        .size     the tensor group's size
        .members  the group's global ranks (sorted)
        .all_reduce(t)             in-place sum over the group (returns t)
        .copy_to_region(x)         Megatron's f: identity forward, all_reduce backward
        .reduce_from_region(x)     Megatron's g: all_reduce forward, identity backward
        .shard(tensor, dim, blocks=1) -> nn.Parameter
                  this rank's part of ``tensor`` along ``dim`` (see shard_of), marked
                  ``planc_shard = (dim, rank, size)`` (and ``planc_shard_blocks``)
        .sequence_parallel   True when plan.json runs the rank's stage sequence-parallel
                  (``stages[i].sequence_parallel``): activations between layers are split along
                  dim 1 (the sequence) over the group, rank r holding the r-th of ``size`` equal parts
        .all_gather_seq(x) / .reduce_scatter_seq(x)   the raw collectives along dim 1 (no autograd)
    copy_to_region(x, tp) / reduce_from_region(x, tp)     the same as functions
    Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022), on activations [batch, sequence, ...]:
    gather_sequence(x, tp)          all-gather along dim 1; backward: reduce-scatter (before column-parallel
                                    projections, which then skip f: the reduce-scatter sums their input gradient)
    reduce_scatter_sequence(x, tp)  the partial sums reduce-scattered along dim 1 (after row-parallel
                                    projections, instead of g); backward: all-gather
    scatter_sequence(x, tp)         a replicated tensor's own part along dim 1; backward: all-gather
    gather_sequence_whole(x, tp)    all-gather along dim 1 into a tensor whose later computation is replicated;
                                    backward: the own part of the (replicated) gradient
    shard_of(tensor, dim, index, parts, blocks=1) -> Tensor
        ``dim`` viewed as ``blocks`` equal blocks (e.g. 3 for a fused q|k|v); part
        ``index`` of ``parts`` of every block, concatenated. blocks = 1: a plain chunk.
    shard_info(param) -> None | (dim, index, parts, blocks)
    shard_size(param) -> None | global length of the split dimension (``planc_shard_size`` when padded)
    context_from_plan(plan, groups, rank) -> TensorParallel | None
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["TensorParallel", "copy_to_region", "reduce_from_region", "shard_of", "shard_info", "shard_size",
           "context_from_plan", "TENSOR_AXIS", "gather_sequence", "reduce_scatter_sequence", "scatter_sequence",
           "gather_sequence_whole", "SEQUENCE_DIM"]

TENSOR_AXIS = "tensor"
SEQUENCE_DIM = 1   # activations are [batch, sequence, ...] (Hugging Face's layout)


def shard_of(tensor: torch.Tensor, dim: int, index: int, parts: int, blocks: int = 1) -> torch.Tensor:
    n = tensor.shape[dim]
    if n % (blocks * parts):
        raise ValueError(f"dimension {dim} of size {n} does not split into {blocks} block(s) of {parts} parts")
    step = n // (blocks * parts)
    block = n // blocks
    pieces = [tensor.narrow(dim, b * block + index * step, step) for b in range(blocks)]
    return pieces[0] if blocks == 1 else torch.cat(pieces, dim=dim)


def shard_size(param) -> int | None:
    """The global length of a shard's split dimension: ``planc_shard_size`` for a padded shard (the real
    rows of a vocabulary table padded to a multiple of the parts, ``hf_vocab``), else local x parts;
    None if replicated. Rows past it are padding: never written to checkpoints."""
    info = shard_info(param)
    if info is None:
        return None
    real = getattr(param, "planc_shard_size", None)
    return int(real) if real is not None else int(param.shape[info[0]]) * info[2]


def shard_info(param):
    """(dim, index, parts, blocks) of a parameter marked by ``TensorParallel.shard``; None if replicated."""
    s = getattr(param, "planc_shard", None)
    if s is None:
        return None
    dim, index, parts = (int(v) for v in s)
    return dim, index, parts, int(getattr(param, "planc_shard_blocks", 1))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad.clone(memory_format=torch.contiguous_format)), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x.clone(memory_format=torch.contiguous_format))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _own_part(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    n = x.shape[SEQUENCE_DIM]
    if n % tp.size:
        raise ValueError(f"sequence length {n} does not split into {tp.size} equal parts (sequence parallelism)")
    part = n // tp.size
    return x.narrow(SEQUENCE_DIM, tp.rank * part, part).contiguous()


class _Sequence(torch.autograd.Function):
    """One sequence collective forward and its adjoint backward, each named by ``_sequence_op``."""

    @staticmethod
    def forward(ctx, x, tp, there, back):
        ctx.tp, ctx.back = tp, back
        return _sequence_op(there, x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_op(ctx.back, grad, ctx.tp), None, None, None


def _sequence_op(name: str, x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """``own_part`` (no message), else the ``TensorParallel`` method of that name (``all_gather_seq``,
    ``reduce_scatter_seq``), so a subclass's collectives (the probe's meta group) are the ones run."""
    return _own_part(x, tp) if name == "own_part" else getattr(tp, name)(x)


def gather_sequence(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """The sequence-split ``x`` gathered along dim 1 on every rank; its gradient reduce-scattered back (the
    ranks' partial input gradients of the column-parallel projections that follow, summed)."""
    return x if tp is None or tp.size == 1 else _Sequence.apply(x, tp, "all_gather_seq", "reduce_scatter_seq")


def reduce_scatter_sequence(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """A row-parallel projection's partial outputs summed over the group, each rank keeping its part of the
    sequence; the gradient all-gathered back."""
    return x if tp is None or tp.size == 1 else _Sequence.apply(x, tp, "reduce_scatter_seq", "all_gather_seq")


def scatter_sequence(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """A replicated ``x``'s own part along the sequence (no message); the parts' gradients all-gathered back,
    since the replicated producer needs its whole gradient on every rank."""
    return x if tp is None or tp.size == 1 else _Sequence.apply(x, tp, "own_part", "all_gather_seq")


def gather_sequence_whole(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """The sequence-split ``x`` gathered along dim 1 for a computation every rank then repeats (or that reduces
    its own input gradient over the group, as a column-parallel head does): its gradient arrives whole and
    equal on every rank, and each keeps its part."""
    return x if tp is None or tp.size == 1 else _Sequence.apply(x, tp, "all_gather_seq", "own_part")


def copy_to_region(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """Megatron's f: the input of a column-parallel layer (identity; gradients summed over the group)."""
    return x if tp is None or tp.size == 1 else _CopyToRegion.apply(x, tp)


def reduce_from_region(x: torch.Tensor, tp: "TensorParallel") -> torch.Tensor:
    """Megatron's g: the partial outputs of a row-parallel layer summed over the group."""
    return x if tp is None or tp.size == 1 else _ReduceFromRegion.apply(x, tp)


class TensorParallel:
    """One rank's view of its tensor-parallel group."""

    def __init__(self, group, rank: int, size: int, members=()):
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
        self.group, self.rank, self.size, self.members = group, int(rank), int(size), tuple(members)
        self.sequence_parallel = False

    def __repr__(self):
        sp = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"TensorParallel(rank={self.rank}, size={self.size}, members={list(self.members)}{sp})"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' parts of ``x`` along dim 1 concatenated in rank order (no autograd)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=self.group)
        parts = out.view((self.size,) + tuple(x.shape))
        return torch.cat(parts.unbind(0), dim=SEQUENCE_DIM)

    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group, rank r keeping the r-th part along dim 1 (no autograd)."""
        if self.size == 1:
            return x
        n = x.shape[SEQUENCE_DIM]
        if n % self.size:
            raise ValueError(f"sequence length {n} does not split into {self.size} equal parts (sequence parallelism)")
        parts = torch.stack(x.chunk(self.size, dim=SEQUENCE_DIM), 0).contiguous()   # [size, batch, n/size, ...]
        out = parts.new_empty(parts.shape[1:])
        _reduce_scatter(out, parts.view((-1,) + tuple(parts.shape[2:])), group=self.group)
        return out

    def copy_to_region(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_region(x, self)

    def reduce_from_region(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(x, self)

    def shard(self, tensor: torch.Tensor, dim: int, blocks: int = 1) -> torch.nn.Parameter:
        p = torch.nn.Parameter(shard_of(tensor.detach(), dim, self.rank, self.size, blocks).clone(),
                               requires_grad=tensor.requires_grad)
        p.planc_shard = (int(dim), self.rank, self.size)
        if blocks != 1:
            p.planc_shard_blocks = int(blocks)
        return p


# torch 2.13 renamed reduce_scatter_tensor (deprecated there); torch >= 2.4 has the old name
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def context_from_plan(plan, groups: dict, rank: int) -> TensorParallel | None:
    """This rank's ``TensorParallel`` from plan.json ``tensor_groups`` and its stage mesh
    (``planfile.Plan``); None when its stage has no ``tensor`` axis of size > 1. The shard index is
    the rank's coordinate along ``tensor`` (so data-parallel peers, which share it, hold the same shard)."""
    members = next((g for g in plan.tensor_groups if rank in g), None)
    if members is None:
        return None
    stage = plan.stage_of(rank)
    if stage is None or TENSOR_AXIS not in stage.mesh_axes:
        raise ValueError(f"rank {rank} is in tensor group {list(members)} but its stage has no "
                         f"'{TENSOR_AXIS}' mesh axis")
    k = stage.mesh_axes.index(TENSOR_AXIS)
    size = stage.mesh_shape[k]
    if size != len(members):
        raise ValueError(f"tensor group {list(members)} has {len(members)} devices but the stage's "
                         f"'{TENSOR_AXIS}' axis has size {size}")
    if members not in groups:
        raise KeyError(f"tensor group {list(members)} is not in plan.json \"groups\"")
    tp = TensorParallel(groups[members], stage.position(rank)[k], size, members)
    tp.sequence_parallel = bool(stage.sequence_parallel)
    return tp
