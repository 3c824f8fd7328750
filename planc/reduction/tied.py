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

A Hugging Face model's tied embedding table split by vocabulary over a holder's ``tensor`` axis is summed
piece by piece instead (:func:`vocab_pieces`: the rows of the lcm grid of the holders' degrees, each over
the devices holding it; one reduction per buffer layout), checked by ``check.check_tied_pieces``
from the stages alone. docs/reduction.md, "Tied parameters split by vocabulary".
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from planc import ir
from planc import plan as planfile
from planc.diagnostics import Diagnostic, PlanError
from planc.reduction.check import check_tied, check_tied_pieces

__all__ = ["plan_tied", "tied_groups", "contribution_keys", "vocab_pieces"]

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


def _coord(st, d) -> int:
    return st.position(d)[st.axes.index(TENSOR)] if TENSOR in st.axes else 0


def vocab_pieces(stages: Sequence[ir.StageLayout], size: int, padded: int) -> list[tuple[tuple[int, int], dict]]:
    """The pieces of a table of ``size`` real rows padded to ``padded`` that holders split by vocabulary
    (docs/reduction.md, "Tied parameters split by vocabulary"): the grid of lcm(degrees) equal parts of the
    padded rows, each cut to the real rows (a piece of padding only is left out), with, per holding stage,
    the devices that hold it (a stage of degree k keeps part c of k at tensor coordinate c; degree 1: all
    real rows). ``[((a, b), {stage: (devices, local row offset)}), ...]`` in row order."""
    grid = math.lcm(*(st.axis_size(TENSOR) for st in stages))
    out = []
    for p in range(grid):
        a, b = p * padded // grid, min((p + 1) * padded // grid, size)
        if a >= b:
            continue
        holds = {}
        for st in stages:
            k = st.axis_size(TENSOR)
            if k <= 1:
                holds[st.index] = (tuple(st.devices), a)
                continue
            c = p // (grid // k)
            holds[st.index] = (tuple(d for d in st.devices if _coord(st, d) == c), a - c * (padded // k))
        out.append(((a, b), holds))
    return out


def _piece_records(stages: Sequence[ir.StageLayout], size: int, padded: int) -> list[list[tuple]]:
    """The pieces grouped into reductions: pieces of one length at one local offset on every holding stage
    share one buffer layout, so one reduction sums them all (one group per piece, disjoint devices); a
    degree-1 holder's offsets differ per piece, so its pieces are one reduction each. Per reduction
    ``[(group, (a, b)), ...]``."""
    by: dict[tuple, list] = {}
    for (a, b), holds in vocab_pieces(stages, size, padded):
        key = (b - a, tuple(sorted((s, off) for s, (_, off) in holds.items())))
        group = tuple(sorted(d for devices, _ in holds.values() for d in devices))
        by.setdefault(key, []).append((group, (a, b)))
    return list(by.values())


def plan_tied(program: ir.Program, stages: Sequence[ir.StageLayout], ties, n_layers: int,
              plan_reduction: Callable, split=(), vocab=None) -> tuple:
    """One ``ReductionPlan`` (``tied`` set) per parameter the probe found shared by layers of two stages or
    more, in the probe's order; ties inside one stage need nothing. ``plan_reduction``: the package's
    (``planc.reduction.plan_reduction``), which synthesizes and ranks the program on the groups.
    ``split``: the probe's ``tied_split``, ``((degree, ((layer, name), ...)), ...)``; a tie across stages
    whose parameter a holding stage's tensor axis would split is a located error at that stage.
    ``vocab``: plan.json's ``VocabSplit`` of a Hugging Face model: its tied embedding table (layer 0 and
    the last layer), split by vocabulary where a holder has a ``tensor`` axis, is summed piece by piece
    (:func:`vocab_pieces`), one reduction per buffer layout (``_piece_records``)."""
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
        if vocab is not None and {layer for layer, _ in holders} >= {0, n_layers - 1} and any(
                layouts[s].axis_size(TENSOR) > 1 for s in held):
            out += _plan_pieces(program, [layouts[s] for s in held], holders, where, numel, vocab, mode,
                                plan_reduction)
            continue
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


def _plan_pieces(program, held, holders, where, numel: int, vocab, mode, plan_reduction) -> list:
    """The split table's reductions (``plan_tied``): per buffer layout one, its groups the pieces'."""
    size, padded = int(vocab.size), int(vocab.embedding)
    row = int(numel) // size
    first, name = holders[0]
    keys = contribution_keys(held)
    out = []
    for pieces in _piece_records(held, size, padded):
        rows = {g: ab for g, ab in pieces}
        (a, b) = pieces[0][1]
        red = ir.Reduction("tied", (), mode)
        planned = plan_reduction(program.cluster, red, list(rows), (b - a) * row * GRAD_BYTES, program.synthesis)
        contributors = tuple(sorted(d for g in planned.groups for d in g))
        split = planfile.TiedSplit(size, padded, tuple(rows[g] for g in planned.groups),
                                   tuple(min(g) for g in planned.groups))
        tied = planfile.Tied(f"layers.{first}.{name}",
                             tuple(planfile.Holder(where[layer], layer, n) for layer, n in holders if layer in where),
                             contributors, min(contributors), split)
        why = check_tied([(str(c), g) for c, g in planned.steps], planned.groups, contributors, keys,
                         pieces=split.rows)
        if why is not None:
            raise AssertionError(f"tied parameter {tied.parameter} rows {list(split.rows)}: {why}")
        out.append(dataclasses.replace(planned, tied=tied))
    why = check_tied_pieces([(r.tied.split, r.groups) for r in out], held, size, padded)
    if why is not None:
        raise AssertionError(f"tied parameter layers.{first}.{name}: {why}")
    return out
