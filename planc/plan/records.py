"""The plan file's cluster, stages and reductions.

Frozen, slotted, validated once in their ``read``; stdlib only (the contract package, ``planc.plan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .jsonpath import At, Group, PlanFileError, Range, device_key, extra, lists, with_extra
from .vocab import Collective, ReductionMode

__all__ = ["Level", "Cluster", "Stage", "Step", "Reduction", "Tied", "Holder"]


# ---------------------------------------------------------------- cluster

@dataclass(frozen=True, slots=True)
class Level:
    name: str
    fanout: int
    bandwidth: float | None
    latency: float
    both_ways: float | None = None     # a direction's bytes/s while the link carries data both ways

    @staticmethod
    def read(at: At) -> "Level":
        return Level(at.key("name").str(), at.key("fanout").int(1), at.key("bandwidth").opt_num(),
                     at.key("latency", 0.0).num(), at.key("both_ways", None).opt_num())

    def to_json(self) -> dict:
        return {"name": self.name, "fanout": self.fanout, "bandwidth": self.bandwidth, "latency": self.latency,
                **({"both_ways": self.both_ways} if self.both_ways is not None else {})}


@dataclass(frozen=True, slots=True)
class Cluster:
    levels: tuple[Level, ...]
    host_level: str
    devices: int
    hosts: tuple[Group, ...]
    extra: tuple = ()

    KEYS = ("levels", "host_level", "devices", "hosts")

    @staticmethod
    def read(at: At) -> "Cluster":
        c = Cluster(tuple(Level.read(x) for x in at.key("levels").items()), at.key("host_level").str(),
                    at.key("devices").int(1), at.key("hosts").groups(), extra(at, Cluster.KEYS))
        flat = sorted(d for h in c.hosts for d in h)
        if flat != list(range(c.devices)):
            at.key("hosts").fail(f"hosts must partition devices 0..{c.devices - 1}")
        return c

    def host_of(self, device: int) -> int:
        for h, devs in enumerate(self.hosts):
            if device in devs:
                return h
        raise PlanFileError(f"plan.json: device {device} is on no host of cluster.hosts")

    def to_json(self) -> dict:
        return with_extra({"levels": [lv.to_json() for lv in self.levels], "host_level": self.host_level,
                            "devices": self.devices, "hosts": lists(self.hosts)}, self.extra)


# ---------------------------------------------------------------- stages

@dataclass(frozen=True, slots=True)
class Stage:
    """A pipeline stage on its mesh.

    ``rows[d]`` is the half-open range of micro-batch rows device ``d`` computes
    (its slice along the stage's ``data`` mesh dimension). ``data_groups`` and
    ``model_groups`` are DeepSpeed's grid for this stage (devices equal on every
    mesh dimension but ``data``, resp. equal on ``data``), one-member groups included.
    """

    index: int
    layers: Range | None
    devices: tuple[int, ...]           # sorted
    mesh: Any                          # nested lists, as written
    mesh_axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_devices: tuple[int, ...]      # row-major over mesh_shape
    rows: tuple[tuple[int, Range], ...] = ()
    data_groups: tuple[Group, ...] = ()
    model_groups: tuple[Group, ...] = ()
    extra: tuple = ()
    sequence_parallel: bool = False    # activations split along the sequence over ``tensor`` (written where tensor > 1)
    zero: int | None = None            # the stage's ZeRO degree where it overrides ``train.zero`` (``stage I ... zero N``)

    KEYS = ("index", "layers", "devices", "mesh", "mesh_axes", "mesh_shape", "mesh_devices", "rows",
            "data_groups", "model_groups", "sequence_parallel", "zero")

    @staticmethod
    def read(at: At) -> "Stage":
        lay = at.key("layers", None)
        layers = None
        if lay.value is not None:
            a, b = lay.ints()
            if not a < b:
                lay.fail(f"expected a non-empty range [a, b], got {lay.value}")
            layers = (a, b)
        shape = at.key("mesh_shape").ints(1)
        mesh_devices = at.key("mesh_devices").ints()
        n = 1
        for s in shape:
            n *= s
        if len(mesh_devices) != n:
            at.key("mesh_devices").fail(f"{len(mesh_devices)} devices for a mesh of shape {list(shape)}")
        devices = at.key("devices").ints()
        if list(devices) != sorted(mesh_devices):
            at.key("devices").fail("must be the mesh's devices, sorted")
        axes = tuple(x.str() for x in at.key("mesh_axes").items())
        if len(axes) != len(shape):
            at.key("mesh_axes").fail(f"{len(axes)} names for a mesh of {len(shape)} dimensions")
        rows = []
        for k, r in at.key("rows", {}).mapping():
            rng = r.ints()
            if len(rng) != 2 or rng[0] >= rng[1]:
                r.fail(f"expected a non-empty row range [a, b], got {r.value}")
            rows.append((device_key(r, k), (rng[0], rng[1])))
        if rows and sorted(d for d, _ in rows) != sorted(devices):
            at.key("rows").fail("must give a row range for every device of the stage")
        st = Stage(at.key("index").int(0), layers, devices, at.key("mesh").value, axes, shape, mesh_devices,
                   tuple(sorted(rows)), at.key("data_groups", []).groups(), at.key("model_groups", []).groups(),
                   extra(at, Stage.KEYS), at.key("sequence_parallel", False).bool(), at.key("zero", None).opt_int(0))
        if st.zero is not None and st.zero > 3:
            at.key("zero").fail(f"expected 0, 1, 2 or 3, got {st.zero}")
        if st.sequence_parallel and st.axis_size("tensor") < 2:
            at.key("sequence_parallel").fail("true on a stage without a 'tensor' mesh axis of size > 1")
        for name in ("data_groups", "model_groups"):
            groups = getattr(st, name)
            if groups and sorted(d for g in groups for d in g) != list(devices):
                at.key(name).fail("must partition the stage's devices")
        return st

    def rows_of(self, device: int) -> Range:
        for d, r in self.rows:
            if d == device:
                return r
        raise PlanFileError(f"plan.json: stages[{self.index}].rows has no range for device {device}")

    def group_of(self, kind: str, device: int) -> Group:
        for g in getattr(self, f"{kind}_groups"):
            if device in g:
                return g
        raise PlanFileError(f"plan.json: stages[{self.index}].{kind}_groups has no group of device {device}")

    def position(self, device: int) -> tuple[int, ...]:
        flat = self.mesh_devices.index(device)
        pos = []
        for n in reversed(self.mesh_shape):
            pos.append(flat % n)
            flat //= n
        return tuple(reversed(pos))

    def to_json(self) -> dict:
        out = {"index": self.index, "layers": list(self.layers) if self.layers else None,
               "devices": list(self.devices), "mesh": self.mesh, "mesh_axes": list(self.mesh_axes),
               "mesh_shape": list(self.mesh_shape), "mesh_devices": list(self.mesh_devices)}
        if self.rows:
            out["rows"] = {str(d): list(r) for d, r in self.rows}
        if self.data_groups:
            out["data_groups"] = lists(self.data_groups)
        if self.model_groups:
            out["model_groups"] = lists(self.model_groups)
        if self.axis_size("tensor") > 1:
            out["sequence_parallel"] = self.sequence_parallel
        if self.zero is not None:
            out["zero"] = self.zero
        return with_extra(out, self.extra)

    def axis_size(self, name: str) -> int:
        """The size of mesh axis ``name`` (1 when the stage has none)."""
        return self.mesh_shape[self.mesh_axes.index(name)] if name in self.mesh_axes else 1



# ---------------------------------------------------------------- reductions

@dataclass(frozen=True, slots=True)
class Step:
    """A collective on disjoint groups, each on one interval of the buffer in units of 1/unit
    (planc.reduction.regions); ``slices`` gives a member's part before and after it."""
    collective: Collective
    groups: tuple[Group, ...]
    regions: tuple[Range, ...]

    def to_json(self) -> dict:
        return {"collective": str(self.collective), "groups": lists(self.groups),
                "regions": [list(r) for r in self.regions]}

    def slices(self, j: int, r: int) -> tuple[Range | None, Range | None]:
        """Member ``r`` of group ``j``: (its interval before the step, after it), in units; None: nothing."""
        a, b = self.regions[j]
        k = len(self.groups[j])
        w = (b - a) // k
        piece = (a + r * w, a + (r + 1) * w)
        c = self.collective
        if c is Collective.ALLREDUCE:
            return (a, b), (a, b)
        if c is Collective.REDUCE_SCATTER:
            return (a, b), piece
        if c is Collective.REDUCE:
            return (a, b), ((a, b) if r == 0 else None)
        if c is Collective.ALL_GATHER:
            return piece, (a, b)
        return ((a, b) if r == 0 else None), (a, b)   # broadcast


@dataclass(frozen=True, slots=True)
class Holder:
    """A layer that uses a tied parameter: stage ``stage``'s layer ``layer`` (global index), under ``name``."""
    stage: int
    layer: int
    name: str

    def describe(self) -> str:
        return f"stage {self.stage} layers.{self.layer}.{self.name}"

    def to_json(self) -> dict:
        return {"stage": self.stage, "layer": self.layer, "name": self.name}


@dataclass(frozen=True, slots=True)
class TiedSplit:
    """A tied parameter split by rows (vocabulary) over its holders' tensor axes (docs/reduction.md, "Tied
    parameters split by vocabulary"): the table has ``size`` real rows, padded to ``padded`` (a multiple of
    every holder's tensor degree); a holder of degree k at tensor coordinate c keeps rows
    [c padded/k, (c + 1) padded/k) (degree 1: [0, size)). Group g of the reduction sums the piece
    ``rows[g]`` (real rows, inside every member's); ``norm_devices[g]`` counts it in the global norm."""
    size: int
    padded: int
    rows: tuple[Range, ...]
    norm_devices: tuple[int, ...]

    @staticmethod
    def read(at: At, groups, contributors) -> "TiedSplit":
        size = at.key("size").int(1)
        padded = at.key("padded").int(size)
        rows = []
        for g, r in zip(groups, at.key("rows").items()):
            pair = r.ints()
            if len(pair) != 2 or not 0 <= pair[0] < pair[1] <= size:
                r.fail(f"expected a non-empty range [a, b] of the {size} real rows, got {r.value}")
            rows.append((pair[0], pair[1]))
        if len(rows) != len(groups):
            at.key("rows").fail(f"{len(at.key('rows').items())} row ranges for {len(groups)} groups")
        lengths = {b - a for a, b in rows}
        if len(lengths) > 1:
            at.key("rows").fail(f"the groups' pieces must be equally long (one buffer size), got {[list(r) for r in rows]}")
        norms = at.key("norm_devices").ints()
        if len(norms) != len(groups):
            at.key("norm_devices").fail(f"{len(norms)} devices for {len(groups)} groups")
        for i, (g, d) in enumerate(zip(groups, norms)):
            if d not in g or d not in contributors:
                at.key("norm_devices").items()[i].fail(f"device {d} is not a contributor in group {list(g)}")
        return TiedSplit(size, padded, tuple(rows), norms)

    def to_json(self) -> dict:
        return {"size": self.size, "padded": self.padded, "rows": [list(r) for r in self.rows],
                "norm_devices": list(self.norm_devices)}


@dataclass(frozen=True, slots=True)
class Tied:
    """What a tied-parameter reduction sums (docs/plan-format.md, "Tied parameters"): the gradient of
    ``parameter`` (``layers.<first layer>.<name>``, the single-process model's name), which every
    holder's stage holds a copy of. Every device of the holders' stages is in exactly one of the
    reduction's groups; a device in ``contributors`` enters its own gradient, any other zeros (a tensor
    replica's identical copy); ``norm_device`` is the one device that counts it in the global norm."""
    parameter: str
    holders: tuple[Holder, ...]
    contributors: tuple[int, ...]
    norm_device: int
    split: TiedSplit | None = None   # split by rows over the holders' tensor axes: one piece per group

    @staticmethod
    def read(at: At, groups) -> "Tied":
        holders = []
        for h in at.key("holders").items():
            holders.append(Holder(h.key("stage").int(0), h.key("layer").int(0), h.key("name").str()))
        if len({h.stage for h in holders}) < 2:
            at.key("holders").fail("a tied parameter is held by layers of two stages or more")
        members = {d for g in groups for d in g}
        contributors = at.key("contributors").ints()
        if list(contributors) != sorted(set(contributors)) or not set(contributors) <= members:
            at.key("contributors").fail("must be sorted distinct devices of the reduction's groups")
        norm = at.key("norm_device").int(0)
        if norm not in contributors:
            at.key("norm_device").fail(f"device {norm} is not a contributor")
        split = at.key("split", None)
        split = None if split.value is None else TiedSplit.read(split, groups, contributors)
        return Tied(at.key("parameter").str(), tuple(holders), contributors, norm, split)

    def to_json(self) -> dict:
        out = {"parameter": self.parameter, "holders": [h.to_json() for h in self.holders],
               "contributors": list(self.contributors), "norm_device": self.norm_device}
        if self.split is not None:
            out["split"] = self.split.to_json()
        return out


@dataclass(frozen=True, slots=True)
class Reduction:
    """A reduction program as the runtime executes it (regions in units of ``1/unit`` of the buffer).

    ``target``: what the program leaves (DESIGN.md, "Collective semantics"): ``allreduce``, every member
    of a group with the whole sum; ``reduce_scatter``, member r of group g the sum of piece
    ``owned[g][r]`` only (ZeRO-1's gradients); ``all_gather``, every member the whole buffer, starting from
    member r holding ``owned[g][r]`` (ZeRO-1's parameters). ``owned`` lists, per group, per member (group
    order), the half-open range it owns, in units; the ranges of a group are equally long, disjoint and
    cover ``[0, unit)``. Empty for ``allreduce``.
    """

    name: str
    axes: tuple[str, ...]
    nbytes: int
    groups: tuple[Group, ...]
    text: str
    steps: tuple[Step, ...]
    predicted: float
    mode: ReductionMode
    unit: int = 1       # every step's regions are in units of 1/unit of the buffer
    stage: int | None = None
    extra: tuple = ()
    target: Collective = Collective.ALLREDUCE
    owned: tuple[tuple[Range, ...], ...] = ()
    tied: Tied | None = None     # a tied parameter's gradient, summed across the stages holding it

    KEYS = ("name", "axes", "bytes", "groups", "program", "mode", "stage", "target", "owned", "tied")
    TARGETS = (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER)

    @staticmethod
    def read(at: At) -> "Reduction":
        prog = at.key("program")
        unit = prog.key("unit").int(1)
        steps = []
        for s in prog.key("steps").items():
            gs = s.key("groups").groups()
            if not gs:
                s.key("groups").fail("a step with no group is invalid")
            coll = s.key("collective").enum(Collective)
            regions = s.key("regions").items()
            if len(regions) != len(gs):
                s.key("regions").fail(f"{len(regions)} regions for {len(gs)} groups")
            rs = []
            for g, r in zip(gs, regions):
                pair = r.ints()
                if len(pair) != 2 or not 0 <= pair[0] < pair[1] <= unit:
                    r.fail(f"expected a non-empty half-open range [a, b] inside [0, {unit}], got {r.value}")
                a, b = pair
                if coll in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER) and (b - a) % len(g):
                    r.fail(f"{coll}: [{a}, {b}) does not split into {len(g)} whole pieces of 1/{unit}")
                rs.append((a, b))
            steps.append(Step(coll, gs, tuple(rs)))
        groups = at.key("groups").groups()
        target = at.key("target", "allreduce").enum(Collective)
        if target not in Reduction.TARGETS:
            at.key("target").fail(f"expected one of {', '.join(map(str, Reduction.TARGETS))}, got {target}")
        owned = _owned(at.key("owned", []), groups, unit, target)
        tied = None
        if at.key("tied", None).value is not None:
            if target is not Collective.ALLREDUCE:
                at.key("target").fail("a tied parameter's reduction has the allreduce target")
            tied = Tied.read(at.key("tied"), groups)
        return Reduction(at.key("name").str(), tuple(x.str() for x in at.key("axes").items()),
                         at.key("bytes").int(0), groups, prog.key("text").str(), tuple(steps),
                         prog.key("predicted").num(), at.key("mode", "synthesize").enum(ReductionMode), unit,
                         at.key("stage", None).opt_int(0), extra(at, Reduction.KEYS), target, owned, tied)

    def owned_by(self, device: int) -> Range | None:
        """The range of the buffer ``device`` owns (reduce-scatter and all-gather targets), in units."""
        for g, ranges in zip(self.groups, self.owned):
            if device in g:
                return ranges[g.index(device)]
        return None

    def group_of(self, device: int) -> Group | None:
        return next((g for g in self.groups if device in g), None)

    def to_json(self) -> dict:
        out = {"name": self.name, "axes": list(self.axes), "bytes": self.nbytes, "groups": lists(self.groups),
               "program": {"text": self.text, "unit": self.unit, "steps": [s.to_json() for s in self.steps],
                           "predicted": self.predicted}}
        if self.stage is not None:
            out["stage"] = self.stage
        out = with_extra(out, self.extra)
        out["mode"] = str(self.mode)
        if self.target is not Collective.ALLREDUCE:
            out["target"] = str(self.target)
            out["owned"] = [[[a, b] for a, b in ranges] for ranges in self.owned]
        if self.tied is not None:
            out["tied"] = self.tied.to_json()
        return out


def _owned(at: At, groups, unit: int, target: Collective) -> tuple[tuple[Range, ...], ...]:
    """``owned``: per group, per member, its range in units; equal lengths, disjoint, covering [0, unit)."""
    if target is Collective.ALLREDUCE:
        if at.value:
            at.fail("an allreduce target owns no pieces (owned is for reduce_scatter and all_gather)")
        return ()
    rows = at.items()
    if len(rows) != len(groups):
        at.fail(f"{len(rows)} lists for {len(groups)} groups")
    out = []
    for g, row in zip(groups, rows):
        ranges = []
        for r in row.items():
            pair = r.ints()
            if len(pair) != 2 or not 0 <= pair[0] < pair[1] <= unit:
                r.fail(f"expected a non-empty half-open range [a, b] inside [0, {unit}], got {r.value}")
            ranges.append((pair[0], pair[1]))
        if len(ranges) != len(g):
            row.fail(f"{len(ranges)} ranges for a group of {len(g)} members")
        if len({b - a for a, b in ranges}) != 1 or sorted(ranges)[0][0] != 0 or any(
                x[1] != y[0] for x, y in zip(sorted(ranges), sorted(ranges)[1:])) or max(b for _, b in ranges) != unit:
            row.fail(f"the members' ranges must be equally long, disjoint and cover [0, {unit}), got {row.value}")
        out.append(tuple(ranges))
    return tuple(out)
