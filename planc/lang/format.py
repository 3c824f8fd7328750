"""IR → canonical .plan text and IR → JSON-able dicts (for `planc check --json`)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math

from planc import ir
from planc.span import Span


def to_data(obj):
    """Plain JSON-able data for any IR record (spans dropped, enums as their spelling)."""
    if isinstance(obj, Span):
        return None
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, ir.ShardingSpec):
        return str(obj)
    if isinstance(obj, ir.Instruction):
        return str(obj)
    if isinstance(obj, ir.HfModel):   # where each key is written is not data
        return {"hf": {"architecture": obj.architecture, "folder": obj.folder, "config": to_data(obj.config)}}
    if dataclasses.is_dataclass(obj):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.name != "span" and not f.name.endswith("_span")}
    if isinstance(obj, (tuple, list)):
        return [to_data(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(v) for k, v in obj.items()}
    return obj


def to_json(program: ir.Program) -> str:
    return json.dumps(to_data(program), indent=2, sort_keys=False)


def _num(x: float) -> str:
    if float(x).is_integer():
        return str(int(x))
    return repr(float(x))


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    if isinstance(v, str):
        return v if v.isidentifier() else f'"{v}"'
    if isinstance(v, (int, float)):
        return _num(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(v)


def _arg(v) -> str:
    """An optimizer argument: a number, or a pair in parentheses (``betas = (0.9, 0.999)``)."""
    if isinstance(v, tuple):
        return "(" + ", ".join(_num(x) for x in v) + ")"
    return _num(v)


def _spec(spec: ir.ShardingSpec) -> str:
    return str(spec)


def to_text(p: ir.Program) -> str:
    """The canonical text of a checked plan; parsing it gives back an equal Program."""
    out = [f"plan {p.name} {{", "  cluster {"]
    for l in p.cluster.levels:
        attrs = []
        if l.bandwidth is not None:
            attrs.append(f"bandwidth {_num(l.bandwidth)} B/s")
        if l.latency:
            attrs.append(f"latency {_num(l.latency)} s")
        out.append(f"    level {l.name} x {l.fanout}" + (" : " + ", ".join(attrs) if attrs else ""))
    out.append(f"    host = {p.cluster.host_level}")
    if p.cluster.flops is not None:
        out.append(f"    flops = {_num(p.cluster.flops)} FLOP/s")
    for precision, rate in p.cluster.flops_by_precision:
        out.append(f"    flops {precision} = {_num(rate)} FLOP/s")
    if p.cluster.memory is not None:
        out.append(f"    memory = {_num(p.cluster.memory)} B")
    if p.cluster.cores is not None:   # `per cluster` (None) reads back as a level named `cluster`, if one is
        out.append(f"    cores = {p.cluster.cores} per {p.cluster.cores_level or 'cluster'}")
    out.append("  }")
    if p.parallel is not None:
        out.append("  parallel {")
        for a in p.parallel.axes:
            out.append(f"    {a.name} = {a.size}")
        if p.parallel.matrix is None:
            out.append("    place = auto")
        else:
            out.append("    place = [" + ", ".join("[" + ", ".join(map(str, r)) + "]" for r in p.parallel.matrix) + "]")
        out.append("  }")
    if p.model is not None:
        args = ", ".join(f"{k} = {_value(v)}" for k, v in p.model.args)
        ref = (f'hf "{p.model.architecture or p.model.folder}"' if isinstance(p.model, ir.HfModel)
               else f'"{p.model.path}:{p.model.function}"')
        out.append(f'  model {ref}' + (f" {{ {args} }}" if args else ""))
    for kind in ("loss", "data"):
        ref = getattr(p, kind)
        if ref is not None:
            args = ", ".join(f"{k} = {_value(v)}" for k, v in ref.args)
            out.append(f'  {kind} "{ref.path}:{ref.function}"' + (f" {{ {args} }}" if args else ""))
    # stages = auto(N) has no stage lines: a stage's `recompute` or `zero N` needs its `layers auto` line
    pipe_auto = (p.stage_mode is ir.StageMode.PIPE_AXIS and any(s.auto_layers for s in p.stages)
                 and not any(s.recompute or s.zero is not None for s in p.stages))
    if pipe_auto:
        out.append(f"  stages = auto({len(p.stages)})")
    for s in p.stages:
        if p.stage_mode is ir.StageMode.PIPE_AXIS and ((s.layers is None and not s.auto_layers) or pipe_auto):
            continue
        line = f"  stage {s.index}"
        if s.auto_layers:
            line += " : layers auto"
        elif s.layers is not None:
            line += f" : layers {s.layers[0]}..{s.layers[1]}"
        if s.first_device is not None:
            dims = ", ".join(f"{n} = {m}" for n, m in zip(s.mesh_axes, s.mesh_shape))
            line += f" on devices {s.first_device}..{s.first_device + len(s.explicit_devices)} as ({dims})"
        if s.recompute:
            line += " recompute"
        if s.zero is not None:
            line += f" zero {s.zero}"
        out.append(line)
    for t in p.transfers:   # an omitted type or spec (measured / derived at compile time) stays omitted
        layer = f" layer {t.src_layer}" if t.src_layer is not None else ""
        ttype = f" : {t.dtype}[{', '.join(map(str, t.shape))}]" if t.shape is not None else ""
        src = f" as {_spec(t.src_spec)}" if t.src_spec is not None else ""
        dst = f" as {_spec(t.dst_spec)}" if t.dst_spec is not None else ""
        out.append(f"  transfer {t.name}{ttype} from stage {t.src_stage}{layer}{src} to stage {t.dst_stage}{dst}")
    for r in p.reductions:
        line = f"  reduce {r.name} over {', '.join(r.axes)}"
        if r.mode is ir.ReductionMode.ALLREDUCE:
            line += " using allreduce"
        elif r.mode is ir.ReductionMode.PROGRAM:
            line += " using " + ir.program_text(r.program)
        if r.shape is not None:
            line += f" : {r.dtype}[{', '.join(map(str, r.shape))}]"
        out.append(line)
    rs = p.resharding
    sched = {
        ir.SchedulerKind.DFS: f"dfs(budget = {_num(rs.dfs_budget_s)} s)",
        ir.SchedulerKind.RANDOMIZED_GREEDY: f"randomized_greedy(trials = {rs.trials}, seed = {rs.seed})",
    }.get(rs.scheduler, str(rs.scheduler))
    out.append(f"  resharding {{ strategy = {rs.strategy}, chunks = {rs.chunks}, schedule = {sched} }}")
    out.append(f"  synthesis {{ max_size = {p.synthesis.max_size}, collectives = [{', '.join(map(str, p.synthesis.collectives))}] }}")
    t = p.train
    opt_args = ", ".join([f"lr = {_num(t.optimizer.lr)}"] + [f"{k} = {_arg(v)}" for k, v in t.optimizer.params])
    out.append("  train {")
    out.append(f"    micro_batch = {t.micro_batch}, micro_batches = {t.micro_batches}, steps = {t.steps}")
    sched = f"interleaved_1f1b(virtual = {t.virtual})" if t.schedule == "interleaved_1f1b" else str(t.schedule)
    out.append(f"    schedule = {sched}, optimizer = {t.optimizer.name}({opt_args})")
    ls = t.lr_schedule
    out.append("    lr_schedule = " + (str(ls.name) if ls.name == "constant" else
                                       f"{ls.name}(warmup = {ls.warmup}, total = {ls.total}, "
                                       f"min_ratio = {_num(ls.min_ratio)})"))
    out.append(f"    precision = {t.precision}, zero = {t.zero}, recompute = {t.recompute}, seed = {t.seed}")
    if t.clip is not None:
        out.append(f"    clip = {_num(t.clip)}")
    if t.timeout is not None:
        out.append(f"    timeout = {_num(t.timeout)} s")
    if t.save_every is not None:
        out.append(f"    save_every = {t.save_every}")
    if not t.sequence_parallel:
        out.append("    sequence_parallel = false")
    out.append("  }")
    if p.deepspeed_overrides:
        out.append(f'  deepspeed "{p.deepspeed_overrides}"')
    out.append("}")
    return "\n".join(out) + "\n"


def summary(p: ir.Program) -> str:
    c = p.cluster
    lines = [f"{p.name}: ok ({p.source_path})"]
    lines.append(f"  devices    {c.devices} on {c.num_hosts} host(s) of {c.devices_per_host} "
                 f"({' x '.join(f'{l.name} {l.fanout}' for l in c.levels)}; host = {c.host_level})")
    if c.flops is not None or c.memory is not None or c.flops_by_precision:
        each = [f"{c.flops / 1e12:g} TFLOP/s" if c.flops is not None else None,
                *(f"{rate / 1e12:g} TFLOP/s in {precision}" for precision, rate in c.flops_by_precision),
                f"{c.memory / 1e9:g} GB memory" if c.memory is not None else None]
        lines.append(f"  device     {', '.join(x for x in each if x)} each")
    if c.cores is not None:
        pools = c.core_pools()
        where = f"one per {c.cores_level}, {len(pools)} in all" if c.cores_level else "one for the whole cluster"
        lines.append(f"  cores      {c.cores} shared by the {len(pools[0])} device(s) of each pool ({where})")
    if p.parallel is not None:
        place = "auto" if p.parallel.matrix is None else "pinned " + str([list(r) for r in p.parallel.matrix])
        lines.append(f"  axes       {', '.join(f'{a.name} {a.size}' for a in p.parallel.axes)} (place = {place})")
    for s in p.stages:
        mesh = ir.stage_mesh(s, p.parallel)
        n = len(s.explicit_devices) if s.explicit_devices else (math.prod(mesh[0]) if mesh else c.devices)
        layers = (f"layers {s.layers[0]}..{s.layers[1]}" if s.layers else "layers auto (cut at compile time)"
                  if s.auto_layers else "all layers" if p.model else "no layers")
        where = f" on devices {s.explicit_devices[0]}..{s.explicit_devices[-1] + 1} as {s.mesh_shape}" if s.explicit_devices else ""
        again = ", recomputes its forward" if s.recompute or p.train.recompute is ir.Recompute.FULL else ""
        zero = s.zero if s.zero is not None else p.train.zero
        again += f", ZeRO-{zero}" if zero else ""
        lines.append(f"  stage {s.index}    {layers}, {n} device(s){where}, mesh axes ({', '.join(s.mesh_axes)}){again}")
    for t in p.transfers:
        ttype = f"{t.dtype}{list(t.shape)}" if t.shape is not None else "(type measured on the model)"
        src = t.src_spec if t.src_spec is not None else "derived"
        dst = t.dst_spec if t.dst_spec is not None else "derived"
        lines.append(f"  transfer   {t.name} {ttype}: stage {t.src_stage} ({src}) -> stage {t.dst_stage} ({dst})")
    for r in p.reductions:
        how = {ir.ReductionMode.SYNTHESIZE: "synthesized", ir.ReductionMode.ALLREDUCE: "flat allreduce",
               ir.ReductionMode.PROGRAM: "pinned: " + (ir.program_text(r.program) if r.program else "")}[r.mode]
        lines.append(f"  reduce     {r.name} over {', '.join(r.axes)} ({how})")
    if p.model is None:
        lines.append("  (communication-only plan: no model)")
    return "\n".join(lines)
