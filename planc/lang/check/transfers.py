"""``transfer`` statements and their sharding specs on the stages' meshes."""

from __future__ import annotations

import re

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, did_you_mean, int_of, source_text, tensor_type
from planc.spec_fit import spec_divide_error, spec_length_error
from planc.span import Span

__all__ = ["check_transfers", "spec_length_error", "spec_divide_error"]  # the last two: planc.spec_fit

_SPEC_TOKEN = re.compile(r"R|S01|S0|S1")


def check_transfers(errs: Diagnostics, decls: list[ast.TransferDecl], stages: tuple[ir.Stage, ...],
                    parallel: ir.Parallel | None, has_model: bool, text: str) -> tuple[ir.Transfer, ...]:
    """Without a model every transfer is complete; with one, an omitted type or spec stays None
    for ``planc.model.infer`` (which also checks a written spec's entry count and divisibility
    once the shape is measured). ``parallel`` gives derived stages their mesh shapes; ``text``
    is the plan's source, quoted in hints."""
    out, names = [], {}
    by_index = {s.index: s for s in stages}
    for t in decls:
        if t.name.value in names:
            errs.add(f"transfer '{t.name.value}' is declared twice", t.name.span)
            continue
        names[t.name.value] = t.span
        name = t.name.value
        missing = False
        if t.type is None and not has_model:
            errs.add(f"transfer '{name}' needs its type, e.g. 'transfer {name} : f32[8, 1024] from ...'; "
                     "only a plan with a model may leave it out (planc measures it on the model)", t.name.span)
            missing = True
        example = " ".join(["S0"] + ["R"] * (len(t.type.dims) - 1 if t.type is not None else 1))
        for side, spec, at in (("source", t.src_spec, t.src_at), ("destination", t.dst_spec, t.dst_at)):
            if spec is None and not has_model:
                errs.add(f"transfer '{name}' needs its {side} layout, e.g. '{source_text(at, text)} as "
                         f"{example}'; "
                         "only a plan with a model may leave it out (planc derives it from the stage's mesh)", at)
                missing = True
        dtype, shape = tensor_type(errs, t.type) if t.type is not None else (None, None)
        src = _stage_ref(errs, t.src_stage, by_index)
        dst = _stage_ref(errs, t.dst_stage, by_index)
        if src is not None and dst is not None and src.index == dst.index:
            errs.add(f"transfer '{t.name.value}' goes from stage {src.index} to itself", t.dst_stage.span)
            continue
        layer = None
        if t.src_layer is not None:
            layer = int_of(errs, t.src_layer, "layer", minimum=0)
            if layer is not None and src is not None and src.layers is not None:
                a, b = src.layers
                if not a <= layer < b:
                    errs.add(f"layer {layer} is not in stage {src.index} (layers {a}..{b})", t.src_layer.span)
        if src is None or dst is None or (t.type is not None and shape is None):
            continue
        sspec = _spec(errs, t.src_spec, shape, src, parallel) if t.src_spec is not None else None
        dspec = _spec(errs, t.dst_spec, shape, dst, parallel) if t.dst_spec is not None else None
        if missing or (t.src_spec is not None and sspec is None) or (t.dst_spec is not None and dspec is None):
            continue
        out.append(ir.Transfer(name, dtype, shape, src.index, layer, sspec, dst.index, dspec, t.span,
                               type_span=t.type.span if t.type is not None else t.name.span,
                               src_spec_span=t.src_spec.span if t.src_spec is not None else t.src_at,
                               dst_spec_span=t.dst_spec.span if t.dst_spec is not None else t.dst_at))
    return tuple(out)


def _stage_ref(errs: Diagnostics, num: ast.Num, by_index: dict[int, ir.Stage]) -> ir.Stage | None:
    idx = int_of(errs, num, "stage index", minimum=0)
    if idx is None:
        return None
    if idx not in by_index:
        have = ", ".join(str(i) for i in sorted(by_index)) or "none"
        errs.add(f"there is no stage {idx} (stages: {have})", num.span)
        return None
    return by_index[idx]


def _spec(errs: Diagnostics, sp: ast.Spec, shape: tuple[int, ...] | None, stage: ir.Stage,
          parallel: ir.Parallel | None) -> ir.ShardingSpec | None:
    """The written spec; with ``shape`` None (to be measured) only its form and mesh axes are checked."""
    mesh = ir.stage_mesh(stage, parallel)
    mesh_shape = mesh[0] if mesh is not None else None
    entries: list[tuple[tuple[int, ...], Span]] = []
    for item in sp.items:
        if item.names is not None:
            if item.word.value != "S":
                errs.add(f"a named sharding entry is written S(axis, ...), not {item.word.value}(...)", item.word.span)
                return None
            dims = []
            for n in item.names:
                if n.value not in stage.mesh_axes:
                    errs.add(f"'{n.value}' is not a mesh axis of stage {stage.index} (axes: "
                             f"{', '.join(stage.mesh_axes) or 'none'})", n.span, did_you_mean(n.value, stage.mesh_axes))
                    return None
                dims.append(stage.mesh_axes.index(n.value))
            if dims not in ([0], [1], [0, 1]):
                errs.add("only S0, S1 and S01 (dimension 0 major) exist; "
                         f"S({', '.join(n.value for n in item.names)}) is not one of them", item.span)
                return None
            entries.append((tuple(dims), item.span))
            continue
        word = item.word.value
        toks = _SPEC_TOKEN.findall(word)
        if "".join(toks) != word:
            errs.add(f"'{word}' is not a sharding spec; each tensor dimension is R, S0, S1 or S01 "
                     "(spaces optional: 'S0 R R' or 'S0RR')", item.word.span)
            return None
        for tok in toks:
            entries.append(((), item.span) if tok == "R" else (tuple(int(c) for c in tok[1:]), item.span))
    if shape is not None and len(entries) != len(shape):
        errs.add(spec_length_error(len(entries), shape), sp.span)
        return None
    used: dict[int, int] = {}
    for tdim, (axes, span) in enumerate(entries):
        for a in axes:
            if a in used:
                errs.add(f"mesh dimension {a} shards both tensor dimension {used[a]} and {tdim}; "
                         "a mesh dimension may shard at most one tensor dimension", span)
                return None
            used[a] = tdim
            if mesh_shape is not None and a >= len(mesh_shape):
                errs.add(f"S{a} needs a mesh dimension {a}, but stage {stage.index}'s mesh is "
                         f"{len(mesh_shape)}-dimensional {tuple(mesh_shape)}", span)
                return None
        if mesh_shape is not None and axes and shape is not None:
            why = spec_divide_error(tdim, shape[tdim], axes, mesh_shape, stage.index)
            if why:
                errs.add(why, span)
                return None
    return ir.ShardingSpec(tuple(a for a, _ in entries))

