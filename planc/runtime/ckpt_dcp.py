"""The tensors of a format-2 checkpoint: global names, owned rectangles, and torch.distributed.checkpoint
(DCP) planners that write and read exactly those rectangles (docs/runtime.md "Checkpoints").

Every tensor is keyed by a plan-independent global name at its global (unsharded) shape:
``model.<name>`` (the fp32 master) and ``optim.<name>.<state>`` (per-parameter optimizer state, fp32).
A rank owns, per parameter, the fragments its ``Regime`` updates (the whole local tensor, or with zero = 1
a contiguous range of it); a fragment is a few rectangles of the local tensor, each cut at the
tensor-parallel blocks and moved to its global offset (``owned_rects``). The same rectangles serve the
write (``RectSavePlanner``: one DCP write item per rectangle; replicas of a rectangle are written once by
DCP's dedup) and the read (``RectLoadPlanner``: DCP's ``create_read_items_for_chunk_list`` reads, from
whatever chunks the writing plan left, exactly the rectangles this rank's plan gives it).

Imports only torch and the standard library.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .tensor_parallel import shard_info, shard_size

__all__ = ["ParamInfo", "stage_params", "flat_rects", "owned_rects", "RectSavePlanner", "RectLoadPlanner",
           "DTYPE_NAMES"]

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float64: "f64"}


class ParamInfo:
    """One parameter of this rank's stage: its global name, global shape, and where its local tensor sits
    in it (``shard``: ``shard_info``'s (dim, index, parts, blocks), None when whole)."""

    __slots__ = ("name", "local", "param", "shape", "shard", "tied", "layer")

    def __init__(self, name, local, param, shape, shard, tied, layer):
        self.name, self.local, self.param, self.shape = name, local, param, shape
        self.shard, self.tied, self.layer = shard, tied, layer

    def entry(self) -> dict:
        """planc.json's ``parameters`` entry."""
        out = {"name": self.name, "shape": list(self.shape), "dtype": DTYPE_NAMES.get(self.param.dtype,
                                                                                     str(self.param.dtype))}
        if self.tied:
            out["tied"] = list(self.tied)
        return out


def global_name(layer_index: int, layer, local: str, param=None) -> str:
    """``layers.<global layer index>.<local name>``, or the layer's own ``planc_param_names`` mapping; a
    parameter tied across stages without that mapping takes its plan.json tied record's name (the first
    holder's, set by ``tied.TiedGradients``), so every stage writes and reads it under one name."""
    names = getattr(layer, "planc_param_names", None)
    if isinstance(names, dict) and local in names:
        return str(names[local])
    tied = getattr(param, "planc_tied_name", None)
    if tied is not None:
        return str(tied)
    return f"layers.{layer_index}.{local}"


def stage_params(module) -> list[ParamInfo]:
    """The parameters of a ``PlanPipelineModule`` (names ``<global layer index>.<name>``) in model order,
    each once (a parameter shared by several layers of the stage takes its first layer's name; the
    others are listed as ``tied``)."""
    out, seen = [], {}
    for full, p in module.named_parameters(remove_duplicate=False):
        index, _, local = full.partition(".")
        layer = getattr(module, index)
        name = global_name(int(index), layer, local, p)
        if id(p) in seen:
            seen[id(p)].tied.append(name)
            continue
        shard = shard_info(p)
        shape = list(p.shape)
        if shard is not None:
            shape[shard[0]] = shard_size(p)   # a padded vocabulary shard: the real rows only
        info = ParamInfo(name, full, p, tuple(shape), shard, [], int(index))
        seen[id(p)] = info
        out.append(info)
    return out


def flat_rects(lo: int, hi: int, shape) -> list[tuple[tuple, tuple]]:
    """The elements [lo, hi) of a row-major tensor of ``shape``, flattened, as rectangles (offsets, sizes),
    in order; each is contiguous in the flat order (fixed leading indices, a range, whole trailing dims)."""
    shape = [int(n) for n in shape]
    nd = len(shape)
    if nd == 0:
        return [((), ())] if lo < hi else []
    out = []

    def rec(lo, hi, k, prefix):
        if lo >= hi:
            return
        s = math.prod(shape[k + 1:])
        a, b = -(-lo // s), hi // s          # whole slices a..b-1 along dim k
        if a > b:                            # inside slice lo // s
            i = lo // s
            rec(lo - i * s, hi - i * s, k + 1, prefix + [i])
            return
        if lo < a * s:
            rec(lo - (a - 1) * s, s, k + 1, prefix + [a - 1])
        if a < b:
            out.append((tuple(prefix + [a] + [0] * (nd - k - 1)), tuple([1] * k + [b - a] + shape[k + 1:])))
        if b * s < hi:
            rec(0, hi - b * s, k + 1, prefix + [b])

    rec(lo, hi, 0, [])
    return out


def owned_rects(info: ParamInfo, lo: int, hi: int) -> list[tuple[tuple, tuple, tuple]]:
    """The rectangles (local offsets, sizes, global offsets) of elements [lo, hi) of ``info``'s local tensor
    (flattened): ``flat_rects`` cut at the tensor-parallel blocks and placed at their global offsets."""
    local_shape = tuple(info.param.shape)
    rects = flat_rects(lo, hi, local_shape)
    if info.shard is None:
        return [(o, s, o) for o, s in rects]
    dim, index, parts, blocks = info.shard
    step = local_shape[dim] // blocks           # a block's part, locally
    real = info.shape[dim]                      # a padded shard's rows past it are padding: left out
    out = []
    for off, size in rects:
        a, b = off[dim], off[dim] + size[dim]
        while a < b:
            block = a // step
            end = min(b, (block + 1) * step)
            o, s, g = list(off), list(size), list(off)
            g[dim] = block * step * parts + index * step + (a - block * step)
            o[dim], s[dim] = a, min(end - a, real - g[dim])
            if s[dim] > 0:
                out.append((tuple(o), tuple(s), tuple(g)))
            a = end
    return out


def local_view(full_flat: torch.Tensor, shape, offsets, sizes) -> torch.Tensor:
    """The rectangle (offsets, sizes) of ``full_flat`` viewed as ``shape``."""
    view = full_flat.view(tuple(shape))
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        view = view.narrow(d, o, n)
    return view


# ---------------------------------------------------------------- DCP planners

class RectSavePlanner(DefaultSavePlanner):
    """Writes ``chunks``: ``{(key, global offsets): (tensor, global shape)}`` as DCP shards of the global
    tensors (the state dict passed to ``dcp.save`` is unused). DCP's global planning dedups replicas (the
    same key and offsets on several ranks) and checks that the chunks of each tensor do not overlap."""

    def __init__(self, chunks: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for (key, offsets), (tensor, shape) in sorted(self.chunks.items()):
            items.append(WriteItem(
                index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(tensor.shape)),
                    properties=TensorProperties.create_from_tensor(tensor), size=torch.Size(shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))][0]


class RectLoadPlanner(LoadPlanner):
    """Reads ``wanted``: ``{key: [(global offsets, destination tensor of the rectangle's shape), ...]}``
    from whatever chunks the checkpoint holds (the state dict passed to ``dcp.load`` is unused). Every
    wanted rectangle must be covered by the checkpoint's chunks (``missing`` lists those that are not)."""

    def __init__(self, wanted: dict):
        self.wanted = wanted
        self.missing: list[str] = []

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key in sorted(self.wanted):
            md = self.metadata.state_dict_metadata.get(key)
            rects = self.wanted[key]
            if not isinstance(md, TensorStorageMetadata):
                self.missing.append(f"{key} (not in the checkpoint)")
                continue
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(t.shape)) for o, t in rects]
            reads = create_read_items_for_chunk_list(key, md, chunks)
            covered = [0] * len(rects)
            for r in reads:
                covered[r.dest_index.index] += math.prod(r.lengths)
            for (o, t), n in zip(rects, covered):
                if n != t.numel():
                    self.missing.append(f"{key} at {list(o)} size {list(t.shape)} ({n} of {t.numel()} "
                                        f"elements in the checkpoint)")
            items += reads
        if self.missing:   # raised inside dcp.load: DCP reports it on every rank
            raise ValueError("the checkpoint does not hold " + "; ".join(self.missing[:3])
                             + (f" (and {len(self.missing) - 3} more)" if len(self.missing) > 3 else ""))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"unexpected non-tensor entry {read_item.dest_index.fqn} in the checkpoint")

    def resolve_tensor(self, read_item):
        dest = self.wanted[read_item.dest_index.fqn][read_item.dest_index.index][1]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(d, o, n)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass   # resolve_tensor returned a view of the destination: the data is in place
