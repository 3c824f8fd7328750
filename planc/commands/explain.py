"""`planc explain`: what planc decided for a plan, and why, from its plan.json.

``explain_data(plan)`` gathers the content once, as plain JSON-able data (times in seconds, sizes in
bytes, deterministic key order); ``planc explain --json`` prints it and ``explain_renderables``
lays it out as rich tables that fit 80 columns: the placement matrix and the ranking of the
matrices, each stage's mesh, per reduction (per stage for explicit-stage gradients) the program
against the flat collective of its target (allreduce; with zero = 1 the gradients' reduce_scatter and
the parameters' all_gather, who owns which piece, and the pair against the flat pair; with zero = 3 the
gather per layer, its price per micro-batch and zero_keep_gathered priced both ways) with its steps
and alternatives, per transfer its strategy, unit tasks
and schedule, each device's host and its region (half-open ``a:b`` per dim) on the source and
destination meshes, then the pipeline's instruction lists.

It reads the typed plan (``planc.plan.Plan``; a plan.json document is read once, validated, with
``Plan.from_json``): the records the runtime runs, and the compiler's predictions and reasons as
``planc.plan.Notes``.
"""

from __future__ import annotations

from planc import plan as planfile
from planc.commands import ui
from planc.pipeline.simulate import NIC_ORDER_GAIN
from planc.commands.summaries import check_summary, idle_devices, idle_warning, sequence_lines  # noqa: F401 - re-exported
from planc.commands.summaries import nothing_to_reduce, nothing_to_reduce_line, tensor_group_data, tensor_group_lines
from planc.commands.summaries import mesh_text, tied_lines, vocab_line
from planc.commands.explain_zero3 import gather_lines, memory_note
from planc.commands.ui import Col


_t = ui.human_seconds


_bytes = ui.human_bytes


def _ranges(region) -> str:
    """A region, one half-open global range ``a:b`` per tensor dimension: ``[0:4, 0:64]``."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


# ---------------------------------------------------------------------------------------------
# the content, as data


def _region_rows(src, dst, host_of: dict[int, int]) -> list[dict]:
    """One row per device: its host, then its region on the source and/or destination mesh (``None``
    where the device is not on that mesh); ``src`` and ``dst`` a route's (device, region) pairs."""
    src, dst = dict(src), dict(dst)
    return [{"device": d, "host": host_of.get(d), "src": _lists(src.get(d)), "dst": _lists(dst.get(d))}
            for d in sorted(set(src) | set(dst))]


def _lists(region):
    return None if region is None else [list(r) for r in region]


def _transfer_data(t: planfile.Transfer, notes: planfile.TransferNotes, host_of: dict[int, int],
                   peers: list[str]) -> dict:
    fwd, lb = t.forward, notes.lower_bound
    out = {
        "name": t.name, "dtype": t.dtype, "shape": list(t.shape),
        "src": {"stage": t.src_stage, "spec": t.src_spec}, "dst": {"stage": t.dst_stage, "spec": t.dst_spec},
        "tasks": len(fwd.tasks), "strategy": str(fwd.strategy), "local": fwd.local,
        "chunks": fwd.chunks if fwd.strategy is planfile.Strategy.BROADCAST else None,
        "scheduler": fwd.scheduler, "makespan": notes.makespan, "lower_bound": lb,
        "ratio": notes.makespan / lb if lb else None, "naive_makespan": notes.naive_makespan,
        "shares_nic_with": peers, "regions": _region_rows(fwd.src_regions, fwd.dst_regions, host_of), "backward": None,
    }
    back = t.backward
    if back is not None:
        same = back.src_regions == fwd.dst_regions and back.dst_regions == fwd.src_regions
        out["backward"] = {"same_regions_reversed": same,
                           "regions": None if same else _region_rows(back.src_regions, back.dst_regions, host_of)}
    return out


def explain_data(plan: planfile.Plan | dict) -> dict:
    """Everything `planc explain` shows, as JSON-able data (seconds, bytes; keys in a fixed order), from the
    typed plan (a plan.json document is read once with ``Plan.from_json``)."""
    plan = planfile.Plan.of(plan)
    notes = planfile.Notes.read(plan)
    c = plan.cluster
    data: dict = {
        "plan": plan.name,
        "cluster": {"devices": c.devices, "levels": [{"name": lv.name, "fanout": lv.fanout} for lv in c.levels],
                    "hosts": len(c.hosts), "host_level": c.host_level},
        "placement": None,
    }
    pl = notes.placement
    if pl:
        ranked = pl.ranked
        if len(ranked) > 1:
            why = (f"predicted communication per iteration {_t(ranked[0].predicted)}, vs "
                   f"{_t(ranked[1].predicted)} for the runner-up {_lists(ranked[1].matrix)}")
        else:
            why = f"pinned by the plan; predicted communication per iteration {_t(ranked[0].predicted)}"
        data["placement"] = {
            "candidates": pl.candidates, "axes": [n for n, _ in pl.axes],
            "sizes": [size for _, size in pl.axes], "levels": [lv.name for lv in c.levels],
            "matrix": _lists(pl.matrix), "why": why, "search": pl.search, "evaluated": pl.evaluated,
            "ranked": [{"matrix": _lists(r.matrix), "predicted": r.predicted, "breakdown": dict(r.breakdown)}
                       for r in ranked],
        }
    data["stages"] = [{"index": s.index, "layers": list(s.layers) if s.layers else None, "mesh": s.mesh,
                       "mesh_axes": list(s.mesh_axes),
                       "sequence_parallel": s.sequence_parallel if s.axis_size("tensor") > 1 else None,
                       "sequence_why": why} for s, why in zip(plan.stages, notes.sequence_why)]
    data["tensor_groups"] = tensor_group_data(plan)
    if notes.layers:   # a Hugging Face model's layers (plan.json train.layers), each with the stage holding it
        stage_of = {i: s.index for s in plan.stages if s.layers for i in range(*s.layers)}
        data["layers"] = [{"index": i, "name": lay.name, "stage": stage_of.get(i), "params": lay.params,
                           "flops": None if lay.flops is None else list(lay.flops)}
                          for i, lay in enumerate(notes.layers)]
    vocab = getattr(plan.train.model, "vocab", None) if plan.train is not None else None
    if vocab:   # the vocabulary split of the embedding table and lm_head (docs/models.md), padded where it is
        data["vocab"] = vocab.to_json()
    host_of = {d: h for h, devs in enumerate(c.hosts) for d in devs}

    def in_host(groups) -> bool:
        return bool(host_of) and all(len({host_of.get(d) for d in g}) == 1 for g in groups)

    z3 = {st.stage: st.zero3 for st in (notes.pipeline.stages if notes.pipeline else ()) if st.zero3}
    data["reductions"] = [_reduction_data(r, n, in_host, str(plan.runtime.in_host))
                          for r, n in zip(plan.reductions, notes.reductions)]
    for r, d in zip(plan.reductions, data["reductions"]):   # ZeRO's programs: the stage's degree (1 or 2)
        if str(r.target) != "allreduce" and plan.train is not None:
            d["zero"] = plan.zero_of(r.stage) if r.stage is not None else plan.train.zero
            if str(r.target) == "all_gather" and z3:   # zero 3: gathered per layer, priced both ways
                d["zero3"] = [[k, z] for k, z in sorted(z3.items()) if r.stage is None or k == r.stage] or None
    _zero_pairs(data["reductions"])
    by_src: dict[int, list[str]] = {}
    for t in plan.transfers:
        by_src.setdefault(t.src_stage, []).append(t.name)
    data["transfers"] = [_transfer_data(t, n, host_of, [x for x in by_src[t.src_stage] if x != t.name])
                         for t, n in zip(plan.transfers, notes.transfers)]
    pipe = plan.pipeline
    data["pipeline"] = None if pipe is None else {
        "schedule": str(pipe.schedule) + (f"(virtual = {pipe.virtual})" if pipe.virtual > 1 else ""),
        "micro_batches": pipe.micro_batches, "predicted_iteration": notes.pipeline.predicted_iteration,
        "actions": [{"stages": list(c.stages), "list": [a.text() for a in c.actions]} for c in pipe.actions],
        "nic_order": _nic_data(pipe, notes.pipeline), "memory": _memory_data(plan, notes)}
    data["choices"] = dict(notes.choices)       # what `auto` became, and why
    return data


def _reduction_data(r: planfile.Reduction, notes: planfile.ReductionNotes, in_host, through: str) -> dict:
    target = str(r.target)
    prog, flat = r.predicted, notes.flat_predicted
    entry = {
        "name": r.name, "axes": list(r.axes), "stage": r.stage, "bytes": r.nbytes,
        "groups": len(r.groups), "group_size": len(r.groups[0]) if r.groups else 0,
        "hierarchy": [{"name": n, "factor": f} for n, f in notes.hierarchy],
        "program": r.text, "predicted": prog, "allreduce_predicted": flat,
        "speedup": flat / prog if prog else None, "candidates": notes.candidates,
        "steps": [{"collective": str(s.collective), "groups": len(s.groups), "example": list(s.groups[0]),
                   "in_host": in_host(s.groups)} for s in r.steps],
        "alternatives": [{"predicted": p, "text": text} for p, text in notes.alternatives],
        "in_host_through": through,
    }
    if target != "allreduce":   # ZeRO-1: who owns which piece, the flat collective of the target
        entry = {k: v for k, v in entry.items() if k != "allreduce_predicted"}
        entry.update(target=target, flat_predicted=flat, unit=r.unit,
                     owned=[[{"device": d, "piece": list(p)} for d, p in zip(g, row)]
                            for g, row in zip(r.groups, r.owned)])
    if r.tied is not None:   # a parameter tied across stages: who holds it, who contributes
        t = r.tied
        entry["tied"] = {"parameter": t.parameter, "holders": [h.to_json() for h in t.holders],
                         "devices": sorted(d for g in r.groups for d in g),
                         "contributors": list(t.contributors), "norm_device": t.norm_device}
        if t.split is not None:   # a table split by vocabulary: each group sums its piece of rows
            entry["tied"]["pieces"] = [{"rows": list(ab), "group": list(g)} for ab, g in zip(t.split.rows, r.groups)]
    return entry


def _memory_data(plan: planfile.Plan, notes: planfile.Notes) -> dict | None:
    """Each stage's bytes per device by part (docs/memory.md), what zero and recompute saved, the limit."""
    stages = notes.pipeline.stages if notes.pipeline is not None else ()
    if not any(st.memory for st in stages):
        return None
    train = plan.train
    rc = train.recompute if train is not None else ()
    return {"limit": notes.memory_limit, "zero": train.zero if train is not None else 0,
            "precision": str(train.precision) if train is not None else None,
            "stages": [{"stage": st.stage, **dict(st.memory or ()), "saved": dict(st.saved),
                        "recompute": bool(rc[st.stage]) if st.stage < len(rc) else False,
                        "zero": plan.zero_of(st.stage), **({"zero3": st.zero3} if st.zero3 else {})} for st in stages]}


def _memory_lines(mem: dict, tty: bool) -> list:
    limit = f"limit {_bytes(mem['limit'])} per device" if mem["limit"] else "no limit given (cluster memory = ...)"
    out = [f"memory per device by stage (its largest device; {mem['precision']}, zero = {mem['zero']}; {limit}; "
           "docs/memory.md):"]
    rows, notes, transient = [], [], []
    for st in mem["stages"]:
        over = " (over)" if mem["limit"] and st.get("total", 0) > mem["limit"] else ""
        rows.append([st["stage"], _bytes(st["parameters"]), _bytes(st["gradients"]), _bytes(st["optimizer"]),
                     _bytes(st["activations"]) + (" (rc)" if st["recompute"] else ""),
                     _bytes(st["logits"]) if "logits" in st else "-", _bytes(st["total"]) + over])
        transient.append([st["stage"], *(_bytes(st[k]) if k in st else "-" for k in ("step", "build"))])
        saved = st["saved"]
        if saved:
            what = [f"zero = {st.get('zero', mem['zero'])} {_saved(saved['zero'])} of optimizer state"
                    + (f" and {_saved(saved['zero_gradients'])} of gradients (reduce-scattered every micro-batch; "
                       "a few buckets staged whole)" if "zero_gradients" in saved else "")
                    + (f" and {_saved(saved['zero_parameters'])} of parameters ({memory_note(st['zero3'])})"
                       if "zero_parameters" in saved and st.get("zero3") else "")] if "zero" in saved else []
            what += [f"recompute saved {_bytes(saved['recompute'])} of activations"] if "recompute" in saved else []
            notes.append(f"  stage {st['stage']}: " + "; ".join(what))
    out.append(ui.table([Col("stage", "right"), Col("parameters", "right"), Col("gradients", "right"),
                         Col("optimizer", "right"), Col("activations", "right"), Col("logits", "right"),
                         Col("total", "right")], rows, tty=tty))
    out.append("  total = parameters + gradients + optimizer + the larger of activations + logits and the "
               "optimizer step's temporary; what a rank allocates at start (building its share) and at the step:")
    out.append(ui.table([Col("stage", "right"), Col("optimizer step", "right"), Col("at start (build)", "right")],
                        transient, tty=tty))
    mesh = [f"stage {st['stage']}: {_bytes(st['mesh_total'])}" for st in mem["stages"] if "mesh_total" in st]
    notes += [f"  a device holds every stage of its mesh at once, in all (docs/memory.md): {', '.join(mesh)}"] \
        if mesh else []
    return out + notes + (["  (rc: the stage recomputes; it keeps only its inputs per micro-batch in flight)"]
                          if any(st["recompute"] for st in mem["stages"]) else [])


def _saved(n: int) -> str:
    """``saved X``, or ``added X`` where the setting costs bytes (fp32 masters of a tiny stage, say)."""
    return f"saved {_bytes(n)}" if n >= 0 else f"added {_bytes(-n)}"


def _zero_pairs(reductions: list[dict]) -> None:
    """ZeRO-1: each all-gather gets ``pair``, the two programs' predictions together against the flat pair's."""
    scatters = {(r["stage"], r["name"]): r for r in reductions if r.get("target") == "reduce_scatter"}
    for r in reductions:
        if r.get("target") != "all_gather":
            continue
        rs = next((x for (stage, _), x in scatters.items() if stage == r["stage"] and x["owned"] == r["owned"]), None)
        if rs is not None:
            r["pair"] = {"with": rs["name"], "predicted": rs["predicted"] + r["predicted"],
                         "flat_predicted": rs["flat_predicted"] + r["flat_predicted"]}


def _nic_data(pipe: planfile.Pipeline, notes: planfile.PipelineNotes) -> dict | None:
    """The host NIC order's decision for the plan's schedule: kept or not, the two predictions, sends per host."""
    sched = notes.schedule(str(pipe.schedule))
    if sched is None or sched.unordered_iteration is None:
        return None       # no simulation: nothing was decided
    return {"kept": bool(pipe.nic_order), "unordered": sched.unordered_iteration,
            "ordered": sched.iteration if sched.nic_ordered else None,
            "sends": {h: len(sends) for h, sends in pipe.nic_order}}


def _nic_line(nic: dict) -> str:
    if nic["kept"]:
        per = ", ".join(f"host {h}: {n}" for h, n in sorted(nic["sends"].items()))
        return (f"host NIC order: kept; each host's cross-host sends one at a time in the plan's order ({per} per "
                f"step), predicted {_t(nic['ordered'])} against {_t(nic['unordered'])} as they come "
                "(docs/simulator.md)")
    return (f"host NIC order: none; one at a time was not predicted at least {NIC_ORDER_GAIN * 100:g} % faster than "
            f"the sends as they come ({_t(nic['unordered'])})")


# ---------------------------------------------------------------------------------------------
# the content, laid out


def _region_table(rows: list[dict], tty: bool):
    return ui.table([Col("device", "right"), Col("host", "right"), Col("src region", wrap=True),
                     Col("dst region", wrap=True)],
                    [[r["device"], "?" if r["host"] is None else r["host"],
                      "" if r["src"] is None else _ranges(r["src"]), "" if r["dst"] is None else _ranges(r["dst"])]
                     for r in rows], tty=tty)


def _placement(pl: dict, tty: bool) -> list:
    out = [f"placement: {pl['candidates']} parallelism matrices fit; chosen (rows = axes, columns = levels):",
           ui.table([Col("axis")] + [Col(n, "right") for n in pl["levels"]],
                    [[a] + row for a, row in zip(pl["axes"], pl["matrix"])], tty=tty),
           f"  why: {pl['why']}"]
    if pl["search"]:
        out.append(f"  ranking: {pl['search']}, {pl['evaluated']} matrices costed by the cost model")
    out.append(ui.table([Col("matrix"), Col("predicted", "right"), Col("breakdown", wrap=True)],
                        [[str(r["matrix"]), _t(r["predicted"]),
                          "\n".join(f"{k} {_t(v)}" for k, v in r["breakdown"].items())]
                         for r in pl["ranked"]], tty=tty))
    return out


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:g}"


def _layers(layers: list[dict], tty: bool):
    return ui.table([Col("layer", "right"), Col("name"), Col("stage", "right"), Col("parameters", "right"),
                     Col("forward FLOPs", "right"), Col("backward FLOPs", "right")],
                    [[lay["index"], lay["name"], "" if lay["stage"] is None else lay["stage"], _count(lay["params"]),
                      _count(lay["flops"][0]) if lay["flops"] else "-", _count(lay["flops"][1]) if lay["flops"] else "-"]
                     for lay in layers], tty=tty)


def _stages(stages: list[dict], tty: bool):
    return ui.table([Col("stage", "right"), Col("layers"), Col("mesh", wrap=True), Col("mesh axes", wrap=True)],
                    [[s["index"], f"{s['layers'][0]}..{s['layers'][1]}" if s["layers"] else "none",
                      str(s["mesh"]), ", ".join(s["mesh_axes"])] for s in stages], tty=tty)


_VERB = {"allreduce": "reduce", "reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}


def _owned_line(r: dict) -> list[str]:
    """Who owns which piece: the first group, then each other group unless it follows the same pattern."""
    if not r["owned"]:
        return []

    def pieces(group):
        return ", ".join(f"[{m['piece'][0]}, {m['piece'][1]}) device {m['device']}"
                         for m in sorted(group, key=lambda m: m["piece"]))

    what = "after the reduce-scatter" if r["target"] == "reduce_scatter" else "where the all-gather starts"
    out = [f"  pieces {what} (in 1/{r['unit']} of the buffer): {pieces(r['owned'][0])}"]
    pattern = [m["piece"] for m in r["owned"][0]]
    others = r["owned"][1:]
    if others and all([m["piece"] for m in g] == pattern for g in others):
        out.append(f"  each of the other {len(others)} group(s) likewise, member by member")
    else:
        out += [f"  and {pieces(g)}" for g in others]
    return out


def _reduction(r: dict, tty: bool) -> list:
    where = f" (stage {r['stage']})" if r["stage"] is not None else ""
    target = r.get("target", "allreduce")
    flat_name = "allreduce" if target == "allreduce" else target
    flat = r["allreduce_predicted"] if target == "allreduce" else r["flat_predicted"]
    speed = f"{r['speedup']:.2f}x vs flat {flat_name}" if r["speedup"] is not None else "no data to move"
    zero = "" if target == "allreduce" else f" (zero = {r.get('zero', 1)})"
    out = [f"{_VERB[target]} {r['name']} over {', '.join(r['axes'])}{where}{zero}: {_bytes(r['bytes'])} per group, "
           f"{r['groups']} group(s) of {r['group_size']}"] if not r.get("tied") else tied_lines(r)
    if r["hierarchy"]:
        out.append("  synthesis hierarchy: root > " + " > ".join(f"{h['name']}({h['factor']})" for h in r["hierarchy"]))
    out.append(f"  program: {r['program'] or 'nothing to reduce'}")
    out.append(f"  predicted {_t(r['predicted'])}; flat {flat_name} {_t(flat)} ({speed}); "
               f"{r['candidates']} valid program(s) found")
    if target != "allreduce":
        out += _owned_line(r)
    for stage, z in r.get("zero3") or ():
        out += gather_lines(z, stage)
    if r.get("pair"):
        p = r["pair"]
        ratio = f"{p['flat_predicted'] / p['predicted']:.2f}x" if p["predicted"] else "no data to move"
        out.append(f"  with the {p['with']}' reduce-scatter: {_t(p['predicted'])} against the flat "
                   f"reduce_scatter + all_gather {_t(p['flat_predicted'])} ({ratio})")
    if r["steps"]:
        out.append(ui.table([Col("step", "right"), Col("collective"), Col("groups", "right"), Col("links"),
                             Col("e.g.", wrap=True)],
                            [[i, s["collective"], s["groups"], "in host" if s.get("in_host") else "across hosts",
                              str(s["example"])] for i, s in enumerate(r["steps"], 1)], tty=tty))
        if any(s.get("in_host") for s in r["steps"]):
            how = ("through the host's shared memory on gloo (docs/runtime.md)"
                   if r.get("in_host_through", "shared_memory") == "shared_memory"
                   else "over the backend's collectives (train { in_host = backend })")
            out.append(f"  in-host steps: {how}, NCCL's own transport on GPUs")
    if r["alternatives"]:
        out.append("  alternatives (one instruction per line):")
        out.append(ui.table([Col("predicted", "right"), Col("program", wrap=True)],
                            [[_t(a["predicted"]), ";\n".join(x.strip() for x in a["text"].split(";"))]
                             for a in r["alternatives"]], tty=tty))
    return out


def _transfers_overview(transfers: list[dict], tty: bool):
    def strategy(t):
        return t["strategy"] + (f" x{t['chunks']}" if t["chunks"] is not None else "")
    return ui.table([Col("transfer", wrap=True), Col("stages"), Col("strategy"), Col("tasks", "right"),
                     Col("makespan", "right"), Col("bound", "right"), Col("naive", "right")],
                    [[t["name"], f"{t['src']['stage']} -> {t['dst']['stage']}", strategy(t), t["tasks"],
                      _t(t["makespan"]), _t(t["lower_bound"]), _t(t["naive_makespan"])] for t in transfers],
                    tty=tty)


def _transfer(t: dict, tty: bool) -> list:
    i, j = t["src"]["stage"], t["dst"]["stage"]
    ratio = f"{t['ratio']:.2f}x" if t["ratio"] is not None else "no bytes cross hosts"
    out = [f"transfer {t['name']}: {t['dtype']}{t['shape']} stage {i} ({t['src']['spec']}) -> stage {j} ({t['dst']['spec']})",
           "  local: both stages on one mesh, every device keeps its own region (nothing moves)" if t.get("local")
           else f"  {t['tasks']} unit task(s), strategy {t['strategy']}"
           + (f" in {t['chunks']} chunks" if t["chunks"] is not None else "") + f", scheduled by {t['scheduler']}",
           f"  makespan {_t(t['makespan'])}; lower bound {_t(t['lower_bound'])} "
           f"({ratio}; the bound counts NIC bytes, not latency); naive schedule {_t(t['naive_makespan'])}"]
    if t["shares_nic_with"]:
        out.append(f"  scheduled on one NIC timeline with {', '.join(t['shares_nic_with'])} (same source stage): "
                   "times are where this transfer ends on it")
    out.append(f"  regions (global ranges a:b per dim; src = stage {i}'s mesh, dst = stage {j}'s):")
    out.append(_region_table(t["regions"], tty))
    back = t["backward"]
    if back is not None:
        if back["same_regions_reversed"]:
            out.append(f"  backward (gradients, stage {j} -> stage {i}): the same regions, reversed")
        else:
            out.append(f"  backward regions (src = stage {j}'s mesh, sending gradients; dst = stage {i}'s):")
            out.append(_region_table(back["regions"], tty))
    return out


def explain_renderables(data: dict, tty: bool = False) -> list:
    """The content of ``explain_data`` as strings (printed as one line each) and rich tables."""
    c = data["cluster"]
    levels = ", ".join(f"{l['name']} x {l['fanout']}" for l in c["levels"])
    out: list = [f"plan {data['plan']}: {c['devices']} devices ({levels}); {c['hosts']} host(s) at level '{c['host_level']}'"]
    if data["placement"]:
        out += [""] + _placement(data["placement"], tty)
    out += ["", "stages:", _stages(data["stages"], tty)] + sequence_lines(data["stages"])
    if data.get("layers"):
        out += ["", "layers (the model's; FLOPs for one micro-batch):", _layers(data["layers"], tty)]
    if data.get("vocab"):
        out.append(vocab_line(data["vocab"]))
    idle = idle_devices(data["stages"], c["devices"])
    if idle:
        out.append(idle_warning(idle, c["devices"]))
    out += [""] + tensor_group_lines(data["tensor_groups"]) if data.get("tensor_groups") else []
    nothing: dict[tuple, list] = {}   # the reductions with nothing to reduce: one line per name, axes and target
    for r in data["reductions"]:
        if nothing_to_reduce(r):
            nothing.setdefault((r["name"], tuple(r["axes"]), r.get("target", "allreduce")), []).append(r)
    for r in data["reductions"]:
        if not nothing_to_reduce(r):
            out += [""] + _reduction(r, tty)
        elif nothing.get(key := (r["name"], tuple(r["axes"]), r.get("target", "allreduce"))):
            out += ["", f"{_VERB[key[2]]} " + nothing_to_reduce_line(nothing.pop(key))]
    if data["transfers"]:
        out += ["", "transfers (times predicted by the cost model; bound = NIC lower bound):",
                _transfers_overview(data["transfers"], tty)]
    for t in data["transfers"]:
        out += [""] + _transfer(t, tty)
    pipe = data["pipeline"]
    if pipe:
        out += ["", f"pipeline: {pipe['schedule']}, {pipe['micro_batches']} micro-batches; predicted iteration "
                    f"{_t(pipe['predicted_iteration'])}",
                ui.table([Col("stages", "right"), Col("actions, in order (F/B/W s.m: forward, backward, weight gradients "
                                                      "of stage s, micro-batch m; recv/send(transfer,fwd|bwd,m))",
                                                      wrap=True)],
                         [[",".join(map(str, c["stages"])), " ".join(c["list"])] for c in pipe["actions"]], tty=tty)]
        if pipe.get("nic_order"):
            out.append(_nic_line(pipe["nic_order"]))
        if pipe.get("memory"):
            out += [""] + _memory_lines(pipe["memory"], tty)
    for what, why in data["choices"].items():
        out.append(f"{what} = auto: {why}")
    return out


def explain(plan: planfile.Plan | dict) -> str:
    """The plain (piped) text of `planc explain` for a plan (or a plan.json document)."""
    return ui.render(*explain_renderables(explain_data(plan), tty=False)).rstrip("\n")


def compile_summary(plan: planfile.Plan | dict, tty: bool = False) -> list:
    """`planc compile`'s table of what was decided: one row per decision, with its prediction."""
    d = explain_data(plan)
    rows = []
    if d["placement"]:
        pl = d["placement"]
        rows.append(["placement", f"matrix {pl['matrix']} (axes {', '.join(pl['axes'])})", _t(pl["ranked"][0]["predicted"])])
    for s in d["stages"]:
        layers = f"layers {s['layers'][0]}..{s['layers'][1]}" if s["layers"] else "no layers"
        rows.append([f"stage {s['index']}", f"{layers}, mesh {mesh_text(s['mesh'])}", ""])
    for r in d["reductions"]:
        where = f" (stage {r['stage']})" if r["stage"] is not None else ""
        what = f" {r['tied']['parameter']}" if r.get("tied") else ""
        rows.append([f"{_VERB[r.get('target', 'allreduce')]} {r['name']}{what}{where}",
                     r["program"] or "nothing to reduce", _t(r["predicted"])])
    for t in d["transfers"]:
        how = t["strategy"] + (f" in {t['chunks']} chunks" if t["chunks"] is not None else "")
        rows.append([f"transfer {t['name']}", "local (one mesh): nothing moves" if t.get("local") else
                     f"{how}, {t['tasks']} unit task(s)", _t(t["makespan"])])
    if d["pipeline"]:
        p = d["pipeline"]
        rows.append(["pipeline", f"{p['schedule']}, {p['micro_batches']} micro-batches", _t(p["predicted_iteration"])])
    return [ui.table([Col("decision", wrap=True), Col("chosen", wrap=True), Col("predicted", "right")], rows, tty=tty)]
