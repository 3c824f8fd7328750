"""plan.json as typed records: the one reader and the one writer, shared by compiler and runtime.

The compiler assembles its decisions and writes them with ``Plan.to_json``;
every rank of a launched job reads them back with ``Plan.from_json``, which
validates the whole file once and names the key that is wrong
(``transfers[1].backward.tasks[3].sender: 9 is not one of the holders [4, 5]``).
After that the runtime only executes: every region, task, group, program and
row range it uses is a field here, none is derived from a spec string.

Only the standard library is used: this module is copied into every output
as ``planc_runtime/planfile.py``.

Records are frozen and slotted; sequences are tuples. Keys of plan.json the
runtime does not read (predictions, rankings, explanations) are kept, in
order, in each record's ``extra`` and written back unchanged, so a round trip
``Plan.from_json(d).to_json() == d`` holds for every plan the compiler writes.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

__all__ = [
    "FORMAT", "PlanFileError", "Strategy", "Collective", "Schedule", "StageMode", "ReductionMode", "Direction",
    "Level", "Cluster", "Stage", "Step", "Reduction", "Task", "Route", "Transfer", "Pipeline", "Train",
    "CodeRef", "Plan", "load", "digest", "dumps", "TagLayout", "DTYPE_NAMES",
]

FORMAT = "planc/1"
DTYPE_NAMES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool")

Range = tuple[int, int]
Region = tuple[Range, ...]
Group = tuple[int, ...]


class PlanFileError(ValueError):
    """plan.json is malformed or contradicts itself; the message names the key."""


class Strategy(StrEnum):
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"
    LOCAL_ALLGATHER = "local_allgather"
    GLOBAL_ALLGATHER = "global_allgather"


class Collective(StrEnum):
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    REDUCE = "reduce"
    BROADCAST = "broadcast"


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    EAGER_1F1B = "eager_1f1b"


class StageMode(StrEnum):
    PIPE_AXIS = "pipe_axis"
    EXPLICIT = "explicit"


class ReductionMode(StrEnum):
    SYNTHESIZE = "synthesize"
    ALLREDUCE = "allreduce"
    PROGRAM = "program"


class Direction(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


# ---------------------------------------------------------------- reading with a path

class _At:
    """A JSON value and where it is (``transfers[0].tasks[2]``), for error messages."""

    __slots__ = ("value", "path")

    def __init__(self, value, path: str):
        self.value, self.path = value, path

    def fail(self, why: str):
        raise PlanFileError(f"plan.json: {self.path or '(top)'}: {why}")

    def key(self, name: str, default=...):
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {_kind(self.value)}")
        sub = f"{self.path}.{name}" if self.path else name
        if name not in self.value:
            if default is ...:
                raise PlanFileError(f"plan.json: {sub}: missing")
            return _At(default, sub)
        return _At(self.value[name], sub)

    def items(self):
        if not isinstance(self.value, list):
            self.fail(f"expected a list, got {_kind(self.value)}")
        return [_At(v, f"{self.path}[{i}]") for i, v in enumerate(self.value)]

    def mapping(self):
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {_kind(self.value)}")
        return [(k, _At(v, f"{self.path}.{k}")) for k, v in self.value.items()]

    def int(self, minimum: int | None = None) -> int:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(f"expected an integer, got {_kind(v)}")
        if minimum is not None and v < minimum:
            self.fail(f"{v} is below {minimum}")
        return v

    def opt_int(self, minimum: int | None = None) -> int | None:
        return None if self.value is None else self.int(minimum)

    def num(self) -> float:
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(f"expected a number, got {_kind(v)}")
        return v

    def opt_num(self):
        return None if self.value is None else self.num()

    def str(self) -> str:
        if not isinstance(self.value, str):
            self.fail(f"expected a string, got {_kind(self.value)}")
        return self.value

    def bool(self) -> bool:
        if not isinstance(self.value, bool):
            self.fail(f"expected true or false, got {_kind(self.value)}")
        return self.value

    def enum(self, cls):
        s = self.str()
        try:
            return cls(s)
        except ValueError:
            self.fail(f"{s!r} is not one of {[str(m) for m in cls]}")

    def ints(self, minimum: int | None = 0) -> tuple[int, ...]:
        return tuple(x.int(minimum) for x in self.items())

    def groups(self) -> tuple[Group, ...]:
        out = []
        for g in self.items():
            members = g.ints()
            if list(members) != sorted(set(members)):
                g.fail(f"group members must be sorted and distinct, got {list(members)}")
            out.append(members)
        return tuple(out)

    def region(self, ndim: int | None = None) -> Region:
        out = []
        for r in self.items():
            pair = r.ints()
            if len(pair) != 2 or pair[0] > pair[1]:
                r.fail(f"expected a half-open range [a, b] with a <= b, got {r.value}")
            out.append((pair[0], pair[1]))
        if ndim is not None and len(out) != ndim:
            self.fail(f"{len(out)} ranges for a tensor of {ndim} dimensions")
        return tuple(out)


def _kind(v) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), repr(v))


def _extra(at: _At, known) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in at.value.items() if k not in known)


def _with_extra(out: dict, extra) -> dict:
    for k, v in extra:
        out[k] = v
    return out


def _lists(groups) -> list[list[int]]:
    return [list(g) for g in groups]


def _region_json(region: Region) -> list[list[int]]:
    return [[a, b] for a, b in region]


# ---------------------------------------------------------------- cluster

@dataclass(frozen=True, slots=True)
class Level:
    name: str
    fanout: int
    bandwidth: float | None
    latency: float

    @staticmethod
    def read(at: _At) -> "Level":
        return Level(at.key("name").str(), at.key("fanout").int(1), at.key("bandwidth").opt_num(),
                     at.key("latency", 0.0).num())

    def to_json(self) -> dict:
        return {"name": self.name, "fanout": self.fanout, "bandwidth": self.bandwidth, "latency": self.latency}


@dataclass(frozen=True, slots=True)
class Cluster:
    levels: tuple[Level, ...]
    host_level: str
    devices: int
    hosts: tuple[Group, ...]
    extra: tuple = ()

    KEYS = ("levels", "host_level", "devices", "hosts")

    @staticmethod
    def read(at: _At) -> "Cluster":
        c = Cluster(tuple(Level.read(x) for x in at.key("levels").items()), at.key("host_level").str(),
                    at.key("devices").int(1), at.key("hosts").groups(), _extra(at, Cluster.KEYS))
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
        return _with_extra({"levels": [lv.to_json() for lv in self.levels], "host_level": self.host_level,
                            "devices": self.devices, "hosts": _lists(self.hosts)}, self.extra)


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

    KEYS = ("index", "layers", "devices", "mesh", "mesh_axes", "mesh_shape", "mesh_devices", "rows",
            "data_groups", "model_groups")

    @staticmethod
    def read(at: _At) -> "Stage":
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
            rows.append((_device_key(r, k), (rng[0], rng[1])))
        if rows and sorted(d for d, _ in rows) != sorted(devices):
            at.key("rows").fail("must give a row range for every device of the stage")
        st = Stage(at.key("index").int(0), layers, devices, at.key("mesh").value, axes, shape, mesh_devices,
                   tuple(sorted(rows)), at.key("data_groups", []).groups(), at.key("model_groups", []).groups(),
                   _extra(at, Stage.KEYS))
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
            out["data_groups"] = _lists(self.data_groups)
        if self.model_groups:
            out["model_groups"] = _lists(self.model_groups)
        return _with_extra(out, self.extra)


def _device_key(at: _At, k: str) -> int:
    if not k.isdigit():
        at.fail(f"device keys are decimal device ids, got {k!r}")
    return int(k)


# ---------------------------------------------------------------- reductions

@dataclass(frozen=True, slots=True)
class Step:
    collective: Collective
    groups: tuple[Group, ...]

    def to_json(self) -> dict:
        return {"collective": str(self.collective), "groups": _lists(self.groups)}


@dataclass(frozen=True, slots=True)
class Reduction:
    name: str
    axes: tuple[str, ...]
    nbytes: int
    groups: tuple[Group, ...]
    text: str
    steps: tuple[Step, ...]
    predicted: float
    mode: ReductionMode
    stage: int | None = None
    extra: tuple = ()

    KEYS = ("name", "axes", "bytes", "groups", "program", "mode", "stage")

    @staticmethod
    def read(at: _At) -> "Reduction":
        prog = at.key("program")
        steps = []
        for s in prog.key("steps").items():
            gs = s.key("groups").groups()
            if not gs:
                s.key("groups").fail("a step with no group is invalid")
            steps.append(Step(s.key("collective").enum(Collective), gs))
        return Reduction(at.key("name").str(), tuple(x.str() for x in at.key("axes").items()),
                         at.key("bytes").int(0), at.key("groups").groups(), prog.key("text").str(), tuple(steps),
                         prog.key("predicted").num(), at.key("mode", "synthesize").enum(ReductionMode),
                         at.key("stage", None).opt_int(0), _extra(at, Reduction.KEYS))

    def group_of(self, device: int) -> Group | None:
        return next((g for g in self.groups if device in g), None)

    def to_json(self) -> dict:
        out = {"name": self.name, "axes": list(self.axes), "bytes": self.nbytes, "groups": _lists(self.groups),
               "program": {"text": self.text, "steps": [s.to_json() for s in self.steps],
                           "predicted": self.predicted}}
        if self.stage is not None:
            out["stage"] = self.stage
        out = _with_extra(out, self.extra)
        out["mode"] = str(self.mode)
        return out


# ---------------------------------------------------------------- transfers

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
    def read(at: _At, ndim: int) -> "Task":
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
        out = {"slice": _region_json(self.slice), "holders": list(self.holders), "receivers": list(self.receivers),
               "sender": self.sender, "group": list(self.group), "start": self.start, "duration": self.duration}
        if self.parts:
            out["parts"] = _lists(self.parts)
        return out


@dataclass(frozen=True, slots=True)
class Route:
    """One direction of a transfer: its tasks and every device's region on both sides.

    Forward: ``src`` = the source stage's devices, ``dst`` = the destination's.
    Backward (gradients): ``src`` = the forward destination, ``dst`` = the forward source.
    """

    strategy: Strategy
    chunks: int
    scheduler: str
    tasks: tuple[Task, ...]
    src_regions: tuple[tuple[int, Region], ...]
    dst_regions: tuple[tuple[int, Region], ...]
    extra: tuple = ()

    KEYS = ("strategy", "chunks", "scheduler", "tasks", "regions")

    @staticmethod
    def read(at: _At, ndim: int, known=()) -> "Route":
        regions = at.key("regions")
        sides = {}
        for side in ("src", "dst"):
            sides[side] = tuple(sorted((_device_key(r, k), r.region(ndim)) for k, r in regions.key(side).mapping()))
        return Route(at.key("strategy").enum(Strategy), at.key("chunks", 1).int(1), at.key("scheduler", "naive").str(),
                     tuple(Task.read(t, ndim) for t in at.key("tasks").items()), sides["src"], sides["dst"],
                     _extra(at, Route.KEYS + tuple(known)))

    def region(self, side: str, device: int) -> Region | None:
        for d, r in (self.src_regions if side == "src" else self.dst_regions):
            if d == device:
                return r
        return None

    def ordered_tasks(self) -> tuple[tuple[int, Task], ...]:
        """(index, task) in schedule order: planned start, then index (the order every rank issues them)."""
        return tuple(sorted(enumerate(self.tasks), key=lambda it: (it[1].start, it[0])))

    def body(self) -> dict:
        out = {"strategy": str(self.strategy), "chunks": self.chunks, "scheduler": self.scheduler,
               "tasks": [t.to_json() for t in self.tasks]}
        return out

    def regions_json(self) -> dict:
        return {"src": {str(d): _region_json(r) for d, r in self.src_regions},
                "dst": {str(d): _region_json(r) for d, r in self.dst_regions}}


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
    def read(at: _At) -> "Transfer":
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
        for route, where in ((t.forward, at), (t.backward, bwd)):
            if route is None:
                continue
            for i, task in enumerate(route.tasks):
                for r in task.receivers:
                    reg = route.region("dst", r)
                    if reg is None or not _inside(task.slice, reg):
                        where.key("tasks").items()[i].fail(
                            f"slice {list(map(list, task.slice))} is outside receiver {r}'s region {reg}")
                reg = route.region("src", task.sender)
                if reg is None or not _inside(task.slice, reg):
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
        out = _with_extra(out, self.forward.extra)
        out["regions"] = self.forward.regions_json()
        if self.backward is not None:
            b = self.backward.body()
            b = _with_extra(b, self.backward.extra)
            b["regions"] = self.backward.regions_json()
            out["backward"] = b
        return out


def _inside(inner: Region, outer: Region) -> bool:
    return all(o0 <= i0 <= i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


# ---------------------------------------------------------------- pipeline and training

@dataclass(frozen=True, slots=True)
class Pipeline:
    schedule: Schedule
    micro_batches: int
    per_stage: tuple[tuple[str, ...], ...]
    extra: tuple = ()

    KEYS = ("schedule", "micro_batches", "per_stage")

    @staticmethod
    def read(at: _At, stages: int) -> "Pipeline":
        m = at.key("micro_batches").int(1)
        lists = []
        for i, ops in enumerate(at.key("per_stage").items()):
            seen = {"F": set(), "B": set()}
            names = []
            for op in ops.items():
                s = op.str()
                if len(s) < 2 or s[0] not in "FB" or not s[1:].isdigit() or int(s[1:]) >= m:
                    op.fail(f"expected F<m> or B<m> with m < {m}, got {s!r}")
                if s[0] == "B" and int(s[1:]) not in seen["F"]:
                    op.fail(f"{s} runs before F{s[1:]}")
                seen[s[0]].add(int(s[1:]))
                names.append(s)
            if seen["F"] != set(range(m)) or seen["B"] != set(range(m)):
                ops.fail(f"stage {i} must run F and B of every micro-batch 0..{m - 1} once")
            lists.append(tuple(names))
        if len(lists) != stages:
            at.key("per_stage").fail(f"{len(lists)} lists for {stages} stages")
        return Pipeline(at.key("schedule").enum(Schedule), m, tuple(lists), _extra(at, Pipeline.KEYS))

    def in_flight_bound(self, stage: int) -> int:
        """Most micro-batches whose forward ran and backward did not, at any point of the stage's list."""
        live = peak = 0
        for op in self.per_stage[stage]:
            live += 1 if op[0] == "F" else -1
            peak = max(peak, live)
        return peak

    def to_json(self) -> dict:
        return _with_extra({"schedule": str(self.schedule), "micro_batches": self.micro_batches,
                            "per_stage": [list(x) for x in self.per_stage]}, self.extra)


@dataclass(frozen=True, slots=True)
class CodeRef:
    file: str
    function: str
    args: tuple = ()       # (key, JSON value) pairs, model only

    @staticmethod
    def read(at: _At) -> "CodeRef":
        args = at.key("args", None)
        return CodeRef(at.key("file").str(), at.key("function").str(),
                       tuple(args.value.items()) if isinstance(args.value, dict) else ())

    def to_json(self, with_args: bool) -> dict:
        out = {"file": self.file, "function": self.function}
        if with_args:
            out["args"] = dict(self.args)
        return out


@dataclass(frozen=True, slots=True)
class Train:
    """Training settings, and who counts the loss.

    ``loss_devices``: last-stage devices, one per row range, whose losses add up
    to the micro-batch's loss; each device's loss is weighted by its share of
    the rows so that every gradient is the gradient of the global mean loss.
    """

    model: CodeRef
    loss: CodeRef
    data: CodeRef
    micro_batch: int
    micro_batches: int
    steps: int
    schedule: Schedule
    optimizer: tuple              # (key, value) pairs: name, lr, ...
    precision: str
    seed: int
    trainable: bool
    not_trainable_because: tuple[str, ...]
    loss_devices: tuple[int, ...] = ()
    extra: tuple = ()

    KEYS = ("model", "loss", "data", "micro_batch", "micro_batches", "steps", "schedule", "optimizer",
            "precision", "seed", "trainable", "not_trainable_because", "loss_devices")

    @staticmethod
    def read(at: _At) -> "Train":
        opt = at.key("optimizer")
        opt.key("name").str()
        return Train(CodeRef.read(at.key("model")), CodeRef.read(at.key("loss")), CodeRef.read(at.key("data")),
                     at.key("micro_batch").int(1), at.key("micro_batches").int(1), at.key("steps").int(0),
                     at.key("schedule").enum(Schedule), tuple(opt.value.items()), at.key("precision").str(),
                     at.key("seed").int(), at.key("trainable", True).bool(),
                     tuple(x.str() for x in at.key("not_trainable_because", []).items()),
                     at.key("loss_devices", []).ints(), _extra(at, Train.KEYS))

    def optimizer_dict(self) -> dict:
        return dict(self.optimizer)

    def to_json(self) -> dict:
        out = {"model": self.model.to_json(True), "loss": self.loss.to_json(False), "data": self.data.to_json(False),
               "micro_batch": self.micro_batch, "micro_batches": self.micro_batches, "steps": self.steps,
               "schedule": str(self.schedule), "optimizer": dict(self.optimizer), "precision": self.precision,
               "seed": self.seed}
        out = _with_extra(out, self.extra)
        out["trainable"] = self.trainable
        out["not_trainable_because"] = list(self.not_trainable_because)
        if self.loss_devices:
            out["loss_devices"] = list(self.loss_devices)
        return out


# ---------------------------------------------------------------- tags

@dataclass(frozen=True, slots=True)
class TagLayout:
    """p2p tag = transfer | direction | micro-batch | task, each field as wide as the plan needs.

    Sized from the plan so that no field wraps; a plan that needs more than 31
    bits is refused by the compiler (the runtime checks again).
    """

    transfer_bits: int
    micro_batch_bits: int
    task_bits: int

    MAX_BITS = 31

    @staticmethod
    def for_sizes(transfers: int, micro_batches: int, tasks: int) -> "TagLayout":
        return TagLayout(_bits(transfers), _bits(micro_batches), _bits(tasks))

    @property
    def total(self) -> int:
        return self.transfer_bits + 1 + self.micro_batch_bits + self.task_bits

    def tag(self, transfer: int, direction: Direction, micro_batch: int, task: int) -> int:
        d = 1 if direction is Direction.BACKWARD else 0
        for value, bits, what in ((transfer, self.transfer_bits, "transfer"),
                                  (micro_batch, self.micro_batch_bits, "micro-batch"), (task, self.task_bits, "task")):
            if not 0 <= value < (1 << bits):
                raise PlanFileError(f"{what} index {value} does not fit the plan's {bits}-bit tag field")
        t = transfer
        t = (t << 1) | d
        t = (t << self.micro_batch_bits) | micro_batch
        return (t << self.task_bits) | task


def _bits(n: int) -> int:
    return max(1, (max(n, 1) - 1).bit_length())


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True, slots=True)
class Plan:
    name: str
    cluster: Cluster
    groups: tuple[Group, ...]
    backward_groups: tuple[Group, ...]
    tensor_groups: tuple[Group, ...]
    stage_mode: StageMode
    stages: tuple[Stage, ...]
    reductions: tuple[Reduction, ...]
    transfers: tuple[Transfer, ...]
    pipeline: Pipeline | None
    train: Train | None
    head: tuple = ()          # source, compiler, placement: written as read
    raw: bytes | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def from_json(doc) -> "Plan":
        at = _At(doc, "")
        if not isinstance(doc, dict):
            at.fail(f"expected an object, got {_kind(doc)}")
        fmt = at.key("format").str()
        if fmt != FORMAT:
            at.key("format").fail(f"expected {FORMAT!r}, got {fmt!r}")
        cluster = Cluster.read(at.key("cluster"))
        stages = tuple(Stage.read(s) for s in at.key("stages").items())
        if [s.index for s in stages] != list(range(len(stages))):
            at.key("stages").fail(f"stage indices must be 0..{len(stages) - 1} in order, got "
                                  f"{[s.index for s in stages]}")
        seen: dict[int, int] = {}
        for s in stages:
            for d in s.devices:
                if d >= cluster.devices:
                    at.key("stages").fail(f"stage {s.index} uses device {d}, the cluster has {cluster.devices}")
                if d in seen:
                    at.key("stages").fail(f"device {d} is in stages {seen[d]} and {s.index}")
                seen[d] = s.index
        pipe = at.key("pipeline", None)
        train = at.key("train", None)
        plan = Plan(
            at.key("name").str(), cluster, at.key("groups").groups(), at.key("backward_groups", []).groups(),
            at.key("tensor_groups", []).groups(), at.key("stage_mode").enum(StageMode), stages,
            tuple(Reduction.read(r) for r in at.key("reductions").items()),
            tuple(Transfer.read(t) for t in at.key("transfers").items()),
            Pipeline.read(pipe, len(stages)) if pipe.value is not None else None,
            Train.read(train) if train.value is not None else None,
            tuple((k, doc[k]) for k in ("source", "compiler", "placement") if k in doc))
        plan._check_references(at)
        return plan

    def _check_references(self, at: _At) -> None:
        listed = set(self.groups)
        for i, r in enumerate(self.reductions):
            for j, s in enumerate(r.steps):
                for g in s.groups:
                    if g not in listed:
                        raise PlanFileError(f"plan.json: reductions[{i}].program.steps[{j}]: group {list(g)} "
                                            "is not listed in groups")
        backward = set(self.backward_groups) | listed
        for i, t in enumerate(self.transfers):
            for side, stage in (("src", t.src_stage), ("dst", t.dst_stage)):
                if stage >= len(self.stages):
                    raise PlanFileError(f"plan.json: transfers[{i}].{side}.stage: no stage {stage}")
            for route, where, pool in ((t.forward, "", listed), (t.backward, ".backward", backward)):
                if route is None:
                    continue
                src_stage, dst_stage = ((t.src_stage, t.dst_stage) if route is t.forward
                                        else (t.dst_stage, t.src_stage))
                for side, st in (("src", src_stage), ("dst", dst_stage)):
                    have = sorted(d for d, _ in getattr(route, f"{side}_regions"))
                    if have != list(self.stages[st].devices):
                        raise PlanFileError(f"plan.json: transfers[{i}]{where}.regions.{side}: must give a region "
                                            f"for every device of stage {st} {list(self.stages[st].devices)}, "
                                            f"got {have}")
                for k, task in enumerate(route.tasks):
                    needed = [task.group] if route.strategy is Strategy.BROADCAST else list(task.parts)
                    for g in needed:
                        if len(g) > 1 and g not in pool:
                            raise PlanFileError(f"plan.json: transfers[{i}]{where}.tasks[{k}]: group {list(g)} "
                                                "is not listed in groups")
        if self.train is not None:
            if self.pipeline is None:
                raise PlanFileError("plan.json: pipeline: missing (a plan with train settings has a pipeline)")
            last = self.stages[-1].devices if self.stages else ()
            for d in self.train.loss_devices:
                if d not in last:
                    raise PlanFileError(f"plan.json: train.loss_devices: {d} is not a device of the last stage")

    # ---- questions the runtime asks
    def stage_of(self, device: int) -> Stage | None:
        for s in self.stages:
            if device in s.devices:
                return s
        return None

    def gradient_reduction(self, device: int) -> Reduction | None:
        """The ``gradients`` entry whose groups hold ``device`` (one per stage when stages differ)."""
        for r in self.reductions:
            if r.name == "gradients" and r.group_of(device) is not None:
                return r
        return None

    def tag_layout(self) -> TagLayout:
        most = max((len(r.tasks) for t in self.transfers for r in (t.forward, t.backward) if r is not None),
                   default=1)
        m = self.pipeline.micro_batches if self.pipeline is not None else 1
        return TagLayout.for_sizes(len(self.transfers), m, most)

    def to_json(self) -> dict:
        head = dict(self.head)
        out = {"format": FORMAT, "name": self.name}
        for k in ("source", "compiler"):
            if k in head:
                out[k] = head[k]
        out["cluster"] = self.cluster.to_json()
        if "placement" in head:
            out["placement"] = head["placement"]
        out["groups"] = _lists(self.groups)
        if self.backward_groups:
            out["backward_groups"] = _lists(self.backward_groups)
        if self.tensor_groups:
            out["tensor_groups"] = _lists(self.tensor_groups)
        out["stage_mode"] = str(self.stage_mode)
        out["stages"] = [s.to_json() for s in self.stages]
        out["reductions"] = [r.to_json() for r in self.reductions]
        out["transfers"] = [t.to_json() for t in self.transfers]
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_json()
        if self.train is not None:
            out["train"] = self.train.to_json()
        return out


def dumps(plan: Plan) -> str:
    """plan.json text: keys in the order ``to_json`` builds them, 2-space indent, trailing newline."""
    return json.dumps(plan.to_json(), indent=2, allow_nan=False) + "\n"


def load(path: str | os.PathLike) -> Plan:
    """Read and validate plan.json; the raw bytes are kept for the digest every rank compares."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path}: not valid JSON ({e})") from None
    plan = Plan.from_json(doc)
    object.__setattr__(plan, "raw", raw)
    return plan


def digest(plan: Plan) -> str:
    """sha256 of the plan.json bytes as written (as read, for a loaded plan)."""
    raw = plan.raw if plan.raw is not None else dumps(plan).encode()
    return hashlib.sha256(raw).hexdigest()
