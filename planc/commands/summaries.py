"""`planc check`'s summary table (re-exported by planc.commands.explain), explain's lines on sequence parallelism, tied
parameters and the vocabulary split, and the idle-devices warning that check, compile and explain print;
explain's tensor groups and its one line for the reductions with nothing to reduce."""
from __future__ import annotations

import re

from planc import plan as planfile
from planc.commands import ui
from planc.commands.ui import Col

__all__ = ["check_summary", "sequence_lines", "tied_lines", "vocab_line", "idle_devices", "idle_warning",
           "plan_idle_warning", "tensor_group_data", "tensor_group_lines", "nothing_to_reduce", "nothing_to_reduce_line"]


def check_summary(summary: str, tty: bool = False) -> list:
    """`planc check`'s output: the first line of ``planc.lang.format.summary`` (name, ok, path), then
    its ``  key   value`` lines as a two-column table; a line of another shape stays a line below it.
    The facts are summary()'s own, so check shows exactly what it says."""
    head, *lines = summary.splitlines()
    rows, notes = [], []
    for line in lines:
        m = re.match(r"^  (\S.*?)\s{2,}(\S.*)$", line)
        if m:
            rows.append([m.group(1), m.group(2)])
        else:
            notes.append(line)
    out: list = [head]
    if rows:
        out.append(ui.table([Col("item"), Col("what", wrap=True)], rows, tty=tty))
    return out + notes


def sequence_lines(stages: list[dict]) -> list[str]:
    """Which tensor stages run sequence-parallel, and why the others do not (plan.json stages[i])."""
    on = [str(s["index"]) for s in stages if s.get("sequence_parallel")]
    out = [f"sequence parallelism: stage{'s' if len(on) > 1 else ''} {', '.join(on)} (norms, residuals and the "
           "activations between stages split along the sequence over tensor)"] if on else []
    out += [f"stage {s['index']}: no sequence parallelism: {s['sequence_why']}" for s in stages
            if s.get("sequence_parallel") is False and s.get("sequence_why")]
    return out


def tied_lines(r: dict) -> list[str]:
    """The head of a tied parameter's reduction: the parameter, its holders and devices, who contributes."""
    t = r["tied"]
    stages = sorted({h["stage"] for h in t["holders"]})
    others = [d for d in t["devices"] if d not in t["contributors"]]
    out = [f"reduce tied parameter {t['parameter']}: {ui.human_bytes(r['bytes'])}, held by stages "
           f"{', '.join(map(str, stages))} on devices {t['devices']}, {r['groups']} group(s) of {r['group_size']}",
           "  holders: " + ", ".join(f"layers.{h['layer']}.{h['name']} (stage {h['stage']})" for h in t["holders"]),
           f"  summed after the last backward, before clip and the step; "
           + ("each piece's first device counts it in the norm" if t.get("pieces") else
              f"device {t['norm_device']} counts it in the norm")]
    if others:
        out.append(f"  devices {others} enter zeros (tensor replicas of a contributor's identical gradient)")
    for p in t.get("pieces") or ():
        out.append(f"  rows {p['rows'][0]}..{p['rows'][1]} of the table summed over {p['group']} (the devices "
                   "holding them)")
    return out


def vocab_line(v: dict) -> str:
    """The vocabulary split (plan.json train.model.hf.vocab): the padding of each table, where there is any."""
    parts = [f"{what} {v[key]} rows ({v[key] - v['size']} padding)" if v[key] != v["size"] else f"{what} unpadded"
             for what, key in (("embedding", "embedding"), ("lm_head", "lm_head"))]
    return (f"vocabulary split by the tensor stages: {v['size']} tokens; " + ", ".join(parts)
            + " (padding rows zero, never trained nor written to checkpoints)")


def mesh_text(mesh, most: int = 64) -> str:
    """A stage's mesh as a nested list; one of more than ``most`` devices with each level cut to its first
    two and last entries (``[[0, 8, …, 56], [64, 72, …, 120], …, [4032, 4040, …, 4088]]``) and its shape
    and size said: a 16,384-device plan's summary stays a screen (``planc explain --json`` lists all)."""
    flat = _flat(mesh)
    if len(flat) <= most:
        return str(mesh)

    def cut(m):
        if not isinstance(m, list):
            return str(m)
        items = [cut(x) for x in (m if len(m) <= 3 else [m[0], m[1], m[-1]])]
        if len(m) > 3:
            items.insert(2, "…")
        return "[" + ", ".join(items) + "]"

    shape, m = [], mesh
    while isinstance(m, list):
        shape.append(len(m))
        m = m[0] if m else None
    return f"{' x '.join(map(str, shape))} of {len(flat)} devices {cut(mesh)}"


def _flat(mesh) -> list[int]:
    return [d for m in mesh for d in _flat(m)] if isinstance(mesh, list) else [mesh]


def idle_devices(stages: list[dict], devices: int) -> list[int]:
    """The cluster's devices no stage's mesh holds (empty for a plan without stages)."""
    if not stages:
        return []
    used = {d for s in stages for d in _flat(s["mesh"])}
    return [d for d in range(devices) if d not in used]


def idle_warning(idle: list[int], devices: int) -> str:
    runs, start = [], None
    for i, d in enumerate(idle):
        if start is None:
            start = d
        if i + 1 == len(idle) or idle[i + 1] != d + 1:
            runs.append(str(start) if start == d else f"{start}..{d + 1}")
            start = None
    return (f"warning: {len(idle)} of the cluster's {devices} devices are idle (device{'s' if len(idle) > 1 else ''} "
            f"{', '.join(runs)}): no stage runs on them, yet a launch starts a rank on each; give them to a "
            "stage (a larger data axis) or use a smaller cluster")


def plan_idle_warning(plan: planfile.Plan | dict) -> list[str]:
    """The idle-devices warning of a compiled plan (or its plan.json), as ``planc check`` and ``planc compile``
    print it (``planc explain`` prints it under its stages table); empty when every device runs a stage."""
    plan = planfile.Plan.of(plan)
    n = plan.cluster.devices
    used = {d for s in plan.stages for d in s.devices}
    idle = [d for d in range(n) if d not in used] if plan.stages else []
    return [idle_warning(idle, n)] if idle else []


def tensor_group_data(plan: planfile.Plan) -> list[dict]:
    """The plan's tensor groups by stage: ``[{"stage", "tensor", "groups"}]`` (each group the devices that
    split the stage's layers and all-reduce their activations among themselves)."""
    stage_of = {d: s.index for s in plan.stages for d in s.devices}
    out: dict[int, list] = {}
    for g in plan.tensor_groups:
        out.setdefault(stage_of.get(g[0]), []).append(list(g))
    return [{"stage": s, "tensor": len(gs[0]), "groups": gs} for s, gs in sorted(out.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def tensor_group_lines(groups: list[dict], shown: int = 4) -> list[str]:
    """Per stage its tensor groups (the first ``shown``, then how many more)."""
    if not groups:
        return []
    out = ["tensor groups (each splits its stage's layers; their all-reduces stay inside it):"]
    for t in groups:
        listed = ", ".join(str(g) for g in t["groups"][:shown])
        more = f", and {len(t['groups']) - shown} more" if len(t["groups"]) > shown else ""
        out.append(f"  stage {t['stage']}: {len(t['groups'])} group(s) of {t['tensor']}: {listed}{more}")
    return out


def nothing_to_reduce(r: dict) -> bool:
    """An explain reduction whose gradients one device holds each: no program, groups of one."""
    return not r["program"] and r["group_size"] <= 1 and not r.get("tied")


def nothing_to_reduce_line(rs: list[dict]) -> str:
    """One line for the reductions (same name, axes and target) that have nothing to reduce."""
    r, stages = rs[0], [x["stage"] for x in rs if x["stage"] is not None]
    axes = " x ".join(r["axes"])
    if not stages:
        return f"{r['name']} over {', '.join(r['axes'])}: nothing to reduce: the plan has {axes} = 1 (one device holds " \
               "each gradient; no communication)"
    where = f"stage {stages[0]} has" if len(stages) == 1 else f"stages {', '.join(map(str, stages))} each have"
    return (f"{r['name']} over {', '.join(r['axes'])} (stage{'s' if len(stages) > 1 else ''} "
            f"{', '.join(map(str, stages))}): nothing to reduce: {where} {axes} = 1 (one device holds each gradient; "
            "no communication)")
