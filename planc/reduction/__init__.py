"""Reduction planning: P² reduction-program synthesis, lowering and ranking.

Entry points: :func:`plan_reductions` (the compiler pass), :func:`plan_reduction`
(one reduction on explicit groups), :func:`best_time` (cheap, for placement
ranking) and :func:`reduction_groups` / :func:`stage_reduction_groups`. With
``train { zero = 1 }`` the gradients get ZeRO-1's pair of programs instead
(``zero.plan_zero``: a reduce-scatter of the gradients, an all-gather of the
parameters). See docs/reduction.md.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Mapping, Sequence

from planc import ir
from planc.cost import Network, collective_time
from planc.reduction import check
from planc.reduction.costs import (TIE_ABSOLUTE, TIE_RELATIVE, groups_of as _groups_of,  # noqa: F401
                                   hierarchy_coefficients as _program_coefficients, lowered as _lowered,
                                   program_coefficients, rank_programs)
from planc.reduction.hierarchy import (Hierarchy, hierarchy_from_matrix, layout_for, matrix_positions)
from planc.reduction.language import parse_program
from planc.reduction.lower import LoweringError, lower_program, resolve
from planc.reduction.pinned import validate_pinned as _validate_pinned
from planc.reduction.plan import MAX_ALTERNATIVES, ReductionPlan
from planc.reduction.synthesize import synthesize
from planc.reduction.tied import plan_tied as _plan_tied
from planc.reduction.zero import PARAMETERS, plan_zero

__all__ = [
    "ReductionPlan", "plan_reduction", "plan_reductions", "best_time", "reduction_groups",
    "stage_reduction_groups", "Hierarchy", "hierarchy_from_matrix", "synthesize", "parse_program",
    "FLAT_ALLREDUCE", "reduction_bytes", "pinned_time", "rank_programs", "TIE_RELATIVE", "resolve",
    "program_coefficients", "plan_zero", "PARAMETERS", "plan_tied", "stage_zero",
]

Groups = tuple[tuple[int, ...], ...]
FLAT_ALLREDUCE = (ir.Instruction(ir.Collective.ALLREDUCE, ir.ROOT_LEVEL, ir.FormKind.INSIDE),)


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


# ---------------------------------------------------------------- one reduction

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
                  per_stage_bytes=per_stage_bytes, stage=stage, mode=reduction.mode)
    if not groups:  # nothing to reduce (reduction axes of size 1)
        return ReductionPlan(program=(), steps=(), predicted=0.0, allreduce_predicted=0.0,
                             candidates=0, **common)
    hierarchy, positions, regular = layout_for(cluster, groups, layout)
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

    With ``train { zero = 1 }`` (or 2; per stage: ``stage I ... zero N``, where stages differ in whether
    they shard each gets its own plan) every gradients plan above becomes ZeRO-1's pair
    (``zero.plan_zero``): the ``gradients`` reduce-scatter, then the ``parameters``
    all-gather over the same groups (per stage for explicit stages).
    """
    cluster = program.cluster
    explicit = program.stage_mode is ir.StageMode.EXPLICIT or coords is None or program.parallel is None
    axis_names = program.parallel.axis_names() if program.parallel is not None else ()
    out: list[ReductionPlan] = []
    zero = stage_zero(program, stages)
    # stages that differ in whether they shard (zero 0 against 1 or 2) get a plan each, as explicit stages do
    mixed = len({z > 0 for z in zero.values()}) > 1
    for red in program.reductions:
        # ZeRO-1/2 shard the gradients' optimizer: a reduce-scatter and an all-gather instead of an allreduce
        gradients = red.name == "gradients" and red.shape is None
        plan = plan_zero if gradients and any(zero.values()) else plan_reduction
        if (explicit or mixed) and gradients:
            sizes = param_bytes or {}
            for st in sorted(stages, key=lambda s: s.index):
                groups = stage_reduction_groups((st,), red.axes)
                plan = plan_zero if zero.get(st.index, 0) else plan_reduction
                _add(out, plan(cluster, red, groups, int(sizes.get(st.index, 0)), program.synthesis,
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
        _add(out, plan(cluster, red, groups, nbytes, program.synthesis, layout, per_stage))
    return tuple(out)


def stage_zero(program: ir.Program, stages: Sequence[ir.StageLayout]) -> dict[int, int]:
    """Each stage's ZeRO degree by index: its own (``stage I ... zero N``) or the train block's."""
    default = program.train.zero if program.train is not None else 0
    own = {s.index: s.zero for s in program.stages if s.zero is not None}
    return {st.index: own.get(st.index, default) for st in stages}


def _add(out: list, planned) -> None:
    """One plan, or ZeRO-1's pair (gradients then parameters), in that order."""
    out.extend(planned if isinstance(planned, tuple) else (planned,))


def plan_tied(program: ir.Program, stages: Sequence[ir.StageLayout], ties, n_layers: int,
              split=(), vocab=None) -> tuple[ReductionPlan, ...]:
    """The tied parameters' reductions (``reduction/tied.py``): one per parameter the probe found shared by
    layers of two stages or more (``ties``: the probe's ``(holders, numel)``), synthesized on the union of
    the holding stages' devices; a Hugging Face model's tied table split by vocabulary (``vocab``: plan.json's
    ``VocabSplit``), one per buffer layout of its pieces."""
    return _plan_tied(program, stages, ties, n_layers, plan_reduction, split, vocab)
