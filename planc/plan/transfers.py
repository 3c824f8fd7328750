"""The plan file's transfers: unit tasks and, per direction, a route with every device's region.

Frozen, slotted, validated once in their ``read``; stdlib only (the contract package, ``planc.plan``).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from .jsonpath import At, Group, PlanFileError, Region, device_key, extra, inside, lists, region_json, with_extra
from .vocab import DTYPE_NAMES, Direction, Strategy

__all__ = ["Task", "Route", "Transfer"]


@dataclass(frozen=True, slots=True)
class Task:
    """One unit task: ``slice`` from ``sender`` (one of ``holders``) to ``receivers``.

    ``parts`` (allgather strategies) are the receiver sets that gather among
    themselves, each receiving 1/len(part) of the slice from the sender.
    """

    slice: Region
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    sender: int
    group: Group
    start: float
    duration: float
    parts: tuple[Group, ...] = ()

    @staticmethod
    def read(at: At, ndim: int) -> "Task":
        t = Task(at.key("slice").region(ndim), at.key("holders").ints(), at.key("receivers").ints(),
                 at.key("sender").int(0), tuple(at.key("group", []).ints()), at.key("start", 0.0).num(),
                 at.key("duration", 0.0).num(), at.key("parts", []).groups())
        if t.sender not in t.holders:
            at.key("sender").fail(f"{t.sender} is not one of the holders {list(t.holders)}")
        if not t.receivers:
            at.key("receivers").fail("a task needs at least one receiver")
        if t.parts and sorted(d for p in t.parts for d in p) != sorted(t.receivers):
            at.key("parts").fail("must partition the receivers")
        return t

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.slice:
            n *= b - a
        return n

    def to_json(self) -> dict:
        out = {"slice": region_json(self.slice), "holders": list(self.holders), "receivers": list(self.receivers),
               "sender": self.sender, "group": list(self.group), "start": self.start, "duration": self.duration}
        if self.parts:
            out["parts"] = lists(self.parts)
        return out


@dataclass(frozen=True, slots=True)
class Route:
    """One direction of a transfer: its tasks and every device's region on both sides.

    Forward: ``src`` = the source stage's devices, ``dst`` = the destination's.
    Backward (gradients): ``src`` = the forward destination, ``dst`` = the forward source.

    ``local`` (plan.json ``"local": true``, written only then): a transfer between two stages of one mesh
    (interleaved_1f1b, zbv) in which every device's ``dst`` region lies inside its own ``src`` region: it
    moves nothing between devices, ``tasks`` is empty and each device takes its region from what it holds.
    Between two stages of one mesh that is not local, a device receives only what it does not hold: its
    region is the tasks' slices it receives and its own ``src`` region's part of it.
    """

    strategy: Strategy
    chunks: int
    scheduler: str
    tasks: tuple[Task, ...]
    src_regions: tuple[tuple[int, Region], ...]
    dst_regions: tuple[tuple[int, Region], ...]
    extra: tuple = ()
    local: bool = False

    KEYS = ("strategy", "chunks", "scheduler", "local", "tasks", "regions")

    @staticmethod
    def read(at: At, ndim: int, known=()) -> "Route":
        regions = at.key("regions")
        sides = {}
        for side in ("src", "dst"):
            sides[side] = tuple(sorted((device_key(r, k), r.region(ndim)) for k, r in regions.key(side).mapping()))
        route = Route(at.key("strategy").enum(Strategy), at.key("chunks", 1).int(1),
                      at.key("scheduler", "naive").str(), tuple(Task.read(t, ndim) for t in at.key("tasks").items()),
                      sides["src"], sides["dst"], extra(at, Route.KEYS + tuple(known)), at.key("local", False).bool())
        if route.local:
            if route.tasks:
                at.key("tasks").fail("a local transfer has no tasks (each device keeps its own region)")
            if [d for d, _ in route.src_regions] != [d for d, _ in route.dst_regions]:
                at.key("local").fail("a local transfer's two sides are the same devices (one mesh)")
            for (d, have), (_, need) in zip(route.src_regions, route.dst_regions):
                if not inside(need, have):
                    regions.key("dst").key(str(d)).fail(
                        f"a local transfer: device {d} needs {[list(r) for r in need]} but holds "
                        f"{[list(r) for r in have]}")
        return route

    def region(self, side: str, device: int) -> Region | None:
        regions = self.src_regions if side == "src" else self.dst_regions
        i = bisect.bisect_left(regions, device, key=lambda dr: dr[0])   # read() sorts them by device
        if i < len(regions) and regions[i][0] == device:
            return regions[i][1]
        for d, r in regions:   # a route built unsorted
            if d == device:
                return r
        return None

    def ordered_tasks(self) -> tuple[tuple[int, Task], ...]:
        """(index, task) in schedule order: planned start, then index (the order every rank issues them)."""
        return tuple(sorted(enumerate(self.tasks), key=lambda it: (it[1].start, it[0])))

    def body(self) -> dict:
        out = {"strategy": str(self.strategy), "chunks": self.chunks, "scheduler": self.scheduler}
        if self.local:
            out["local"] = True
        out["tasks"] = [t.to_json() for t in self.tasks]
        return out

    def regions_json(self) -> dict:
        return {"src": {str(d): region_json(r) for d, r in self.src_regions},
                "dst": {str(d): region_json(r) for d, r in self.dst_regions}}


@dataclass(frozen=True, slots=True)
class Transfer:
    name: str
    dtype: str
    shape: tuple[int, ...]
    src_stage: int
    src_layer: int | None
    src_spec: str
    dst_stage: int
    dst_spec: str
    forward: Route
    backward: Route | None
    extra: tuple = ()

    KEYS = ("name", "dtype", "shape", "src", "dst", "backward")

    @staticmethod
    def read(at: At) -> "Transfer":
        shape = at.key("shape").ints(1)
        dtype = at.key("dtype").str()
        if dtype not in DTYPE_NAMES:
            at.key("dtype").fail(f"{dtype!r} is not one of {list(DTYPE_NAMES)}")
        src, dst = at.key("src"), at.key("dst")
        fwd = Route.read(at, len(shape), known=Transfer.KEYS)
        bwd = at.key("backward", None)
        t = Transfer(at.key("name").str(), dtype, shape, src.key("stage").int(0), src.key("layer", None).opt_int(0),
                     src.key("spec").str(), dst.key("stage").int(0), dst.key("spec").str(), fwd,
                     Route.read(bwd, len(shape)) if bwd.value is not None else None)
        whole = tuple((0, n) for n in shape)
        for route, where in ((t.forward, at), (t.backward, bwd)):
            if route is None:
                continue
            for side in ("src", "dst"):
                for d, reg in getattr(route, f"{side}_regions"):
                    if not inside(reg, whole):
                        where.key("regions").key(side).key(str(d)).fail(
                            f"region {[list(r) for r in reg]} is outside the tensor's shape {list(shape)}")
        for route, where in ((t.forward, at), (t.backward, bwd)):
            if route is None:
                continue
            for i, task in enumerate(route.tasks):
                for r in task.receivers:
                    reg = route.region("dst", r)
                    if reg is None or not inside(task.slice, reg):
                        where.key("tasks").items()[i].fail(
                            f"slice {list(map(list, task.slice))} is outside receiver {r}'s region {reg}")
                reg = route.region("src", task.sender)
                if reg is None or not inside(task.slice, reg):
                    where.key("tasks").items()[i].fail(
                        f"sender {task.sender} does not hold slice {list(map(list, task.slice))} (holds {reg})")
        return t

    def route(self, direction: Direction) -> Route:
        if direction is Direction.FORWARD:
            return self.forward
        if self.backward is None:
            raise PlanFileError(f"plan.json: transfer {self.name!r} has no backward route")
        return self.backward

    def to_json(self) -> dict:
        src = {"stage": self.src_stage, "spec": self.src_spec, "layer": self.src_layer}
        out = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "src": src,
               "dst": {"stage": self.dst_stage, "spec": self.dst_spec}}
        out.update(self.forward.body())
        out = with_extra(out, self.forward.extra)
        out["regions"] = self.forward.regions_json()
        if self.backward is not None:
            b = self.backward.body()
            b = with_extra(b, self.backward.extra)
            b["regions"] = self.backward.regions_json()
            out["backward"] = b
        return out
