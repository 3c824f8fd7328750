"""The compiler driver: a straight line of passes from a checked plan to plan.json.

    load → probe (the model's real sizes, in a subprocess; meanwhile ranking's reduction programs are made)
         → infer (dtype, shape, specs) → place → [check_trainable] → reductions
         → transfers (forward, backward) → pipeline
         → assemble (planc.driver.assemble: the passes' records as one planc.plan.Plan) → launch check → plan.json

The pipeline pass offers candidates (with the host NIC order the simulation kept, then without);
the first whose assembled plan the launch check accepts (tags fit, no rendezvous hang) is written.

Each pass is ``(input, ctx) -> record``; every compile (unless ``--no-verify``) checks every
output with an independent checker before the next pass (``planc.driver.verify``).

Every pass is pure; this module only strings them together and validates what
the model really produces against what the plan declares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from planc import budget, ir
from planc.model import hfmodel
from planc.driver.assemble import assemble
from planc.lang import load
from planc.diagnostics import Diagnostic, PlanError
from planc.pipeline.choose import (check_pinned, choose_by_prediction, choose_schedule, predicted_record,
                                   simulate_schedules)
from planc.pipeline.cut import apply_auto_stages, more_stages_fit
from planc.pipeline.fit import needs
from planc.pipeline.memory import saved, stage_memory
from planc.pipeline.deadlock import check_rendezvous
from planc.pipeline.schedules import PipelinePlan, build as build_pipeline
from planc.pipeline.siminput import compiled_input
from planc.pipeline.zero3price import zero3_notes
from planc.placement import Placement, place, warm
from planc.model.infer import chain_transfers, decide_sequence, infer_transfers
from planc.model.probe import (ModelProbe, check_against_model, check_model_reductions, probe_for_cut, probe_model,
                         start_probe, tensor_traffic_by_stage)
from planc.reduction import plan_reductions, plan_tied
from planc.resharding import plan_routes
from planc import plan as planfile
from planc.plan.file import written
from planc.span import Span
from planc.driver.trainable import check_trainable
from planc.driver.verify import verify

FORMAT = planfile.FORMAT


@dataclass(frozen=True, slots=True)
class CompiledPlan:
    program: ir.Program
    plan_json: dict
    untrainable: tuple[Diagnostic, ...] = ()   # why training is not supported (comm-only still works)
    plan: planfile.Plan | None = None          # the typed plan file plan_json was written from

    @property
    def text(self) -> str | None:
        """plan.json's text as the compiler verified it (the bytes the plan holds), None when it holds none."""
        return self.plan.raw.decode() if self.plan is not None and self.plan.raw is not None else None

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
    profile: object = None   # a planc.commands.profile.Profile: each pass's time and memory (planc compile --profile)

    @property
    def training(self) -> bool:
        return self.program.model is not None


@budget.accepts   # budget=...: the resource bounds (planc.budget) every pass checks
def compile_program(program: ir.Program, probe: ModelProbe | None = None, verify: bool = True,
                    stages_reason: str | None = None, progress=None, profile=None) -> CompiledPlan:
    """The passes in order, each ``(input, ctx) -> record``; with ``verify`` each output is checked
    by an independent checker before the next pass runs (``planc.driver.verify``). ``progress(text)``, if
    given, is told what runs next (``PASS_TEXT``); it does not change the result."""
    program = chain_transfers(program)   # no transfer line: each stage's output to the next (the probe's too)
    ctx = Context(program, probe, verify, progress=progress, profile=profile)
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
        plan = _run("assemble", assemble_pass, (reductions, routes, cand.pipeline), cctx)
        with _section(ctx, "launch check"):
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


def _section(ctx: Context, name: str, child: bool = False):
    return ctx.profile.section(name, child) if ctx.profile is not None else contextlib.nullcontext()


def _run(name: str, fn, value, ctx: Context):
    if ctx.progress is not None:
        ctx.progress(PASS_TEXT[name])
    with _section(ctx, name):
        out = fn(value, ctx)
    if ctx.verify:
        with _section(ctx, f"verify {name}"):
            verify(name, out, ctx)
    return out


def infer_pass(program: ir.Program, ctx: Context) -> ir.Program:
    """The model as measured: stage coverage, declared types, reductions over tensor; then every
    transfer completed (dtype, shape, specs)."""
    if ctx.probe is not None:
        check_against_model(program, ctx.probe)
        check_model_reductions(program, ctx.probe)
    return infer_transfers(decide_sequence(program, ctx.probe), ctx.probe)


def _param_bytes(program: ir.Program, ctx: Context):
    """Per stage, one device's gradient bytes: fp32, whatever the precision (the runtime reduces in fp32)."""
    return ctx.probe.stage_param_bytes(program.stages, ir.Precision.FP32) if ctx.probe else None


def place_pass(program: ir.Program, ctx: Context) -> Placement:
    """The matrix, ranked by predicted communication: gradient reductions, transfers, and the
    tensor-parallel all-reduces the probe measured (no declaration needed; planc.model.probe.TensorTraffic)."""
    return place(program, _param_bytes(program, ctx), tensor_traffic=tensor_traffic_by_stage(ctx.probe, program))


def reductions_pass(program: ir.Program, ctx: Context):
    """Each stage's gradients (and standalone reductions), then every parameter tied across stages."""
    p = ctx.placement
    vocab = hfmodel.vocab_record(program, ctx.probe) if hfmodel.is_hf(program) and ctx.probe is not None else None
    tied = (plan_tied(program, p.stages, ctx.probe.tied, len(ctx.probe.layer_params), ctx.probe.tied_split, vocab)
            if ctx.training and ctx.probe is not None and ctx.probe.tied else ())
    return plan_reductions(program, p.coords, p.stages, p.matrix, _param_bytes(program, ctx)) + tied


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
        with _section(ctx, "simulate"):
            runs = _simulated(program, ctx, reductions, routes, nic)   # every schedule's predicted iteration
        chosen, choices = program, ()
        more = more_stages_fit(program, ctx.probe)   # what `stages = auto(N)` with more stages would need
        if ctx.training and program.train.schedule is not ir.PipeSchedule.AUTO:
            check_pinned(program, ctx.placement.stages, ctx.probe, more)
        if ctx.training and program.train.schedule is ir.PipeSchedule.AUTO:   # the best that fits the memory
            if runs is not None:
                schedule, why = choose_by_prediction(program, ctx.placement.stages, ctx.probe, runs[0], more)
            else:
                schedule, why = choose_schedule(program, ctx.placement.stages, ctx.probe, more)
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
    runs = simulate_schedules(sim, len(ctx.placement.stages), program.train.micro_batches, program.transfers, nic=nic,
                              schedule=program.train.schedule, virtual=program.train.virtual)
    return (runs, sim, rate) if runs is not None else None


def pipeline_pass(value, ctx: Context):
    """The schedule's per-stage lists; with a compute model, the simulator's predicted iteration."""
    program, runs = value
    if not ctx.training:
        return None
    S, B = len(ctx.placement.stages), program.train.micro_batches
    plan = build_pipeline(program.train.schedule, S, B, program.transfers, check=not ctx.untrainable,
                          virtual=program.train.virtual)
    if ctx.probe is not None:   # the memory model's bytes per device by part (docs/memory.md)
        memory = stage_memory(program, ctx.placement.stages, ctx.probe)
        lists = plan.record()   # micro-batches in flight per stage: read from the action lists
        flights = [lists.in_flight_bound(k) for k in range(S)]
        z3 = zero3_notes(memory, flights, *((runs[1], plan.actions) if runs is not None else ()))
        # a mesh of several stages (interleaved_1f1b, zbv): what its devices hold for all of them at once
        mesh = {n.stage: n.total for n in needs(memory, program.train.schedule, B, program.train.virtual)
                if n.mates} if any(len(c.stages) > 1 for c in plan.actions) else {}
        plan = dataclasses.replace(plan, memory=tuple(
            dict(m.parts(f), **({"mesh_total": mesh[m.stage]} if m.stage in mesh else {}),
                 **({"saved": saved(m, f)} if saved(m, f) else {}), **({"zero3": z} if z else {}))
            for m, f, z in zip(memory, flights, z3)))
    if runs is None:
        return plan
    runs, sim, rate = runs
    prediction = runs[program.train.schedule][1]
    given = program.cluster.flops_for(program.train.precision) is not None
    return dataclasses.replace(plan, predicted_iteration=prediction.iteration, predicted=predicted_record(
        sim, prediction, rate, given, runs), nic_order=prediction.nic_order)


def assemble_pass(value, ctx: Context) -> planfile.Plan:
    """The records as one plan file, holding the bytes plan.json will have (verified read back as them)."""
    return written(assemble(value, ctx))


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
    shared: dict = {}   # what the two backends' checks share (the tails' verdict)
    return (check_rendezvous(plan, ahead=ahead, shared=shared)
            + check_rendezvous(plan, ahead=ahead, backend="gloo", shared=shared))


def _plan_span(program: ir.Program):
    """Where a finding about the whole launched plan points: the schedule as written (its lists are what
    runs), else the first stage, else the file."""
    if program.train is not None and program.train.schedule_span.line > 0:
        return program.train.schedule_span
    if program.stages and program.stages[0].span.line > 0:
        return program.stages[0].span
    return Span.unknown(program.source_path)


@budget.accepts   # budget=...: the resource bounds (planc.budget), from load on
def compile_file(path: str | Path, probe: bool = True, timings: bool = False, verify: bool = True,
                 progress=None, cache=None, profile=None) -> CompiledPlan:
    """Load, probe and compile one plan file. ``verify`` (on unless ``planc compile --no-verify``)
    checks every pass's output independently. ``progress(text)``: told what runs
    next (the CLI's spinner on a terminal; see ``compile_program``). ``cache``: where the model probe's
    answers are kept across compiles (``planc.model.probe_cache``: a ``ProbeCache``, a folder, True for
    ``~/.cache/planc/probe/``; None: probe every time). ``profile``: a ``planc.commands.profile.Profile`` that
    records each pass's seconds and memory. The model is probed once: a plan whose stages are cut
    (``stages = auto(N)``) gets the cut's probe from the chain probe (``planc.model.probe.probe_for_cut``)
    and probes again only when the cut's dataflow is not the chain."""
    say = progress or (lambda text: None)
    cache = _cache(cache)
    ctx = Context(None, profile=profile)
    t0 = time.perf_counter()
    with _section(ctx, "load"):
        program = chain_transfers(load(path))   # no transfer line: the chain, which the probe measures
    try:
        model_probe = None
        if probe and program.model is not None:
            say(PASS_TEXT["probe"])
            pending = start_probe(program, cache=cache)   # the subprocess runs while ranking's programs are made
            with _section(ctx, "warm place"), contextlib.suppress(PlanError):
                warm(program, stop=pending.done)   # a plan error here is the place pass's to report, after the probe's
            with _section(ctx, "probe", child=True):     # what is left to wait for
                model_probe = pending.result()
        stages_reason = None
        if program.auto_stages:   # stages = auto(N): cut the layers, then the cut's dataflow from the same probe
            with _section(ctx, "cut"):
                program, stages_reason = apply_auto_stages(program, model_probe)
                cut_probe = probe_for_cut(model_probe, program)
            if cut_probe is None:   # not a chain (skips, layers past LAYER_TRAFFIC): probe the cut program
                say(PASS_TEXT["probe"] + " (the cut's dataflow)")
                with _section(ctx, "probe (the cut)", child=True):
                    cut_probe = probe_model(program, cache=cache)
            model_probe = cut_probe
        compiled = compile_program(program, model_probe, verify=verify, stages_reason=stages_reason,
                                   progress=progress, profile=profile)
    except PlanError as e:   # errors found by the passes point into the plan: show its lines too
        raise e.with_source(program.source_path, Path(path).read_text()) from None
    if timings:
        compiled.plan_json["compiler"]["seconds"] = round(time.perf_counter() - t0, 3)
        compiled = dataclasses.replace(compiled, plan=planfile.Plan.from_json(compiled.plan_json))   # no stale text
    return compiled


def _cache(cache):
    if cache is None or cache is False:
        return None
    from planc.model.probe_cache import ProbeCache
    if isinstance(cache, ProbeCache):
        return cache
    return ProbeCache(None if cache is True else cache)


def dump_plan(plan: dict) -> str:
    """plan.json text, written by the plan file's one writer (``planfile.dumps``)."""
    return planfile.dumps(planfile.Plan.from_json(plan))
