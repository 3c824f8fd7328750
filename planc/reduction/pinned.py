"""A pinned program (``reduce NAME over AXES using PROGRAM``) checked against its target, with located errors."""

from __future__ import annotations

from planc import ir
from planc.diagnostics import Diagnostic, PlanError, did_you_mean
from planc.reduction import semantics
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.lower import LoweringError, lower_program, resolve

__all__ = ["invalid", "validate_pinned"]

Groups = tuple[tuple[int, ...], ...]
C = ir.Collective


def invalid(reduction: ir.Reduction, reason: str, hint: str | None = None, stage: int | None = None) -> PlanError:
    where = "" if stage is None else f" on stage {stage}"
    return PlanError(Diagnostic(f"reduction program for '{reduction.name}' is invalid{where}: {reason}",
                                reduction.program_span, hint))


def validate_pinned(reduction: ir.Reduction, hierarchy: Hierarchy, positions, groups: Groups,
                    stage: int | None = None, target: ir.Collective = C.ALLREDUCE):
    """The pinned program's lowered steps; a located PlanError when a level does not fit, a step's
    precondition fails or the final state misses ``target`` (allreduce, or ZeRO-1's reduce_scatter:
    the error then says which target the program does meet, if any)."""
    program = reduction.program or ()
    if not program:
        raise invalid(reduction, "the program is empty", stage=stage)
    for i, instr in enumerate(program, 1):
        try:
            resolve(instr, hierarchy)
        except LoweringError as e:
            bad = instr.slice if instr.slice not in hierarchy.names else instr.form_level
            hint = did_you_mean(bad, hierarchy.names) if bad not in hierarchy.names else None
            if stage is not None and hint is None:
                hint = ("every stage runs the pinned program on its own reduction groups; without `using`, "
                        "planc synthesizes a program for each stage")
            raise invalid(reduction, f"step {i} {instr}: {e.reason}", hint, stage) from None
    try:
        steps = lower_program(program, hierarchy, positions)
        semantics.run(steps, groups, target)
    except LoweringError as e:
        raise invalid(reduction, e.reason, stage=stage) from None
    except semantics.SemanticsError as e:
        if target is C.ALLREDUCE:
            raise invalid(reduction, e.reason, stage=stage) from None
        raise _not_scattering(reduction, steps, groups, e.reason, stage) from None
    return steps


def _not_scattering(reduction: ir.Reduction, steps, groups: Groups, reason: str, stage: int | None) -> PlanError:
    """With zero = 1 the gradients' pinned program must meet the reduce-scatter target; say which it meets."""
    hint = ("with zero = 1 planc synthesizes the parameters' all-gather from the pieces this program leaves; "
            "leave out `using` to let planc synthesize both")
    try:
        semantics.run(steps, groups, C.ALLREDUCE)
    except semantics.SemanticsError:
        pass
    else:
        return invalid(reduction, "with zero = 1 the gradients are reduce-scattered (each member of a reduction "
                                  "group keeps its own 1/k of the sum), but this program leaves every member the "
                                  "whole sum: it meets the allreduce target, not the reduce-scatter target; pin "
                                  "one that ends in pieces, e.g. reduce_scatter(slice=root, form=inside)",
                       hint, stage)
    if reason.startswith("after step"):
        return invalid(reduction, "with zero = 1 the program must meet the reduce-scatter target (each member of a "
                                  f"reduction group its own 1/k of the sum), and it meets none: {reason}", hint, stage)
    return invalid(reduction, reason, stage=stage)
