"""An independent checker of a compiled ``OUT/plan.json`` against its contract.

Written from the specification text only (PLAN_FORMAT.md, DESIGN.md's rank mapping and
collective semantics, LANGUAGE.md's specs and stage meshes): it imports nothing of planc and
knows nothing of how the plan was found. ``check(out_dir, plan_file)`` returns
``(violations, warnings)``: a violation breaks the contract, a warning is a doubt the text does
not settle. A plan.json so malformed that a check cannot even read it is one violation, never an
exception.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1,
               "bool": 1}
STRATEGIES = {"send_recv", "local_allgather", "global_allgather", "broadcast"}
SCHEDULERS = {"naive", "load_balance", "dfs", "randomized_greedy"}
COLLECTIVES = {"allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast"}
PIPELINE_SCHEDULES = {"gpipe", "1f1b", "eager_1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
SPEC_ENTRIES = {"R": (), "S0": (0,), "S1": (1,), "S01": (0, 1)}   # mesh dimensions, major first
NUMBER = (int, float)
TIME_EPS = 1e-12   # seconds: float noise between one task's end and the next one's start


def check(out_dir: Path, plan_file: Path | None = None) -> tuple[list[str], list[str]]:
    """Check ``out_dir/plan.json``; with ``plan_file``, also its ``source.sha256`` and ``name``."""
    report = _Report()
    try:
        doc = json.loads((Path(out_dir) / "plan.json").read_text())
    except (OSError, ValueError) as e:
        report.bad(f"plan.json cannot be read: {e}")
        return report.violations, report.warnings
    try:
        _check_plan(doc, Path(plan_file) if plan_file is not None else None, report)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        report.bad(f"plan.json is malformed where the checker looked ({type(e).__name__}: {e})")
    return report.violations, report.warnings


@dataclass
class _Report:
    violations: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def bad(self, msg: str) -> None:
        self.violations.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def need(self, obj, key: str, types, where: str):
        """``obj[key]``, reported missing or of the wrong type (None then, or the wrong value)."""
        if not isinstance(obj, dict) or key not in obj:
            self.bad(f"{where}: missing required key '{key}'")
            return None
        value = obj[key]
        if types is not None and (not isinstance(value, types) or _is_bool_as_number(value, types)):
            self.bad(f"{where}.{key}: expected {_type_names(types)}, got {value!r:.80}")
        return value


def _is_bool_as_number(value, types) -> bool:
    return isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))


def _type_names(types) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def _is_number(x) -> bool:
    return isinstance(x, NUMBER) and not isinstance(x, bool)


@dataclass
class _Stage:
    devices: list[int]
    position: dict[int, tuple[int, ...]]   # device -> its index in the mesh
    shape: list[int]
    mesh_axes: list[str]


@dataclass
class _Facts:
    """What later sections need from earlier ones."""
    fanouts: list[int] = field(default_factory=list)
    devices: int = 0
    host_of: dict[int, int] = field(default_factory=dict)
    host_bandwidth: float | None = None
    groups: set[tuple[int, ...]] = field(default_factory=set)
    axis_names: list[str] | None = None
    coords: list[list[int]] | None = None
    stage_mode: str | None = None
    stages: dict[int, _Stage] = field(default_factory=dict)
    has_model: bool = False
    shared: list[tuple[int, int]] = field(default_factory=list)   # (stage, the first stage on its mesh)


def _check_plan(doc: dict, plan_file: Path | None, report: _Report) -> None:
    facts = _Facts()
    _check_header(doc, plan_file, report)
    _check_cluster(doc, facts, report)
    _check_groups(doc, facts, report)
    _check_placement(doc, facts, report)
    _check_stages(doc, facts, report)
    for r in report.need(doc, "reductions", list, "plan") or []:
        _check_reduction(r, facts, report)
    _check_tied_pieces(doc.get("reductions") or [], facts, report)
    check_zero_pairs(doc, report)
    for t in report.need(doc, "transfers", list, "plan") or []:
        _check_transfer(t, facts, report)
    _check_pipeline(doc, facts, report)


# ------------------------------------------------------------------ header, cluster, groups

def _check_header(doc: dict, plan_file: Path | None, report: _Report) -> None:
    if doc.get("format") != "planc/1":
        report.bad(f"format is {doc.get('format')!r}, not 'planc/1'")
    name = report.need(doc, "name", str, "plan")
    source = report.need(doc, "source", dict, "plan")
    if source:
        report.need(source, "path", str, "source")
        sha = report.need(source, "sha256", str, "source")
        if plan_file is not None and isinstance(sha, str):
            real = hashlib.sha256(plan_file.read_bytes()).hexdigest()
            if sha != real:
                report.bad(f"source.sha256 {sha} is not the sha256 of {plan_file.name}'s bytes ({real})")
    if plan_file is not None and isinstance(name, str):
        declared = _declared_plan_name(plan_file.read_text())
        if declared is not None and declared != name:
            report.bad(f"name {name!r} is not the plan's name {declared!r}")
    compiler = report.need(doc, "compiler", dict, "plan")
    if compiler:
        report.need(compiler, "version", str, "compiler")
        seconds = report.need(compiler, "seconds", None, "compiler")
        if "seconds" in compiler and not _is_number(seconds):
            report.warn(f"compiler.seconds is {seconds!r}; the contract's example shows a number")


def _declared_plan_name(text: str) -> str | None:
    """``NAME`` of the first ``plan NAME {`` outside comments."""
    for line in text.splitlines():
        m = re.match(r"\s*plan\s+([A-Za-z_][A-Za-z0-9_]*)", line.split("#", 1)[0])
        if m:
            return m.group(1)
    return None


def _check_cluster(doc: dict, facts: _Facts, report: _Report) -> None:
    cluster = report.need(doc, "cluster", dict, "plan") or {}
    levels = report.need(cluster, "levels", list, "cluster") or []
    for i, level in enumerate(levels):
        where = f"cluster.levels[{i}]"
        report.need(level, "name", str, where)
        fanout = report.need(level, "fanout", int, where)
        bandwidth = report.need(level, "bandwidth", None, where)
        report.need(level, "latency", NUMBER, where)
        if isinstance(fanout, int) and fanout > 1 and not _is_number(bandwidth):
            report.bad(f"{where}.bandwidth is {bandwidth!r} on a level with fanout {fanout}")
        facts.fanouts.append(fanout if isinstance(fanout, int) else 1)
    facts.devices = math.prod(facts.fanouts)
    devices = report.need(cluster, "devices", int, "cluster")
    if devices != facts.devices:
        report.bad(f"cluster.devices {devices} is not the product of the fanouts {facts.fanouts}")
    host_level = report.need(cluster, "host_level", str, "cluster")
    hosts = report.need(cluster, "hosts", list, "cluster")
    names = [level.get("name") for level in levels]
    if host_level not in names:
        report.bad(f"cluster.host_level {host_level!r} is not one of the levels {names}")
        return
    h = names.index(host_level)
    per_host = math.prod(facts.fanouts[h + 1:])
    want = [list(range(k * per_host, (k + 1) * per_host)) for k in range(math.prod(facts.fanouts[:h + 1]))]
    if hosts != want:
        report.bad(f"cluster.hosts {hosts} do not follow the level numbering: {want}")
    facts.host_of = {d: k for k, members in enumerate(want) for d in members}
    facts.host_bandwidth = levels[h].get("bandwidth")


def _check_groups(doc: dict, facts: _Facts, report: _Report) -> None:
    for g in report.need(doc, "groups", list, "plan") or []:
        if g != sorted(g) or len(set(g)) != len(g):
            report.bad(f"groups: {g} is not sorted by rank without repeats")
        if not all(isinstance(d, int) and 0 <= d < facts.devices for d in g):
            report.bad(f"groups: {g} names a device outside 0..{facts.devices - 1}")
        if tuple(g) in facts.groups:
            report.warn(f"groups: {g} listed twice")
        if len(g) < 2:
            report.warn(f"groups: one-device group {g}")
        facts.groups.add(tuple(g))


# ------------------------------------------------------------------ placement and stages

def rank_coords(fanouts: list[int], matrix: list[list[int]]) -> list[list[int]]:
    """DESIGN.md "Rank mapping": each device's axis coordinates under a parallelism matrix."""
    out = []
    for device in range(math.prod(fanouts)):
        level_coords = _digits(device, fanouts)
        digits = [[0] * len(fanouts) for _ in matrix]   # digits[axis][level]
        for j, c in enumerate(level_coords):
            for i, d in enumerate(_digits(c, [row[j] for row in matrix])):   # axis 0 most significant
                digits[i][j] = d
        out.append([_mixed_radix(digits[i], row) for i, row in enumerate(matrix)])   # outermost level first
    return out


def _digits(value: int, radices: list[int]) -> list[int]:
    out = []
    for r in reversed(radices):
        out.append(value % r)
        value //= r
    return out[::-1]


def _mixed_radix(digits: list[int], radices: list[int]) -> int:
    value = 0
    for d, r in zip(digits, radices):
        value = value * r + d
    return value


def _check_placement(doc: dict, facts: _Facts, report: _Report) -> None:
    placement = doc.get("placement")
    if placement is None:
        return
    axes = report.need(placement, "axes", list, "placement") or []
    matrix = report.need(placement, "matrix", list, "placement") or []
    report.need(placement, "candidates", int, "placement")
    ranked = report.need(placement, "ranked", list, "placement")
    coords = report.need(placement, "coords", list, "placement")
    facts.axis_names = [a["name"] for a in axes]
    sizes = [a["size"] for a in axes]
    if len(matrix) != len(axes) or any(len(row) != len(facts.fanouts) for row in matrix):
        report.bad(f"placement.matrix {matrix} is not axes x levels ({len(axes)} x {len(facts.fanouts)})")
        return
    for i, row in enumerate(matrix):
        if math.prod(row) != sizes[i]:
            report.bad(f"placement.matrix row {i} {row}: product is not the axis size {sizes[i]}")
    for j, fanout in enumerate(facts.fanouts):
        if math.prod(row[j] for row in matrix) != fanout:
            report.bad(f"placement.matrix column {j}: product is not the level's fanout {fanout}")
    if ranked is not None:
        if not 1 <= len(ranked) <= 10:
            report.bad(f"placement.ranked has {len(ranked)} entries (1 to 10)")
        elif ranked[0].get("matrix") != matrix:
            report.bad(f"placement.ranked[0] {ranked[0].get('matrix')} is not the chosen matrix {matrix}")
        predicted = [r.get("predicted") for r in ranked]
        if not all(_is_number(p) for p in predicted):
            report.bad(f"placement.ranked: predictions are not all numbers: {predicted}")
        elif not _best_first(predicted):
            report.bad(f"placement.ranked is not best first: {predicted}")
    want = rank_coords(facts.fanouts, matrix)
    if coords != want:
        first = next((d for d in range(max(len(want), len(coords or []))) if d >= len(want) or d >= len(coords)
                      or coords[d] != want[d]), None)
        report.bad(f"placement.coords do not follow the rank mapping of matrix {matrix}: device {first} "
                   f"has {_at(coords, first)}, the mapping gives {_at(want, first)}")
    else:
        facts.coords = coords


def _best_first(predicted: list) -> bool:
    """Ascending, up to float noise between equally good choices."""
    return all(b >= a * (1 - 1e-9) for a, b in zip(predicted, predicted[1:]))


def _at(xs, i):
    return xs[i] if isinstance(xs, list) and i is not None and i < len(xs) else None


def _mesh_positions(mesh) -> tuple[dict[int, tuple[int, ...]], list[int]]:
    """device -> index in a nested-list mesh, and the mesh's shape."""
    shape, m = [], mesh
    while isinstance(m, list):
        shape.append(len(m))
        m = m[0] if m else None
    position = {}
    for index in itertools.product(*(range(s) for s in shape)):
        m = mesh
        for i in index:
            m = m[i]
        if isinstance(m, list) or m in position:
            raise ValueError(f"mesh {mesh} is not a rectangular array of distinct device ids")
        position[m] = index
    return position, shape


def _check_stages(doc: dict, facts: _Facts, report: _Report) -> None:
    facts.stage_mode = mode = report.need(doc, "stage_mode", str, "plan")
    if mode not in ("pipe_axis", "explicit"):
        report.bad(f"stage_mode {mode!r} is neither 'pipe_axis' nor 'explicit'")
    if mode == "pipe_axis" and facts.coords is None:
        report.bad("stage_mode 'pipe_axis' without a valid placement to take the stages from")
    stages = report.need(doc, "stages", list, "plan") or []
    if [s.get("index") for s in stages] != list(range(len(stages))):
        report.bad(f"stages are not indexed 0..{len(stages) - 1} in order: {[s.get('index') for s in stages]}")
    used: dict[int, dict] = {}
    for s in stages:
        where = f"stages[{s.get('index')}]"
        report.need(s, "layers", (list, type(None)), where)
        devices = report.need(s, "devices", list, where) or []
        mesh = report.need(s, "mesh", list, where)
        mesh_axes = report.need(s, "mesh_axes", list, where) or []
        position, shape = _mesh_positions(mesh)
        if sorted(position) != sorted(devices):
            report.bad(f"{where}: mesh devices {sorted(position)} are not its devices {devices}")
        other = {used[d]["index"] for d in devices if d in used}
        mate = next((t for t in stages if t.get("index") in other), None)
        if other and (len(other) > 1 or (mate.get("mesh"), mate.get("mesh_axes")) != (mesh, mesh_axes)):
            report.bad(f"{where}: devices {sorted(d for d in devices if d in used)} are on another stage too")
        elif other:   # LANGUAGE.md: interleaved_1f1b and zbv run several stages on one whole mesh
            facts.shared.append((s.get("index"), mate.get("index")))
        used.update((d, s) for d in devices if d not in used)
        if len(shape) != len(mesh_axes):
            report.bad(f"{where}: a {len(shape)}-dimensional mesh with mesh_axes {mesh_axes}")
        facts.stages[s["index"]] = _Stage(sorted(devices), position, shape, mesh_axes)
        if mode == "pipe_axis" and facts.coords is not None:
            _check_pipe_axis_stage(s["index"], facts, report, _coordinate(doc, s["index"], len(stages)))
        elif mode == "explicit":
            row_major = sorted(position, key=position.get)
            first = min(row_major, default=0)
            if row_major != list(range(first, first + len(row_major))):
                report.bad(f"{where}: explicit mesh {mesh} is not a row-major range of devices")
    if mode == "pipe_axis" and facts.axis_names is not None:
        pipe = facts.axis_names.index("pipe") if "pipe" in facts.axis_names else None
        n = max(c[pipe] for c in facts.coords) + 1 if pipe is not None and facts.coords else 1
        if len(stages) != n * _per_mesh(doc):
            report.bad(f"{len(stages)} stages for a pipe axis of size {n} ({_per_mesh(doc)} per coordinate)")
    facts.has_model = any(s.get("layers") is not None for s in stages)
    _check_layers([s.get("layers") for s in stages], report)


def _per_mesh(doc: dict) -> int:
    """LANGUAGE.md "Pipeline schedules": stages per pipe coordinate (V of interleaved_1f1b, 2 for zbv)."""
    pipe = doc.get("pipeline") or {}
    return {"interleaved_1f1b": pipe.get("virtual", 1), "zbv": 2}.get(pipe.get("schedule"), 1)


def _coordinate(doc: dict, index: int, n: int) -> int:
    """The pipe coordinate of stage ``index`` of ``n`` (LANGUAGE.md): p + kP under interleaved_1f1b, the V
    (I for I < P, else 2P - 1 - I) under zbv, else the index."""
    per = _per_mesh(doc)
    P = max(1, n // max(per, 1))
    if (doc.get("pipeline") or {}).get("schedule") == "zbv":
        return index if index < P else 2 * P - 1 - index
    return index % P if per > 1 else index


def _check_pipe_axis_stage(index: int, facts: _Facts, report: _Report, coordinate: int | None = None) -> None:
    """LANGUAGE.md: the devices whose pipe coordinate is the stage's (its index, but under interleaved_1f1b and
    zbv), as a mesh over the non-pipe axes."""
    coordinate = index if coordinate is None else coordinate
    stage, names = facts.stages[index], facts.axis_names
    where = f"stages[{index}]"
    pipe = names.index("pipe") if "pipe" in names else None
    others = [i for i in range(len(names)) if i != pipe]
    if stage.mesh_axes != [names[i] for i in others]:
        report.bad(f"{where}: mesh_axes {stage.mesh_axes} are not the non-pipe axes {[names[i] for i in others]}")
    want = [d for d in range(facts.devices) if pipe is None or facts.coords[d][pipe] == coordinate]
    if stage.devices != want:
        report.bad(f"{where}: devices {stage.devices} are not those with pipe coordinate {coordinate}: {want}")
    for d in want:
        at = tuple(facts.coords[d][i] for i in others)
        if stage.position.get(d) != at:
            report.bad(f"{where}: device {d} sits at mesh index {stage.position.get(d)}, its coordinates say {at}")
            return


def _check_layers(layers: list, report: _Report) -> None:
    ranges = [r for r in layers if r is not None]
    if not ranges:
        return
    if len(ranges) != len(layers) or not all(len(r) == 2 and r[0] < r[1] for r in ranges):
        report.bad(f"stage layers are not all non-empty [start, end) ranges: {layers}")
    elif any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        report.bad(f"stage layer ranges overlap or are out of stage order: {layers}")
    elif ranges[0][0] != 0 or any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        report.warn(f"stage layer ranges leave layers out: {layers}")


# ------------------------------------------------------------------ reductions

class _Invalid(Exception):
    """A step whose precondition fails (DESIGN.md "Collective semantics")."""


def _normal(pieces):
    """Merge adjacent pieces that sum the same contributions."""
    out = []
    for a, b, who in pieces:
        if out and out[-1][1] == a and out[-1][2] == who:
            out[-1] = (out[-1][0], b, who)
        else:
            out.append((a, b, who))
    return out


def apply_collective(state: dict, collective: str, group: list[int]) -> None:
    """One collective on one group, in place on ``state`` (device -> list of (a, b, contributors))."""
    held = [_normal(state[d]) for d in group]
    name = f"{collective}{group}"
    if collective == "broadcast":
        if not held[0]:
            raise _Invalid(f"{name}: the root holds nothing")
        if any(held[1:]):
            raise _Invalid(f"{name}: a non-root member holds something")
        for d in group[1:]:
            state[d] = list(held[0])
        return
    if not all(held):
        raise _Invalid(f"{name}: a member holds nothing")
    if collective == "all_gather":
        for r, h in enumerate(held):
            if len(h) != 1:
                raise _Invalid(f"{name}: member {group[r]} holds {len(h)} pieces, not one")
        if len({h[0][2] for h in held}) != 1 or len({h[0][1] - h[0][0] for h in held}) != 1:
            raise _Invalid(f"{name}: members' pieces differ in contributors or length")
        if any(held[r][0][0] != held[r - 1][0][1] for r in range(1, len(held))):
            raise _Invalid(f"{name}: member r does not hold the piece after member r-1's")
        whole = _normal([h[0] for h in held])
        for d in group:
            state[d] = list(whole)
        return
    if collective not in ("allreduce", "reduce_scatter", "reduce"):
        raise _Invalid(f"unknown collective {collective!r}")
    intervals = [[(a, b) for a, b, _ in h] for h in held]
    if any(iv != intervals[0] for iv in intervals):
        raise _Invalid(f"{name}: members hold different intervals")
    for k in range(len(intervals[0])):
        for x, y in itertools.combinations([h[k][2] for h in held], 2):
            if x & y:
                raise _Invalid(f"{name}: contributor sets overlap")
    summed = _normal([(a, b, frozenset().union(*(h[k][2] for h in held))) for k, (a, b) in enumerate(intervals[0])])
    if collective == "allreduce":
        for d in group:
            state[d] = list(summed)
    elif collective == "reduce":
        state[group[0]] = summed
        for d in group[1:]:
            state[d] = []
    else:   # reduce_scatter: the held region cut into len(group) equal consecutive pieces
        piece = sum(b - a for a, b, _ in summed) / len(group)
        for r, d in enumerate(group):
            lo, hi, offset, mine = r * piece, (r + 1) * piece, Fraction(0), []
            for a, b, who in summed:
                x0, x1 = max(lo, offset), min(hi, offset + (b - a))
                if x0 < x1:
                    mine.append((a + x0 - offset, a + x1 - offset, who))
                offset += b - a
            state[d] = _normal(mine)


def simulate_program(steps: list, groups: list[list[int]], target: str = "allreduce",
                     owned: list | None = None, unit: int = 1) -> str | None:
    """Why the program does not reach its target; None if it does. ``allreduce``: every device holds
    [0, 1) summed over its group. ``reduce_scatter``: member r of each group holds exactly the piece
    ``owned[g][r]`` (in 1/unit) summed over the group. ``all_gather``: starting from member r holding
    ``owned[g][r]`` summed over the group, every device holds [0, 1) summed over its group."""
    if target == "all_gather":
        state = {d: [(Fraction(a, unit), Fraction(b, unit), frozenset(g))]
                 for g, ranges in zip(groups, owned) for d, (a, b) in zip(g, ranges)}
    else:
        state = {d: [(Fraction(0), Fraction(1), frozenset([d]))] for g in groups for d in g}
    try:
        for k, step in enumerate(steps):
            for g in step["groups"]:
                outside = [d for d in g if d not in state]
                if outside:
                    raise _Invalid(f"step {k}: devices {outside} are in no reduction group")
                apply_collective(state, step["collective"], g)
    except _Invalid as e:
        return str(e)
    if target == "reduce_scatter":
        for g, ranges in zip(groups, owned):
            for d, (a, b) in zip(g, ranges):
                if _normal(state[d]) != [(Fraction(a, unit), Fraction(b, unit), frozenset(g))]:
                    held = [(str(x), str(y), sorted(who)) for x, y, who in state[d]]
                    return f"device {d} ends with {held}, not its owned [{a}/{unit}, {b}/{unit}) summed over {g}"
        return None
    for g in groups:
        for d in g:
            if _normal(state[d]) != [(0, 1, frozenset(g))]:
                held = [(str(a), str(b), sorted(who)) for a, b, who in state[d]]
                return f"device {d} ends with {held}, not [0, 1) summed over {g}"
    return None


def _expected_reduction_groups(r: dict, facts: _Facts) -> set[tuple[int, ...]]:
    """Devices equal on every coordinate not reduced over (placement axes, or each stage's mesh)."""
    axes = r.get("axes") or []
    buckets: dict = {}
    if facts.stage_mode == "pipe_axis" and facts.coords is not None:
        keep = [i for i, n in enumerate(facts.axis_names) if n not in axes]
        devices = facts.stages[r["stage"]].devices if "stage" in r else range(facts.devices)
        for d in devices:
            buckets.setdefault(tuple(facts.coords[d][i] for i in keep), []).append(d)
    elif facts.stage_mode == "explicit":
        for index in ([r["stage"]] if "stage" in r else sorted(facts.stages)):
            stage = facts.stages[index]
            if not any(a in stage.mesh_axes for a in axes):
                continue
            keep = [i for i, a in enumerate(stage.mesh_axes) if a not in axes]
            for d in stage.devices:
                buckets.setdefault((index, *(stage.position[d][i] for i in keep)), []).append(d)
    return {tuple(sorted(g)) for g in buckets.values() if len(g) > 1}


def simulate_tied(steps: list, groups: list[list[int]], contributors: list[int]) -> dict | str:
    """A tied parameter's program replayed from every contributor holding its own gradient and every
    other member holding zeros (nothing): per device, the contributors whose gradients it ends with over
    the whole buffer; or why a step is invalid or a device ends without the whole buffer."""
    state = {d: [(Fraction(0), Fraction(1), frozenset([d]) if d in contributors else frozenset())]
             for g in groups for d in g}
    try:
        for k, step in enumerate(steps):
            for g in step["groups"]:
                outside = [d for d in g if d not in state]
                if outside:
                    raise _Invalid(f"step {k}: devices {outside} are in no reduction group")
                apply_collective(state, step["collective"], g)
    except _Invalid as e:
        return str(e)
    out = {}
    for d, held in state.items():
        held = _normal(held)
        if len(held) != 1 or held[0][:2] != (0, 1):
            return f"device {d} ends with {[(str(a), str(b), sorted(w)) for a, b, w in held]}, not the whole buffer"
        out[d] = held[0][2]
    return out


def _check_tied(r: dict, where: str, facts: _Facts, report: _Report) -> None:
    """DESIGN.md: "a reduction whose groups join devices of several stages (the stages that hold the
    parameter)"; LANGUAGE.md: its gradient "is summed over all of them". Every device of every holding
    stage ends with the sum over exactly one contribution per (stage, mesh position bar the tensor
    coordinate): every stage's every data replica once, a tensor replica's identical copy not again."""
    tied = r["tied"]
    holders = report.need(tied, "holders", list, f"{where}.tied") or []
    contributors = report.need(tied, "contributors", list, f"{where}.tied") or []
    stages = sorted({h.get("stage") for h in holders})
    if len(stages) < 2 or any(s not in facts.stages for s in stages):
        report.bad(f"{where}.tied: holders on stages {stages}: not two stages or more of the plan")
        return
    key = {}
    for s in stages:
        st = facts.stages[s]
        keep = [i for i, a in enumerate(st.mesh_axes) if a != "tensor"]
        for d in st.devices:
            key[d] = (s, tuple(st.position[d][i] for i in keep))
    groups = r.get("groups") or []
    if "split" in tied:   # one piece of rows per group: which devices is _check_tied_pieces'
        members = [d for g in groups for d in g]
        if len(members) != len(set(members)) or not set(members) <= set(key):
            report.bad(f"{where}: groups {groups} are not disjoint groups of the holding stages' devices")
            return
    elif sorted(d for g in groups for d in g) != sorted(key):
        report.bad(f"{where}: groups {groups} do not partition the holding stages' devices {sorted(key)}")
        return
    for k, step in enumerate((r.get("program") or {}).get("steps") or []):
        for g in step.get("groups") or []:
            if g != sorted(g) or len(g) < 2 or tuple(g) not in facts.groups:
                report.bad(f"{where}: step {k}: group {g} is not sorted, has one device or is not in groups")
    if tied.get("norm_device") not in contributors:
        report.bad(f"{where}.tied: norm_device {tied.get('norm_device')} is not a contributor")
    ended = simulate_tied((r.get("program") or {}).get("steps") or [], groups, contributors)
    if isinstance(ended, str):
        report.bad(f"{where}: the tied program is invalid: {ended}")
        return
    want = sorted(set(key.values()))
    for d in sorted(ended):
        got = sorted(key[c] for c in ended[d])
        if got != want:
            report.bad(f"{where}: device {d} ends with the tied gradient of {got}, not one of each of {want}")
            return


def _check_tied_pieces(reductions: list, facts: _Facts, report: _Report) -> None:
    """LANGUAGE.md: a tied table "vocabulary-split over tensor axes of different degrees" is "padded to a
    multiple of the least common multiple of their degrees", its gradient "summed over all of them";
    DESIGN.md's collective semantics on pieces: each piece of rows a buffer of its own. A holder of tensor
    degree k at coordinate c keeps part c of k of the padded rows (degree 1: all real rows); every real
    row is summed by exactly one group, whose members are exactly the devices keeping it."""
    by: dict[str, list] = {}
    for r in reductions:
        t = r.get("tied") or {}
        if "split" in t:
            by.setdefault(t.get("parameter"), []).append(r)
    for name, rs in by.items():
        split = rs[0]["tied"]["split"]
        size, padded = split.get("size"), split.get("padded")
        rows = {}
        for s in sorted({h.get("stage") for h in rs[0]["tied"]["holders"]}):
            st = facts.stages.get(s)
            if st is None:
                continue
            k = st.shape[st.mesh_axes.index("tensor")] if "tensor" in st.mesh_axes else 1
            if k > 1 and padded % k:
                report.bad(f"tied {name}: {padded} padded rows do not split over stage {s}'s tensor axis of {k}")
                return
            for d in st.devices:
                c = st.position[d][st.mesh_axes.index("tensor")] if k > 1 else 0
                rows[d] = (0, size) if k <= 1 else (c * padded // k, min((c + 1) * padded // k, size))
        pieces = sorted((tuple(ab), tuple(g)) for r in rs for ab, g in zip(r["tied"]["split"]["rows"], r["groups"]))
        at = 0
        for (a, b), g in pieces:
            holders = sorted(d for d, (x, y) in rows.items() if x <= a and b <= y)
            if a != at or list(g) != holders or any(x < b and a < y and not (x <= a and b <= y)
                                                    for x, y in rows.values()):
                report.bad(f"tied {name}: rows [{a}, {b}) summed over {list(g)}; the devices keeping them are "
                           f"{holders} (pieces must tile the {size} rows once)")
                return
            at = b
        if at != size:
            report.bad(f"tied {name}: rows [{at}, {size}) are summed by no group")


def _check_reduction(r: dict, facts: _Facts, report: _Report) -> None:
    where = f"reductions[{r.get('name')}{' stage ' + str(r['stage']) if 'stage' in r else ''}]"
    if "tied" in r:
        report.need(r, "bytes", int, where)
        _check_tied(r, where, facts, report)
        return
    report.need(r, "name", str, where)
    axes = report.need(r, "axes", list, where) or []
    report.need(r, "bytes", int, where)
    groups = report.need(r, "groups", list, where) or []
    program = report.need(r, "program", dict, where)
    target = r.get("target", "allreduce")
    owned = r.get("owned") or []
    if target not in ("allreduce", "reduce_scatter", "all_gather"):
        report.bad(f"{where}: unknown target {target!r}")
        return
    report.need(r, "allreduce_predicted" if target == "allreduce" else "flat_predicted", NUMBER, where)
    if target != "allreduce" and not _owned_ok(owned, groups, (program or {}).get("unit", 1)):
        report.bad(f"{where}: owned {owned} does not give each group's members equal, disjoint ranges covering "
                   f"[0, unit)")
        return
    report.need(r, "candidates", int, where)
    alternatives = report.need(r, "alternatives", list, where) or []
    if len(alternatives) > 10:
        report.bad(f"{where}: {len(alternatives)} alternatives (at most 10)")
    predicted = [a.get("predicted") for a in alternatives]
    if not all(_is_number(p) for p in predicted) or not _best_first(predicted):
        report.bad(f"{where}: alternatives are not next best first: {predicted}")
    names = facts.axis_names if facts.stage_mode == "pipe_axis" else \
        {a for s in facts.stages.values() for a in s.mesh_axes}
    if names is not None and any(a not in names for a in axes):
        report.bad(f"{where}: axes {axes} are not all axes of the plan ({sorted(names)})")
    want = _expected_reduction_groups(r, facts)
    if {tuple(g) for g in groups} != want or len(groups) != len(want):
        report.bad(f"{where}: groups {groups} are not those of the placement: {sorted(map(list, want))}")
    if program is None:
        return
    report.need(program, "text", str, f"{where}.program")
    report.need(program, "predicted", NUMBER, f"{where}.program")
    steps = report.need(program, "steps", list, f"{where}.program") or []
    if not groups:
        if steps:
            report.bad(f"{where}: no reduction groups, yet the program has steps")
        return
    if not steps:
        report.bad(f"{where}: an empty program for groups {groups}")
        return
    for k, step in enumerate(steps):
        if step.get("collective") not in COLLECTIVES:
            report.bad(f"{where}: step {k}: unknown collective {step.get('collective')!r}")
        step_groups = step.get("groups") or []
        if not step_groups:
            report.bad(f"{where}: step {k} has no group")
        if len({d for g in step_groups for d in g}) != sum(len(g) for g in step_groups):
            report.bad(f"{where}: step {k}: groups {step_groups} are not disjoint")
        for g in step_groups:
            if g != sorted(g) or len(g) < 2:
                report.bad(f"{where}: step {k}: group {g} is not sorted or has one device")
            if tuple(g) not in facts.groups:
                report.bad(f"{where}: step {k}: group {g} is not in groups")
    why = simulate_program(steps, groups, target, owned, program.get("unit", 1))
    if why is not None:
        goal = "compute the sum" if target == "allreduce" else f"reach its target {target}"
        report.bad(f"{where}: program {program.get('text')!r} does not {goal}: {why}")


def _owned_ok(owned: list, groups: list, unit: int) -> bool:
    if len(owned) != len(groups):
        return False
    for g, ranges in zip(groups, owned):
        spans = sorted(tuple(x) for x in ranges)
        if len(spans) != len(g) or len({b - a for a, b in spans}) != 1 or spans[0][0] != 0 \
                or spans[-1][1] != unit or any(x[1] != y[0] for x, y in zip(spans, spans[1:])):
            return False
    return True


def check_zero_pairs(doc: dict, report: _Report) -> None:
    """ZeRO-1: every reduce-scatter target has an all-gather over the same groups starting from the same
    owned ranges in the same units (so parameters come back to where the shards were updated), and back."""
    reds = doc.get("reductions") or []
    key = lambda r: (r.get("stage"), json.dumps(r.get("groups")), json.dumps(r.get("owned")),  # noqa: E731
                     (r.get("program") or {}).get("unit"))
    scatters = [key(r) for r in reds if r.get("target") == "reduce_scatter"]
    gathers = [key(r) for r in reds if r.get("target") == "all_gather"]
    if sorted(scatters, key=str) != sorted(gathers, key=str):
        report.bad(f"reductions: reduce-scatter targets {scatters} and all-gather targets {gathers} do not pair up")


# ------------------------------------------------------------------ transfers

def spec_regions(spec: str, shape: list[int], stage: _Stage, where: str, report: _Report) -> dict | None:
    """Each device's region [[start, end) per tensor dimension] under a canonical sharding spec."""
    entries = spec.split() if isinstance(spec, str) else None
    if entries is None or len(entries) != len(shape) or any(e not in SPEC_ENTRIES for e in entries):
        report.bad(f"{where}: spec {spec!r} is not one of R S0 S1 S01 per dimension of {shape}")
        return None
    mesh_dims = [m for e in entries for m in SPEC_ENTRIES[e]]
    if len(set(mesh_dims)) != len(mesh_dims) or any(m >= len(stage.shape) for m in mesh_dims):
        report.bad(f"{where}: spec {spec!r} on a mesh of shape {stage.shape} uses a mesh dimension twice "
                   f"or one the mesh lacks")
        return None
    regions = {}
    for d in stage.devices:
        region = []
        for size, entry in zip(shape, entries):
            dims = SPEC_ENTRIES[entry]
            parts = math.prod(stage.shape[m] for m in dims)
            if size % parts:
                report.bad(f"{where}: spec {spec!r}: dimension of size {size} does not divide by {parts}")
                return None
            index = _mixed_radix([stage.position[d][m] for m in dims], [stage.shape[m] for m in dims])
            region.append([index * size // parts, (index + 1) * size // parts])
        regions[d] = region
    return regions


def _check_transfer(t: dict, facts: _Facts, report: _Report) -> None:
    where = f"transfers[{t.get('name')}]"
    report.need(t, "name", str, where)
    dtype = report.need(t, "dtype", str, where)
    if dtype not in DTYPE_BYTES:
        report.bad(f"{where}: dtype {dtype!r} is not one of {' '.join(DTYPE_BYTES)}")
    shape = report.need(t, "shape", list, where) or []
    src = report.need(t, "src", dict, where) or {}
    dst = report.need(t, "dst", dict, where) or {}
    for key in ("regions", "tasks", "makespan", "lower_bound", "naive_makespan", "strategy", "chunks",
                "scheduler"):
        if key not in t:
            report.bad(f"{where}: missing required key '{key}'")
    if "backward" not in t and facts.has_model:
        report.bad(f"{where}: missing required key 'backward' in a plan with a model")
    if src.get("stage") not in facts.stages or dst.get("stage") not in facts.stages:
        report.bad(f"{where}: stages {src.get('stage')!r} -> {dst.get('stage')!r} are not both stages of the plan")
        return
    src_stage, dst_stage = facts.stages[src["stage"]], facts.stages[dst["stage"]]
    same = src_stage.devices == dst_stage.devices and src_stage.position == dst_stage.position
    if set(src_stage.devices) & set(dst_stage.devices) and not same:
        report.bad(f"{where}: source and destination meshes share devices")
    src_regions = spec_regions(src.get("spec"), shape, src_stage, f"{where}.src", report)
    dst_regions = spec_regions(dst.get("spec"), shape, dst_stage, f"{where}.dst", report)
    if src_regions is None or dst_regions is None:
        return
    element = DTYPE_BYTES.get(dtype, 1)
    _check_route(t, where, src_regions, dst_regions, element, facts, report, forward=True, same=same)
    if isinstance(t.get("backward"), dict):   # the gradient: destination to source, planned like the forward
        route = dict(t["backward"])
        route.setdefault("strategy", t.get("strategy"))
        _check_route(route, f"{where}.backward", dst_regions, src_regions, element, facts, report, forward=False,
                     same=same)


def _check_route(route: dict, where: str, src_regions: dict, dst_regions: dict, element: int, facts: _Facts,
                 report: _Report, forward: bool, same: bool = False) -> None:
    """One direction of a transfer: its regions, tasks, NIC schedule and bounds (the contract's
    example gives the backward only tasks and makespan: its other keys are checked where present).
    ``same``: between two stages of one mesh (interleaved_1f1b, zbv): a device keeps its own part of its
    region and receives only the rest; with nothing to receive the route has no tasks and is
    ``"local": true``, and only then."""
    strategy = route.get("strategy")
    if strategy not in STRATEGIES:
        report.bad(f"{where}: strategy {strategy!r} is not one of {sorted(STRATEGIES)}")
    if "chunks" in route and not isinstance(route["chunks"], int):
        report.bad(f"{where}: chunks {route['chunks']!r} is not an integer")
    if "scheduler" in route and route["scheduler"] not in SCHEDULERS:
        report.bad(f"{where}: scheduler {route['scheduler']!r} is not one of {sorted(SCHEDULERS)}")
    tasks = report.need(route, "tasks", list, where) or []
    makespan = report.need(route, "makespan", NUMBER, where)
    lower_bound = route.get("lower_bound")
    regions = route.get("regions")
    if regions is not None or forward:
        regions = regions or {}
        for side, want in (("src", src_regions), ("dst", dst_regions)):
            got = {int(d): r for d, r in (regions.get(side) or {}).items()}
            if got != want:
                report.bad(f"{where}: regions.{side} {got} are not what the spec assigns: {want}")
    rank = len(next(iter(dst_regions.values()), []))
    received: dict[int, list] = {d: [] for d in dst_regions}
    nic_busy: dict[int, list] = {}
    last_end = 0.0
    for i, task in enumerate(tasks):
        tw = f"{where}.tasks[{i}]"
        piece = report.need(task, "slice", list, tw)
        holders = report.need(task, "holders", list, tw) or []
        receivers = report.need(task, "receivers", list, tw) or []
        sender = report.need(task, "sender", int, tw)
        start = report.need(task, "start", NUMBER, tw)
        duration = report.need(task, "duration", NUMBER, tw)
        if piece is None:
            continue
        if len(piece) != rank or any(a >= b for a, b in piece):
            report.bad(f"{tw}: slice {piece} is empty or of the wrong rank")
            continue
        want_holders = sorted(d for d, r in src_regions.items() if _inside(piece, r))
        if sorted(holders) != want_holders:
            report.bad(f"{tw}: holders {holders} are not the source devices holding {piece}: {want_holders}")
        if sender not in holders or sender not in want_holders:
            report.bad(f"{tw}: sender {sender} is not a holder of {piece}")
        if not receivers:
            report.warn(f"{tw}: a task without receivers")
        for d in receivers:
            if d not in dst_regions:
                report.bad(f"{tw}: receiver {d} is not on the destination mesh")
            elif same and _inside(piece, src_regions[d]):
                report.bad(f"{tw}: receiver {d} holds {piece} already (both stages are on its mesh)")
            elif not _inside(piece, dst_regions[d]):
                report.bad(f"{tw}: slice {piece} is not inside receiver {d}'s region {dst_regions[d]}")
            else:
                received[d].append(piece)
        group = task.get("group")
        if strategy == "broadcast":
            if group is None:
                report.bad(f"{tw}: a broadcast task without a group")
            elif group != sorted({sender, *receivers}):
                report.bad(f"{tw}: group {group} is not {{sender}} + receivers, sorted")
        for g in [group, *(task.get("parts") or [])]:   # parts: planc's allgather receiver sets
            if g and len(g) > 1 and tuple(sorted(g)) not in facts.groups:
                report.bad(f"{tw}: group {g} is not in groups")
        if not (_is_number(start) and _is_number(duration)) or sender not in facts.host_of:
            continue
        last_end = max(last_end, start + duration)
        for host in _nics_used(sender, receivers, facts.host_of):
            nic_busy.setdefault(host, []).append((start, start + duration, i))
    if bool(route.get("local", False)) != (same and not tasks):
        report.bad(f"{where}: local is {bool(route.get('local', False))}, but " + (
            "it moves nothing between two stages of one mesh" if same and not tasks else
            "only a route between two stages of one mesh without tasks is local"))
    for d, region in dst_regions.items():
        own = [[max(a0, b0), min(a1, b1)] for (a0, a1), (b0, b1) in zip(region, src_regions[d])] if same else None
        if own and all(a < b for a, b in own):
            received[d].append(own)   # one mesh: the device keeps its own part
        why = _cover(region, received[d])
        if why:
            report.bad(f"{where}: receiver {d} {why}")
    for host, spans in nic_busy.items():
        spans.sort()
        for (a0, a1, i), (b0, b1, j) in zip(spans, spans[1:]):
            if b0 < a1 - TIME_EPS:
                report.bad(f"{where}: tasks {i} and {j} overlap on host {host}'s NIC: [{a0}, {a1}) and [{b0}, {b1})")
    if _is_number(makespan) and makespan < last_end - TIME_EPS:
        report.warn(f"{where}: makespan {makespan} ends before the last task ({last_end})")
    if not _is_number(lower_bound):
        if forward or lower_bound is not None:
            report.bad(f"{where}: lower_bound {lower_bound!r} is not a number")
        return
    if _is_number(facts.host_bandwidth) and facts.host_bandwidth > 0 and facts.host_of:
        want = nic_lower_bound(src_regions, dst_regions, facts.host_of, element) / facts.host_bandwidth
        if not math.isclose(want, lower_bound, rel_tol=1e-6, abs_tol=1e-15):
            report.bad(f"{where}: lower_bound {lower_bound} is not the contract's NIC bound {want}")
    if _is_number(makespan) and makespan < lower_bound * (1 - 1e-9):
        report.bad(f"{where}: makespan {makespan} < lower_bound {lower_bound}")


def _nics_used(sender: int, receivers: list[int], host_of: dict[int, int]) -> set[int]:
    """The sender's host if any receiver is elsewhere, and every receiver host but the sender's."""
    home = host_of[sender]
    away = {host_of[d] for d in receivers if d in host_of and host_of[d] != home}
    return away | {home} if away else set()


def _inside(piece, region) -> bool:
    return all(r0 <= p0 and p1 <= r1 for (p0, p1), (r0, r1) in zip(piece, region))


def _grid(boxes: list) -> tuple[list, np.ndarray]:
    """Cells of the grid cut by every box's edges (per dimension), and each cell's volume."""
    cuts = [sorted({x for box in boxes for x in box[k]}) for k in range(len(boxes[0]))]
    volume = np.ones([len(c) - 1 for c in cuts], dtype=np.int64)
    for k, c in enumerate(cuts):
        widths = np.diff(c).reshape([-1 if j == k else 1 for j in range(len(cuts))])
        volume = volume * widths
    return cuts, volume


def _cells(box, cuts) -> tuple:
    return tuple(slice(c.index(a), c.index(b)) for (a, b), c in zip(box, cuts))


def _cover(region, pieces) -> str | None:
    """Why ``pieces`` do not cover ``region`` exactly once; None if they do."""
    if not region:
        return None
    cuts, volume = _grid([region, *pieces])
    count = np.zeros(volume.shape, dtype=np.int64)
    for p in pieces:
        count[_cells(p, cuts)] += 1
    inside = np.zeros(volume.shape, dtype=bool)
    inside[_cells(region, cuts)] = True
    gap, twice = int(volume[inside & (count == 0)].sum()), int(volume[count > 1].sum())
    if gap or twice:
        return f"is short of {gap} elements of its region {region} and receives {twice} twice"
    return None


def nic_lower_bound(src_regions: dict, dst_regions: dict, host_of: dict[int, int], element: int) -> int:
    """PLAN_FORMAT.md: max over hosts of max(bytes its devices need that none of them holds,
    bytes held only on it that devices elsewhere need), distinct bytes counted once."""
    cuts, volume = _grid([*src_regions.values(), *dst_regions.values()])
    best = 0
    for host in sorted(set(host_of.values())):
        masks = {key: np.zeros(volume.shape, dtype=bool) for key in ("held_here", "held_else", "need_here",
                                                                       "need_else")}
        for kind, regions in (("held", src_regions), ("need", dst_regions)):
            for d, region in regions.items():
                masks[f"{kind}_{'here' if host_of[d] == host else 'else'}"][_cells(region, cuts)] = True
        incoming = volume[masks["need_here"] & ~masks["held_here"]].sum()
        outgoing = volume[masks["held_here"] & ~masks["held_else"] & masks["need_else"]].sum()
        best = max(best, int(incoming), int(outgoing))
    return best * element


# ------------------------------------------------------------------ pipeline

def _check_actions(doc: dict, classes: list, micro_batches: int, n_stages: int, report: _Report) -> None:
    """pipeline.actions (PLAN_FORMAT.md "Schedules"): every stage run by one class, its F and B (and W, if
    any, for all) of every micro-batch once, B after F and W after B, each transfer's forward sent after
    its source's F and received before its destination's F (gradients the other way), and the lists
    replayed together: a RECV waits until the other class has passed the matching SEND (sends never
    block). Lists that cannot all finish are a hang."""
    owner, lists = {}, []
    for c, cls in enumerate(classes):
        for s in cls.get("stages", []):
            if s in owner:
                report.bad(f"pipeline.actions: stage {s} is in classes {owner[s]} and {c}")
            owner[s] = c
        lists.append([tuple(a) for a in cls.get("list", [])])
    if sorted(owner) != list(range(n_stages)):
        report.bad(f"pipeline.actions: the classes run stages {sorted(owner)}, not 0..{n_stages - 1}")
        return
    transfers = [(t["name"], t["src"]["stage"], t["dst"]["stage"]) for t in doc.get("transfers", [])]
    for c, acts in enumerate(lists):
        where = f"pipeline.actions[{c}]"
        pos = {a: i for i, a in enumerate(acts)}
        if len(pos) != len(acts):
            report.bad(f"{where}: an action is listed twice")
        for s in classes[c]["stages"]:
            for kind in ("F", "B", "W"):
                got = sorted(a[2] for a in acts if a[0] == kind and a[1] == s)
                if kind == "W" and not got:
                    continue
                if got != list(range(micro_batches)):
                    report.bad(f"{where}: stage {s} does not run {kind} of each of {micro_batches} micro-batches once")
            for m in range(micro_batches):
                for first, then in ((("F", s, m), ("B", s, m)), (("B", s, m), ("W", s, m))):
                    if then in pos and first in pos and pos[first] > pos[then]:
                        report.bad(f"{where}: {then[0]}{s}.{m} before {first[0]}{s}.{m}")
            if ("REDUCE", s) not in pos:
                report.bad(f"{where}: no REDUCE of stage {s}")
        for name, src, dst in transfers:
            for m in range(micro_batches):
                for kind, stage, direction, compute, before in (("SEND", src, "forward", "F", False),
                                                                ("RECV", dst, "forward", "F", True),
                                                                ("SEND", dst, "backward", "B", False),
                                                                ("RECV", src, "backward", "B", True)):
                    if stage not in classes[c]["stages"]:
                        continue
                    a = (kind, stage, m, name, direction)
                    ref = pos.get((compute, stage, m))
                    if a not in pos or ref is None:
                        report.bad(f"{where}: no {list(a)}")
                    elif (pos[a] < ref) != before:
                        report.bad(f"{where}: {list(a)} {'after' if before else 'before'} {compute}{stage}.{m}")
    # the replay: each class's list in order, a RECV waiting for the matching SEND of the peer class
    sent, at = set(), [0] * len(lists)
    moved = True
    while moved:
        moved = False
        for c, acts in enumerate(lists):
            while at[c] < len(acts):
                a = acts[at[c]]
                if a[0] == "RECV" and (a[3], a[4], a[2]) not in sent:
                    break
                if a[0] == "SEND":
                    sent.add((a[3], a[4], a[2]))
                at[c] += 1
                moved = True
    stuck = [f"class {c} at {list(acts[at[c]])}" for c, acts in enumerate(lists) if at[c] < len(acts)]
    if stuck:
        report.bad(f"pipeline.actions: the lists cannot all finish (a hang): {'; '.join(stuck)}")


def _check_pipeline(doc: dict, facts: _Facts, report: _Report) -> None:
    pipeline = doc.get("pipeline")
    if pipeline is None:
        if facts.has_model:
            report.bad("a plan with a model (stages with layers) has no pipeline")
        return
    n_stages = len(facts.stages)
    schedule = report.need(pipeline, "schedule", str, "pipeline")
    if schedule not in PIPELINE_SCHEDULES:
        report.bad(f"pipeline.schedule {schedule!r} is not one of {sorted(PIPELINE_SCHEDULES)}")
    micro_batches = report.need(pipeline, "micro_batches", int, "pipeline") or 0
    classes = report.need(pipeline, "actions", list, "pipeline") or []
    stages = report.need(pipeline, "stages", list, "pipeline") or []
    predictions = [("pipeline", "predicted_iteration", pipeline)]
    predictions += [(f"pipeline.stages[{i}]", key, stage) for i, stage in enumerate(stages)
                    for key in ("busy", "bubble", "peak_activation_bytes")]
    unsimulated = []
    for where, key, obj in predictions:
        value = report.need(obj, key, None, where)
        if value is None:
            unsimulated.append(f"{where}.{key}")
        elif not _is_number(value):
            report.bad(f"{where}.{key}: expected a number, got {value!r:.80}")
    if unsimulated and all(key in obj for _, key, obj in predictions):
        report.warn(f"pipeline: {len(unsimulated)} predictions are null (not simulated), e.g. {unsimulated[0]}")
    if len(stages) != n_stages:
        report.bad(f"pipeline: {len(stages)} stages figures for {n_stages} stages")
    _check_classes(pipeline, classes, facts, n_stages, report)
    _check_actions(doc, classes, micro_batches, n_stages, report)


def _check_classes(pipeline: dict, classes: list, facts: _Facts, n_stages: int, report: _Report) -> None:
    """LANGUAGE.md "Pipeline schedules": interleaved_1f1b(virtual = V) (plan.json ``virtual``, V >= 2) runs
    stages p, p + P, ... on one mesh, zbv stages p and 2P - 1 - p, every other schedule one stage per mesh;
    a class's stages share one mesh, and stages on one mesh are one class."""
    schedule = pipeline.get("schedule")
    virtual = pipeline.get("virtual")
    if (schedule == "interleaved_1f1b") != (virtual is not None):
        report.bad(f"pipeline.virtual {virtual!r} with schedule {schedule!r} (written for interleaved_1f1b only)")
    elif virtual is not None and not (isinstance(virtual, int) and virtual >= 2):
        report.bad(f"pipeline.virtual {virtual!r} is not a whole number of 2 or more")
    per = {"interleaved_1f1b": virtual if isinstance(virtual, int) else 1, "zbv": 2}.get(schedule, 1)
    P = n_stages // per if per and n_stages % per == 0 else None
    if P is None:
        report.bad(f"pipeline: {n_stages} stages do not divide into {per} per mesh")
        return
    want = sorted(tuple(sorted((p, 2 * P - 1 - p))) if schedule == "zbv" else tuple(p + k * P for k in range(per))
                  for p in range(P))
    got = sorted(tuple(sorted(c.get("stages", []))) for c in classes)
    if got != want:
        report.bad(f"pipeline.actions: classes {got}, but {schedule} runs the stages as {want}")
    class_of = {s: tuple(sorted(c.get("stages", []))) for c in classes for s in c.get("stages", [])}
    for s, mate in facts.shared:
        if s not in class_of.get(mate, ()):
            report.bad(f"stages {mate} and {s} share a mesh but are not one class of pipeline.actions")
    for c in got:
        meshes = {(tuple(facts.stages[s].devices), tuple(sorted(facts.stages[s].position.items())))
                  for s in c if s in facts.stages}
        if len(meshes) > 1:
            report.bad(f"pipeline.actions: the stages {list(c)} of one class are on different meshes")
