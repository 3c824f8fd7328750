"""ZeRO-1's reduction programs: a reduce-scatter of the gradients and an all-gather of the parameters.

With ``train { zero = 1 }`` each member of a data group keeps the fp32 master weights and optimizer
state of its own piece of the flat buffer. The gradients' program must leave each member of a
reduction group its own 1/k of the sum (DESIGN.md, the *reduce-scatter* target; which member owns
which piece is the program's choice) and the parameters' program must start from exactly those
pieces and end with every member holding the whole buffer (the *all-gather* target).

:func:`plan_zero` plans the pair for one set of reduction groups:

* synthesized (the default): every reduce-scatter program up to ``synthesis.max_size``
  (``synthesize_reduce_scatter``), for each its assignment and every all-gather program from it
  (``synthesize_all_gather``); pairs are ranked by the sum of their predictions (``rank_programs``),
  so a cheap reduce-scatter whose pieces only an expensive all-gather can return loses to the pair
  that is cheapest together;
* ``using allreduce``: the flat ``reduce_scatter(slice=root, form=inside)`` and ``all_gather(...)``;
* ``using PROGRAM``: the pinned program must meet the reduce-scatter target (a located error says
  which target it meets otherwise); its all-gather is synthesized from its pieces.

The flat pair is the baseline both plans record (``flat_predicted``). Both plans carry the same
``owned`` pieces and are written with the same unit (the lcm of the two programs'), so the runtime
pads a buffer identically for both.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from planc import ir
from planc.cost import Network, collective_time
from planc.diagnostics import Diagnostic, PlanError
from planc.reduction import check, semantics
from planc.reduction.costs import hierarchy_coefficients, lowered, rank_programs
from planc.reduction.hierarchy import Hierarchy, layout_for
from planc.reduction.lower import LoweringError, lower_program
from planc.reduction.pinned import validate_pinned
from planc.reduction.plan import MAX_ALTERNATIVES, Owned, ReductionPlan
from planc.reduction.regions import program_regions
from planc.reduction.synthesize import canonical_assignment, synthesize_all_gather, synthesize_reduce_scatter

__all__ = ["plan_zero", "FLAT_REDUCE_SCATTER", "FLAT_ALL_GATHER", "PARAMETERS", "mirror"]

C = ir.Collective
Groups = tuple[tuple[int, ...], ...]
Program = tuple[ir.Instruction, ...]
PARAMETERS = "parameters"     # the all-gather's name in plan.json (the gradients keep theirs)
FLAT_REDUCE_SCATTER = (ir.Instruction(C.REDUCE_SCATTER, ir.ROOT_LEVEL, ir.FormKind.INSIDE),)
FLAT_ALL_GATHER = (ir.Instruction(C.ALL_GATHER, ir.ROOT_LEVEL, ir.FormKind.INSIDE),)


def mirror(program: Program) -> Program | None:
    """The all-gather that undoes a reduce-scatter-only program: its steps reversed as all_gathers on the
    same slices and forms (each all_gather joins exactly the pieces the matching reduce_scatter cut);
    None when the program has another collective."""
    if not program or any(i.collective is not C.REDUCE_SCATTER for i in program):
        return None
    return tuple(ir.Instruction(C.ALL_GATHER, i.slice, i.form, i.form_level) for i in reversed(program))


class _Layout:
    """One set of reduction groups on its synthesis hierarchy, with its costs memoised."""

    def __init__(self, cluster: ir.Cluster, groups: Groups, layout, nbytes: int, synthesis: ir.Synthesis):
        self.net = Network(cluster)
        self.groups, self.nbytes, self.synthesis = groups, nbytes, synthesis
        self.hierarchy, self.positions, self.regular = layout_for(cluster, groups, layout)
        self.k = min(len(g) for g in groups)
        self.cache: dict = {}

    def predict(self, programs: Sequence[Program], start: float = 1.0) -> list[float]:
        coeffs = hierarchy_coefficients(self.net, self.hierarchy, self.positions, programs, self.cache, start)
        return [a * self.nbytes + b for a, b in coeffs]

    def steps(self, program: Program):
        return lowered(program, self.hierarchy, self.positions, self.cache)

    def owned(self, rs_steps) -> Owned:
        return semantics.assignment(semantics.run(rs_steps, self.groups, C.REDUCE_SCATTER), self.groups)

    def gathers(self, rs_program: Program, owned: Owned) -> list[tuple[Program, tuple]]:
        """Every all-gather program (with its lowered steps) that returns the buffer from ``owned``:
        synthesized on the canonical layout, else the mirror of ``rs_program``; each re-run on the
        real groups."""
        found: tuple[Program, ...] = ()
        if self.regular and self.hierarchy.size > 1:
            try:
                start = canonical_assignment(rs_program, self.hierarchy)
            except (LoweringError, semantics.SemanticsError):
                start = None
            if start is not None:
                found = synthesize_all_gather(self.hierarchy, start, self.synthesis.max_size,
                                              self.synthesis.collectives)
        if not found:
            back = mirror(rs_program)
            found = (back,) if back is not None else ()
        begin = semantics.assigned_state(self.groups, owned)
        out = []
        for program in found:
            try:
                steps = lower_program(program, self.hierarchy, self.positions)
                semantics.run(steps, self.groups, C.ALL_GATHER, begin)
            except (LoweringError, semantics.SemanticsError):
                continue
            out.append((program, steps))
        return out


def _empty(reduction: ir.Reduction, common: dict) -> tuple[ReductionPlan, ReductionPlan]:
    """Nothing to shard (data degree 1): both entries with no groups, as an allreduce would have."""
    return (ReductionPlan(name=reduction.name, program=(), steps=(), predicted=0.0, allreduce_predicted=0.0,
                          candidates=0, target=C.REDUCE_SCATTER, **common),
            ReductionPlan(name=PARAMETERS, program=(), steps=(), predicted=0.0, allreduce_predicted=0.0,
                          candidates=0, target=C.ALL_GATHER, **common))


def _alternatives(order, programs, steps_of, preds, chosen_steps, first_group, target, owned_first=None):
    """Up to MAX_ALTERNATIVES next programs (distinct lowered steps), re-checked on the first group,
    listed by their own prediction as written (exact ties: shorter first, then by text)."""
    seen = {chosen_steps}
    out = []
    first = set(first_group)
    for i in order:
        if len(out) == MAX_ALTERNATIVES:
            break
        steps = steps_of(i)
        if steps in seen:
            continue
        seen.add(steps)
        unit = owned = None
        if owned_first is not None:
            unit = math.lcm(*(x.denominator for ab in owned_first for x in ab))
            owned = [[(int(a * unit), int(b * unit)) for a, b in owned_first]]
        why = check.check_program([(str(c), tuple(g for g in gs if g[0] in first)) for c, gs in steps],
                                  [first_group], unit=unit, target=str(target), owned=owned)
        if why is not None:
            raise AssertionError(f"alternative {ir.program_text(programs[i])} fails the checker: {why}")
        out.append((preds[i], len(programs[i]), ir.program_text(programs[i])))
    out.sort()
    return tuple((t, p) for p, _, t in out)


def plan_zero(cluster: ir.Cluster, reduction: ir.Reduction, groups: Sequence[Sequence[int]], nbytes: int,
              synthesis: ir.Synthesis = ir.Synthesis(),
              layout: tuple[Hierarchy, Mapping[int, tuple[int, tuple[int, ...]]]] | None = None,
              per_stage_bytes: tuple[tuple[int, int], ...] | None = None,
              stage: int | None = None) -> tuple[ReductionPlan, ReductionPlan]:
    """ZeRO-1's pair for ``reduction`` (the gradients) over ``groups``: ``(reduce-scatter of the gradients,
    all-gather of the parameters)``, both ReductionPlans with the same groups, owned pieces and unit."""
    groups = tuple(sorted(tuple(sorted(g)) for g in groups if len(g) > 1))
    common = dict(axes=tuple(reduction.axes), nbytes=int(nbytes), groups=groups, per_stage_bytes=per_stage_bytes,
                  stage=stage, mode=reduction.mode)
    if not groups:
        return _empty(reduction, common)
    lay = _Layout(cluster, groups, layout, int(nbytes), synthesis)
    common["hierarchy"] = lay.hierarchy
    flat_rs = collective_time(lay.net, C.REDUCE_SCATTER, groups, nbytes)
    flat_ag = collective_time(lay.net, C.ALL_GATHER, groups, nbytes / lay.k)
    if reduction.mode is ir.ReductionMode.ALLREDUCE:
        rs_programs: tuple[Program, ...] = (FLAT_REDUCE_SCATTER,)
        rs_steps_list = [((C.REDUCE_SCATTER, groups),)]
    elif reduction.mode is ir.ReductionMode.PROGRAM:
        rs_steps_list = [validate_pinned(reduction, lay.hierarchy, lay.positions, groups, stage, C.REDUCE_SCATTER)]
        rs_programs = (tuple(reduction.program),)
    else:
        rs_programs = ((synthesize_reduce_scatter(lay.hierarchy, synthesis.max_size, synthesis.collectives)
                        if lay.regular and lay.hierarchy.size > 1 else ()) or (FLAT_REDUCE_SCATTER,))
        rs_steps_list = [lay.steps(p) for p in rs_programs]
    # the flat pair is its own baseline: its predictions are the flat times as computed above
    rs_preds = [flat_rs] if reduction.mode is ir.ReductionMode.ALLREDUCE else lay.predict(rs_programs)
    pairs = []   # per reduce-scatter program: (owned, [(ag program, steps)], ag predictions, ag order)
    totals = []
    for program, steps, pred in zip(rs_programs, rs_steps_list, rs_preds):
        owned = lay.owned(steps)
        if reduction.mode is ir.ReductionMode.ALLREDUCE:
            gathers = [(FLAT_ALL_GATHER, ((C.ALL_GATHER, groups),))]
        else:
            gathers = lay.gathers(program, owned)
        ag_preds = ([flat_ag] if reduction.mode is ir.ReductionMode.ALLREDUCE
                    else lay.predict([p for p, _ in gathers], 1 / lay.k))
        order = [i for i, _ in rank_programs([p for p, _ in gathers], ag_preds)]
        pairs.append((owned, gathers, ag_preds, order))
        totals.append(pred + ag_preds[order[0]] if gathers else math.inf)
    usable = [i for i, t in enumerate(totals) if t < math.inf]
    if not usable:
        raise PlanError(Diagnostic(
            f"with zero = 1 no all-gather program of at most {synthesis.max_size} steps returns the parameters "
            f"from the pieces the program for '{reduction.name}' leaves"
            + ("" if stage is None else f" on stage {stage}"),
            reduction.program_span if reduction.mode is ir.ReductionMode.PROGRAM else reduction.span,
            "raise synthesis { max_size } or pin a program that only reduce-scatters"))
    ranked = [usable[i] for i, _ in rank_programs([rs_programs[i] for i in usable], [totals[i] for i in usable])]
    best = ranked[0]
    owned, gathers, ag_preds, ag_order = pairs[best]
    rs_steps = rs_steps_list[best]
    ag_program, ag_steps = gathers[ag_order[0]]
    u_rs, _ = program_regions(rs_steps, groups)
    u_ag, _ = program_regions(ag_steps, groups, semantics.assigned_state(groups, owned))
    unit = math.lcm(u_rs, u_ag)
    rs_alts = _alternatives(ranked[1:], rs_programs, lambda i: rs_steps_list[i], rs_preds, rs_steps, groups[0],
                            C.REDUCE_SCATTER)
    ag_alts = _alternatives(ag_order[1:], [p for p, _ in gathers], lambda i: gathers[i][1], ag_preds, ag_steps,
                            groups[0], C.ALL_GATHER, owned[0])
    scatter = ReductionPlan(name=reduction.name, program=rs_programs[best], steps=rs_steps, predicted=rs_preds[best],
                            allreduce_predicted=flat_rs, candidates=len(rs_programs), alternatives=rs_alts,
                            target=C.REDUCE_SCATTER, owned=owned, unit=unit, **common)
    if reduction.mode is ir.ReductionMode.PROGRAM:   # only the gradients' program was pinned
        common["mode"] = ir.ReductionMode.SYNTHESIZE
    gather = ReductionPlan(name=PARAMETERS, program=ag_program, steps=ag_steps, predicted=ag_preds[ag_order[0]],
                           allreduce_predicted=flat_ag, candidates=len(gathers), alternatives=ag_alts,
                           target=C.ALL_GATHER, owned=owned, unit=unit, **common)
    return scatter, gather
