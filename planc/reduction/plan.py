"""``ReductionPlan``: the reduction pass's decision for one reduction, and its plan.json record.

A plan has a *target* (DESIGN.md "Collective semantics"): ``allreduce`` (every member ends with the
whole sum), or ZeRO-1's pair — ``reduce_scatter`` (each member ends with its own 1/k piece, ``owned``
says which) and ``all_gather`` (from exactly those pieces back to the whole buffer). Every plan is
re-checked at construction by the independent checker (``check.py``) against its target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from planc import ir, plan as planfile
from planc.reduction import check, semantics
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.regions import program_regions

__all__ = ["ReductionPlan", "MAX_ALTERNATIVES", "Owned"]

Groups = tuple[tuple[int, ...], ...]
Owned = tuple[tuple[tuple[Fraction, Fraction], ...], ...]   # per group, per member (group order): [a, b)
MAX_ALTERNATIVES = 10
C = ir.Collective


@dataclass(frozen=True, slots=True)
class ReductionPlan:
    """The decision for one reduction; ``record`` is its plan.json entry (``to_json`` the same as a dict).

    ``allreduce_predicted`` is the flat alternative's prediction: the single flat allreduce, or for
    ZeRO-1's targets the flat reduce_scatter / all_gather (plan.json calls it ``flat_predicted`` then).
    ``owned`` (reduce_scatter and all_gather targets): per group, per member, the piece of the buffer
    it owns after the reduce-scatter program, which is where the all-gather program starts. ``unit``
    (0: the program's own, ``regions.program_regions``) is what plan.json writes regions and ``owned``
    in; ZeRO-1's two programs of a stage are written with the same one (the lcm of theirs), so the
    runtime pads a buffer identically for both.
    """

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
    target: ir.Collective = C.ALLREDUCE
    owned: Owned = ()
    unit: int = 0
    mode: ir.ReductionMode = ir.ReductionMode.SYNTHESIZE   # as the plan asked (``using ...``)
    tied: planfile.Tied | None = None   # a tied parameter's gradient across stages (reduction/tied.py)

    def __post_init__(self) -> None:
        if len(self.alternatives) > MAX_ALTERNATIVES:
            raise ValueError("at most 10 alternatives")
        if any(b[1] < a[1] for a, b in zip(self.alternatives, self.alternatives[1:])):
            raise ValueError(f"reduction plan {self.name!r}: alternatives not in non-decreasing predicted time")
        if self.target not in (C.ALLREDUCE, C.REDUCE_SCATTER, C.ALL_GATHER):
            raise ValueError(f"reduction plan {self.name!r}: target {self.target} is not a reduction target")
        if (self.target is C.ALLREDUCE) == bool(self.owned) and self.groups:
            raise ValueError(f"reduction plan {self.name!r}: owned pieces go with a reduce_scatter or all_gather target")
        if not self.groups:
            return
        units, owned = self._owned_units()
        why = check.check_program([(str(c), g) for c, g in self.steps], self.groups, unit=units,
                                  target=str(self.target), owned=owned)
        if why is not None:
            where = "" if self.stage is None else f" (stage {self.stage})"
            raise ValueError(f"reduction plan {self.name!r}{where} does not meet its {self.target} target: {why}")

    @property
    def text(self) -> str:
        return ir.program_text(self.program)

    @property
    def flat_predicted(self) -> float:
        """The flat alternative's prediction (the single flat collective of the target)."""
        return self.allreduce_predicted

    def _owned_units(self, unit: int | None = None) -> tuple[int | None, tuple[tuple[tuple[int, int], ...], ...] | None]:
        """``(unit, owned in units of 1/unit)``; ``unit`` None: the least that makes every bound whole."""
        if not self.owned:
            return None, None
        if unit is None:
            unit = math.lcm(*(x.denominator for row in self.owned for ab in row for x in ab))
        out = tuple(tuple((a * unit, b * unit) for a, b in row) for row in self.owned)
        if any(x.denominator != 1 for row in out for ab in row for x in ab):
            raise ValueError(f"reduction plan {self.name!r}: owned pieces are not whole units of 1/{unit}")
        return unit, tuple(tuple((int(a), int(b)) for a, b in row) for row in out)

    def regions(self) -> tuple[int, tuple[tuple[tuple[int, int], ...], ...]]:
        """``(unit, regions)`` as plan.json writes them (``regions.program_regions``, scaled to ``unit``)."""
        start = semantics.assigned_state(self.groups, self.owned) if self.target is C.ALL_GATHER else None
        unit, regions = program_regions(self.steps, self.groups, start)
        if self.unit and self.unit != unit:
            if self.unit % unit:
                raise ValueError(f"reduction plan {self.name!r}: unit {self.unit} is not a multiple of the "
                                 f"program's {unit}")
            f = self.unit // unit
            unit, regions = self.unit, tuple(tuple((a * f, b * f) for a, b in row) for row in regions)
        return unit, regions

    def to_json(self) -> dict:
        out = {"name": self.name}
        if self.stage is not None:
            out["stage"] = self.stage
        unit, regions = self.regions()   # what the runtime executes
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
        out.update(self._targeted(unit))
        if self.tied is not None:
            out["tied"] = self.tied.to_json()
        return out

    def _targeted(self, unit: int) -> dict:
        """``target`` and ``owned`` (in units of 1/unit) for ZeRO-1's targets; nothing for allreduce."""
        if self.target is C.ALLREDUCE:
            return {}
        return {"target": str(self.target), "owned": [[list(r) for r in row] for row in self._owned_units(unit)[1] or ()]}

    def _figures(self) -> tuple[tuple[str, object], ...]:
        """What plan.json carries beyond the program the runtime runs: the ranking's figures, in order."""
        flat = "allreduce_predicted" if self.target is C.ALLREDUCE else "flat_predicted"
        out = ((flat, self.allreduce_predicted), ("candidates", self.candidates),
               ("alternatives", [{"text": t, "predicted": p} for t, p in self.alternatives]),
               ("hierarchy", [{"name": n, "factor": f} for n, f in self.hierarchy.levels]))
        if self.per_stage_bytes is not None:
            out += (("per_stage_bytes", [{"stage": s, "bytes": b} for s, b in self.per_stage_bytes]),)
        return out

    def record(self, mode: ir.ReductionMode | None = None, collectives=()) -> planfile.Reduction:
        """The plan file's entry (``planc.plan.Reduction``): the typed steps with their regions
        (``planc.reduction.regions``), the target and each member's ``owned`` range; the ranking's
        figures and the ``collectives`` the synthesis could use in ``extra`` (plan.json carries them;
        the runtime does not read them). ``mode``: the plan's own when not given."""
        unit, regions = self.regions()
        steps = tuple(planfile.Step(c, tuple(tuple(g) for g in gs), tuple(tuple(r) for r in rs))
                      for (c, gs), rs in zip(self.steps, regions))
        owned = self._owned_units(unit)[1] or ()
        return planfile.Reduction(self.name, tuple(self.axes), self.nbytes, tuple(tuple(g) for g in self.groups),
                                  self.text, steps, self.predicted, planfile.ReductionMode(mode or self.mode), unit,
                                  self.stage, self._figures() + (("collectives", [str(c) for c in collectives]),),
                                  planfile.Collective(str(self.target)), owned, self.tied)
