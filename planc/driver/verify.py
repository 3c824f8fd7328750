"""Verification between the compiler's passes (``planc compile --verify``; always on in the tests).

Each verifier looks at one pass's output with code that knows nothing of how it
was found — the reduction programs are replayed by ``planc.reduction.check``
(the collective semantics of DESIGN.md, against each program's target; ZeRO-1's all-gather must
start exactly where its reduce-scatter's steps end), the transfers by
``planc.resharding.check`` (regions recomputed from the specs, coverage, NIC
timelines, the lower bound), the plan file by its own validating reader — and
returns what is wrong. The driver names the pass whose output failed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

from planc import ir
from planc.reduction.check import check_pair, check_program, check_tied, check_tied_pieces
from planc.resharding.check import check_plan
from planc import plan as planfile

__all__ = ["VerifyError", "VERIFIERS", "verify"]


class VerifyError(AssertionError):
    """A pass produced output that its independent checker rejects: a compiler bug, never the user's."""


def _inferred(program: ir.Program, _ctx) -> list[str]:
    out = []
    for t in program.transfers:
        if t.dtype is None or t.shape is None or t.src_spec is None or t.dst_spec is None:
            out.append(f"transfer '{t.name}' is still missing its dtype, shape or a spec")
        elif t.dtype not in ir.DTYPE_BYTES:
            out.append(f"transfer '{t.name}' has dtype {t.dtype!r}")
    return out


def _placed(placement, ctx) -> list[str]:
    """Stage meshes of the right size inside the cluster, disjoint but where the schedule runs several stages
    on one mesh (interleaved_1f1b, zbv: ``planc.plan.class_stages``), which then have the same mesh."""
    out, seen = [], {}
    n = ctx.program.cluster.devices
    t = ctx.program.train
    mates: dict[int, tuple] = {}
    if t is not None and planfile.stages_per_class(str(t.schedule), t.virtual) > 1 and ctx.program.model is not None:
        for cls in planfile.class_stages(str(t.schedule), len(placement.stages), t.virtual):
            mates.update((s, cls) for s in cls)
    mesh = {st.index: (st.devices, st.shape) for st in placement.stages}
    for st in placement.stages:
        size = 1
        for s in st.shape:
            size *= s
        if size != len(st.devices) or len(set(st.devices)) != len(st.devices):
            out.append(f"stage {st.index}: {len(st.devices)} devices for a mesh of shape {list(st.shape)}")
        for d in st.devices:
            if not 0 <= d < n:
                out.append(f"stage {st.index} uses device {d}, the cluster has {n}")
            if d in seen and (seen[d] not in mates.get(st.index, ()) or mesh[seen[d]] != mesh[st.index]):
                out.append(f"device {d} is in stages {seen[d]} and {st.index}")
            seen[d] = st.index
    return out


def _where(r) -> str:
    return f"reduction {r.name!r}{f' (stage {r.stage})' if r.stage is not None else ''}"


def _units(owned) -> tuple[int | None, list | None]:
    """A plan's owned pieces (fractions) as whole units of their least common denominator."""
    if not owned:
        return None, None
    unit = math.lcm(*(x.denominator for row in owned for ab in row for x in ab))
    return unit, [[(int(a * unit), int(b * unit)) for a, b in row] for row in owned]


def _reduced(reductions, _ctx) -> list[str]:
    out = []
    for r in reductions:
        if not r.groups:
            continue
        unit, owned = _units(r.owned)
        steps = [(str(c), g) for c, g in r.steps]
        why = check_program(steps, r.groups, unit=unit, target=str(r.target), owned=owned)
        if why is None and getattr(r, "tied", None) is not None:
            why = check_tied(steps, r.groups, r.tied.contributors, _holder_keys(r.tied, _ctx.placement.stages),
                             pieces=r.tied.split.rows if r.tied.split is not None else None)
        if why is not None:
            out.append(f"{_where(r)}: {why}")
    out += _pieces(reductions, _ctx.placement.stages, "")
    for rs, ag in _pairs(reductions, out):
        unit, owned = _units(rs.owned)
        _, ag_owned = _units(ag.owned)
        why = check_pair(([(str(c), g) for c, g in rs.steps], rs.groups, unit, owned),
                         ([(str(c), g) for c, g in ag.steps], ag.groups, unit, ag_owned))
        if why is not None:
            out.append(f"{_where(rs)} and {_where(ag)}: {why}")
    return out


def _pieces(reductions, stages, prefix: str) -> list[str]:
    """Every tied table split by rows: its pieces, over all its reductions, checked against the rows each
    holding device keeps (``check_tied_pieces``, from the stages alone)."""
    by: dict[str, list] = {}
    for r in reductions:
        t = getattr(r, "tied", None)
        if t is not None and t.split is not None:
            by.setdefault(t.parameter, []).append(r)
    out = []
    for name, rs in by.items():
        t = rs[0].tied
        held = [st for st in stages if st.index in {h.stage for h in t.holders}]
        why = check_tied_pieces([(r.tied.split, r.groups) for r in rs], held, t.split.size, t.split.padded)
        if why is not None:
            out.append(f"{prefix}tied parameter {name}: {why}")
    return out


def _holder_keys(tied, stages) -> dict:
    """Per device of the stages holding a tied parameter, what its gradient sums over: (stage, its mesh
    position without the ``tensor`` coordinate), derived here from the stages alone (``StageLayout``s
    or plan.json ``Stage``s)."""
    out = {}
    for st in stages:
        if st.index not in {h.stage for h in tied.holders}:
            continue
        axes = tuple(getattr(st, "axes", None) or getattr(st, "mesh_axes", ()))
        for d in st.devices:
            pos = st.position(d)
            out[d] = (st.index, tuple(x for i, x in enumerate(pos) if axes[i] != ir.MeshAxis.TENSOR))
    return out


def _pairs(reductions, problems: list[str]) -> list:
    """ZeRO-1's (reduce-scatter, all-gather) pairs: one all-gather per reduce-scatter, over the same
    groups of the same stage; an unpaired one is a problem."""
    scatters = [r for r in reductions if str(r.target) == "reduce_scatter"]
    gathers = [r for r in reductions if str(r.target) == "all_gather"]
    pairs = []
    for rs in scatters:
        mates = [ag for ag in gathers if ag.stage == rs.stage and tuple(ag.groups) == tuple(rs.groups)]
        if len(mates) != 1:
            problems.append(f"{_where(rs)}: {len(mates)} all-gather programs over its groups, not one")
            continue
        pairs.append((rs, mates[0]))
        gathers.remove(mates[0])
    problems += [f"{_where(ag)}: no reduce-scatter program over its groups" for ag in gathers]
    return [(rs, ag) for rs, ag in pairs if rs.groups]


def _json_view(ctx, transfers) -> dict:
    """The shape of plan.json the resharding checker reads: cluster, stages, transfers, groups."""
    c = ctx.program.cluster
    stages = [{"index": s.index, "mesh": _as_lists(s.mesh()), "devices": sorted(s.devices)}
              for s in ctx.placement.stages]
    return {"cluster": {"levels": [{"name": lv.name, "fanout": lv.fanout, "bandwidth": lv.bandwidth,
                                    "latency": lv.latency} for lv in c.levels],
                        "host_level": c.host_level, "devices": c.devices, "hosts": [list(h) for h in c.hosts()]},
            "stages": stages, "transfers": [t.to_json() for t in transfers]}


def _as_lists(x):
    return [_as_lists(y) for y in x] if isinstance(x, tuple) else x


def _routed(routes, ctx) -> list[str]:
    out = []
    forward, backward = routes
    for label, plans in (("forward", forward), ("backward", backward)):
        if not plans:
            continue
        view = _json_view(ctx, plans)   # check_plan checks every transfer (check_transfer), then what they share
        out += [f"{label}: {e}" for e in check_plan(view)]
    return out


def _scheduled(pipeline, ctx) -> list[str]:
    if pipeline is None:
        return []
    m = pipeline.micro_batches
    out = []
    for s, ops in enumerate(pipeline.per_stage):
        f = [i for k, i in ops if k == "F"]
        b = [i for k, i in ops if k == "B"]
        w = [i for k, i in ops if k == "W"]
        if sorted(f) != list(range(m)) or sorted(b) != list(range(m)) or (w and sorted(w) != list(range(m))):
            out.append(f"stage {s} does not run F and B (and W, if any) of every micro-batch once")
        elif any(ops.index(("B", i)) < ops.index(("F", i)) for i in range(m)):
            out.append(f"stage {s} runs a backward before its forward")
        elif w and any(ops.index(("W", i)) < ops.index(("B", i)) for i in range(m)):
            out.append(f"stage {s} runs a weight-gradient pass before its backward")
    return out


def _assembled(plan: planfile.Plan, _ctx) -> list[str]:
    # the bytes plan.json will hold (planc.plan.file.written; else the one writer's now), read back by the
    # runtime's validating reader, must be these records: what every rank will execute is what was decided
    raw = plan.raw if plan.raw is not None else planfile.dumps(plan).encode()
    try:
        again = planfile.Plan.from_json(json.loads(raw))
    except planfile.PlanFileError as e:
        return [str(e)]
    except ValueError as e:
        return [f"plan.json is not valid JSON ({e})"]
    out = [] if again == plan else ["plan.json's bytes do not read back as the assembled records"]
    for r in plan.reductions:   # the typed steps the runtime executes, replayed with their regions
        if not r.groups:
            continue
        why = check_program([(str(s.collective), s.groups) for s in r.steps], r.groups, unit=r.unit,
                            regions=[s.regions for s in r.steps], target=str(r.target),
                            owned=r.owned if r.owned else None)
        if why is None and r.tied is not None:
            why = check_tied([(str(s.collective), s.groups) for s in r.steps], r.groups, r.tied.contributors,
                             _holder_keys(r.tied, plan.stages), unit=r.unit, regions=[s.regions for s in r.steps],
                             pieces=r.tied.split.rows if r.tied.split is not None else None)
        if why is not None:
            out.append(f"plan.json {_where(r)}: {why}")
    out += _pieces(plan.reductions, plan.stages, "plan.json ")
    for rs, ag in _pairs(plan.reductions, out):   # the all-gather starts where the reduce-scatter's steps end
        why = check_pair(([(str(s.collective), s.groups) for s in rs.steps], rs.groups, rs.unit, rs.owned),
                         ([(str(s.collective), s.groups) for s in ag.steps], ag.groups, ag.unit, ag.owned))
        if why is not None:
            out.append(f"plan.json {_where(rs)} and {_where(ag)}: {why}")
    return out


VERIFIERS: dict[str, Callable] = {
    "infer": _inferred, "place": _placed, "reductions": _reduced, "transfers": _routed,
    "pipeline": _scheduled, "assemble": _assembled,
}


def verify(pass_name: str, output, ctx) -> None:
    """Raise VerifyError naming ``pass_name`` when its output fails its independent check."""
    problems = VERIFIERS[pass_name](output, ctx)
    if problems:
        raise VerifyError(f"--verify: the output of pass '{pass_name}' is invalid:\n  " + "\n  ".join(problems))
