"""An independent checker of plan.json ``transfers`` entries (PLAN_FORMAT.md invariants).

It shares no code with the planner: it reads only JSON-shaped dicts, parses
spec strings itself, recomputes every device's region from the stage meshes,
and recomputes the lower bound on its own elementary grid. Use
:func:`check_plan` on a whole plan dict (``cluster``, ``stages``,
``transfers``, optionally ``groups``) or :func:`check_transfer` on one entry.
Both return a list of error strings, empty when the plan is valid.
"""

from __future__ import annotations

import bisect
import itertools
from math import prod

_REL = 1e-9


def _parse_spec(text: str) -> list[list[int]]:
    out = []
    for tok in text.split():
        if tok == "R":
            out.append([])
        elif tok.startswith("S") and tok[1:].isdigit():
            out.append([int(c) for c in tok[1:]])
        else:
            raise ValueError(f"bad spec entry {tok!r}")
    return out


def _mesh_shape(mesh) -> list[int]:
    shape = []
    while isinstance(mesh, list | tuple):
        shape.append(len(mesh))
        mesh = mesh[0]
    return shape


def _flatten(mesh) -> list[int]:
    if isinstance(mesh, list | tuple):
        return [d for m in mesh for d in _flatten(m)]
    return [mesh]


def _regions(stage: dict, spec_text: str, shape: list[int]) -> dict[int, list[tuple[int, int]]]:
    """device -> its box under the spec on this stage's mesh."""
    mesh = stage.get("mesh", stage["devices"])
    mshape = _mesh_shape(mesh)
    flat = _flatten(mesh)
    if len(mshape) == 1 and len(flat) == 1 and len(stage["devices"]) == 1:
        mshape = []  # a one-device stage may be written [d]
    spec = _parse_spec(spec_text)
    if len(spec) != len(shape):
        raise ValueError(f"spec {spec_text!r} does not fit shape {shape}")
    out = {}
    for flat_i, dev in enumerate(flat):
        pos, rest = [], flat_i
        for n in reversed(mshape):
            pos.append(rest % n)
            rest //= n
        pos.reverse()
        box = []
        for n, axes in zip(shape, spec):
            count, idx = 1, 0
            for a in axes:
                size = mshape[a] if a < len(mshape) else 1
                idx = idx * size + (pos[a] if a < len(pos) else 0)
                count *= size
            box.append((idx * n // count, (idx + 1) * n // count))
        out[dev] = box
    return out


def _inside(inner, outer) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def _overlap(a, b) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def _volume(box) -> int:
    return prod(hi - lo for lo, hi in box)


def _host_bandwidth(cluster: dict) -> float | None:
    if len(cluster["hosts"]) <= 1:
        return None
    for level in cluster["levels"]:
        if level["name"] == cluster["host_level"]:
            return level["bandwidth"]
    raise ValueError("host level not among the levels")


def _cells(shape, *sides) -> list[list[int]]:
    """Per dim, the cuts of the elementary grid: 0, n and every region boundary on either side."""
    return [sorted({0, n} | {r[k][0] for side in sides for r in side.values()}
                   | {r[k][1] for side in sides for r in side.values()}) for k, n in enumerate(shape)]


def _hosts_per_cell(regions, cuts, host_of) -> dict[tuple[int, ...], set[int]]:
    """Elementary cell (an index per dim) -> the hosts of the devices whose region holds it.

    Devices with the same region are taken together; a region holds the cells between its
    boundaries (cut indices), so the work is the (cell, distinct region) pairs, not cells x devices."""
    by_box: dict[tuple, set[int]] = {}
    for d, r in regions.items():
        by_box.setdefault(tuple(tuple(x) for x in r), set()).add(host_of[d])
    index = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    out: dict[tuple[int, ...], set[int]] = {}
    for box, hosts in by_box.items():
        ranges = [range(ix[lo], ix[hi]) for (lo, hi), ix in zip(box, index)]
        for cell in itertools.product(*ranges):
            hit = out.get(cell)
            if hit is None:
                out[cell] = set(hosts)
            else:
                hit |= hosts
    return out


def recompute_lower_bound(entry: dict, src_regions, dst_regions, cluster: dict) -> float:
    """max over hosts of max(bytes in, bytes out) ÷ host bandwidth, over an elementary grid.

    A host takes in every cell some device of it needs and none of it holds; it must send out
    every cell that only its devices hold and some device elsewhere needs."""
    bw = _host_bandwidth(cluster)
    if bw is None:
        return 0.0
    shape = entry["shape"]
    itemsize = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4,
                "i16": 2, "i8": 1, "u8": 1, "bool": 1}[entry["dtype"]]
    host_of = {d: h for h, devs in enumerate(cluster["hosts"]) for d in devs}
    cuts = _cells(shape, src_regions, dst_regions)
    held = _hosts_per_cell(src_regions, cuts, host_of)
    needed = _hosts_per_cell(dst_regions, cuts, host_of)
    load_in: dict[int, int] = {}
    load_out: dict[int, int] = {}
    nothing: set[int] = set()
    for cell, receivers in needed.items():
        nbytes = prod(cs[i + 1] - cs[i] for cs, i in zip(cuts, cell)) * itemsize
        holders = held.get(cell, nothing)
        for h in receivers - holders:
            load_in[h] = load_in.get(h, 0) + nbytes
        if len(holders) == 1:
            (h,) = holders
            if receivers - holders:
                load_out[h] = load_out.get(h, 0) + nbytes
    return max((*load_in.values(), *load_out.values()), default=0) / bw


def recompute_lower_bound_masks(entry: dict, src_regions, dst_regions, cluster: dict) -> float:
    """:func:`recompute_lower_bound` by device bit masks, cell by cell and host by host (cells x hosts
    x devices: the reference the grouped count above is tested against)."""
    bw = _host_bandwidth(cluster)
    if bw is None:
        return 0.0
    shape = entry["shape"]
    itemsize = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4,
                "i16": 2, "i8": 1, "u8": 1, "bool": 1}[entry["dtype"]]
    host_of = {d: h for h, devs in enumerate(cluster["hosts"]) for d in devs}
    src_devs, dst_devs = sorted(src_regions), sorted(dst_regions)
    bit = {d: 1 << i for i, d in enumerate(src_devs + dst_devs)}
    per_dim = []  # per dim: list of (length, holder mask, receiver mask)
    for k, cuts in enumerate(_cells(shape, src_regions, dst_regions)):
        cells = []
        for lo, hi in zip(cuts, cuts[1:]):
            hm = sum(bit[d] for d in src_devs if src_regions[d][k][0] <= lo and hi <= src_regions[d][k][1])
            rm = sum(bit[d] for d in dst_devs if dst_regions[d][k][0] <= lo and hi <= dst_regions[d][k][1])
            cells.append((hi - lo, hm, rm))
        per_dim.append(cells)
    host_mask: dict[int, int] = {}
    for d in src_devs + dst_devs:
        host_mask[host_of[d]] = host_mask.get(host_of[d], 0) | bit[d]
    load = {h: [0, 0] for h in host_mask}
    all_src = sum({bit[d] for d in src_devs})   # (a device on both sides has one bit, its last)
    all_dst = sum({bit[d] for d in dst_devs})
    for combo in itertools.product(*per_dim):
        vol, hm, rm = 1, all_src, all_dst
        for length, h_, r_ in combo:
            vol, hm, rm = vol * length, hm & h_, rm & r_
        if not rm:
            continue
        for h, m in host_mask.items():
            if rm & m and not hm & m:
                load[h][0] += vol * itemsize
            if hm and not hm & ~m and rm & ~m:
                load[h][1] += vol * itemsize
    return max((max(v) for v in load.values()), default=0) / bw


class _Holding:
    """Which source devices hold a box: the regions that contain its first corner (found through
    the elementary grid of the source regions), those that contain all of it, their devices sorted.
    Any region that holds the box holds that corner, so no task scans every region."""

    def __init__(self, regions: dict[int, list[tuple[int, int]]], shape):
        self.by_box: dict[tuple, list[int]] = {}
        for d, r in regions.items():
            self.by_box.setdefault(tuple(tuple(x) for x in r), []).append(d)
        self.cuts = _cells(shape, regions)
        index = [{c: i for i, c in enumerate(cs)} for cs in self.cuts]
        self.at: dict[tuple[int, ...], list[tuple]] = {}   # elementary cell -> the regions holding it
        for box in self.by_box:
            for cell in itertools.product(*(range(ix[lo], ix[hi]) for (lo, hi), ix in zip(box, index))):
                self.at.setdefault(cell, []).append(box)

    def of(self, box) -> list[int]:
        corner = tuple(bisect.bisect_right(cs, lo) - 1 for cs, (lo, _) in zip(self.cuts, box))
        return sorted(d for r in self.at.get(corner, ()) if _inside(box, r) for d in self.by_box[r])


def check_transfer(entry: dict, plan: dict, memo: dict | None = None) -> list[str]:
    """Errors of one ``transfers`` entry, given the plan's ``cluster`` and ``stages``. Between two stages of
    one mesh (the same mesh: interleaved_1f1b, zbv) a device keeps its own part of its region and receives
    the rest, never a slice it holds; with nothing to receive anywhere the entry has no tasks and is
    ``"local": true`` (and only then). ``memo``: a dict
    kept across the entries of one plan (``check_plan``), so each stage's regions under a spec and the
    device-to-host map are computed once, not once per entry."""
    errors: list[str] = []
    name = entry.get("name", "?")
    memo = {} if memo is None else memo

    def err(msg: str) -> None:
        errors.append(f"transfer {name}: {msg}")

    def regions(side):
        key = ("regions", side["stage"], side["spec"], tuple(shape))
        if key not in memo:
            memo[key] = _regions(stages[side["stage"]], side["spec"], shape)
        return memo[key]

    stages = {s["index"]: s for s in plan["stages"]}
    shape = entry["shape"]
    try:
        src = regions(entry["src"])
        dst = regions(entry["dst"])
    except (KeyError, ValueError) as e:
        return [f"transfer {name}: {e}"]
    same = stages[entry["src"]["stage"]].get("mesh") == stages[entry["dst"]["stage"]].get("mesh") and set(src) == set(dst)
    if set(src) & set(dst) and not same:
        err("source and destination meshes overlap")
    if bool(entry.get("local", False)) != (same and not entry["tasks"]):
        err("a transfer between two stages of one mesh with no tasks is local (\"local\": true), and only it"
            if same else "a local transfer is between two stages of one mesh")
    if "host_of" not in memo:
        memo["host_of"] = {d: h for h, devs in enumerate(plan["cluster"]["hosts"]) for d in devs}
    host_of = memo["host_of"]
    received: dict[int, list] = {d: [] for d in dst}
    nic_use: dict[int, list[tuple[float, float]]] = {}
    end = 0.0
    key = ("holding", entry["src"]["stage"], entry["src"]["spec"], tuple(shape))
    if key not in memo:
        memo[key] = _Holding(src, shape)
    holding = memo[key]
    for i, t in enumerate(entry["tasks"]):
        box = [tuple(r) for r in t["slice"]]
        if len(box) != len(shape) or any(not (0 <= lo < hi <= n) for (lo, hi), n in zip(box, shape)):
            err(f"task {i}: bad slice {t['slice']}")
            continue
        holders = holding.of(box)
        if sorted(t["holders"]) != holders:
            err(f"task {i}: holders {t['holders']} but the source devices holding it are {holders}")
        if t["sender"] not in t["holders"] or t["sender"] not in src or not _inside(box, src[t["sender"]]):
            err(f"task {i}: sender {t['sender']} does not hold the slice")
        for r in t["receivers"]:
            if r not in dst:
                err(f"task {i}: receiver {r} is not a destination device")
            elif same and _inside(box, src[r]):
                err(f"task {i}: receiver {r} holds the slice already (one mesh)")
            elif not _inside(box, dst[r]):
                err(f"task {i}: slice not inside receiver {r}'s region")
            else:
                received[r].append(box)
        if entry["strategy"] == "broadcast" and sorted(t["group"]) != sorted({t["sender"], *t["receivers"]}):
            err(f"task {i}: broadcast group must be sender and receivers")
        if t["start"] < 0 or t["duration"] < 0:
            err(f"task {i}: negative time")
        sh = host_of[t["sender"]]
        remote = {host_of[r] for r in t["receivers"]} - {sh}
        for h in (remote | {sh}) if remote else ():
            nic_use.setdefault(h, []).append((t["start"], t["start"] + t["duration"]))
        end = max(end, t["start"] + t["duration"])
    for d, boxes in received.items():
        if same:   # one mesh: a device keeps its own part of what it needs
            own = [(max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(dst[d], src[d])]
            if all(lo < hi for lo, hi in own):
                boxes = boxes + [own]
        if sum(_volume(b) for b in boxes) != _volume(dst[d]):
            err(f"device {d} receives {sum(_volume(b) for b in boxes)} elements, needs {_volume(dst[d])}")
        for a, b in itertools.combinations(boxes, 2):
            if _overlap(a, b):
                err(f"device {d} receives {a} and {b}, which overlap")
                break
    errors.extend(f"transfer {name}: {e}" for e in nic_overlaps(nic_use))
    lb = recompute_lower_bound(entry, src, dst, plan["cluster"])
    if abs(lb - entry["lower_bound"]) > _REL * max(lb, 1e-30):
        err(f"lower_bound {entry['lower_bound']} but recomputed {lb}")
    if entry["makespan"] < lb * (1 - _REL):
        err(f"makespan {entry['makespan']} below the lower bound {lb}")
    if abs(entry["makespan"] - end) > _REL * max(end, 1e-30):
        err(f"makespan {entry['makespan']} but the last task ends at {end}")
    return errors


def nic_overlaps(nic_use: dict[int, list[tuple[float, float]]]) -> list[str]:
    out = []
    for h, spans in sorted(nic_use.items()):
        spans = sorted(spans)
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            if s1 < e0 - _REL * max(e0, 1e-30):
                out.append(f"NIC of host {h}: tasks [{s0}, {e0}) and [{s1}, {e1}) overlap")
    return out


def check_plan(plan: dict) -> list[str]:
    """All transfers; NIC timelines shared by transfers from one source stage; groups listed."""
    errors = []
    shared: dict[int, dict[int, list]] = {}
    host_of = {d: h for h, devs in enumerate(plan["cluster"]["hosts"]) for d in devs}
    listed = {tuple(g) for g in plan.get("groups", [])}
    memo = {"host_of": host_of}
    for entry in plan.get("transfers", []):
        errors.extend(check_transfer(entry, plan, memo))
        nics = shared.setdefault(entry["src"]["stage"], {})
        for t in entry["tasks"]:
            sh = host_of[t["sender"]]
            remote = {host_of[r] for r in t["receivers"]} - {sh}
            for h in (remote | {sh}) if remote else ():
                nics.setdefault(h, []).append((t["start"], t["start"] + t["duration"]))
            if "groups" in plan and entry["strategy"] == "broadcast" and tuple(sorted(t["group"])) not in listed:
                errors.append(f"transfer {entry['name']}: group {t['group']} not in groups")
    if len(plan.get("transfers", [])) > 1:
        for stage, nics in sorted(shared.items()):
            errors.extend(f"transfers from stage {stage}: {e}" for e in nic_overlaps(nics))
    return errors
