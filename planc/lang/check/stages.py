"""``stage`` statements: stages of the ``pipe`` axis, or explicit stages on written device ranges."""

from __future__ import annotations

import math

from planc import ir
from planc.lang import ast
from planc.lang.check.schedule import Choice, check_meshes
from planc.lang.check.training import zero_degree
from planc.lang.check.values import Diagnostics, int_of
from planc.span import Span

__all__ = ["check_stages"]


def check_stages(errs: Diagnostics, decls: list[ast.StageDecl], cluster: ir.Cluster | None,
                 parallel: ir.Parallel | None, has_model: bool, plan_span: Span,
                 auto: ast.StagesAuto | None = None, choice: Choice = Choice()
                 ) -> tuple[ir.StageMode, tuple[ir.Stage, ...]]:
    """The stage mode and the stages, numbered 0..S-1 with contiguous layers (and, explicit,
    disjoint meshes, or meshes shared as ``choice``, the schedule, runs them: ``check_meshes``). Without
    declarations, the ``pipe`` axis implies ``choice.per`` stages per coordinate (one but for
    interleaved_1f1b and zbv).
    ``auto`` (``stages = auto(N)``) or ``layers auto`` on every stage leaves the layer ranges to
    the compiler (``ir.Stage.auto_layers``; their checks wait until the model is cut)."""
    explicit = [d for d in decls if d.devices is not None]
    if explicit and len(explicit) != len(decls):
        derived = next(d for d in decls if d.devices is None)
        errs.add("either every stage names its devices ('on devices C..D as (M1, M2)') or none does", derived.span)
        return ir.StageMode.EXPLICIT, ()
    mode = ir.StageMode.EXPLICIT if explicit else ir.StageMode.PIPE_AXIS
    if not has_model and mode is ir.StageMode.PIPE_AXIS:   # no pipeline to run: one stage per coordinate
        choice = Choice()
    cut = auto is not None or any(d.auto is not None for d in decls)   # planc cuts the layers
    if cut and not _auto_ok(errs, decls, auto, has_model):
        return mode, ()
    if mode is ir.StageMode.PIPE_AXIS and parallel is None and auto is not None and not decls:
        if errs.found:   # a broken parallel block: said already
            return mode, ()
        errs.add("'stages = auto(N)' takes its stages from the 'pipe' axis: add a 'parallel' block with "
                 "'pipe = N', or give each stage its mesh ('stage I on devices C..D as (M1, M2)')", auto.span)
        return mode, ()
    if mode is ir.StageMode.PIPE_AXIS and parallel is None and decls:
        errs.add("stages without 'on devices' take their devices from the 'pipe' axis; add a 'parallel' block "
                 "or give each stage its devices", decls[0].span)
        return mode, ()
    if mode is ir.StageMode.PIPE_AXIS and parallel is None and not decls:
        if cluster is not None and not errs.found:
            if has_model:
                errs.add("a plan with a model needs a 'parallel' block or explicit stages", plan_span)
        return mode, ()
    out: list[ir.Stage] = []
    seen: dict[int, Span] = {}
    for d in decls:
        idx = int_of(errs, d.index, "stage index", minimum=0)
        if idx is None:
            continue
        if idx in seen:
            errs.add(f"stage {idx} is declared twice (first at line {seen[idx].line})", d.index.span)
            continue
        seen[idx] = d.span
        layers = None
        if d.layers is not None and not cut:
            a = int_of(errs, d.layers.start, "first layer", minimum=0)
            b = int_of(errs, d.layers.end, "end layer", minimum=0)
            if a is not None and b is not None:
                if b <= a:
                    errs.add(f"layer range {a}..{b} is empty (ranges are half-open: A..B holds A up to B-1)",
                             d.layers.span)
                else:
                    layers = (a, b)
        elif has_model and not cut:
            errs.add(f"stage {idx} needs its layers ('stage {idx} : layers A..B', or 'layers auto' to let planc "
                     "cut them) because the plan has a model", d.span)
        first = shape = None
        axes: tuple[str, ...] = ()
        if mode is ir.StageMode.EXPLICIT:
            first, shape, axes = _explicit_mesh(errs, d, cluster)
        elif parallel is not None:
            axes = ir.derived_mesh(parallel)[1]
        out.append(ir.Stage(idx, layers, first, shape, axes, d.span, auto_layers=cut,
                            recompute=True if d.recompute is not None else None,
                            zero=zero_degree(errs, d.zero, f"stage {idx}: zero") if d.zero is not None else None))
    out.sort(key=lambda s: s.index)
    if not out and decls:
        return mode, ()
    for want, s in enumerate(out):
        if s.index != want:
            errs.add(f"stages are numbered 0..{len(out) - 1} in order; stage {want} is missing", s.span)
            break
    if auto is not None and auto.count is not None and decls:
        n = int_of(errs, auto.count, "the number of stages in auto(N)")
        if n is not None and n != len(out):
            errs.add(f"stages = auto({n}) cuts the model into {n} stages but {len(out)} stage mesh"
                     f"{'es are' if len(out) != 1 else ' is'} declared; give one 'stage I on devices ...' per stage",
                     auto.count.span)
    if mode is ir.StageMode.PIPE_AXIS and parallel is not None:
        pipe = parallel.size_of(ir.MeshAxis.PIPE, 1)
        need = pipe * choice.per
        if out and len(out) != need and not choice.broken:
            if choice.shares:
                errs.add(f"schedule = {choice.text()} runs {choice.per} stages on each pipe coordinate: the 'pipe' "
                         f"axis of size {pipe} needs {need} stages, {len(out)} are declared",
                         out[-1].span if len(out) > need else decls[0].span)
            else:
                errs.add(f"the 'pipe' axis has size {pipe} but {len(out)} stages are declared; declare one stage per "
                         "pipe coordinate" + _sharing_hint(len(out), pipe), out[-1].span if len(out) > pipe
                         else decls[0].span)
        if not out and auto is not None:
            return mode, _pipe_auto(errs, auto, parallel, pipe, choice)
        if not out and need > 1 and has_model:
            errs.add(f"the 'pipe' axis has size {pipe}; declare each stage's layers ('stage 0 : layers 0..4') "
                     f"or let planc cut them ('stages = auto({need})')", parallel.span)
        if not out:
            axes = ir.derived_mesh(parallel)[1]
            out = [ir.Stage(i, None, None, None, axes, parallel.span) for i in range(need)]
    if not cut:
        _check_layers(errs, out)
    if mode is ir.StageMode.EXPLICIT:
        check_meshes(errs, out, choice, has_model)
    return mode, tuple(out)


def _sharing_hint(stages: int, pipe: int) -> str:
    """A plan with a multiple of the pipe size in stages may mean a schedule that shares the meshes."""
    if pipe < 1 or stages <= pipe or stages % pipe:
        return ""
    v = stages // pipe
    also = " or schedule = zbv" if v == 2 else ""
    return f" (or run {v} on each: schedule = interleaved_1f1b(virtual = {v}){also})"


def _auto_ok(errs: Diagnostics, decls: list[ast.StageDecl], auto: ast.StagesAuto | None, has_model: bool) -> bool:
    """``stages = auto(N)`` / ``layers auto`` are written consistently. False: no stages can be made
    (no model, a bad N); a written layer range where planc chooses them is reported and ignored."""
    ok = True
    if auto is not None and auto.count is not None:
        ok = int_of(errs, auto.count, "the number of stages in auto(N)") is not None
    if not has_model:
        what = "'stages = auto(N)'" if auto is not None else "'layers auto'"
        errs.add(f"{what} lets planc cut the model's layers into stages, but this plan has no model "
                 "('model \"file.py:function\"')", auto.span if auto is not None else
                 next(d.auto for d in decls if d.auto is not None))
        return False
    if auto is not None:
        for d in decls:
            if d.layers is not None or d.auto is not None:
                errs.add("with 'stages = auto(N)' planc chooses every stage's layers; write the stage without "
                         f"'layers' ('stage {d.index.text} on devices C..D as (M1, M2)'), or drop 'stages = auto(N)'",
                         d.layers.span if d.layers is not None else d.auto)
        return ok
    fixed = [d for d in decls if d.auto is None]
    if fixed:
        errs.add("either every stage's layers are 'auto' or none are: planc cuts all the layers or none of them",
                 fixed[0].layers.span if fixed[0].layers is not None else fixed[0].span)
    return ok


def _pipe_auto(errs: Diagnostics, auto: ast.StagesAuto, parallel: ir.Parallel, pipe: int,
               choice: Choice = Choice()) -> tuple[ir.Stage, ...]:
    """``stages = auto(N)`` without stage lines: ``choice.per`` stages per coordinate of a ``pipe`` axis of
    size P (N = P, or P x V under interleaved_1f1b(virtual = V), 2P under zbv)."""
    need = n = pipe * choice.per
    if auto.count is not None and choice.broken:   # the schedule is wrong (said): its stage count is unknown
        n = int_of(errs, auto.count, "the number of stages in auto(N)") or need
    elif auto.count is not None:
        n = int_of(errs, auto.count, "the number of stages in auto(N)")
        if n is None:
            return ()
        if ir.MeshAxis.PIPE not in parallel.axis_names() and n > choice.per:
            errs.add(f"stages = auto({n}) needs a 'pipe' axis of size {n // choice.per} in the 'parallel' block "
                     "(it has none), or explicit stage meshes ('stage I on devices C..D as (M1, M2)')",
                     auto.count.span)
            n = need
        elif n != need and choice.shares:
            errs.add(f"stages = auto({n}) but schedule = {choice.text()} runs {choice.per} stages on each pipe "
                     f"coordinate: the 'pipe' axis of size {pipe} needs stages = auto({need})", auto.count.span)
            n = need
        elif n != need:   # reported; the stages of the pipe axis go on to the other checks
            errs.add(f"stages = auto({n}) but the 'pipe' axis has size {pipe}; the stages are the pipe "
                     f"coordinates, so write 'stages = auto({pipe})' or 'pipe = {n}'" + _sharing_hint(n, pipe),
                     auto.count.span)
            n = pipe
    axes = ir.derived_mesh(parallel)[1]
    return tuple(ir.Stage(i, None, None, None, axes, auto.span, auto_layers=True) for i in range(n))


def _explicit_mesh(errs: Diagnostics, d: ast.StageDecl, cluster: ir.Cluster | None
                   ) -> tuple[int | None, tuple[int, ...] | None, tuple[str, ...]]:
    """``(first device, mesh shape, axis names)`` of ``on devices C..D as (M1, M2)``."""
    c = int_of(errs, d.devices.start, "first device", minimum=0)
    e = int_of(errs, d.devices.end, "end device", minimum=0)
    dims, names = [], []
    for md in d.mesh:
        size = int_of(errs, md.size, "mesh dimension size")
        if size is None:
            return None, None, ()
        dims.append(size)
        names.append(md.name.value if md.name else None)
    if any(n is not None for n in names) and any(n is None for n in names):
        errs.add("name every mesh dimension or none (e.g. 'as (data = 2, tensor = 4)')", d.span)
        return None, None, ()
    axes = tuple(n if n is not None else f"m{i}" for i, n in enumerate(names))
    if len(set(axes)) != len(axes):
        errs.add(f"mesh dimension names repeat: {', '.join(axes)}", d.span)
    if len(dims) > 2:
        errs.add(f"a stage mesh has 1 or 2 dimensions, got {len(dims)}", d.span)
    if c is None or e is None:
        return None, None, axes
    if e <= c:
        errs.add(f"device range {c}..{e} is empty (ranges are half-open)", d.devices.span)
        return None, None, axes
    if cluster is not None and e > cluster.devices:
        errs.add(f"device range {c}..{e} goes past the cluster's {cluster.devices} devices (0..{cluster.devices})",
                 d.devices.span)
        return None, None, axes
    if math.prod(dims) != e - c:
        errs.add(f"mesh shape ({', '.join(map(str, dims))}) holds {math.prod(dims)} devices but the range "
                 f"{c}..{e} has {e - c}", d.span)
        return None, None, axes
    return c, tuple(dims), axes


def _check_layers(errs: Diagnostics, stages: list[ir.Stage]) -> None:
    """When every stage has layers, they tile 0..L without gaps or overlaps."""
    with_layers = [s for s in stages if s.layers is not None]
    if not with_layers or len(with_layers) != len(stages):
        return
    expect = 0
    for s in stages:
        a, b = s.layers
        if a < expect:
            errs.add(f"stage {s.index} layers {a}..{b} overlap the previous stage's (which end at {expect})", s.span)
        elif a > expect:
            errs.add(f"stage {s.index} layers start at {a} but the previous stage ends at {expect}; "
                     f"layer ranges must be contiguous", s.span)
        expect = b
