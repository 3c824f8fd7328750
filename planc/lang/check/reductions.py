"""``reduce`` statements: the axes reduced over and, optionally, a pinned P² program."""

from __future__ import annotations

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, did_you_mean, tensor_type
from planc.span import Span

__all__ = ["check_reductions", "check_program"]


def check_reductions(errs: Diagnostics, decls: list[ast.ReduceDecl], cluster: ir.Cluster | None,
                     parallel: ir.Parallel | None, stages: tuple[ir.Stage, ...],
                     mode: ir.StageMode, has_model: bool = True) -> tuple[ir.Reduction, ...]:
    """Reductions over known axes: the ``parallel`` axes but ``pipe``, or explicit stages' mesh axes.
    ``gradients`` are the model's parameter gradients: without a model there are none to size it by."""
    out, names = [], set()
    if mode is ir.StageMode.EXPLICIT:
        # explicit stages reduce over their own mesh dimensions (LANGUAGE.md); a `parallel`
        # axis that no mesh has would reduce over nothing
        known = list(dict.fromkeys(a for s in stages for a in s.mesh_axes))
    else:
        known = list(parallel.axis_names()) if parallel else []
    for r in decls:
        if r.name.value in names:
            errs.add(f"reduction '{r.name.value}' is declared twice", r.name.span)
            continue
        names.add(r.name.value)
        ok = True
        axes = []
        for a in r.axes:
            if a.value not in known:
                errs.add(f"'{a.value}' is not an axis (axes: {', '.join(known) or 'none'})", a.span,
                         did_you_mean(a.value, known))
                ok = False
            elif a.value == ir.MeshAxis.PIPE and mode is ir.StageMode.PIPE_AXIS:
                errs.add("'pipe' is the pipeline axis: stages hold different layers, so there is nothing to "
                         "reduce over it", a.span)
                ok = False
            elif a.value in axes:
                errs.add(f"axis '{a.value}' is listed twice", a.span)
                ok = False
            axes.append(a.value)
        dtype = shape = None
        if r.name.value == "gradients":
            if ok and not has_model and r.type is None:   # (after its axes: one mistake at a time)
                errs.add("'reduce gradients' needs a model: it reduces the model's parameter gradients, and a "
                         "plan without a 'model' line has none", r.name.span,
                         f"add a model, or reduce a standalone tensor: "
                         f"'reduce grads over {', '.join(a.value for a in r.axes) or ir.MeshAxis.DATA} : f32[1048576]'")
                ok = False
            elif r.type is not None:
                errs.add("'gradients' are sized by the model's parameters; a shape is only for standalone "
                         "reductions (use another name)", r.type.span)
                ok = False
        elif r.type is None:
            errs.add(f"standalone reduction '{r.name.value}' needs a tensor type, e.g. "
                     f"'reduce {r.name.value} over {', '.join(axes) or ir.MeshAxis.DATA} : f32[1048576]'", r.span)
            ok = False
        else:
            dtype, shape = tensor_type(errs, r.type)
            ok = ok and dtype is not None
        mode_, program, pspan = ir.ReductionMode.SYNTHESIZE, None, Span(0, 0, 0, 0)
        if r.using is not None:
            pspan = r.using_span
            if len(r.using) == 1 and r.using[0].args is None and r.using[0].collective.value == "allreduce":
                mode_ = ir.ReductionMode.ALLREDUCE
            else:
                program = check_program(errs, r.using, cluster)
                if program is None:
                    ok = False
                mode_ = ir.ReductionMode.PROGRAM
        if ok:
            out.append(ir.Reduction(r.name.value, tuple(axes), mode_, program, dtype, shape, r.span, pspan))
    return tuple(out)


def check_program(errs: Diagnostics, steps: tuple[ast.StepNode, ...], cluster: ir.Cluster | None
                  ) -> tuple[ir.Instruction, ...] | None:
    """A written ``using`` program: each step ``COLLECTIVE(slice=LEVEL, form=...)`` over known levels.
    Whether it reduces its groups is the reduction pass's check, once the placement is known."""
    levels = [ir.ROOT_LEVEL] + ([l.name for l in cluster.levels] if cluster else [])
    colls = [c.value for c in ir.Collective]
    out = []
    for st in steps:
        name = st.collective.value
        if name not in colls:
            errs.add(f"unknown collective '{name}'; expected one of {', '.join(colls)}", st.collective.span,
                     did_you_mean(name, colls))
            return None
        if st.args is None:
            errs.add(f"'{name}' needs its slice and form, e.g. {name}(slice=root, form=inside)", st.span)
            return None
        args = {}
        for a in st.args:
            if a.key.value not in ("slice", "form"):
                errs.add(f"unknown step argument '{a.key.value}'; expected slice or form", a.key.span,
                         did_you_mean(a.key.value, ["slice", "form"]))
                return None
            if a.key.value in args:
                errs.add(f"'{a.key.value}' is given twice", a.key.span)
                return None
            args[a.key.value] = a
        if set(args) != {"slice", "form"}:
            missing = ({"slice", "form"} - set(args)).pop()
            errs.add(f"step '{name}' is missing '{missing}='", st.span)
            return None
        sl = args["slice"]
        if sl.level is not None or sl.value.value not in levels:
            errs.add(f"slice must name a level ({', '.join(levels)}), got '{sl.value.value}'", sl.value.span,
                     did_you_mean(sl.value.value, levels))
            return None
        fm = args["form"]
        kinds = [k.value for k in ir.FormKind]
        if fm.value.value not in kinds:
            errs.add(f"form must be inside, parallel(LEVEL) or master(LEVEL), got '{fm.value.value}'",
                     fm.value.span, did_you_mean(fm.value.value, kinds))
            return None
        kind = ir.FormKind(fm.value.value)
        if kind is ir.FormKind.INSIDE and fm.level is not None:
            errs.add("form 'inside' takes no level", fm.level.span)
            return None
        if kind is not ir.FormKind.INSIDE:
            if fm.level is None:
                errs.add(f"form '{kind}' needs a level: {kind}(LEVEL)", fm.span)
                return None
            if fm.level.value not in levels:
                errs.add(f"'{fm.level.value}' is not a level ({', '.join(levels)})", fm.level.span,
                         did_you_mean(fm.level.value, levels))
                return None
        out.append(ir.Instruction(ir.Collective(name), sl.value.value, kind, fm.level.value if fm.level else None))
    return tuple(out)
