"""Reduction planning: P² reduction-program synthesis, lowering and ranking.

Entry points: :func:`plan_reductions` (the compiler pass), :func:`plan_reduction`
(one reduction on explicit groups), :func:`best_time` (cheap, for placement
ranking) and :func:`reduction_groups` / :func:`stage_reduction_groups`.
See docs/reduction.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping, Sequence

from planc import ir, plan as planfile
from planc.cost import Network, collective_time, held_after, step_coefficients
from planc.lang.errors import Diagnostic, PlanError, did_you_mean
from planc.reduction import check, semantics
from planc.reduction.hierarchy import (Hierarchy, group_positions, hierarchy_from_matrix,
                                       matrix_positions)
from planc.reduction.language import parse_program
from planc.reduction.regions import program_regions
from planc.reduction.lower import LoweringError, lower, lower_program, resolve
from planc.reduction.synthesize import synthesize

__all__ = [
    "ReductionPlan", "plan_reduction", "plan_reductions", "best_time", "reduction_groups",
    "stage_reduction_groups", "Hierarchy", "hierarchy_from_matrix", "synthesize", "parse_program",
    "FLAT_ALLREDUCE", "reduction_bytes", "pinned_time", "rank_programs", "TIE_RELATIVE", "resolve",
    "program_coefficients",
]

Groups = tuple[tuple[int, ...], ...]
FLAT_ALLREDUCE = (ir.Instruction(ir.Collective.ALLREDUCE, ir.ROOT_LEVEL, ir.FormKind.INSIDE),)
MAX_ALTERNATIVES = 10
# Predictions within this relative distance of the cheapest program of their tie class are equal
# for ranking (the cost model is far coarser; sums of the same terms in another order differ by ulps).
TIE_RELATIVE = 1e-9
TIE_ABSOLUTE = 1e-15     # seconds: predictions of zero-byte, zero-latency reductions all tie


@dataclass(frozen=True, slots=True)
class ReductionPlan:
    """The decision for one reduction; ``to_json`` is its plan.json entry."""

    name: str
    axes: tuple[str, ...]
    nbytes: int
    groups: Groups
    program: tuple[ir.Instruction, ...]
    steps: tuple[tuple[ir.Collective, Groups], ...]
    predicted: float
    allreduce_predicted: float
    candidates: int
    alternatives: tuple[tuple[str, float], ...] = ()
    hierarchy: Hierarchy = Hierarchy(())
    per_stage_bytes: tuple[tuple[int, int], ...] | None = None
    stage: int | None = None     # explicit stages: the stage whose gradients this plan reduces

    def __post_init__(self) -> None:
        if len(self.alternatives) > MAX_ALTERNATIVES:
            raise ValueError("at most 10 alternatives")
        if any(b[1] < a[1] for a, b in zip(self.alternatives, self.alternatives[1:])):
            raise ValueError(f"reduction plan {self.name!r}: alternatives not in non-decreasing predicted time")
        why = check.check_program([(str(c), g) for c, g in self.steps], self.groups)
        if self.groups and why is not None:
            where = "" if self.stage is None else f" (stage {self.stage})"
            raise ValueError(f"reduction plan {self.name!r}{where} does not reduce its groups: {why}")

    @property
    def text(self) -> str:
        return ir.program_text(self.program)

    def to_json(self) -> dict:
        out = {"name": self.name}
        if self.stage is not None:
            out["stage"] = self.stage
        unit, regions = program_regions(self.steps, self.groups)   # what the runtime executes
        out.update({
            "axes": list(self.axes),
            "bytes": self.nbytes,
            "groups": [list(g) for g in self.groups],
            "program": {
                "text": self.text,
                "unit": unit,
                "steps": [{"collective": str(c), "groups": [list(g) for g in gs],
                           "regions": [list(r) for r in rs]} for (c, gs), rs in zip(self.steps, regions)],
                "predicted": self.predicted,
            },
        })
        out.update(self._figures())
        return out

    def _figures(self) -> tuple[tuple[str, object], ...]:
        """What plan.json carries beyond the program the runtime runs: the ranking's figures, in order."""
        out = (("allreduce_predicted", self.allreduce_predicted), ("candidates", self.candidates),
               ("alternatives", [{"text": t, "predicted": p} for t, p in self.alternatives]),
               ("hierarchy", [{"name": n, "factor": f} for n, f in self.hierarchy.levels]))
        if self.per_stage_bytes is not None:
            out += (("per_stage_bytes", [{"stage": s, "bytes": b} for s, b in self.per_stage_bytes]),)
        return out

    def record(self, mode: ir.ReductionMode, collectives) -> planfile.Reduction:
        """The plan file's entry (``planc.plan.Reduction``): the typed steps with their regions
        (``planc.reduction.regions``); the ranking's figures and the ``collectives`` the synthesis
        could use in ``extra`` (plan.json carries them; the runtime does not read them)."""
        unit, regions = program_regions(self.steps, self.groups)
        steps = tuple(planfile.Step(c, tuple(tuple(g) for g in gs), tuple(tuple(r) for r in rs))
                      for (c, gs), rs in zip(self.steps, regions))
        return planfile.Reduction(self.name, tuple(self.axes), self.nbytes, tuple(tuple(g) for g in self.groups),
                                  self.text, steps, self.predicted, planfile.ReductionMode(mode), unit, self.stage,
                                  self._figures() + (("collectives", [str(c) for c in collectives]),))


# ---------------------------------------------------------------- reduction groups

def reduction_groups(coords: Sequence[Sequence[int] | None], axis_names: Sequence[str],
                     reduction_axes: Sequence[str]) -> Groups:
    """Devices equal on every non-reduction axis form a group (``coords[d]`` in axis order; None = idle)."""
    red = {list(axis_names).index(a) for a in reduction_axes}
    buckets: dict[tuple, list[int]] = {}
    for d, c in enumerate(coords):
        if c is None:
            continue
        key = tuple(x for i, x in enumerate(c) if i not in red)
        buckets.setdefault(key, []).append(d)
    return tuple(sorted(tuple(sorted(g)) for g in buckets.values()))


def stage_reduction_groups(stages: Sequence[ir.StageLayout], reduction_axes: Sequence[str]) -> Groups:
    """Explicit stages: in each stage, devices equal on every other mesh dimension.

    A stage without one of the axes reduces over those it has (over none: no group).
    """
    out = []
    for st in stages:
        red = {i for i, a in enumerate(st.axes) if a in reduction_axes}
        buckets: dict[tuple, list[int]] = {}
        for d in st.devices:
            pos = st.position(d)
            buckets.setdefault(tuple(x for i, x in enumerate(pos) if i not in red), []).append(d)
        out.extend(tuple(sorted(g)) for g in buckets.values())
    return tuple(sorted(out))


# ---------------------------------------------------------------- costs

_STEP_CACHE: dict[tuple, tuple[float, float]] = {}
_STEP_CACHE_DEVICES = 1 << 22    # bound on the devices listed in the keys (memory)
_step_cache_devices = 0


def _step_coefficients(net: Network, collective: ir.Collective, groups: Groups) -> tuple[float, float]:
    """:func:`step_coefficients`, cached across matrices by the exact lowered groups.

    Different matrices often lower an instruction to the same groups; the
    cost depends only on the cluster, the collective and the groups.
    """
    global _step_cache_devices
    key = (net.cluster, collective, groups)
    hit = _STEP_CACHE.get(key)
    if hit is None:
        hit = step_coefficients(net, collective, groups)
        n = sum(len(g) for g in groups)
        if _step_cache_devices + n > _STEP_CACHE_DEVICES:
            _STEP_CACHE.clear()
            _step_cache_devices = 0
        _STEP_CACHE[key] = hit
        _step_cache_devices += n
    return hit


def _program_coefficients(net: Network, hierarchy: Hierarchy, positions, programs, cache: dict
                          ) -> list[tuple[float, float]]:
    """Per program ``(a, b)`` with predicted time ``a·S + b`` for S bytes.

    Every cost term is linear in the held size, so one evaluation per
    instruction (:func:`step_coefficients`, = the times at 1 and 0 bytes)
    serves every program and every size. An instruction's groups depend only
    on its slice and form, not on its collective, so they are lowered once
    per ``(slice, form level, master?)``.
    """
    groups_of: dict[tuple, tuple] = cache.setdefault("groups", {})

    def step(instr):
        s, t = resolve(instr, hierarchy)
        key = (s, t, instr.form is ir.FormKind.MASTER)
        groups = groups_of.get(key)
        if groups is None:
            groups = groups_of[key] = lower(instr, hierarchy, positions)
        bw, lat = _step_coefficients(net, instr.collective, groups)
        return bw, lat, len(groups[0])

    return program_coefficients(programs, step, cache)


def program_coefficients(programs, step, memo: dict | None = None) -> list[tuple[float, float]]:
    """Per program ``(a, b)``, its time ``a·S + b`` for S bytes: over its instructions, each step's
    bandwidth coefficient times the fraction of S held at that step, plus its latency.
    ``step(instr)`` gives an instruction's ``(bandwidth coefficient, latency, group size)``; it is
    called once per instruction (memoised in ``memo``, shared across calls when given)."""
    memo = {} if memo is None else memo
    out = []
    for program in programs:
        a = b = 0.0
        frac = 1.0
        for instr in program:
            hit = memo.get(instr)
            if hit is None:
                hit = memo[instr] = step(instr)
            bw, lat, k = hit
            a += frac * bw
            b += lat
            frac = held_after(instr.collective, k, frac)
        out.append((a, b))
    return out


@lru_cache(maxsize=1024)
def _matrix_costs(cluster: ir.Cluster, matrix, axis_names, reduction_axes, synthesis: ir.Synthesis):
    hier, positions = matrix_positions(cluster, matrix, axis_names, reduction_axes)
    if hier.size < 2:
        return ((0.0, 0.0),)
    programs = synthesize(hier, synthesis.max_size, synthesis.collectives) or FLAT_ALLREDUCE_ONLY
    return tuple(_program_coefficients(Network(cluster), hier, positions, programs, {}))


FLAT_ALLREDUCE_ONLY = (FLAT_ALLREDUCE,)


def best_time(cluster: ir.Cluster, matrix: Sequence[Sequence[int]], axis_names: Sequence[str],
              reduction_axes: Sequence[str], nbytes: float, synthesis: ir.Synthesis = ir.Synthesis()) -> float:
    """Predicted time of the best synthesized program for a matrix (cached; cheap per call)."""
    coeffs = _matrix_costs(cluster, tuple(tuple(r) for r in matrix), tuple(axis_names),
                           tuple(reduction_axes), synthesis)
    return min(a * nbytes + b for a, b in coeffs)


def _lowered(program, hierarchy: Hierarchy, positions, cache: dict) -> tuple:
    """:func:`lower_program` with the groups :func:`_program_coefficients` lowered reused from ``cache``."""
    groups_of = cache.setdefault("groups", {})
    out = []
    for instr in program:
        s, t = resolve(instr, hierarchy)
        key = (s, t, instr.form is ir.FormKind.MASTER)
        groups = groups_of.get(key)
        if groups is None:
            groups = groups_of[key] = lower(instr, hierarchy, positions)
        out.append((instr.collective, groups))
    return tuple(out)


def _groups_of(positions) -> Groups:
    by_gid: dict[int, list[int]] = {}
    for d, (gid, _) in positions.items():
        by_gid.setdefault(gid, []).append(d)
    return tuple(sorted(tuple(sorted(g)) for g in by_gid.values()))


@lru_cache(maxsize=4096)
def _pinned_costs(cluster: ir.Cluster, matrix, axis_names, reduction_axes, program: tuple[ir.Instruction, ...]):
    hier, positions = matrix_positions(cluster, matrix, axis_names, reduction_axes)
    if hier.size < 2:
        return (0.0, 0.0)
    try:
        steps = lower_program(program, hier, positions)
    except (LoweringError, KeyError, ValueError):
        return None
    if check.check_program([(str(c), g) for c, g in steps], _groups_of(positions)) is not None:
        return None
    return _program_coefficients(Network(cluster), hier, positions, (program,), {})[0]


def pinned_time(cluster: ir.Cluster, matrix: Sequence[Sequence[int]], axis_names: Sequence[str],
                reduction_axes: Sequence[str], program: Sequence[ir.Instruction], nbytes: float) -> float | None:
    """Predicted time of a pinned program under a matrix; None when it is not valid there."""
    coeffs = _pinned_costs(cluster, tuple(tuple(r) for r in matrix), tuple(axis_names), tuple(reduction_axes),
                           tuple(program))
    return None if coeffs is None else coeffs[0] * nbytes + coeffs[1]


# ---------------------------------------------------------------- ranking

def rank_programs(programs: Sequence[Sequence[ir.Instruction]], predictions: Sequence[float]
                  ) -> list[tuple[int, float]]:
    """``(index, rounded prediction)`` of every program, best first: a total, deterministic order.

    Predictions are rounded to tie classes: the cheapest prediction not yet in a class opens one,
    and every prediction within ``TIE_RELATIVE`` of it (relative; plus ``TIE_ABSOLUTE``) joins it,
    with that cheapest prediction as its rounded value. Programs are ordered by rounded
    prediction, then length (shorter first), then program text. So the order is non-decreasing
    in the rounded prediction, predictions that differ by float noise always tie (a class spans
    ``TIE_RELATIVE`` from its cheapest member, not a fixed grid whose boundaries noise can
    straddle), and a later program's prediction is never below an earlier one's by more than
    ``TIE_RELATIVE`` of it.
    """
    texts = [ir.program_text(p) for p in programs]
    by_value = sorted(range(len(programs)), key=lambda i: (predictions[i], len(programs[i]), texts[i]))
    rounded: dict[int, float] = {}
    lead: float | None = None
    for i in by_value:
        p = predictions[i]
        if lead is None or p > lead + TIE_RELATIVE * abs(lead) + TIE_ABSOLUTE:
            lead = p
        rounded[i] = lead
    order = sorted(range(len(programs)), key=lambda i: (rounded[i], len(programs[i]), texts[i]))
    return [(i, rounded[i]) for i in order]


# ---------------------------------------------------------------- one reduction

def _invalid(reduction: ir.Reduction, reason: str, hint: str | None = None, stage: int | None = None) -> PlanError:
    where = "" if stage is None else f" on stage {stage}"
    return PlanError(Diagnostic(f"reduction program for '{reduction.name}' is invalid{where}: {reason}",
                                reduction.program_span, hint))


def _validate_pinned(reduction: ir.Reduction, hierarchy: Hierarchy, positions, groups: Groups,
                     stage: int | None = None):
    program = reduction.program or ()
    if not program:
        raise _invalid(reduction, "the program is empty", stage=stage)
    for i, instr in enumerate(program, 1):
        try:
            resolve(instr, hierarchy)
        except LoweringError as e:
            bad = instr.slice if instr.slice not in hierarchy.names else instr.form_level
            hint = did_you_mean(bad, hierarchy.names) if bad not in hierarchy.names else None
            if stage is not None and hint is None:
                hint = ("every stage runs the pinned program on its own reduction groups; without `using`, "
                        "planc synthesizes a program for each stage")
            raise _invalid(reduction, f"step {i} {instr}: {e.reason}", hint, stage) from None
    try:
        steps = lower_program(program, hierarchy, positions)
        semantics.run(steps, groups)
    except (LoweringError, semantics.SemanticsError) as e:
        raise _invalid(reduction, e.reason, stage=stage) from None
    return steps


def plan_reduction(cluster: ir.Cluster, reduction: ir.Reduction, groups: Sequence[Sequence[int]],
                   nbytes: int, synthesis: ir.Synthesis = ir.Synthesis(),
                   layout: tuple[Hierarchy, Mapping[int, tuple[int, tuple[int, ...]]]] | None = None,
                   per_stage_bytes: tuple[tuple[int, int], ...] | None = None,
                   stage: int | None = None) -> ReductionPlan:
    """Plan one reduction over explicit reduction groups.

    ``layout`` (hierarchy, positions) comes from the matrix when there is one;
    otherwise it is derived from the groups' geometry. Irregular groups get
    the root-only hierarchy: synthesis then offers the flat allreduce only,
    and a pinned program may use only ``slice=root``. ``stage`` (explicit
    stages: the groups are that stage's) is recorded and named in errors.
    Programs are ranked by :func:`rank_programs`.
    """
    groups = tuple(sorted(tuple(sorted(g)) for g in groups if len(g) > 1))
    net = Network(cluster)
    common = dict(name=reduction.name, axes=tuple(reduction.axes), nbytes=int(nbytes), groups=groups,
                  per_stage_bytes=per_stage_bytes, stage=stage)
    if not groups:  # nothing to reduce (reduction axes of size 1)
        return ReductionPlan(program=(), steps=(), predicted=0.0, allreduce_predicted=0.0,
                             candidates=0, **common)
    regular = True
    if layout is None:
        layout = group_positions(cluster, groups)
        if layout is None:
            regular = False
            layout = (Hierarchy(()), {d: (gid, ()) for gid, g in enumerate(groups) for d in g})
    hierarchy, positions = layout
    flat_time = collective_time(net, ir.Collective.ALLREDUCE, groups, nbytes)
    common["hierarchy"] = hierarchy
    if reduction.mode is ir.ReductionMode.ALLREDUCE:
        return ReductionPlan(program=FLAT_ALLREDUCE, steps=((ir.Collective.ALLREDUCE, groups),),
                             predicted=flat_time, allreduce_predicted=flat_time, candidates=1, **common)
    if reduction.mode is ir.ReductionMode.PROGRAM:
        steps = _validate_pinned(reduction, hierarchy, positions, groups, stage)
        (a, b), = _program_coefficients(net, hierarchy, positions, [reduction.program], {})
        return ReductionPlan(program=tuple(reduction.program), steps=steps, predicted=a * nbytes + b,
                             allreduce_predicted=flat_time, candidates=1, **common)
    programs = synthesize(hierarchy, synthesis.max_size, synthesis.collectives) if regular else ()
    programs = tuple(p for p in programs) or FLAT_ALLREDUCE_ONLY
    cache: dict = {}
    coeffs = _program_coefficients(net, hierarchy, positions, programs, cache)
    # ties (within TIE_RELATIVE, below the model's precision) go to the shorter program, then by text
    order = [i for i, _ in rank_programs(programs, [a * nbytes + b for a, b in coeffs])]
    chosen = programs[order[0]]
    steps = _lowered(chosen, hierarchy, positions, cache)
    seen = {steps}
    alternatives = []
    # Alternatives are re-checked on the first reduction group (lowering repeats the same groups
    # over every reduction group); the chosen program is checked on all of them (ReductionPlan).
    first = set(groups[0])
    for i in order[1:]:
        if len(alternatives) == MAX_ALTERNATIVES:
            break
        alt_steps = _lowered(programs[i], hierarchy, positions, cache)
        if alt_steps in seen:
            continue
        seen.add(alt_steps)
        why = check.check_program([(str(c), tuple(g for g in gs if g[0] in first)) for c, gs in alt_steps],
                                  groups[:1])
        if why is not None:
            raise AssertionError(f"alternative {ir.program_text(programs[i])} fails the checker: {why}")
        alternatives.append((coeffs[i][0] * nbytes + coeffs[i][1], len(programs[i]), ir.program_text(programs[i])))
    # the ranking's tie classes may order predictions that differ by float noise either way; plan.json
    # lists the alternatives by their predicted time as written, exact ties shorter first, then by text
    alternatives.sort()
    a, b = coeffs[order[0]]
    return ReductionPlan(program=chosen, steps=steps, predicted=a * nbytes + b, allreduce_predicted=flat_time,
                         candidates=len(programs), alternatives=tuple((t, p) for p, _, t in alternatives), **common)


# ---------------------------------------------------------------- all reductions of a program

def reduction_bytes(reduction: ir.Reduction, param_bytes: Mapping[int, int] | None) -> int | None:
    """Bytes each group reduces, or None when unknown.

    A standalone reduction: its declared tensor. Gradients: the largest stage's
    parameter bytes, since every stage reduces its own at the same time.
    """
    if reduction.shape is not None and reduction.dtype is not None:
        return math.prod(reduction.shape) * ir.DTYPE_BYTES[reduction.dtype]
    if reduction.name == "gradients" and param_bytes:
        return max(param_bytes.values())
    return None


def plan_reductions(program: ir.Program, coords: Sequence[Sequence[int] | None] | None,
                    stages: Sequence[ir.StageLayout], matrix: Sequence[Sequence[int]] | None,
                    param_bytes: Mapping[int, int] | None = None) -> tuple[ReductionPlan, ...]:
    """Plan every reduction of ``program``, in declaration order.

    Gradients are reduced per stage (each reduction group lies in one stage).

    * Explicit stages (or no coords / no ``parallel``): stages may differ in
      size and shape, so ``reduce gradients`` yields one :class:`ReductionPlan`
      per stage, in stage order (``stage`` set): that stage's groups, its
      parameter bytes (``param_bytes[stage index]``; 0 when unknown) and a
      program synthesized on its own geometry. A stage with nothing to reduce
      (groups of one) gets an entry with no groups. A pinned program (or
      ``using allreduce``) applies to every stage; one invalid on a stage is
      an error naming the stage.
    * Pipe-axis stages: one plan whose program all stages use; ``bytes`` is the
      largest stage's parameter bytes and the prediction is that program on
      every group with that size (conservative); the per-stage sizes are
      listed in ``per_stage_bytes``.

    Standalone reductions (a declared shape) are one plan each.
    """
    cluster = program.cluster
    explicit = program.stage_mode is ir.StageMode.EXPLICIT or coords is None or program.parallel is None
    axis_names = program.parallel.axis_names() if program.parallel is not None else ()
    out = []
    for red in program.reductions:
        if explicit and red.name == "gradients" and red.shape is None:
            sizes = param_bytes or {}
            for st in sorted(stages, key=lambda s: s.index):
                groups = stage_reduction_groups((st,), red.axes)
                out.append(plan_reduction(cluster, red, groups, int(sizes.get(st.index, 0)), program.synthesis,
                                          stage=st.index))
            continue
        if explicit:
            groups = stage_reduction_groups(stages, red.axes)
        else:
            groups = reduction_groups(coords, axis_names, red.axes)
        layout = None
        if matrix is not None and not explicit:
            hier, positions = matrix_positions(cluster, matrix, axis_names, red.axes)
            if _groups_of(positions) == groups:
                layout = (hier, positions)
        per_stage = None
        if red.name == "gradients" and red.shape is None:
            sizes = {st.index: int((param_bytes or {}).get(st.index, 0)) for st in stages}
            per_stage = tuple(sorted(sizes.items()))
            nbytes = reduction_bytes(red, sizes) or 0
        else:
            nbytes = reduction_bytes(red, None) or 0
        out.append(plan_reduction(cluster, red, groups, nbytes, program.synthesis, layout, per_stage))
    return tuple(out)
