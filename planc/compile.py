"""The compiler driver: a straight line of passes from a checked plan to plan.json.

    load → probe (the model's real sizes, in a subprocess)
         → infer (dtype, shape, specs) → place → [check_trainable] → reductions
         → transfers (forward, backward) → pipeline → assemble (planfile.Plan) → launch check → plan.json

The pipeline pass offers candidates (with the host NIC order the simulation kept, then without);
the first whose assembled plan the launch check accepts (tags fit, no rendezvous hang) is written.

Each pass is ``(input, ctx) -> record``; every compile (unless ``--no-verify``) checks every
output with an independent checker before the next pass (``planc.verify``).

Every pass is pure; this module only strings them together and validates what
the model really produces against what the plan declares.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from planc import __version__, budget, ir
from planc.lang import load
from planc.lang.errors import Diagnostic, PlanError
from planc.pipeline.choose import choose_by_prediction, choose_schedule, predicted_record, simulate_schedules
from planc.pipeline.cut import apply_auto_stages
from planc.pipeline.deadlock import check_rendezvous
from planc.pipeline.schedules import PipelinePlan, build as build_pipeline
from planc.pipeline.siminput import compiled_input
from planc.placement import Placement, place
from planc.infer import infer_transfers
from planc.probe import (ModelProbe, check_against_model, check_model_reductions, probe_model,
                         tensor_traffic_by_stage)
from planc.reduction import plan_reductions, stage_reduction_groups
from planc.resharding import groups_used, plan_routes
from planc.resharding import device_region
from planc import plan as planfile
from planc.span import Span
from planc.trainable import check_trainable, stage_data_degree
from planc.verify import verify

FORMAT = "planc/1"
DATA_AXIS, TENSOR_AXIS = ir.MeshAxis.DATA, ir.MeshAxis.TENSOR


@dataclass(frozen=True, slots=True)
class CompiledPlan:
    program: ir.Program
    plan_json: dict
    untrainable: tuple[Diagnostic, ...] = ()   # why training is not supported (comm-only still works)
    plan: planfile.Plan | None = None          # the typed plan file plan_json was written from

    def describe(self) -> str:
        p = self.plan_json
        parts = [f"{p['cluster']['devices']} devices", f"{len(p['stages'])} stage(s)"]
        if p.get("placement"):
            parts.append(f"matrix {p['placement']['matrix']}")
        for r in p["reductions"]:
            where = f" (stage {r['stage']})" if r.get("stage") is not None else ""
            parts.append(f"{r['name']}{where}: {r['program']['text'] or 'nothing to reduce'}")
        if p["transfers"]:
            parts.append(f"{len(p['transfers'])} transfer(s)")
        return "; ".join(parts)


# ---------------------------------------------------------------- the passes

def _ordered_groups(*lists) -> list[list[int]]:
    seen: dict[tuple[int, ...], None] = {}
    for groups in lists:
        for g in groups:
            g = tuple(sorted(g))
            if len(g) > 1:
                seen.setdefault(g, None)
    return [list(g) for g in seen]


def _tensor_groups(stages) -> list[list[int]]:
    """Tensor-parallel groups: in each stage with a mesh axis ``tensor`` of size > 1, the devices
    equal on every other mesh dimension (members sorted; sorted list, as the reductions' groups)."""
    if not any(st.axis_size(TENSOR_AXIS) > 1 for st in stages):
        return []
    return [list(g) for g in stage_reduction_groups(stages, (TENSOR_AXIS,)) if len(g) > 1]


@dataclass(frozen=True, slots=True)
class Context:
    """What the passes read besides their input: the probe, and what earlier passes decided."""

    program: ir.Program
    probe: ModelProbe | None = None
    verify: bool = False
    placement: Placement | None = None
    untrainable: tuple[Diagnostic, ...] = ()
    choices: tuple = ()     # (what, why) of decisions made for `auto` (stage cut, schedule)
    progress: object = None  # progress(text) before each pass (planc compile's spinner on a terminal)

    @property
    def training(self) -> bool:
        return self.program.model is not None


@budget.accepts   # budget=...: the resource bounds (planc.budget) every pass checks
def compile_program(program: ir.Program, probe: ModelProbe | None = None, verify: bool = True,
                    stages_reason: str | None = None, progress=None) -> CompiledPlan:
    """The passes in order, each ``(input, ctx) -> record``; with ``verify`` each output is checked
    by an independent checker before the next pass runs (``planc.verify``). ``progress(text)``, if
    given, is told what runs next (``PASS_TEXT``); it does not change the result."""
    ctx = Context(program, probe, verify, progress=progress)
    program = _run("infer", infer_pass, program, ctx)
    ctx = dataclasses.replace(ctx, program=program)
    placement = _run("place", place_pass, program, ctx)
    choices = (("stages", stages_reason),)
    ctx = dataclasses.replace(ctx, program=program, placement=placement, choices=choices,
                              untrainable=check_trainable(program, placement.stages) if ctx.training else ())
    reductions = _run("reductions", reductions_pass, program, ctx)
    routes = _run("transfers", transfers_pass, program, ctx)
    if progress is not None:
        progress(PASS_TEXT["simulate"])
    program, ctx, plan = launchable(program, ctx, reductions, routes)
    return CompiledPlan(program, plan.to_json(), ctx.untrainable, plan)


def launchable(program: ir.Program, ctx: Context, reductions, routes) -> tuple[ir.Program, Context, planfile.Plan]:
    """pipeline → assemble → launch check over the schedule pass's candidates, best first: the first the
    launch check accepts, with why any before it was turned down in ``choices``; a located error when it
    accepts none."""
    rejected = ()   # (what, why) of the candidates turned down
    for cand in schedule_candidates(program, ctx, reductions, routes):
        cctx = dataclasses.replace(ctx, program=cand.program, choices=ctx.choices + rejected + cand.choices)
        plan = _run("assemble", assemble, (reductions, routes, cand.pipeline), cctx)
        hangs = launch_check(plan, cctx)
        if not hangs:
            return cand.program, cctx, plan
        if cand.pipeline is None or not cand.pipeline.nic_order:
            break
        # the host NIC order is an optimisation the simulation kept; the rendezvous check (every rank's
        # issue order, the receive threads' queues) finds it could hang: the next candidate runs without it
        rejected += (("nic_order", "none: the host NIC order the simulation kept could hang the lists under "
                                   f"rendezvous semantics ({hangs[0]}); the plan runs without one"),)
    raise RendezvousHang(Diagnostic("the plan could hang when launched:\n  " + "\n  ".join(map(str, hangs)),
                                    _plan_span(cand.program)), hangs, bool(cand.pipeline and cand.pipeline.nic_order))


class RendezvousHang(PlanError):
    """The launch check's finding that the plan could hang with every candidate schedule; ``nic_ordered``:
    the last candidate had a host NIC order."""

    def __init__(self, diagnostic: Diagnostic, hangs: list, nic_ordered: bool):
        super().__init__(diagnostic)
        self.hangs, self.nic_ordered = hangs, nic_ordered


PASS_TEXT = {"probe": "probing the model", "infer": "inferring transfers", "place": "ranking placements",
             "reductions": "synthesizing reductions", "transfers": "planning resharding",
             "simulate": "simulating schedules", "pipeline": "building the pipeline", "assemble": "assembling plan.json"}


def _run(name: str, fn, value, ctx: Context):
    if ctx.progress is not None:
        ctx.progress(PASS_TEXT[name])
    out = fn(value, ctx)
    if ctx.verify:
        verify(name, out, ctx)
    return out


def infer_pass(program: ir.Program, ctx: Context) -> ir.Program:
    """The model as measured: stage coverage, declared types, reductions over tensor; then every
    transfer completed (dtype, shape, specs)."""
    if ctx.probe is not None:
        check_against_model(program, ctx.probe)
        check_model_reductions(program, ctx.probe)
    return infer_transfers(program, ctx.probe)


def _param_bytes(program: ir.Program, ctx: Context):
    return ctx.probe.stage_param_bytes(program.stages, program.train.precision) if ctx.probe else None


def place_pass(program: ir.Program, ctx: Context) -> Placement:
    """The matrix, ranked by predicted communication: gradient reductions, transfers, and the
    tensor-parallel all-reduces the probe measured (no declaration needed; planc.probe.TensorTraffic)."""
    return place(program, _param_bytes(program, ctx), tensor_traffic=tensor_traffic_by_stage(ctx.probe))


def reductions_pass(program: ir.Program, ctx: Context):
    p = ctx.placement
    return plan_reductions(program, p.coords, p.stages, p.matrix, _param_bytes(program, ctx))


def transfers_pass(program: ir.Program, ctx: Context):
    """Every transfer's forward plan and, in training plans, its gradient's way back."""
    return plan_routes(program, ctx.placement.stages, backward=ctx.training)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A schedule the launch check may accept: the program with its schedule decided, the ``(what, why)``
    choices that decided it, and its lists (None: not a training plan)."""

    program: ir.Program
    choices: tuple
    pipeline: PipelinePlan | None


def schedule_candidates(program: ir.Program, ctx: Context, reductions, routes):
    """The pipeline pass's candidates, best first, each simulated only when asked for: the schedule the
    simulation predicts fastest with the host NIC order it kept, then, when it kept one, the schedule
    chosen again by the simulation without any order (``schedule = auto`` is decided anew)."""
    for nic in (True, False):
        runs = _simulated(program, ctx, reductions, routes, nic)   # every schedule's predicted iteration
        chosen, choices = program, ()
        if ctx.training and program.train.schedule is ir.PipeSchedule.AUTO:   # the best that fits the memory
            if runs is not None:
                schedule, why = choose_by_prediction(program, ctx.placement.stages, ctx.probe, runs[0])
            else:
                schedule, why = choose_schedule(program, ctx.placement.stages, ctx.probe)
            chosen = dataclasses.replace(program, train=dataclasses.replace(program.train, schedule=schedule))
            choices = (("schedule", why),)
        cctx = dataclasses.replace(ctx, program=chosen, choices=ctx.choices + choices)
        pipeline = _run("pipeline", pipeline_pass, (chosen, runs), cctx)
        yield Candidate(chosen, choices, pipeline)
        if pipeline is None or not pipeline.nic_order:
            return


def _simulated(program: ir.Program, ctx: Context, reductions, routes, nic: bool = True):
    """``(runs, sim, flops)``: each schedule's lists and predicted iteration (planc.pipeline.simulate), or
    None when there is nothing to predict (no training, no probe, or a plan the runtime cannot train)."""
    if not ctx.training or ctx.untrainable or ctx.probe is None:
        return None
    sim, rate = compiled_input(program, ctx.placement.stages, ctx.probe, reductions, routes)
    edges = tuple((t.src_stage, t.dst_stage) for t in program.transfers)
    runs = simulate_schedules(sim, len(ctx.placement.stages), program.train.micro_batches, edges, nic=nic)
    return (runs, sim, rate) if runs is not None else None


def pipeline_pass(value, ctx: Context):
    """The schedule's per-stage lists; with a compute model, the simulator's predicted iteration."""
    program, runs = value
    if not ctx.training:
        return None
    edges = None if ctx.untrainable else tuple((t.src_stage, t.dst_stage) for t in program.transfers)
    plan = build_pipeline(program.train.schedule, len(ctx.placement.stages), program.train.micro_batches, edges)
    if runs is None:
        return plan
    runs, sim, rate = runs
    prediction = runs[program.train.schedule][1]
    return dataclasses.replace(plan, predicted_iteration=prediction.iteration, predicted=predicted_record(
        sim, prediction, rate, program.cluster.flops is not None, runs), nic_order=prediction.nic_order)


def assemble(decisions, ctx: Context) -> planfile.Plan:
    """Every decision as the typed plan file (``planc.plan``), validated on construction; it
    checks nothing else (the launch check does, ``launch_check``)."""
    reductions, (transfers, backward), pipeline = decisions
    program, probe, placement, untrainable = ctx.program, ctx.probe, ctx.placement, ctx.untrainable
    training = ctx.training
    red_json = [dict(r.to_json(), mode=str(_reduction_of(program, r.name).mode),
                     collectives=[str(c) for c in program.synthesis.collectives]) for r in reductions]
    stages = placement.stages
    layout = {s.index: s for s in stages}
    tr_json = []
    for i, (fwd, t) in enumerate(zip(transfers, program.transfers)):
        rec = fwd.to_json()
        src = program.stage(t.src_stage)
        rec["src"]["layer"] = t.src_layer if t.src_layer is not None else (
            src.layers[1] - 1 if src.layers is not None else None)
        _add_parts(rec, program.cluster)
        rec["regions"] = _regions(t.shape, layout[t.src_stage], t.src_spec, layout[t.dst_stage], t.dst_spec)
        if backward:
            b = backward[i].to_json()
            back = {k: b[k] for k in ("strategy", "chunks", "scheduler", "tasks", "makespan", "lower_bound",
                                      "naive_makespan")}
            _add_parts(back, program.cluster)
            back["regions"] = _regions(t.shape, layout[t.dst_stage], t.dst_spec, layout[t.src_stage], t.src_spec)
            rec["backward"] = back
        tr_json.append(rec)
    tensor_groups = _tensor_groups(stages) if training else []
    groups = _ordered_groups(
        *[[g for st in r["program"]["steps"] for g in st["groups"]] for r in red_json],
        groups_used(transfers, program.cluster),
        groups_used(backward, program.cluster),
        tensor_groups,
    )
    backward_groups = _ordered_groups(groups_used(backward, program.cluster))
    c = program.cluster
    plan = {
        "format": FORMAT,
        "name": program.name,
        # the file's name, not the path as typed: the same plan gives the same output from any directory
        "source": {"path": Path(program.source_path).name, "sha256": program.source_sha256},
        "compiler": {"version": __version__, "seconds": None},   # compile_file(timings=True) fills it
        "cluster": {
            "levels": [{"name": lv.name, "fanout": lv.fanout, "bandwidth": lv.bandwidth, "latency": lv.latency,
                        **({"both_ways": lv.both_ways} if lv.both_ways is not None else {})}
                       for lv in c.levels],
            "host_level": c.host_level, "devices": c.devices,
            "hosts": [list(h) for h in c.hosts()],
        },
    }
    for key in ("flops", "memory", "op_overhead", "step_overhead"):   # when given (the last two: cluster files)
        if getattr(c, key, None) is not None:
            plan["cluster"][key] = getattr(c, key)
    if getattr(c, "cores", None) is not None:   # cluster { cores = N per LEVEL|cluster }: cores_level None = cluster
        plan["cluster"].update(cores=c.cores, cores_level=c.cores_level)
    pj = placement.to_json()
    if pj is not None:
        plan["placement"] = pj
    plan["groups"] = groups
    if backward_groups:
        plan["backward_groups"] = backward_groups
    if tensor_groups:
        plan["tensor_groups"] = tensor_groups
    plan["stage_mode"] = str(program.stage_mode)
    plan["stages"] = [_stage_json(s, program.train.micro_batch if training else None) for s in stages]
    if any(why for _, why in ctx.choices):
        plan["choices"] = {what: why for what, why in ctx.choices if why}   # why `auto` became what it is
    plan["reductions"] = red_json
    plan["transfers"] = tr_json
    if pipeline is not None:
        plan["pipeline"] = pipeline.to_json()
    if training:
        plan["train"] = _train_json(program, probe, stages)
        plan["train"]["trainable"] = not untrainable
        plan["train"]["not_trainable_because"] = [d.message for d in untrainable]
    plan["runtime"] = program.train.runtime.to_json()
    try:
        return planfile.Plan.from_json(plan)
    except planfile.PlanFileError as e:   # a compiler bug, never the user's: say so
        raise AssertionError(f"the compiler assembled an invalid plan file: {e}") from None


def launch_check(plan: planfile.Plan, ctx: Context) -> list:
    """What would stop the assembled plan once launched: its message tags must fit in the point-to-point
    tag bits (else a located error), and the hangs of every rank's issue order simulated under rendezvous
    semantics (``planc.pipeline.deadlock``; empty: it cannot hang)."""
    program, training = ctx.program, ctx.training
    tags = plan.tag_layout()
    if tags.total > planfile.TagLayout.MAX_BITS:
        raise PlanError(Diagnostic(
            f"the plan needs {tags.total}-bit message tags ({len(program.transfers)} transfers, "
            f"{program.train.micro_batches if training else 1} micro-batches, up to {2 ** tags.task_bits} unit tasks "
            f"per transfer) but point-to-point tags have {planfile.TagLayout.MAX_BITS} bits; use fewer micro-batches "
            "or coarser shardings", program.transfers[0].span if program.transfers else _plan_span(program)))
    ahead = plan.runtime.recv_ahead   # the depth the runtime runs with (plan.json runtime)
    return check_rendezvous(plan, ahead=ahead) + check_rendezvous(plan, ahead=ahead, backend="gloo")


def _plan_span(program: ir.Program):
    """Where a finding about the whole launched plan points: the schedule as written (its lists are what
    runs), else the first stage, else the file."""
    if program.train is not None and program.train.schedule_span.line > 0:
        return program.train.schedule_span
    if program.stages and program.stages[0].span.line > 0:
        return program.stages[0].span
    return Span.unknown(program.source_path)


def _reduction_of(program: ir.Program, name: str) -> ir.Reduction:
    return next(r for r in program.reductions if r.name == name)


def _regions(shape, src: ir.StageLayout, src_spec, dst: ir.StageLayout, dst_spec) -> dict:
    """Every device's region on each mesh, half-open global ranges (plan.json ``regions``)."""
    def side(layout, spec):
        return {str(d): [list(r) for r in device_region(tuple(shape), layout, spec, d)]
                for d in sorted(layout.devices)}
    return {"src": side(src, src_spec), "dst": side(dst, dst_spec)}


def _add_parts(rec: dict, cluster: ir.Cluster) -> None:
    """Allgather strategies: each task's receiver sets that gather among themselves, written out."""
    strategy = rec["strategy"]
    if strategy not in (str(ir.Strategy.LOCAL_ALLGATHER), str(ir.Strategy.GLOBAL_ALLGATHER)):
        return
    for task in rec["tasks"]:
        if strategy == str(ir.Strategy.GLOBAL_ALLGATHER):
            task["parts"] = [sorted(task["receivers"])]
        else:
            by_host: dict[int, list[int]] = {}
            for r in task["receivers"]:
                by_host.setdefault(cluster.host_of(r), []).append(r)
            task["parts"] = [sorted(v) for _, v in sorted(by_host.items())]


def _stage_json(s: ir.StageLayout, micro_batch: int | None) -> dict:
    out = {"index": s.index, "layers": list(s.layers) if s.layers else None, "devices": sorted(s.devices),
           "mesh": _as_lists(s.mesh()), "mesh_axes": list(s.axes), "mesh_shape": list(s.shape),
           "mesh_devices": list(s.devices)}
    if micro_batch is None:
        return out
    data = stage_data_degree(s)
    k = s.axes.index(DATA_AXIS) if DATA_AXIS in s.axes else None
    rows = {}
    for d in sorted(s.devices):
        i = s.position(d)[k] if k is not None else 0
        rows[str(d)] = [i * micro_batch // data, (i + 1) * micro_batch // data]
    out["rows"] = rows
    out["data_groups"] = [list(g) for g in _split(s, k, along=True)]
    out["model_groups"] = [list(g) for g in _split(s, k, along=False)]
    return out


def _split(s: ir.StageLayout, k: int | None, along: bool) -> list[tuple[int, ...]]:
    """along: devices equal on every mesh dim but ``k`` (a data group); else devices equal on ``k``."""
    groups: dict[tuple, list[int]] = {}
    for d in s.devices:
        pos = s.position(d)
        if along:
            key = tuple(v for i, v in enumerate(pos) if i != k)
        else:
            key = (pos[k],) if k is not None else ()
        groups.setdefault(key, []).append(d)
    return sorted(tuple(sorted(g)) for g in groups.values())


def _as_lists(x):
    return [_as_lists(y) for y in x] if isinstance(x, tuple) else x


def _train_json(program: ir.Program, probe: ModelProbe | None, stages) -> dict:
    t = program.train
    m, lf, d = program.model, program.loss, program.data
    out = {
        "model": {"file": Path(m.path).name, "function": m.function, "args": dict(m.args)},
        "loss": {"file": Path(lf.path).name, "function": lf.function},
        "data": {"file": Path(d.path).name, "function": d.function},
        "micro_batch": t.micro_batch, "micro_batches": t.micro_batches, "steps": t.steps,
        "schedule": str(t.schedule),
        "optimizer": {"name": t.optimizer.name, "lr": t.optimizer.lr, **dict(t.optimizer.params)},
        "precision": str(t.precision), "seed": t.seed,
        "layer_params": list(probe.layer_params) if probe else None,
        "loss_devices": _loss_devices(max(stages, key=lambda s: s.index)),
    }
    for key in ("timeout", "save_every"):   # train { timeout = 60 s, save_every = N }
        if getattr(t, key, None) is not None:
            out[key] = getattr(t, key)
    return out


def _loss_devices(last: ir.StageLayout) -> list[int]:
    """One device per row range of the last stage: the one at position 0 on every mesh dim but ``data``."""
    k = last.axes.index(DATA_AXIS) if DATA_AXIS in last.axes else None
    return sorted(d for d in last.devices if all(v == 0 for i, v in enumerate(last.position(d)) if i != k))


@budget.accepts   # budget=...: the resource bounds (planc.budget), from load on
def compile_file(path: str | Path, probe: bool = True, timings: bool = False, verify: bool = True,
                 progress=None) -> CompiledPlan:
    """Load, probe and compile one plan file. ``verify`` (on unless ``planc compile --no-verify``)
    checks every pass's output independently. ``progress(text)``: told what runs
    next (the CLI's spinner on a terminal; see ``compile_program``)."""
    say = progress or (lambda text: None)
    t0 = time.perf_counter()
    program = load(path)
    try:
        if probe and program.model is not None:
            say(PASS_TEXT["probe"])
        model_probe = probe_model(program) if (probe and program.model is not None) else None
        stages_reason = None
        if program.auto_stages:   # stages = auto(N): cut the layers first, then probe the cut's real dataflow
            program, stages_reason = apply_auto_stages(program, model_probe)
            say(PASS_TEXT["probe"] + " (the cut's dataflow)")
            model_probe = probe_model(program)
        compiled = compile_program(program, model_probe, verify=verify, stages_reason=stages_reason,
                                   progress=progress)
    except PlanError as e:   # errors found by the passes point into the plan: show its lines too
        raise e.with_source(program.source_path, Path(path).read_text()) from None
    if timings:
        compiled.plan_json["compiler"]["seconds"] = round(time.perf_counter() - t0, 3)
    return compiled


def dump_plan(plan: dict) -> str:
    """plan.json text, written by the plan file's one writer (``planfile.dumps``)."""
    return planfile.dumps(planfile.Plan.from_json(plan))
