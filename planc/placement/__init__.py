"""Placement synthesis (P² §2.1, §3.1): which device runs which slice of the parallelism axes.

``place(program)`` picks a parallelism matrix (pinned, or ranked by the
predicted communication time of one training iteration), maps every device
to its axis coordinates by DESIGN.md's rank mapping, and lays the stages out
as meshes. See docs/placement.md.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from planc import ir
from planc.cost import Network, step_coefficients
from planc.diagnostics import Diagnostic, PlanError
from planc.placement import closed
from planc.placement.mapping import (
    Coords, coords_for, device_of, level_coords, program_costs, reduction_factors, reduction_lower_bound,
    stage_layouts,
)
from planc.placement.matrices import Matrix, count_matrices, enumerate_matrices, is_matrix, matrix_problems
from planc.placement.records import loss_devices, stage_record
from planc.reduction import pinned_time, reduction_bytes, stage_reduction_groups
from planc.resharding import parts_per_dim

__all__ = [
    "Placement", "place", "warm", "stage_record", "loss_devices", "coords_for", "stage_layouts", "device_of",
    "level_coords",
    "count_matrices", "enumerate_matrices", "is_matrix", "matrix_problems",
    "NOMINAL_REDUCTION_BYTES", "MAX_RANKED", "BOUND_SLACK",
]

NOMINAL_REDUCTION_BYTES = 1 << 20   # a reduction whose size is unknown is costed at 1 MiB
MAX_RANKED = 10
# Lower bounds are scaled by (1 - BOUND_SLACK) before pruning: a bound and a cost computed by
# different float expressions of the same quantity may differ by rounding, never by this much.
BOUND_SLACK = 1e-9


@dataclass(frozen=True, slots=True)
class Placement:
    """The chosen parallelism matrix, its runners-up, device coordinates and stage meshes.

    ``matrix`` is None for explicit-stage plans without a ``parallel`` block
    (then ``coords`` is empty and ``to_json()`` is None). ``search`` says how
    the ranking was made: ``pinned``, ``exhaustive`` (every matrix costed) or
    ``branch_and_bound`` (every matrix costed or proven, by a lower bound, worse than
    the ``MAX_RANKED``-th best); ``evaluated`` how many matrices were costed.
    """

    matrix: Matrix | None
    candidates: int
    ranked: tuple[tuple[Matrix, float], ...]
    coords: Coords
    stages: tuple[ir.StageLayout, ...]
    axes: tuple[tuple[str, int], ...] = ()
    search: str | None = None
    evaluated: int = 0
    breakdown: tuple[tuple[tuple[str, float], ...], ...] = ()   # per ranked matrix: (what, seconds)
    tensor_traffic: tuple[dict, ...] = ()   # the chosen matrix's costed tensor-parallel traffic, per stage

    def to_json(self) -> dict[str, Any] | None:
        """The plan.json ``placement`` section (PLAN_FORMAT.md)."""
        if self.matrix is None:
            return None
        return {
            "axes": [{"name": n, "size": s} for n, s in self.axes],
            "matrix": [list(r) for r in self.matrix],
            "candidates": self.candidates,
            "ranked": [{"matrix": [list(r) for r in m], "predicted": t,
                        "breakdown": {what: sec for what, sec in parts}}
                       for (m, t), parts in zip(self.ranked, self.breakdown or ((),) * len(self.ranked))],
            "search": self.search,
            "evaluated": self.evaluated,
            "coords": [list(c) for c in self.coords],
            **({"tensor_traffic": [dict(t) for t in self.tensor_traffic]} if self.tensor_traffic else {}),
        }


# ---------------------------------------------------------------- cost model access

def _reduction_bytes(red: ir.Reduction, param_bytes: dict[int, int] | None) -> int:
    nbytes = reduction_bytes(red, param_bytes)
    return NOMINAL_REDUCTION_BYTES if nbytes is None else nbytes


def _region_bytes(nbytes: int, spec: ir.ShardingSpec, layout: ir.StageLayout) -> float:
    return nbytes / math.prod(parts_per_dim(layout.shape, spec))


def _zero2(program: ir.Program, degree: int = 2) -> bool:
    """Whether some stage runs ZeRO-2 or more (``degree``: 3, ZeRO-3) (the train block's ``zero`` or a stage
    line's ``zero N``)."""
    default = program.train.zero if program.train is not None else 0
    return any((s.zero if s.zero is not None else default) >= degree for s in program.stages) or (
        default >= degree and not program.stages)


def _zero3_gathers(program: ir.Program) -> float:
    """ZeRO-3's parameter bytes gathered per iteration for each byte of fp32 gradient: in the precision
    (bf16/fp16 half of fp32), 2 gathers a layer per micro-batch (3 with recompute), once a step kept."""
    t = program.train
    per = 1 if t.zero_keep_gathered else t.micro_batches * (3 if t.recompute is ir.Recompute.FULL else 2)
    return per * (1 if t.precision is ir.Precision.FP32 else 0.5)


METHODS = ("closed", "devices")


class _Costing:
    """Predicted communication seconds of one iteration under a matrix.

    ``method``: ``closed`` counts the transfers' and tensor groups' link loads from the matrix's
    digits (``planc.placement.closed``: per matrix, work independent of the devices); ``devices``
    lays the stages out and walks every device (the reference the closed forms equal, bit for bit).
    """

    def __init__(self, program: ir.Program, param_bytes: dict[int, int] | None, honour_pinned: bool = True,
                 tensor_traffic=None, method: str = "closed"):
        if method not in METHODS:
            raise ValueError(f"unknown costing method {method!r} (one of {', '.join(METHODS)})")
        self.method = method
        self.program = program
        self.tensor_traffic = dict(tensor_traffic or {})   # stage -> (forward, backward) all-reduce bytes
        self.cluster = program.cluster
        self.fanouts = program.cluster.fanouts
        self.names = program.parallel.axis_names()
        self.sizes = tuple(a.size for a in program.parallel.axes)
        self.honour_pinned = honour_pinned   # False: cost pinned programs as if synthesized
        self.net = Network(program.cluster)
        self.reductions = []
        rows_of = {n: i for i, n in enumerate(self.names)}
        for red in program.reductions:
            if not red.axes or not all(a in self.names for a in red.axes):
                continue  # explicit-stage reductions over mesh names the matrix does not decide
            syn = program.synthesis
            if red.mode is ir.ReductionMode.ALLREDUCE:
                # A one-instruction program of allreduce is exactly the flat AllReduce.
                syn = ir.Synthesis(max_size=1, collectives=(ir.Collective.ALLREDUCE,))
            pinned = red.program if red.mode is ir.ReductionMode.PROGRAM else None
            rows = tuple(sorted({rows_of[a] for a in red.axes}))
            nbytes = _reduction_bytes(red, param_bytes)
            gathered = nbytes * _zero3_gathers(program) / 2 if red.name == "gradients" and red.shape is None and \
                _zero2(program, 3) else 0
            if red.name == "gradients" and red.shape is None and _zero2(program):
                nbytes *= program.train.micro_batches   # ZeRO-2 and 3 reduce-scatter every micro-batch's gradient
            self.reductions.append((red.name, tuple(red.axes), nbytes, syn, pinned, rows))
            if gathered:   # ZeRO-3's per-layer gathers: half an all-reduce of their bytes (a ring all-gather's)
                self.reductions.append(("parameters (zero 3 gathers)", tuple(red.axes), gathered, syn, None, rows))
        self.cache: dict[Matrix, float] = {}
        self.parts: dict[Matrix, tuple[tuple[str, float], ...]] = {}

    def __call__(self, matrix: Matrix) -> float:
        hit = self.cache.get(matrix)
        if hit is not None:
            return hit
        parts = []
        for name, axes, nbytes, syn, pinned, rows in self.reductions:
            if pinned is not None and self.honour_pinned:
                t = pinned_time(self.cluster, matrix, self.names, axes, pinned, nbytes)
                if t is None:           # the pinned program is not valid under this matrix
                    self.cache[matrix] = math.inf
                    return math.inf
            else:
                # the best synthesized program; depends on the matrix only through its reduction factors
                coeffs = program_costs(self.cluster, reduction_factors(matrix, rows), syn)
                t = min(a * nbytes + b for a, b in coeffs)
            parts.append((f"reduce {name}", t))
        if (self.program.transfers or self.tensor_traffic) and self.method == "closed" and closed.applies(self.program):
            self._closed_parts(matrix, parts)
        elif self.program.transfers or self.tensor_traffic:
            coords = coords_for(matrix, self.fanouts, self.sizes)
            layouts = stage_layouts(self.program, coords)
            if self.program.transfers:
                parts.append(("transfers", self.transfer_time(layouts)))
            if self.tensor_traffic:
                parts.append(("tensor traffic", max(r["predicted"] for r in self.tensor_records(layouts))))
        t = 0.0
        for _, sec in parts:
            t += sec
        self.cache[matrix] = t
        self.parts[matrix] = tuple(parts)
        return t

    def _closed_parts(self, matrix: Matrix, parts: list) -> None:
        """The parts ``transfers`` and ``tensor traffic`` from the matrix's digits (same floats)."""
        if self.program.transfers:
            t = closed.transfer_time(self.program, self.net, matrix, self._region)
            if t is None:   # a transfer inside one stage: walk the devices
                t = self.transfer_time(stage_layouts(self.program, coords_for(matrix, self.fanouts, self.sizes)))
            parts.append(("transfers", t))
        if self.tensor_traffic:
            parts.append(("tensor traffic", max(closed.tensor_predictions(
                self.program, self.net, self.tensor_traffic, matrix))))

    def _region(self, tr: ir.Transfer) -> float:
        """One destination device's bytes of ``tr`` (every derived stage has the same mesh shape)."""
        shape, _ = ir.derived_mesh(self.program.parallel)
        return tr.nbytes / math.prod(parts_per_dim(shape, tr.dst_spec))

    def key(self, matrix: Matrix) -> tuple[tuple[int, ...], ...]:
        """What the reduction parts of the cost depend on: each reduction's per-level factors."""
        return tuple(reduction_factors(matrix, r[5]) for r in self.reductions)

    def bound(self, key: tuple[tuple[int, ...], ...]) -> float:
        """A lower bound on the cost of every matrix with these reduction factors (docs/placement.md):
        the sum of each reduction's :func:`reduction_lower_bound`; transfers and tensor traffic >= 0."""
        total = 0.0
        for (_, _, nbytes, _, _, _), factors in zip(self.reductions, key):
            total += reduction_lower_bound(self.cluster, factors, nbytes)
        return total * (1 - BOUND_SLACK)

    def tensor_records(self, stages: tuple[ir.StageLayout, ...]) -> list[dict]:
        return tensor_records(self.program, self.net, self.tensor_traffic, stages)

    def transfer_time(self, stages: tuple[ir.StageLayout, ...]) -> float:
        """Each destination device pulls its region from the nearest source device, forward and backward."""
        by_index = {s.index: s for s in stages}
        total = 0.0
        for tr in self.program.transfers:
            src, dst = by_index.get(tr.src_stage), by_index.get(tr.dst_stage)
            if src is None or dst is None or not src.devices:
                continue
            nearest: dict[tuple[int, ...], int] = {}
            for d in src.devices:  # deepest shared prefix → lowest source id under it
                c = level_coords(d, self.fanouts)
                for k in range(len(c) + 1):
                    key = c[:k]
                    if key not in nearest or d < nearest[key]:
                        nearest[key] = d
            region = _region_bytes(tr.nbytes, tr.dst_spec, dst)
            flows = []
            for d in dst.devices:
                c = level_coords(d, self.fanouts)
                for k in range(len(c), -1, -1):
                    if c[:k] in nearest:
                        flows.append((nearest[c[:k]], d, region))
                        break
            total += self.net.flows_time(flows) * self.program.train.micro_batches * 2
        return total


def tensor_records(program: ir.Program, net: Network, traffic, stages: tuple[ir.StageLayout, ...]) -> list[dict]:
    """Per tensor-parallel stage of ``traffic`` (stage -> (forward, backward) all-reduce bytes per
    micro-batch): its tensor groups in these layouts and the predicted seconds of its all-reduces over
    one iteration (a flat allreduce on every group at once, as the runtime issues them). Stages run at
    once, so the slowest stage's time is the iteration's."""
    by_index = {s.index: s for s in stages}
    m = program.train.micro_batches if program.train is not None else 1
    out = []
    for s, (fwd, bwd) in sorted((traffic or {}).items()):
        st = by_index.get(s)
        if st is None:
            continue
        groups = tuple(g for g in stage_reduction_groups((st,), (ir.MeshAxis.TENSOR,)) if len(g) > 1)
        a, b = step_coefficients(net, ir.Collective.ALLREDUCE, groups) if groups else (0.0, 0.0)
        ops = tuple(fwd) + tuple(bwd)
        out.append({"stage": s, "groups": [list(g) for g in groups],
                    "forward": {"all_reduces": len(fwd), "bytes": sum(fwd)},
                    "backward": {"all_reduces": len(bwd), "bytes": sum(bwd)},
                    "bytes_per_micro_batch": sum(ops), "micro_batches": m,
                    "predicted": m * (a * sum(ops) + b * len(ops))})
    return out


def _rank(evaluated: dict[Matrix, float]) -> tuple[tuple[Matrix, float], ...]:
    """Best first, at most MAX_RANKED; matrices that cannot run a pinned program are left out."""
    best = sorted(((m, t) for m, t in evaluated.items() if math.isfinite(t)), key=lambda kv: (kv[1], kv[0]))
    return tuple(best[:MAX_RANKED])


def _branch_and_bound(cost: _Costing, fanouts: tuple[int, ...], sizes: tuple[int, ...]
                      ) -> tuple[dict[Matrix, float], bool]:
    """Cost every matrix that can be among the ``MAX_RANKED`` best; return the table and whether
    every matrix was costed.

    Matrices are grouped by what their reduction costs depend on (:meth:`_Costing.key`); groups
    are visited in increasing lower bound, and once ``MAX_RANKED`` finite costs are known, a group
    whose bound exceeds the ``MAX_RANKED``-th best cannot contain a ranked matrix (its every
    matrix costs at least the bound), nor can any later group. Every matrix of a visited group is
    costed. Equal costs are never pruned (``>``, not ``>=``), so ties break exactly as in full
    enumeration.
    """
    groups: dict[tuple, list[Matrix]] = {}
    for mx in enumerate_matrices(fanouts, sizes):
        groups.setdefault(cost.key(mx), []).append(mx)
    order = sorted(groups, key=lambda k: (cost.bound(k), k))
    table: dict[Matrix, float] = {}
    best: list[float] = []     # the MAX_RANKED smallest finite costs so far, ascending

    def cutoff() -> float:
        return best[-1] if len(best) >= MAX_RANKED else math.inf

    complete = True
    for key in order:
        if cost.bound(key) > cutoff():
            complete = False
            break
        for mx in groups[key]:
            t = cost(mx)
            table[mx] = t
            if math.isfinite(t) and t <= cutoff():
                bisect.insort(best, t)
                del best[MAX_RANKED:]
    return table, complete


def warm(program: ir.Program, stop=lambda: False) -> int:
    """Synthesize ahead of ranking the reduction programs ranking costs (``program_costs``, cached by
    exactly what it depends on: cluster, reduction factors, synthesis settings; no bytes, no stage cut)
    for the matrices' reduction factors in the order branch and bound visits them at nominal bytes,
    until ``stop()`` is true; how many it synthesized. The compiler runs it while the model probe's
    subprocess runs (``planc.driver.compile.compile_file``). It changes no result: a cached answer is the
    answer a fresh call gives, and ranking itself decides what to cost, with the probe's bytes."""
    par = program.parallel
    if par is None or program.stage_mode is ir.StageMode.EXPLICIT or par.matrix is not None:
        return 0
    cost = _Costing(program, None)
    keys = {cost.key(mx) for mx in enumerate_matrices(program.cluster.fanouts, tuple(a.size for a in par.axes))}
    done = 0
    for key in sorted(keys, key=lambda k: (cost.bound(k), k)):
        for (_, _, _, syn, pinned, _), factors in zip(cost.reductions, key):
            if stop():
                return done
            if pinned is None:
                program_costs(cost.cluster, factors, syn)
                done += 1
    return done


def place(program: ir.Program, param_bytes: dict[int, int] | None = None, *,
          tensor_traffic=None, method: str = "closed") -> Placement:
    """Choose the parallelism matrix and lay out devices and stages (a pure pass).

    ``param_bytes`` maps a stage index to its parameter-gradient bytes; it
    sizes ``reduce gradients`` (the largest stage's, as the reduction pass does) when ranking.
    ``tensor_traffic`` maps a stage index to ``(forward, backward)``, the bytes of each all-reduce
    one device of it issues over its tensor group per micro-batch (measured by the probe); it is
    costed as the part ``tensor traffic`` of every matrix, with no declaration in the plan.
    ``method`` (``closed`` or ``devices``) picks how ranking counts those two parts (:class:`_Costing`);
    both give the same placement.
    """
    par = program.parallel
    if par is None or program.stage_mode is ir.StageMode.EXPLICIT:
        # explicit meshes fix every device's role: there is no matrix to choose (docs/placement.md)
        layouts = stage_layouts(program, ())
        records = tensor_records(program, Network(program.cluster), tensor_traffic, layouts)
        return Placement(None, 0, (), (), layouts, tensor_traffic=tuple(records))
    fanouts = program.cluster.fanouts
    sizes = tuple(a.size for a in par.axes)
    axes = tuple((a.name, a.size) for a in par.axes)
    candidates = count_matrices(fanouts, sizes)
    cost = _Costing(program, param_bytes, tensor_traffic=tensor_traffic, method=method)

    if par.matrix is not None:
        matrix = tuple(tuple(r) for r in par.matrix)
        problems = matrix_problems(matrix, fanouts, sizes)
        if problems:
            raise PlanError([Diagnostic(f"the pinned placement matrix is not valid: {p}", par.span)
                             for p in problems])
        t = cost(matrix)
        if not math.isfinite(t):    # the reduction pass explains why the pinned program cannot run here
            cost = _Costing(program, param_bytes, honour_pinned=False, tensor_traffic=tensor_traffic, method=method)
            t = cost(matrix)
        ranked = ((matrix, t),)
        search, evaluated = "pinned", 1
    else:
        if candidates == 0:
            raise PlanError(Diagnostic("no parallelism matrix fits these axes on this cluster", par.span))
        table, complete = _branch_and_bound(cost, fanouts, sizes)
        search = "exhaustive" if complete else "branch_and_bound"
        ranked = _rank(table)
        if not ranked:
            # no matrix admits the pinned program(s): rank as if synthesized, and let the
            # reduction pass explain, for the best matrix, which step fails and why
            cost = _Costing(program, param_bytes, honour_pinned=False, tensor_traffic=tensor_traffic, method=method)
            table = {mx: cost(mx) for mx in table}
            ranked = _rank(table)
        matrix = ranked[0][0]
        evaluated = len(table)

    coords = coords_for(matrix, fanouts, sizes)
    breakdown = tuple(cost.parts[m] for m, _ in ranked)
    layouts = stage_layouts(program, coords)
    return Placement(matrix, candidates, ranked, coords, layouts,
                     axes, search, evaluated, breakdown, tuple(cost.tensor_records(layouts)))
