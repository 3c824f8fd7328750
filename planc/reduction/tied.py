"""Tied parameters across stages: one reduction per parameter, over the devices of every stage holding it.

A parameter shared by layers of several stages (the probe's ``tied``: the same ``nn.Parameter`` reachable
from two layers) is held by every one of those stages; each device's gradient of it is a partial sum
(its stage's layers, its rows). The sum every copy needs counts each stage's each data replica once, and
a tensor replica's identical gradient once:

* the holding stages' tensor degrees agree (``t``, 1 without a ``tensor`` axis): one group per tensor
  coordinate ``c``, the devices of every holding stage at ``c``; every device contributes;
* they differ: one group, every device of the holding stages; only the devices at tensor coordinate 0
  contribute, the others enter zeros.

The program is P² synthesis's on those groups (``plan_reduction``: a hierarchy from the groups' geometry,
the flat allreduce when it is irregular), checked by ``check.py`` against the allreduce target at
construction, and the contributors' rule by ``check.check_tied``. docs/reduction.md, "Tied
parameters".
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from planc import ir
from planc import plan as planfile
from planc.lang.errors import Diagnostic, PlanError
from planc.reduction.check import check_tied

__all__ = ["plan_tied", "tied_groups", "contribution_keys"]

TENSOR = ir.MeshAxis.TENSOR
GRAD_BYTES = 4   # gradients are reduced in fp32 (fp64 parameters: counted as fp32 here, a prediction only)


def _stage_of_layer(program: ir.Program, n_layers: int) -> dict[int, int]:
    out = {}
    for st in program.stages:
        a, b = st.layers if st.layers is not None else (0, n_layers)
        for i in range(a, b):
            out[i] = st.index
    return out


def _refuse_split(program: ir.Program, across, layouts: dict, where: dict, split: dict) -> None:
    """Only a replicated parameter can be tied across stages: every copy takes the same whole update. A
    tie (``across``: ``(holders, numel, holding stages)``) the model splits over a holding stage's tensor
    axis is refused at that stage's line."""
    errs = []
    for holders, _, held in across:
        for s in held:
            k = layouts[s].axis_size(TENSOR)
            if k > 1 and tuple(holders[0]) in split.get(k, ()):
                names = ", ".join(f"layers.{i}.{n} (stage {where[i]})" for i, n in holders if i in where)
                errs.append(Diagnostic(
                    f"stage {s} splits a parameter tied across stages over its 'tensor' axis ({k}): {names} "
                    "are one parameter, and only a replicated parameter can be tied across stages (every copy "
                    "takes the same whole update); keep the shared module out of the model's tensor split, or "
                    f"give stage {s} no 'tensor' axis", program.stage(s).span))
    if errs:
        raise PlanError(errs)


def tied_groups(stages: Sequence[ir.StageLayout]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(groups, contributors) of a parameter held by ``stages`` (see the module docstring)."""
    degrees = {st.axis_size(TENSOR) for st in stages}

    def coord(st, d):
        return st.position(d)[st.axes.index(TENSOR)] if TENSOR in st.axes else 0

    if len(degrees) == 1:
        by: dict[int, list[int]] = {}
        for st in stages:
            for d in st.devices:
                by.setdefault(coord(st, d), []).append(d)
        groups = tuple(sorted(tuple(sorted(g)) for g in by.values()))
        return groups, tuple(sorted(d for st in stages for d in st.devices))
    groups = (tuple(sorted(d for st in stages for d in st.devices)),)
    return groups, tuple(sorted(d for st in stages for d in st.devices if coord(st, d) == 0))


def contribution_keys(stages) -> dict[int, tuple]:
    """Per device of the holding ``stages`` (``StageLayout``s, or plan.json ``Stage``s): what its gradient is
    a partial sum over, (stage, mesh position without its tensor coordinate); tensor replicas share it."""
    out = {}
    for st in stages:
        axes = tuple(getattr(st, "axes", None) or getattr(st, "mesh_axes", ()))
        for d in st.devices:
            pos = list(st.position(d))
            if TENSOR in axes:
                pos.pop(axes.index(TENSOR))
            out[d] = (st.index, tuple(pos))
    return out


def plan_tied(program: ir.Program, stages: Sequence[ir.StageLayout], ties, n_layers: int,
              plan_reduction: Callable, split=()) -> tuple:
    """One ``ReductionPlan`` (``tied`` set) per parameter the probe found shared by layers of two stages or
    more, in the probe's order; ties inside one stage need nothing. ``plan_reduction``: the package's
    (``planc.reduction.plan_reduction``), which synthesizes and ranks the program on the groups.
    ``split``: the probe's ``tied_split``, ``((degree, ((layer, name), ...)), ...)``; a tie across stages
    whose parameter a holding stage's tensor axis would split is a located error at that stage."""
    where = _stage_of_layer(program, n_layers)
    layouts = {st.index: st for st in stages}
    across = []   # (holders, numel, holding stages) of each tie held by two stages or more
    for holders, numel in ties:
        held = sorted({where[layer] for layer, _ in holders if layer in where})
        if len(held) > 1:
            across.append((holders, numel, held))
    _refuse_split(program, across, layouts, where, {k: set(v) for k, v in split})
    grads = next((r for r in program.reductions if r.name == "gradients" and r.shape is None), None)
    mode = (ir.ReductionMode.ALLREDUCE if grads is not None and grads.mode is ir.ReductionMode.ALLREDUCE
            else ir.ReductionMode.SYNTHESIZE)
    out = []
    for holders, numel, held in across:
        groups, contributors = tied_groups([layouts[s] for s in held])
        first, name = holders[0]
        tied = planfile.Tied(f"layers.{first}.{name}",
                             tuple(planfile.Holder(where[layer], layer, n) for layer, n in holders if layer in where),
                             contributors, min(contributors))
        red = ir.Reduction("tied", (), mode)
        planned = plan_reduction(program.cluster, red, groups, int(numel) * GRAD_BYTES, program.synthesis)
        why = check_tied([(str(c), g) for c, g in planned.steps], planned.groups, contributors,
                         contribution_keys([layouts[s] for s in held]))
        if why is not None:
            raise AssertionError(f"tied parameter {tied.parameter}: {why}")
        out.append(dataclasses.replace(planned, tied=tied))
    return tuple(out)
