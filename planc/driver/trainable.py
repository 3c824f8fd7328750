"""Whether the training runtime can train a placed plan: a policy decided once, by the compiler.

``planc.driver.compile`` runs :func:`check_trainable` after placement; its diagnostics go into plan.json
(``train.trainable``, ``train.not_trainable_because``) and ``planc compile`` reports them as errors.
"""

from __future__ import annotations

from planc import ir
from planc.diagnostics import Diagnostic

DATA_AXIS = ir.MeshAxis.DATA


def check_trainable(program: ir.Program, stages: tuple[ir.StageLayout, ...]) -> tuple[Diagnostic, ...]:
    """Why the training runtime cannot train this plan (empty: it can). Decided once, here.

    The runtime repeats none of these policy checks; it only checks what needs
    the real world (world size, ranks per host, digest, real output shapes).
    Such a plan still compiles: its output runs with ``--comm-only``, and
    ``planc compile`` reports these as errors (exit 2) after writing it.
    """
    errs = []
    rows = program.train.micro_batch
    for st in stages:
        data = stage_data_degree(st)
        if rows % data:
            errs.append(Diagnostic(f"micro_batch = {rows} rows do not split evenly over stage {st.index}'s "
                                   f"data = {data}; use a multiple of {data}",
                                   program.train.span_of("micro_batch", program.stage(st.index).span)))
    ordered = sorted(program.stages, key=lambda s: s.index)
    for prev, s in zip(ordered, ordered[1:]):
        if prev.layers is not None and s.layers is not None and prev.layers[1] != s.layers[0]:
            errs.append(Diagnostic(f"stage {s.index} starts at layer {s.layers[0]} but stage {prev.index} ends at "
                                   f"layer {prev.layers[1]}; training runs the stages' layers as one contiguous "
                                   "model, in stage order", s.span))
    for t in program.transfers:
        if t.src_stage > t.dst_stage:
            errs.append(Diagnostic(f"transfer '{t.name}' goes from stage {t.src_stage} back to stage {t.dst_stage}; "
                                   "training needs activations to flow to later stages", t.span))
    last = max(s.index for s in program.stages)
    for s in ordered:
        if s.index > 0 and not any(t.dst_stage == s.index for t in program.transfers):
            errs.append(Diagnostic(f"stage {s.index} receives no activation from an earlier stage; declare "
                                   f"'transfer NAME from stage {s.index - 1} to stage {s.index}'", s.span))
        if s.index < last and not any(t.src_stage == s.index for t in program.transfers):
            errs.append(Diagnostic(f"stage {s.index} sends no activation to a later stage; only the last stage "
                                   "may end the model", s.span))
    shared = str(program.train.schedule) in ("interleaved_1f1b", "zbv")
    if shared and (program.train.clip is not None or str(program.train.precision) == "fp16"):
        what = "clip" if program.train.clip is not None else "precision = fp16"
        errs.append(Diagnostic(f"{what} needs one gradient norm over every stage a device runs, and under "
                               f"{program.train.schedule} a device runs several stages: not supported yet; drop "
                               "clip, use bf16, or another schedule",
                               program.train.span_of("clip" if program.train.clip is not None else "precision",
                                                     program.train.span_of("schedule", ordered[-1].span))))
    return tuple(errs)


def stage_data_degree(st: ir.StageLayout) -> int:
    """Size of the stage's mesh dimension named ``data`` (1 without one)."""
    return st.axis_size(DATA_AXIS)
