"""Tied parameters: one ``nn.Parameter`` used by layers of several stages (docs/reduction.md, "Tied parameters").

Two halves, both torch and the contract only:

- ``shared_parameters(layers)`` (the compiler's probe calls it): the parameters reachable from the
  ``named_parameters`` of two layers or more, each as the ``(layer index, local name)`` of every layer
  holding it (the first name within a layer). A parameter used twice inside one layer is one parameter
  and not listed.
- ``TiedGradients``: at run time, the tied parameters this rank holds (plan.json reductions with a
  ``tied`` record). They stay out of the stage's gradient buckets: their gradients accumulate in fp32
  buckets of their own (``grads.GradientBuckets`` with no executor: no stage reduction), and after the
  last backward each is summed by its planned program over the devices of every stage holding it (a
  rank not among the record's ``contributors`` enters zeros: a tensor replica's identical gradient is
  counted once). Every holder then has the same gradient, and the same parameter (every rank built the
  whole model from the same seed), so every copy takes the same step. A table split by vocabulary
  (``tied.split``: a Hugging Face model's tied embedding on a tensor stage) has one record per buffer
  layout of its pieces: each sums the rank's piece of rows, a slice of its shard's gradient, over the
  holders of that piece (docs/reduction.md, "Tied parameters split by vocabulary"); every holder of a
  row then has the same gradient and value for it.
"""
from __future__ import annotations

import torch

__all__ = ["shared_parameters", "probe_record", "split_record", "TiedGradients", "TiedError"]


def shared_parameters(layers) -> list[list[tuple[int, str]]]:
    """Per parameter reachable from two layers or more: ``[(layer, local name), ...]`` in layer order
    (its first name in each layer); the groups in the order of their first holder."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            held = holders.setdefault(id(p), [])
            if not held or held[-1][0] != i:
                held.append((i, name))
    return sorted((h for h in holders.values() if len(h) > 1), key=lambda h: h[0][0])   # stable: name order


def _first(layers, group):
    """The parameter of a ``shared_parameters`` group, by its first holder."""
    layer, name = group[0]
    return dict(layers[layer].named_parameters())[name]


def probe_record(layers) -> list[dict]:
    """The probe's ``tied`` answer: per shared parameter, ``{"holders": [[layer, name], ...], "numel": n}``."""
    return [{"holders": [[i, n] for i, n in group], "numel": _first(layers, group).numel()}
            for group in shared_parameters(layers)]


def split_record(layers) -> list[list]:
    """The first holder ``[layer, name]`` of each shared parameter a builder model's build split over a
    tensor group (``TensorParallel.shard``): the compiler refuses such a tie across stages
    (reduction/tied.py); a Hugging Face model's vocabulary split is planned piecewise instead."""
    from .tensor_parallel import shard_info
    return [list(group[0]) for group in shared_parameters(layers) if shard_info(_first(layers, group)) is not None]


class TiedError(ValueError):
    """plan.json's tied records do not fit this rank's stage (a compiler bug or an edited plan)."""


def check_planned(plan, layers) -> None:
    """Every parameter the model (all its ``layers``, as every rank builds it) shares between layers of two
    stages has its tied reduction in plan.json; else a ``TiedError`` (a plan compiled without the probe,
    ``--no-probe``, does not know the model's ties, and the copies would drift apart)."""
    stage_of = {}
    for st in plan.stages:
        a, b = st.layers if st.layers is not None else (0, len(layers))
        stage_of.update({i: st.index for i in range(a, b)})
    planned = [{(h.layer, h.name) for h in r.tied.holders} for r in plan.reductions if r.tied is not None]
    for group in shared_parameters(layers):
        if len({stage_of.get(i) for i, _ in group}) > 1 and not any(set(group) <= h for h in planned):
            where = ", ".join(f"layers.{i}.{n} (stage {stage_of.get(i)})" for i, n in group)
            raise TiedError(f"the model ties one parameter across stages ({where}) but plan.json has no tied "
                            "reduction for it: compile the plan with the model probe (not --no-probe)")


class TiedGradients:
    """The tied parameters of one stage rank and their programs.

    ``module``: the stage's ``PipelineModule`` (parameters named ``<global layer>.<local name>``);
    ``records``: plan.json's tied reductions (``Reduction.tied`` set) whose groups hold ``rank``.
    ``params`` lists the rank's tied parameters (the stage's buckets leave them out); ``buckets``
    their fp32 gradient buckets (None when the rank holds none); ``counts_norm``: the parameters whose
    gradient this rank counts in the global norm (the record's ``norm_device``).
    """

    def __init__(self, module, records, rank: int, groups: dict, device, plan=None, bucket_bytes=None, tracer=None):
        from .grads import GradientBuckets
        from .reduce import ReductionExecutor
        named = dict(module.named_parameters(remove_duplicate=False))
        self.entries = []      # (record, parameter, executor, contributes, (x, y): its flat elements the program sums)
        seen: dict[int, bool] = {}   # parameter id -> split by rows (several piece records may share it)
        for r in records:
            t = r.tied
            mine = [h for h in t.holders if f"{h.layer}.{h.name}" in named]
            if not mine:
                raise TiedError(f"rank {rank}: tied parameter {t.parameter}: none of its holders "
                                f"{[h.describe() for h in t.holders]} is a layer of this rank's stage")
            p = named[f"{mine[0].layer}.{mine[0].name}"]
            if any(named[f"{h.layer}.{h.name}"] is not p for h in mine[1:]):
                raise TiedError(f"rank {rank}: tied parameter {t.parameter}: its holders in this stage are "
                                "different parameters")
            span = _piece(r, p, rank)
            if id(p) in seen and not (seen[id(p)] and t.split is not None):
                raise TiedError(f"rank {rank}: tied parameter {t.parameter} has two tied records")
            seen[id(p)] = t.split is not None
            p.planc_tied_name = t.parameter   # one name in checkpoints, whichever stage writes it (ckpt_dcp)
            ex = (ReductionExecutor.for_plan(plan, r, groups, rank) if plan is not None
                  else ReductionExecutor(r, groups, rank))
            self.entries.append((r, p, ex, rank in t.contributors, span))
        self.params = list({id(p): p for _, p, _, _, _ in self.entries}.values())
        self.ids = {id(p) for p in self.params}
        # the parameters whose gradient this rank counts in the global norm: None, all of it; else its pieces
        self.counts_norm: dict[int, list | None] = {}
        for r, p, _, _, span in self.entries:
            group = r.group_of(rank)
            if r.tied.split is None and r.tied.norm_device == rank:
                self.counts_norm[id(p)] = None
            elif r.tied.split is not None and r.tied.split.norm_devices[r.groups.index(group)] == rank:
                self.counts_norm.setdefault(id(p), []).append(span)
        self.tracer = tracer
        self.buckets = (GradientBuckets(self.params, None, device, bucket_bytes=bucket_bytes)
                        if self.params else None)

    @classmethod
    def build(cls, module, plan, rank: int, groups: dict, device, tracer=None) -> "TiedGradients":
        """The engine's: the plan's tied reductions holding ``rank``; a mismatch is the engine's error."""
        from .dataflow import EngineError
        try:
            check_planned(plan, getattr(module, "_layer_specs", None) or ())   # DeepSpeed keeps every layer
            return cls(module, plan.tied_reductions(rank), rank, groups, device, plan=plan,
                       bucket_bytes=plan.runtime.grad_bucket_bytes, tracer=tracer)
        except TiedError as e:
            raise EngineError(str(e)) from None

    def others(self, params) -> list:
        """``params`` but the tied ones: what the stage's own buckets reduce. DeepSpeed's own all-reduce
        would sum every ``.grad``, the tied ones too: the engine uses the buckets when this rank holds one."""
        return [p for p in params if id(p) not in self.ids]

    def written(self, p) -> list | None:
        """The flat element spans of ``p`` this rank writes to a checkpoint: None, all of it (a tied
        parameter held whole: every holder writes the same chunk, which DCP writes once); for a table split
        by rows, the pieces it counts in the norm (one writer per piece: the holders' rows overlap)."""
        if not any(e[1] is p and e[0].tied.split is not None for e in self.entries):
            return None
        return list(self.counts_norm.get(id(p)) or ())

    def describe(self) -> str:
        return "; ".join(f"{r.tied.parameter} over {[list(g) for g in r.groups]} by {r.text}"
                         for r, _, _, _, _ in self.entries)

    def attach(self) -> None:
        if self.buckets is not None:
            self.buckets.attach()

    @torch.no_grad()
    def reduce(self) -> None:
        """After the stage's last backward: each tied gradient (or piece of one) summed over its holders by
        its program; every holder's copy then has a gradient (zero where no contributor produced one)."""
        if self.buckets is None:
            return
        b = self.buckets
        b.finish()
        b.no_gradient = set()
        for r, p, ex, contributes, (x, y) in self.entries:
            slot, off = b.slot[id(p)]
            flat = b.buckets[slot][0][off + x:off + y]
            if not contributes:
                flat.zero_()
            t0 = self.tracer.now() if self.tracer is not None else 0.0
            ex.run(flat)
            if self.tracer is not None:
                self.tracer.complete(f"reduce tied {r.tied.parameter}", t0, self.tracer.now(), "reduce",
                                     bytes=flat.numel() * flat.element_size())
        for p in self.params:
            slot, off = b.slot[id(p)]
            flat = b.buckets[slot][0][off:off + p.numel()]
            if p.dtype == flat.dtype:
                p.grad = flat.view_as(p)


def _piece(r, p, rank: int) -> tuple[int, int]:
    """The flat elements [x, y) of this rank's ``p`` that the tied record ``r`` sums: all of it, or for a
    table split by rows (``tied.split``) its group's piece, at its offset in the rank's rows (its tensor
    shard's rows of the padded table, ``shard_info``; all real rows when unsplit)."""
    from .tensor_parallel import shard_info
    t = r.tied
    info = shard_info(p)
    if t.split is None:
        if info is not None:
            raise TiedError(f"rank {rank}: tied parameter {t.parameter} is split over the tensor axis, but its "
                            "tied record sums it whole (plan.json tied.split is missing)")
        return 0, p.numel()
    if info is not None and (info[0] != 0 or info[3] != 1):
        raise TiedError(f"rank {rank}: tied parameter {t.parameter} is split along dimension {info[0]}; a tied "
                        "table splits by rows (dimension 0)")
    rows = p.shape[0]
    total = rows * info[2] if info is not None else rows
    if total != (t.split.padded if info is not None else t.split.size):
        raise TiedError(f"rank {rank}: tied parameter {t.parameter}: this rank holds {rows} rows of a table of "
                        f"{total}, but plan.json's split pads {t.split.size} rows to {t.split.padded}")
    lo = info[1] * rows if info is not None else 0
    a, b = t.split.rows[r.groups.index(r.group_of(rank))]
    if not lo <= a < b <= lo + rows:
        raise TiedError(f"rank {rank}: tied parameter {t.parameter}: its piece of rows [{a}, {b}) is not inside "
                        f"this rank's rows [{lo}, {lo + rows})")
    row = p.numel() // rows
    return (a - lo) * row, (b - lo) * row
