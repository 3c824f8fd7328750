"""The compiler driver: a straight line of passes from a checked plan to plan.json.

    load → probe (model sizes) → place → plan_reductions → plan_transfers
         → pipeline → plan.json (planc/1)

Every pass is pure; this module only strings them together and validates what
the model really produces against what the plan declares.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from planc import __version__, ir
from planc.lang import load
from planc.lang.errors import Diagnostic, PlanError
from planc.pipeline.schedules import build as build_pipeline
from planc.placement import place
from planc.probe import ModelProbe, check_against_model, probe_model
from planc.reduction import plan_reductions, stage_reduction_groups
from planc.resharding import groups_used, plan_transfers

FORMAT = "planc/1"


@dataclass(frozen=True, slots=True)
class CompiledPlan:
    program: ir.Program
    plan_json: dict
    untrainable: tuple[Diagnostic, ...] = ()   # why training is not supported yet (comm-only still works)

    def describe(self) -> str:
        p = self.plan_json
        parts = [f"{p['cluster']['devices']} devices", f"{len(p['stages'])} stage(s)"]
        if p.get("placement"):
            parts.append(f"matrix {p['placement']['matrix']}")
        for r in p["reductions"]:
            parts.append(f"{r['name']}: {r['program']['text']}")
        if p["transfers"]:
            parts.append(f"{len(p['transfers'])} transfer(s)")
        return "; ".join(parts)


def check_trainable(program: ir.Program, stages: tuple[ir.StageLayout, ...]) -> tuple[Diagnostic, ...]:
    """Why the training runtime cannot train this plan yet (empty: it can).

    Such a plan still compiles: its output runs with ``--comm-only``, and
    ``planc compile`` reports these as errors (exit 2) after writing it.
    """
    errs = []
    if program.train.precision is not ir.Precision.FP32:
        errs.append(Diagnostic(f"training in {program.train.precision} is not yet supported by the planc runtime "
                               "(fp32 only); use precision = fp32", program.model.span))
    sizes = {len(s.devices) for s in stages}
    if len(sizes) > 1:
        desc = ", ".join(f"stage {s.index} has {len(s.devices)}" for s in stages)
        errs.append(Diagnostic("training with stages of different device counts is not yet supported "
                               f"({desc}); drop the model to compile a communication-only plan",
                               program.stages[0].span))
    else:
        # DeepSpeed's pipeline grid is pipe x data x model: every stage needs the same split
        def split(st: ir.StageLayout) -> tuple[int, int]:
            data = st.shape[st.axes.index("data")] if "data" in st.axes else 1
            return data, len(st.devices) // data
        if len({split(st) for st in stages}) > 1:
            desc = ", ".join(f"stage {st.index}: {split(st)}" for st in stages)
            errs.append(Diagnostic("training needs every stage to have the same (data, other) mesh sizes for "
                                   f"DeepSpeed's pipeline grid; the stages have {desc}", program.stages[0].span))
    idle = sorted(set(range(program.cluster.devices)) - {d for st in stages for d in st.devices})
    if idle:
        shown = ", ".join(map(str, idle[:8])) + (", ..." if len(idle) > 8 else "")
        errs.append(Diagnostic(f"training needs every device in a stage, but devices {shown} are in none "
                               "(DeepSpeed's pipeline grid spans the whole world)", program.stages[0].span))
    for t in program.transfers:
        for side, st_index, spec in (("source", t.src_stage, t.src_spec), ("destination", t.dst_stage, t.dst_spec)):
            st = next(s for s in stages if s.index == st_index)
            want = tuple((st.axes.index("data"),) if (i == 0 and "data" in st.axes and st.shape[st.axes.index("data")] > 1)
                         else () for i in range(len(t.shape)))
            if spec.dims != want:
                errs.append(Diagnostic(
                    f"transfer '{t.name}': training needs each device's {side} shard to be its data-parallel slice "
                    f"({ir.ShardingSpec(want)} on stage {st_index}), got {spec}; other specs are supported in "
                    "communication-only plans", t.span))
    for t in program.transfers:
        if t.src_stage > t.dst_stage:
            errs.append(Diagnostic(f"transfer '{t.name}' goes from stage {t.src_stage} back to stage {t.dst_stage}; "
                                   "training needs activations to flow to later stages", t.span))
    for s in program.stages[1:]:
        if not any(t.dst_stage == s.index and t.src_stage == s.index - 1 for t in program.transfers):
            errs.append(Diagnostic(f"stage {s.index} receives no activation from stage {s.index - 1}; declare "
                                   f"'transfer NAME : DTYPE[...] from stage {s.index - 1} as ... to stage {s.index} as ...'",
                                   s.span))
    return tuple(errs)


# ---------------------------------------------------------------- the passes

def _reverse(t: ir.Transfer) -> ir.Transfer:
    return dataclasses.replace(t, src_stage=t.dst_stage, dst_stage=t.src_stage, src_spec=t.dst_spec,
                               dst_spec=t.src_spec, src_layer=None)


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
    if not any("tensor" in st.axes and st.shape[st.axes.index("tensor")] > 1 for st in stages):
        return []
    return [list(g) for g in stage_reduction_groups(stages, ("tensor",)) if len(g) > 1]


def compile_program(program: ir.Program, probe: ModelProbe | None = None) -> CompiledPlan:
    if probe is not None:
        check_against_model(program, probe)
    param_bytes = probe.stage_param_bytes(program.stages, program.train.precision) if probe else None
    placement = place(program, param_bytes)
    stages = placement.stages
    untrainable = check_trainable(program, stages) if program.model is not None else ()
    reductions = plan_reductions(program, placement.coords, stages, placement.matrix, param_bytes)
    transfers = plan_transfers(program, stages)
    backward = plan_transfers(dataclasses.replace(program, transfers=tuple(_reverse(t) for t in program.transfers)),
                              stages) if program.model is not None else ()
    pipeline = None
    if program.model is not None:
        edges = None if untrainable else tuple((t.src_stage, t.dst_stage) for t in program.transfers)
        pipeline = build_pipeline(program.train.schedule, len(stages), program.train.micro_batches, edges)

    red_json = [dict(r.to_json(), mode=str(red.mode), collectives=[str(c) for c in program.synthesis.collectives])
                for r, red in zip(reductions, program.reductions)]
    tr_json = [t.to_json() for t in transfers]
    for fwd, t in zip(tr_json, program.transfers):
        src = program.stage(t.src_stage)
        fwd["src"]["layer"] = t.src_layer if t.src_layer is not None else (
            src.layers[1] - 1 if src.layers is not None else None)
    for fwd, bwd in zip(tr_json, backward):
        b = bwd.to_json()
        fwd["backward"] = {k: b[k] for k in ("strategy", "chunks", "scheduler", "tasks", "makespan", "lower_bound",
                                             "naive_makespan")}
    tensor_groups = _tensor_groups(stages) if program.model is not None else []
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
        "source": {"path": program.source_path, "sha256": program.source_sha256},
        "compiler": {"version": __version__, "seconds": None},   # compile_file(timings=True) fills it
        "cluster": {
            "levels": [{"name": l.name, "fanout": l.fanout, "bandwidth": l.bandwidth, "latency": l.latency}
                       for l in c.levels],
            "host_level": c.host_level, "devices": c.devices,
            "hosts": [list(h) for h in c.hosts()],
        },
    }
    pj = placement.to_json()
    if pj is not None:
        plan["placement"] = pj
    plan["groups"] = groups
    if backward_groups:
        plan["backward_groups"] = backward_groups
    if tensor_groups:
        plan["tensor_groups"] = tensor_groups
    plan["stage_mode"] = str(program.stage_mode)
    plan["stages"] = [
        {"index": s.index, "layers": list(s.layers) if s.layers else None, "devices": sorted(s.devices),
         "mesh": _as_lists(s.mesh()), "mesh_axes": list(s.axes), "mesh_shape": list(s.shape),
         "mesh_devices": list(s.devices)}
        for s in stages
    ]
    plan["reductions"] = red_json
    plan["transfers"] = tr_json
    if pipeline is not None:
        plan["pipeline"] = pipeline.to_json()
    plan["train"] = _train_json(program, probe)
    if plan["train"] is not None:
        plan["train"]["trainable"] = not untrainable
        plan["train"]["not_trainable_because"] = [d.message for d in untrainable]
    return CompiledPlan(program, plan, untrainable)


def _as_lists(x):
    return [_as_lists(y) for y in x] if isinstance(x, tuple) else x


def _train_json(program: ir.Program, probe: ModelProbe | None) -> dict | None:
    if program.model is None:
        return None
    t = program.train
    m, lf, d = program.model, program.loss, program.data
    return {
        "model": {"file": Path(m.path).name, "function": m.function, "args": dict(m.args)},
        "loss": {"file": Path(lf.path).name, "function": lf.function},
        "data": {"file": Path(d.path).name, "function": d.function},
        "micro_batch": t.micro_batch, "micro_batches": t.micro_batches, "steps": t.steps,
        "schedule": str(t.schedule),
        "optimizer": {"name": t.optimizer.name, "lr": t.optimizer.lr, **dict(t.optimizer.params)},
        "precision": str(t.precision), "seed": t.seed,
        "layer_params": list(probe.layer_params) if probe else None,
    }


def compile_file(path: str | Path, probe: bool = True, timings: bool = False) -> CompiledPlan:
    t0 = time.perf_counter()
    program = load(path)
    try:
        model_probe = probe_model(program) if (probe and program.model is not None) else None
        compiled = compile_program(program, model_probe)
    except PlanError as e:   # errors found by the passes point into the plan: show its lines too
        raise e.with_source(program.source_path, Path(path).read_text()) from None
    if timings:
        compiled.plan_json["compiler"]["seconds"] = round(time.perf_counter() - t0, 3)
    return compiled


def dump_plan(plan: dict) -> str:
    """plan.json text: stable key order as built, 1-space indent, trailing newline."""
    return json.dumps(plan, indent=1, allow_nan=False) + "\n"
