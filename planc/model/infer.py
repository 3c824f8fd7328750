"""Complete every transfer of a training plan: its type measured on the model, its layouts derived.

``infer_transfers(program, probe) -> program`` is pure. In a plan with a model
a transfer may omit its type (taken from the model probe, which ran the plan's
stage dataflow on one whole micro-batch) and either sharding spec (derived from
the stage's mesh: the batch dimension, dim 0, split over the mesh axis named
``data`` when it has size > 1, replicated over every other mesh axis; every
other tensor dimension replicated). A plan with a model and no transfer line at
all gets the chain (``chain_transfers``: each stage's output to the next stage).
That derived layout is what a stage of a training plan computes, so a written
spec must be it (written forms that describe the same layout, such as
``S(data)`` or a split over an axis of size 1, are equal). In a bf16 or fp16
plan every floating transfer, measured or declared (``f32[...]`` names the
activation as the model builds it), is sent in the plan's precision: its dtype
becomes bf16 or f16, since the stages run in it while the probe runs the model
as built. A plan without a model is returned unchanged: the front end has
already required everything.
"""

from __future__ import annotations

import dataclasses

from planc import ir
from planc.diagnostics import Diagnostic, PlanError, Span
from planc.model.probe import ModelProbe, activation_dtype
from planc.spec_fit import spec_divide_error, spec_length_error

DATA_AXIS = ir.MeshAxis.DATA
TENSOR_AXIS = ir.MeshAxis.TENSOR

Mesh = tuple[tuple[int, ...], tuple[str, ...]]


def derived_spec(ndim: int, mesh: Mesh | None, sequence: bool = False) -> ir.ShardingSpec:
    """The layout a training stage computes: dim 0 over the mesh axis ``data`` (size > 1), else R; on a
    sequence-parallel stage (``sequence``) dim 1, the sequence, over the mesh axis ``tensor``."""
    dims: list[tuple[int, ...]] = [()] * ndim
    if ndim and ir.axis_size(mesh, DATA_AXIS) > 1:
        dims[0] = (mesh[1].index(DATA_AXIS),)
    if sequence and ndim >= 2 and ir.axis_size(mesh, TENSOR_AXIS) > 1:
        dims[1] = (mesh[1].index(TENSOR_AXIS),)
    return ir.ShardingSpec(tuple(dims))


def decide_sequence(program: ir.Program, probe: ModelProbe | None) -> ir.Program:
    """Every stage with a mesh axis ``tensor`` > 1 marked sequence-parallel or given the reason it is not
    (LANGUAGE.md "Hugging Face models"): on unless ``train { sequence_parallel = false }``, the model cannot
    (a builder without the keyword ``sequence_parallel``, a tp plan without modules to gather around) or
    the sequence does not split over the degree (the probe's ``sequence_errors``)."""
    if program.model is None:
        return program
    out = []
    for st in program.stages:
        k = ir.axis_size(program.stage_mesh(st.index), TENSOR_AXIS)
        if k < 2:
            out.append(st)
            continue
        if not program.train.sequence_parallel:
            why = "train { sequence_parallel = false }"
        elif probe is None:
            why = "the model was not probed (--no-probe), so planc cannot tell whether it can"
        elif not probe.tensor_parallel:
            why = "the model builder does not split its layers over tensor (no keyword tensor_parallel)"
        else:
            why = probe.sequence_problem(k)
        out.append(dataclasses.replace(st, sequence_parallel=why is None, sequence_why=why))
    return dataclasses.replace(program, stages=tuple(out))


def same_layout(a: ir.ShardingSpec, b: ir.ShardingSpec, mesh: Mesh | None) -> bool:
    """Whether two specs place every element alike on this mesh (splits over axes of size 1 are no splits)."""
    if len(a.dims) != len(b.dims):
        return False
    shape = mesh[0] if mesh is not None else ()

    def norm(spec):
        return tuple(tuple(x for x in d if x >= len(shape) or shape[x] > 1) for d in spec.dims)
    return norm(a) == norm(b)


def describe_layout(spec: ir.ShardingSpec, mesh: Mesh | None) -> str:
    """``S0 R R (batch rows split over data = 4, replicated over tensor)`` for a derived layout."""
    if mesh is None:
        return str(spec)
    shape, axes = mesh
    split = {a for d in spec.dims for a in d}
    parts = []
    if spec.dims and spec.dims[0]:
        over = ", ".join(f"{axes[a]} = {shape[a]}" for a in spec.dims[0])
        parts.append(f"batch rows split over {over}")
    if len(spec.dims) > 1 and spec.dims[1]:
        over = ", ".join(f"{axes[a]} = {shape[a]}" for a in spec.dims[1])
        parts.append(f"the sequence split over {over}: sequence parallelism")
    rest = [axes[a] for a in range(len(axes)) if a not in split]
    if rest:
        parts.append("replicated over " + ", ".join(rest))
    text = ", ".join(parts)
    if DATA_AXIS not in axes and axes:
        text += f"; no mesh axis is named {DATA_AXIS}"
    return f"{spec} ({text})" if text else str(spec)


def _at(span: Span, fallback: Span) -> Span:
    return span if span.line else fallback


def _spec_errors(t: ir.Transfer, side: str, spec: ir.ShardingSpec, shape, mesh: Mesh | None,
                 stage: int, span: Span) -> list[Diagnostic]:
    """The checker's entry-count and divisibility checks, for a shape known only now."""
    why = spec_length_error(len(spec.dims), shape)
    if why:
        return [Diagnostic(f"transfer '{t.name}' ({side} spec): {why}", span)]
    if mesh is None:
        return []
    for tdim, axes in enumerate(spec.dims):
        if axes and all(a < len(mesh[0]) for a in axes):
            why = spec_divide_error(tdim, shape[tdim], axes, mesh[0], stage)
            if why:
                return [Diagnostic(f"transfer '{t.name}' ({side} spec): {why}", span)]
    return []




def _type(t: ir.Transfer, probe: ModelProbe | None, errs: list[Diagnostic], precision=ir.Precision.FP32):
    if t.shape is not None:   # a declared floating type is the activation's, sent in the plan's precision
        return activation_dtype(t.dtype, precision), t.shape
    span = _at(t.type_span, t.span)
    if t.src_stage > t.dst_stage:   # nothing to measure: the model's activations flow to later stages only
        errs.append(Diagnostic(f"transfer '{t.name}' goes from stage {t.src_stage} back to stage {t.dst_stage}: "
                               "activations flow from a stage to later ones, so nothing is measured for it; "
                               f"write 'transfer {t.name} from stage {t.dst_stage} to stage {t.src_stage}' (or declare "
                               "its type for a communication-only plan)", t.span))
        return None, None
    if probe is None:
        errs.append(Diagnostic(f"transfer '{t.name}' has no type and the model was not probed: declare it "
                               f"('transfer {t.name} : f32[...] from ...') or allow probing (drop --no-probe) "
                               "so planc measures it on the model", span))
        return None, None
    m = probe.measured(t.name)
    if m is None or m.shape is None:
        why = m.error if m is not None and m.error else "the model probe did not reach it"
        errs.append(Diagnostic(f"transfer '{t.name}' has no type and planc could not measure it on the model "
                               f"({why}); declare it ('transfer {t.name} : f32[...] from ...')", span))
        return None, None
    if m.dtype not in ir.DTYPE_BYTES:
        errs.append(Diagnostic(f"transfer '{t.name}': stage {t.src_stage} produces a tensor of dtype {m.dtype}, "
                               f"which planc cannot send (dtypes: {', '.join(ir.DTYPE_BYTES)})", span))
        return None, None
    # the probe runs the model as built (fp32); the stage runs in the plan's precision
    return activation_dtype(m.dtype, precision), tuple(m.shape)


def chain_name(src: int, dst: int) -> str:
    """The name of an inferred chain transfer: ``s0_to_s1``."""
    return f"s{src}_to_s{dst}"


def chain_transfers(program: ir.Program) -> ir.Program:
    """A plan with a model, two or more stages and no ``transfer`` line at all: each stage's output goes
    to the next stage (LANGUAGE.md), as the transfers ``s0_to_s1``, ``s1_to_s2``, ... with nothing
    written (dtype and shape measured by the probe, layouts derived: :func:`infer_transfers`). Once any
    transfer is written, the written ones are the plan's: such a plan comes back unchanged, as does a
    plan without a model (the front end requires its transfers)."""
    if program.model is None or program.transfers or len(program.stages) < 2:
        return program
    stages = sorted(program.stages, key=lambda s: s.index)
    names = {s.index for s in stages}
    out = []
    for a, b in zip(stages, stages[1:]):
        if b.index != a.index + 1 or a.index not in names:
            continue
        at = b.span   # an error about an inferred transfer points at the stage that receives it
        out.append(ir.Transfer(chain_name(a.index, b.index), None, None, a.index, None, None, b.index, None,
                               span=at, type_span=at, src_spec_span=a.span, dst_spec_span=at))
    return dataclasses.replace(program, transfers=tuple(out))


def infer_transfers(program: ir.Program, probe: ModelProbe | None) -> ir.Program:
    """``program`` with every transfer complete (dtype, shape, both specs); errors are located PlanErrors."""
    if program.model is None:
        return program
    errs: list[Diagnostic] = []
    out = []
    sequence_stages = {s.index: s.sequence_parallel for s in program.stages}
    for t in program.transfers:
        dtype, shape = _type(t, probe, errs, program.train.precision)
        if shape is None:
            continue
        specs = {}
        for side, stage, spec, span in (("source", t.src_stage, t.src_spec, t.src_spec_span),
                                        ("destination", t.dst_stage, t.dst_spec, t.dst_spec_span)):
            mesh = program.stage_mesh(stage)
            sequence = sequence_stages.get(stage, False)
            want = derived_spec(len(shape), mesh, sequence)
            at = _at(span, t.span)
            if spec is None:
                problems = _spec_errors(t, side, want, shape, mesh, stage, at)
                errs += problems
                specs[side] = want if not problems else None
                continue
            problems = _spec_errors(t, side, spec, shape, mesh, stage, at)
            whole = derived_spec(len(shape), mesh)   # written replicated on a sequence-parallel stage: honoured
            if problems:
                errs += problems
                specs[side] = None
            elif sequence and same_layout(spec, whole, mesh):
                specs[side] = whole
            elif not same_layout(spec, want, mesh):
                errs.append(Diagnostic(f"transfer '{t.name}': stage {stage} computes {describe_layout(want, mesh)}, "
                                       f"but the plan says {spec}", at))
                specs[side] = None
            else:
                specs[side] = want
        if specs["source"] is None or specs["destination"] is None:
            continue
        out.append(dataclasses.replace(t, dtype=dtype, shape=shape, src_spec=specs["source"],
                                       dst_spec=specs["destination"]))
    if errs:
        raise PlanError(errs)
    return dataclasses.replace(program, transfers=tuple(out))
