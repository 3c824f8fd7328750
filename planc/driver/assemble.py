"""The assemble pass: the passes' records put together as the typed plan file (``planc.plan.Plan``).

Each pass's output makes its own records of the contract: ``ReductionPlan.record`` (``Reduction`` with
its typed steps and regions), ``planc.resharding.transfer_records`` (``Transfer`` with a ``Route`` per
direction: tasks, allgather parts, every device's region), ``planc.placement.stage_record`` (``Stage``:
mesh, rows, DeepSpeed's grid) and ``PipelinePlan.record`` (``Pipeline``); the program's cluster and
training settings become ``Cluster`` and ``Train`` here, its ``runtime`` is the contract's ``Runtime``
already. ``assemble`` constructs the ``Plan`` from them and runs the plan's own cross-reference check
(``Plan.check``); no JSON is built or read back. Every record's own checks (the reader's, with a key
path) run on the compiled plan in ``planc.driver.verify``'s ``assemble`` verifier, which re-reads
``plan.to_json()`` with the validating reader.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

from planc import __version__, ir
from planc.model import hfmodel
from planc import plan as planfile
from planc.placement import loss_devices, stage_record
from planc.model.probe import ModelProbe
from planc.reduction import stage_reduction_groups
from planc.resharding import groups_used, transfer_records

__all__ = ["assemble", "cluster_record", "train_record"]

TENSOR_AXIS = ir.MeshAxis.TENSOR


def assemble(decisions, ctx) -> planfile.Plan:
    """Every decision as the typed plan file (``planc.plan``), its cross-references checked
    (``Plan.check``); it checks nothing else (the launch check does, ``compile.launch_check``)."""
    reductions, (transfers, backward), pipeline = decisions
    program, stages, training = ctx.program, ctx.placement.stages, ctx.training
    cluster = program.cluster
    reds = tuple(r.record(r.mode, program.synthesis.collectives) for r in reductions)   # each plan knows its mode
    tensor_groups = _tensor_groups(stages) if training else ()
    train = train_record(program, ctx.probe, stages, ctx.untrainable) if training else None
    groups = _ordered_groups(*[[g for st in r.steps for g in st.groups] for r in reds],
                             groups_used(transfers, cluster), groups_used(backward, cluster), tensor_groups,
                             [train.norm_group] if train is not None else [])
    plan = planfile.Plan(
        program.name, cluster_record(cluster), groups, _ordered_groups(groups_used(backward, cluster)),
        tensor_groups, program.stage_mode,
        tuple(stage_record(s, program.train.micro_batch if training else None,
                           next((p for p in program.stages if p.index == s.index), None)) for s in stages), reds,
        transfer_records(program, stages, transfers, backward),
        pipeline.record() if pipeline is not None else None,
        train, _runtime(program, train), _head(program, ctx))
    try:
        return plan.check()
    except planfile.PlanFileError as e:   # a compiler bug, never the user's: say so
        raise AssertionError(f"the compiler assembled an invalid plan file: {e}") from None


def _runtime(program: ir.Program, train) -> planfile.Runtime:
    """plan.json ``runtime``: the train block's runtime settings; and its ``timeout`` where no train record
    holds it (a plan without a model: its communication-only run ends within it too); under interleaved_1f1b
    and zbv each transfer on communicators of its own (``p2p_per_transfer``)."""
    runtime = program.train.runtime
    if train is None and program.train.timeout is not None:
        runtime = dataclasses.replace(runtime, timeout=program.train.timeout)
    if train is not None and planfile.stages_per_class(str(program.train.schedule), program.train.virtual) > 1:
        runtime = dataclasses.replace(runtime, p2p_per_transfer=True)   # a pipe that comes back to a mesh
    return runtime


def _head(program: ir.Program, ctx) -> tuple:
    """plan.json's keys the runtime does not read: the source, the compiler, the placement's ranking,
    why each ``auto`` became what it is."""
    # the file's name, not the path as typed: the same plan gives the same output from any directory
    head = (("source", {"path": Path(program.source_path).name, "sha256": program.source_sha256}),
            ("compiler", {"version": __version__, "seconds": None}))   # compile_file(timings=True) fills it
    pj = ctx.placement.to_json()
    if pj is not None:
        head += (("placement", pj),)
    if any(why for _, why in ctx.choices):
        head += (("choices", {what: why for what, why in ctx.choices if why}),)
    return head


def cluster_record(c: ir.Cluster) -> planfile.Cluster:
    """The cluster as plan.json writes it; what only the compiler's cost model reads in ``extra``."""
    levels = tuple(planfile.Level(lv.name, lv.fanout, lv.bandwidth, lv.latency, lv.both_ways) for lv in c.levels)
    extra = tuple((key, getattr(c, key)) for key in ("flops", "memory", "op_overhead", "step_overhead")
                  if getattr(c, key, None) is not None)   # when given (the last two: cluster files)
    if getattr(c, "cores", None) is not None:   # cluster { cores = N per LEVEL|cluster }: cores_level None = cluster
        extra += (("cores", c.cores), ("cores_level", c.cores_level))
    if c.flops_by_precision:   # cluster { flops bf16 = ... }: {precision: FLOP/s}, where given per precision
        extra += (("flops_by_precision", dict(c.flops_by_precision)),)
    return planfile.Cluster(levels, c.host_level, c.devices, tuple(tuple(h) for h in c.hosts()), extra)


def train_record(program: ir.Program, probe: ModelProbe | None, stages, untrainable=()) -> planfile.Train:
    """The training settings with every default filled in (LANGUAGE.md, "Training settings"), the user
    code by file name, who counts the loss, the group the global gradient norm is summed over; the
    probe's per-layer parameter counts in ``extra``."""
    t = program.train
    m, lf, d = program.model, program.loss, program.data
    by_index = sorted(program.stages, key=lambda s: s.index)
    recompute = tuple(s.recompute if s.recompute is not None else t.recompute is ir.Recompute.FULL
                      for s in by_index)
    fp16 = t.precision is ir.Precision.FP16
    norm_group = (tuple(sorted({dv for s in stages for dv in s.devices}))
                  if t.clip is not None or fp16 else ())
    if isinstance(m, ir.HfModel):   # a Hugging Face model: its record, and its causal-LM loss by default
        model, loss = hfmodel.model_record(program, probe), hfmodel.loss_record(program)
    else:
        model = planfile.CodeRef(Path(m.path).name, m.function, tuple(dict(m.args).items()))
        loss = planfile.CodeRef(Path(lf.path).name, lf.function)
    return planfile.Train(
        model, loss, planfile.CodeRef(Path(d.path).name, d.function, tuple(dict(d.args).items())),
        t.micro_batch, t.micro_batches, t.steps, planfile.Schedule(str(t.schedule)),
        planfile.Optimizer.make(t.optimizer.name, t.optimizer.lr, **dict(t.optimizer.params)),   # defaults filled in
        planfile.Precision(str(t.precision)), t.seed, not untrainable, tuple(diag.message for diag in untrainable),
        loss_devices(max(stages, key=lambda s: s.index)), getattr(t, "timeout", None), getattr(t, "save_every", None),
        (("layer_params", list(probe.layer_params) if probe else None),) + hfmodel.layer_listing(probe),
        t.lr_schedule, t.zero, recompute, t.clip,
        planfile.LossScale() if fp16 else None, norm_group,
        planfile.Zero3(t.zero_prefetch, t.zero_keep_gathered) if any(
            (s.zero if s.zero is not None else t.zero) == 3 for s in by_index) else None)


def _ordered_groups(*lists) -> tuple[tuple[int, ...], ...]:
    """Every group of more than one member, members sorted, in first-use order."""
    seen: dict[tuple[int, ...], None] = {}
    for groups in lists:
        for g in groups:
            g = tuple(sorted(g))
            if len(g) > 1:
                seen.setdefault(g, None)
    return tuple(seen)


def _tensor_groups(stages) -> tuple[tuple[int, ...], ...]:
    """Tensor-parallel groups: in each stage with a mesh axis ``tensor`` of size > 1, the devices
    equal on every other mesh dimension (members sorted; sorted list, as the reductions' groups)."""
    if not any(st.axis_size(TENSOR_AXIS) > 1 for st in stages):
        return ()
    return tuple(tuple(g) for g in stage_reduction_groups(stages, (TENSOR_AXIS,)) if len(g) > 1)

