"""The plan file's records other than transfers: cluster, stages, reductions, pipeline, training, tags.

Frozen, slotted, validated once in their ``read``; stdlib only (see ``planfile``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .planjson import At, Group, PlanFileError, Range, device_key, extra, lists, with_extra

__all__ = ["Strategy", "Collective", "Schedule", "StageMode", "ReductionMode", "Direction", "Level", "Cluster",
           "Stage", "Step", "Reduction", "Pipeline", "CodeRef", "Train", "TagLayout", "DTYPE_NAMES"]

DTYPE_NAMES = ("f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool")


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

    KEYS = ("index", "layers", "devices", "mesh", "mesh_axes", "mesh_shape", "mesh_devices", "rows",
            "data_groups", "model_groups")

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
                   extra(at, Stage.KEYS))
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
        return with_extra(out, self.extra)



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
class Reduction:
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

    KEYS = ("name", "axes", "bytes", "groups", "program", "mode", "stage")

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
        return Reduction(at.key("name").str(), tuple(x.str() for x in at.key("axes").items()),
                         at.key("bytes").int(0), at.key("groups").groups(), prog.key("text").str(), tuple(steps),
                         prog.key("predicted").num(), at.key("mode", "synthesize").enum(ReductionMode), unit,
                         at.key("stage", None).opt_int(0), extra(at, Reduction.KEYS))

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
        return out


# ---------------------------------------------------------------- pipeline and training

@dataclass(frozen=True, slots=True)
class Pipeline:
    schedule: Schedule
    micro_batches: int
    per_stage: tuple[tuple[str, ...], ...]
    extra: tuple = ()
    # per host (index), its cross-host sends in the order its NIC runs them, one at a time:
    # ((host, ((rank, transfer, direction, micro-batch), ...)), ...); empty: sends go as they come
    nic_order: tuple = ()

    KEYS = ("schedule", "micro_batches", "per_stage", "nic_order")

    @staticmethod
    def read(at: At, stages: int) -> "Pipeline":
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
        nic, hosts = [], set()
        for e in at.key("nic_order", []).items():
            h = e.key("host").int(0)
            if h in hosts:
                e.key("host").fail(f"host {h} has two orders")
            hosts.add(h)
            seen, sends = set(), []
            for item in e.key("sends").items():
                parts = item.items()
                if len(parts) != 4:
                    item.fail("expected [rank, transfer, direction, micro-batch]")
                key = (parts[0].int(0), parts[1].str(), parts[2].str(), parts[3].int(0))
                if key[2] not in ("forward", "backward"):
                    parts[2].fail(f"expected forward or backward, got {key[2]!r}")
                if key[3] >= m:
                    parts[3].fail(f"micro-batch {key[3]} of {m}")
                if key in seen:
                    item.fail(f"{list(key)} is listed twice")
                seen.add(key)
                sends.append(key)
            nic.append((h, tuple(sends)))
        return Pipeline(at.key("schedule").enum(Schedule), m, tuple(lists), extra(at, Pipeline.KEYS), tuple(nic))

    def in_flight_bound(self, stage: int) -> int:
        """Most micro-batches whose forward ran and backward did not, at any point of the stage's list."""
        live = peak = 0
        for op in self.per_stage[stage]:
            live += 1 if op[0] == "F" else -1
            peak = max(peak, live)
        return peak

    def to_json(self) -> dict:
        out = {"schedule": str(self.schedule), "micro_batches": self.micro_batches,
               "per_stage": [list(x) for x in self.per_stage]}
        if self.nic_order:
            out["nic_order"] = [{"host": h, "sends": [list(k) for k in keys]} for h, keys in self.nic_order]
        return with_extra(out, self.extra)

    def nic_order_of(self, host: int) -> tuple:
        """Host ``host``'s send order (empty when it has none)."""
        return next((keys for h, keys in self.nic_order if h == host), ())


@dataclass(frozen=True, slots=True)
class CodeRef:
    file: str
    function: str
    args: tuple = ()       # (key, JSON value) pairs, model only

    @staticmethod
    def read(at: At) -> "CodeRef":
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
    timeout: float | None = None        # collective timeout in seconds (train { timeout = ... })
    save_every: int | None = None       # checkpoint every N steps when train.py --save DIR is given
    extra: tuple = ()

    KEYS = ("model", "loss", "data", "micro_batch", "micro_batches", "steps", "schedule", "optimizer",
            "precision", "seed", "trainable", "not_trainable_because", "loss_devices", "timeout", "save_every")

    @staticmethod
    def read(at: At) -> "Train":
        opt = at.key("optimizer")
        opt.key("name").str()
        return Train(CodeRef.read(at.key("model")), CodeRef.read(at.key("loss")), CodeRef.read(at.key("data")),
                     at.key("micro_batch").int(1), at.key("micro_batches").int(1), at.key("steps").int(0),
                     at.key("schedule").enum(Schedule), tuple(opt.value.items()), at.key("precision").str(),
                     at.key("seed").int(), at.key("trainable", True).bool(),
                     tuple(x.str() for x in at.key("not_trainable_because", []).items()),
                     at.key("loss_devices", []).ints(), _positive(at.key("timeout", None)),
                     at.key("save_every", None).opt_int(1), extra(at, Train.KEYS))

    def optimizer_dict(self) -> dict:
        return dict(self.optimizer)

    def to_json(self) -> dict:
        out = {"model": self.model.to_json(True), "loss": self.loss.to_json(False), "data": self.data.to_json(False),
               "micro_batch": self.micro_batch, "micro_batches": self.micro_batches, "steps": self.steps,
               "schedule": str(self.schedule), "optimizer": dict(self.optimizer), "precision": self.precision,
               "seed": self.seed}
        out = with_extra(out, self.extra)
        out["trainable"] = self.trainable
        out["not_trainable_because"] = list(self.not_trainable_because)
        if self.loss_devices:
            out["loss_devices"] = list(self.loss_devices)
        if self.timeout is not None:
            out["timeout"] = self.timeout
        if self.save_every is not None:
            out["save_every"] = self.save_every
        return out


def _positive(at: At) -> float | None:
    if at.value is None:
        return None
    v = at.num()
    if v <= 0:
        at.fail(f"expected a positive number of seconds, got {v}")
    return v


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
