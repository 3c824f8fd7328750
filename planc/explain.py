"""`planc explain`: what planc decided for a plan, and why, from its plan.json.

Per reduction (per stage for explicit-stage gradients) the program against flat allreduce; per
transfer its schedule and, when plan.json has ``regions``, each device's host and its region
(half-open ``a:b`` per dim) on the source and destination meshes. Older plan.json files without
``regions`` are rendered without that table.
"""

from __future__ import annotations


def _t(seconds) -> str:
    if seconds is None:
        return "n/a"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _bytes(n: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{int(n)} B"


def _ranges(region) -> str:
    """A region, one half-open global range ``a:b`` per tensor dimension: ``[0:4, 0:64]``."""
    try:
        return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"
    except (TypeError, ValueError):
        return str(region)


def _device_key(d):
    s = str(d)
    return (0, int(s), s) if s.isdigit() else (1, 0, s)


def _region_rows(regions: dict, host_of: dict[int, int]) -> list[str]:
    """One row per device: its host, then its region on the source and/or destination mesh."""
    src = regions.get("src") or {}
    dst = regions.get("dst") or {}
    if not isinstance(src, dict) or not isinstance(dst, dict):
        return ["    (regions not readable)"]
    devices = sorted(set(src) | set(dst), key=_device_key)
    labels = {}
    for d in devices:
        host = host_of.get(int(d)) if str(d).isdigit() else None
        labels[d] = f"dev {d} (host {'?' if host is None else host})"
    width = max((len(v) for v in labels.values()), default=0)
    rows = []
    for d in devices:
        cells = ([f"src {_ranges(src[d])}"] if d in src else []) + ([f"dst {_ranges(dst[d])}"] if d in dst else [])
        rows.append(f"    {labels[d]:<{width}}  " + "  ".join(cells))
    return rows


def _transfer_regions(t: dict, host_of: dict[int, int]) -> list[str]:
    """Each device's region on both meshes, forward and (when it differs from the reverse) backward."""
    regions = t.get("regions")
    if not isinstance(regions, dict):
        return []          # plan.json from before per-device regions: nothing to show
    i, j = t["src"]["stage"], t["dst"]["stage"]
    out = [f"  regions (global ranges a:b per dim; src = stage {i}'s mesh, dst = stage {j}'s):"]
    out += _region_rows(regions, host_of)
    back = (t.get("backward") or {}).get("regions")
    if isinstance(back, dict):
        if back.get("src") == regions.get("dst") and back.get("dst") == regions.get("src"):
            out.append(f"  backward (gradients, stage {j} -> stage {i}): the same regions, reversed")
        else:
            out.append(f"  backward regions (src = stage {j}'s mesh, sending gradients; dst = stage {i}'s):")
            out += _region_rows(back, host_of)
    return out


def explain(plan: dict) -> str:
    out: list[str] = []
    c = plan["cluster"]
    levels = ", ".join(f"{l['name']} x {l['fanout']}" for l in c["levels"])
    out.append(f"plan {plan['name']}: {c['devices']} devices ({levels}); {len(c['hosts'])} host(s) at level '{c['host_level']}'")

    pl = plan.get("placement")
    if pl:
        axes = [a["name"] for a in pl["axes"]]
        lv = [l["name"] for l in c["levels"]]
        out.append("")
        out.append(f"placement: {pl['candidates']} parallelism matrices fit; chosen (rows = axes, columns = levels):")
        width = max(len(a) for a in axes)
        out.append(" " * (width + 4) + "  ".join(f"{n:>6}" for n in lv))
        for name, row in zip(axes, pl["matrix"]):
            out.append(f"    {name:<{width}}" + "  ".join(f"{x:>6}" for x in row))
        ranked = pl["ranked"]
        if len(ranked) > 1:
            best, second = ranked[0]["predicted"], ranked[1]["predicted"]
            why = (f"predicted communication per iteration {_t(best)}, vs {_t(second)} for the runner-up "
                   f"{ranked[1]['matrix']}")
        else:
            why = f"pinned by the plan; predicted communication per iteration {_t(ranked[0]['predicted'])}"
        out.append(f"  why: {why}")
        search = pl.get("search")
        if search:
            out.append(f"  ranking: {search}, {pl.get('evaluated')} matrices costed by the cost model")
        for r in ranked:
            parts = ", ".join(f"{k} {_t(v)}" for k, v in (r.get("breakdown") or {}).items())
            out.append(f"    {str(r['matrix']):<24} {_t(r['predicted']):>10}" + (f"  = {parts}" if parts else ""))
    out.append("")
    for s in plan["stages"]:
        layers = f"layers {s['layers'][0]}..{s['layers'][1]}" if s.get("layers") else "no layers"
        out.append(f"stage {s['index']}: {layers}, mesh {s['mesh']} (axes {', '.join(s['mesh_axes'])})")

    for r in plan["reductions"]:
        out.append("")
        prog, flat = r["program"]["predicted"], r["allreduce_predicted"]
        speed = f"{flat / prog:.2f}x vs flat allreduce" if prog else "no data to move"
        where = f" (stage {r['stage']})" if r.get("stage") is not None else ""
        out.append(f"reduce {r['name']} over {', '.join(r['axes'])}{where}: {_bytes(r['bytes'])} per group, "
                   f"{len(r['groups'])} group(s) of {len(r['groups'][0]) if r['groups'] else 0}")
        if r.get("hierarchy"):
            out.append("  synthesis hierarchy: root > " + " > ".join(f"{h['name']}({h['factor']})" for h in r["hierarchy"]))
        out.append(f"  program: {r['program']['text']}")
        out.append(f"  predicted {_t(prog)}; flat allreduce {_t(flat)} ({speed}); {r['candidates']} valid program(s) found")
        for step in r["program"]["steps"]:
            gs = step["groups"]
            out.append(f"    {step['collective']} on {len(gs)} group(s), e.g. {gs[0]}")
        if r["alternatives"]:
            out.append("  alternatives:")
            for a in r["alternatives"]:
                out.append(f"    {_t(a['predicted']):>10}  {a['text']}")

    host_of = {d: h for h, devs in enumerate(c.get("hosts") or ()) for d in devs}
    by_src: dict[int, list[str]] = {}
    for t in plan["transfers"]:
        by_src.setdefault(t["src"]["stage"], []).append(t["name"])
    for t in plan["transfers"]:
        out.append("")
        ratio = f"{t['makespan'] / t['lower_bound']:.2f}x" if t["lower_bound"] else "no bytes cross hosts"
        out.append(f"transfer {t['name']}: {t['dtype']}{t['shape']} stage {t['src']['stage']} ({t['src']['spec']}) -> "
                   f"stage {t['dst']['stage']} ({t['dst']['spec']})")
        out.append(f"  {len(t['tasks'])} unit task(s), strategy {t['strategy']}"
                   + (f" in {t['chunks']} chunks" if t["strategy"] == "broadcast" else "")
                   + f", scheduled by {t['scheduler']}")
        out.append(f"  makespan {_t(t['makespan'])}; lower bound {_t(t['lower_bound'])} "
                   f"({ratio}; the bound counts NIC bytes, not latency); naive schedule {_t(t['naive_makespan'])}")
        peers = [n for n in by_src[t["src"]["stage"]] if n != t["name"]]
        if peers:
            out.append(f"  scheduled on one NIC timeline with {', '.join(peers)} (same source stage): "
                       "times are where this transfer ends on it")
        out += _transfer_regions(t, host_of)
    pipe = plan.get("pipeline")
    if pipe:
        out.append("")
        out.append(f"pipeline: {pipe['schedule']}, {pipe['micro_batches']} micro-batches; predicted iteration "
                   f"{_t(pipe.get('predicted_iteration'))}")
        for i, ops in enumerate(pipe["per_stage"]):
            out.append(f"  stage {i}: {' '.join(ops)}")
    for what, why in (plan.get("choices") or {}).items():   # what `auto` became, and why
        out.append(f"{what} = auto: {why}")
    return "\n".join(out)
