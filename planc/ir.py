"""The checked, typed intermediate representation of a plan.

``planc.lang`` turns ``.plan`` text into an :class:`Program`; every pass reads
these frozen records and never mutates them. Names for closed choices are
``StrEnum`` members whose values are the spellings of the language and of
plan.json. Vocabulary: an *axis* is a parallelism axis or a mesh axis; a *dim*
is a tensor dimension; a *level* is a level of the system hierarchy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from planc.hfref import HfModel  # noqa: F401 (`model hf`, re-exported)
from planc.plan import Collective, LrSchedule, MeshAxis, Precision, Recompute, ReductionMode, Runtime, StageMode
from planc.span import Span

_NOSPAN = Span(0, 0, 0, 0)

# The closed vocabularies the language shares with plan.json (MeshAxis, Collective, Precision,
# StageMode, ReductionMode) are the contract's (planc.plan.vocab), imported above and re-exported
# here; the requests below may say ``auto`` or name the synthesis language's forms, which plan.json
# never holds.


class FormKind(StrEnum):
    INSIDE = "inside"
    PARALLEL = "parallel"
    MASTER = "master"


class Strategy(StrEnum):
    SEND_RECV = "send_recv"
    LOCAL_ALLGATHER = "local_allgather"
    GLOBAL_ALLGATHER = "global_allgather"
    BROADCAST = "broadcast"
    AUTO = "auto"


class SchedulerKind(StrEnum):
    NAIVE = "naive"
    LOAD_BALANCE = "load_balance"
    DFS = "dfs"
    RANDOMIZED_GREEDY = "randomized_greedy"


class PipeSchedule(StrEnum):
    """``auto`` is a request, not a schedule: ``planc.pipeline.choose.choose_schedule`` replaces it by
    a concrete one before the pipeline lists are built (plan.json never holds ``auto``).
    ``interleaved_1f1b`` carries its virtual degree in ``Train.virtual``."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    EAGER_1F1B = "eager_1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZB_H1 = "zb_h1"
    ZBV = "zbv"
    AUTO = "auto"

    @classmethod
    def concrete(cls) -> tuple["PipeSchedule", ...]:
        """The schedules that can be built (every member but ``auto``)."""
        return tuple(s for s in cls if s is not cls.AUTO)


DTYPE_BYTES: dict[str, int] = {
    "f64": 8, "f32": 4, "f16": 2, "bf16": 2,
    "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1,
}
ROOT_LEVEL = "root"


# ---------------------------------------------------------------- cluster

def level_coords(device: int, fanouts) -> tuple[int, ...]:
    """Row-major level coordinates of a device under ``fanouts``, outermost level first: the one home
    of mixed-radix decoding (a device's position in a mesh, a digit string over hierarchy factors)."""
    out = []
    for f in reversed(fanouts):
        out.append(device % f)
        device //= f
    return tuple(reversed(out))


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    fanout: int
    bandwidth: float | None  # bytes/s per direction of the link joining a unit to its siblings
    latency: float = 0.0     # seconds
    span: Span = field(default=_NOSPAN, compare=False, repr=False)
    # bytes/s per direction while the link carries data both ways at once (None: as ``bandwidth``);
    # measured by `planc calibrate` (TCP: each direction's acknowledgements queue behind the other's data)
    both_ways: float | None = None

    @property
    def loaded_both_ways(self) -> float | None:
        """The bandwidth of a direction while the other direction is busy too."""
        if self.bandwidth is None or self.both_ways is None:
            return self.bandwidth
        return min(self.bandwidth, self.both_ways)


@dataclass(frozen=True, slots=True)
class Cluster:
    """``flops``: one device's throughput in FLOP/s (None: not given, no compute model); ``memory``:
    one device's memory in bytes (None: not given, no limit for ``schedule = auto``).

    ``cores``: devices that compute on one shared pool of CPU cores (``cores = 2 per cluster``:
    an emulated cluster on one machine; ``cores = 8 per host``: CPU hosts whose ranks share the
    host's cores). ``cores_level`` names the level each of whose units holds one pool; None with
    ``cores`` given: one pool for the whole cluster. ``cores`` None: every device computes on its
    own (GPUs), the default.

    ``op_overhead`` / ``step_overhead``: seconds of a device's time the training runtime spends on
    each pipeline instruction (F or B) beyond its layers, and on each step beyond its list (the
    optimizer, the step's own bookkeeping); measured by ``planc calibrate`` (cluster files only),
    None: not modelled (0)."""

    levels: tuple[Level, ...]
    host_level: str
    flops: float | None = None
    memory: float | None = None
    cores: int | None = None
    cores_level: str | None = None
    op_overhead: float | None = None
    step_overhead: float | None = None
    flops_by_precision: tuple[tuple[str, float], ...] = ()   # (precision, FLOP/s) where given per precision

    def flops_for(self, precision: str) -> float | None:
        """One device's throughput at ``precision`` (fp32, bf16, fp16): as given for it, else ``flops``."""
        return dict(self.flops_by_precision).get(str(precision), self.flops)

    @property
    def fanouts(self) -> tuple[int, ...]:
        return tuple(l.fanout for l in self.levels)

    @property
    def devices(self) -> int:
        return math.prod(self.fanouts)

    def level_index(self, name: str) -> int:
        for i, l in enumerate(self.levels):
            if l.name == name:
                return i
        raise KeyError(name)

    @property
    def host_index(self) -> int:
        return self.level_index(self.host_level)

    def level_coords(self, device: int) -> tuple[int, ...]:
        """Row-major level coordinates of a device, outermost level first."""
        return level_coords(device, self.fanouts)

    @property
    def devices_per_host(self) -> int:
        return math.prod(self.fanouts[self.host_index + 1:])

    @property
    def num_hosts(self) -> int:
        return math.prod(self.fanouts[: self.host_index + 1])

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def hosts(self) -> tuple[tuple[int, ...], ...]:
        k = self.devices_per_host
        return tuple(tuple(range(h * k, (h + 1) * k)) for h in range(self.num_hosts))

    def core_pools(self) -> tuple[tuple[int, ...], ...]:
        """The devices sharing each pool of ``cores`` (contiguous ranges); () when ``cores`` is None."""
        if self.cores is None:
            return ()
        if self.cores_level is None:
            return (tuple(range(self.devices)),)
        i = self.level_index(self.cores_level)
        k = math.prod(self.fanouts[i + 1:])
        return tuple(tuple(range(u * k, (u + 1) * k)) for u in range(self.devices // k))


# ---------------------------------------------------------------- parallelism and meshes

@dataclass(frozen=True, slots=True)
class Axis:
    name: str
    size: int
    span: Span = field(default=_NOSPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Parallel:
    axes: tuple[Axis, ...]
    matrix: tuple[tuple[int, ...], ...] | None  # None: place = auto
    span: Span = field(default=_NOSPAN, compare=False, repr=False)

    def axis_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.axes)

    def size_of(self, name: str, default: int | None = None) -> int:
        """The size of axis ``name``; ``default`` when there is none (None: KeyError)."""
        for a in self.axes:
            if a.name == name:
                return a.size
        if default is None:
            raise KeyError(name)
        return default


@dataclass(frozen=True, slots=True)
class ShardingSpec:
    """Per tensor dim, the mesh axes (indices) that shard it: () = R, (0,) = S0, (1,) = S1, (0, 1) = S01."""

    dims: tuple[tuple[int, ...], ...]

    def __str__(self) -> str:
        return " ".join("R" if not d else "S" + "".join(str(a) for a in d) for d in self.dims)

    @staticmethod
    def parse(text: str) -> "ShardingSpec":
        """Parse the canonical form ``S0 R R`` (used by plan.json readers and tests)."""
        dims = []
        for tok in text.split():
            if tok == "R":
                dims.append(())
            elif tok.startswith("S") and tok[1:].isdigit():
                dims.append(tuple(int(c) for c in tok[1:]))
            else:
                raise ValueError(f"bad sharding spec entry {tok!r} in {text!r}")
        return ShardingSpec(tuple(dims))


Mesh = tuple[tuple[int, ...], tuple[str, ...]]   # (shape, axis names)


def derived_mesh(parallel: Parallel) -> Mesh:
    """The mesh of a stage of the ``pipe`` axis: the other parallel axes, in declared order
    (without a ``pipe`` axis, the single stage spans them all)."""
    axes = tuple(a for a in parallel.axes if a.name != MeshAxis.PIPE)
    return tuple(a.size for a in axes), tuple(a.name for a in axes)


def stage_mesh(stage: "Stage", parallel: Parallel | None) -> Mesh | None:
    """A stage's mesh (shape, axis names) before placement: an explicit stage's as written; a stage of
    the ``pipe`` axis spans the other parallel axes in declared order. None when it cannot be known
    (derived stages without a ``parallel`` block)."""
    if stage.mesh_shape is not None:
        shape = tuple(stage.mesh_shape)
        return shape, tuple(stage.mesh_axes) or tuple(f"m{k}" for k in range(len(shape)))
    if parallel is None:
        return None
    return derived_mesh(parallel)


def axis_size(mesh: Mesh | None, name: str) -> int:
    """The size of the mesh axis ``name`` (1 when the mesh has none)."""
    if mesh is None or name not in mesh[1]:
        return 1
    return mesh[0][mesh[1].index(name)]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """A stage placed on devices: its mesh, row-major over ``shape``, axes named ``axes``."""

    index: int
    layers: tuple[int, int] | None
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    devices: tuple[int, ...]  # row-major over shape: devices[i*shape[1]+j] = mesh[i][j]
    _offset: dict = field(init=False, repr=False, compare=False)   # device -> its index in devices

    def __post_init__(self) -> None:
        object.__setattr__(self, "_offset", {d: i for i, d in enumerate(self.devices)})

    def mesh(self):
        """Nested tuples, shape ``shape`` (a 0-d mesh is the single device)."""
        def build(offset: int, dims: tuple[int, ...]):
            if not dims:
                return self.devices[offset]
            stride = math.prod(dims[1:])
            return tuple(build(offset + i * stride, dims[1:]) for i in range(dims[0]))
        return build(0, self.shape) if self.shape else (self.devices[0],)

    def axis_size(self, name: str) -> int:
        """The size of mesh axis ``name`` (1 when the stage has none); see :func:`axis_size`."""
        return axis_size((self.shape, self.axes), name)

    def position(self, device: int) -> tuple[int, ...]:
        """Mesh coordinates of a device of this stage."""
        i = self._offset.get(device)
        if i is None:
            raise ValueError(f"device {device} is not in stage {self.index}")
        return level_coords(i, self.shape)


# ---------------------------------------------------------------- statements

@dataclass(frozen=True, slots=True)
class CodeRef:
    path: str        # as written, relative to the plan file's folder
    function: str
    args: tuple[tuple[str, object], ...] = ()
    span: Span = field(default=_NOSPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Stage:
    """``auto_layers``: the plan leaves the layer range to the compiler (``stages = auto(N)`` or
    ``layers auto``); ``layers`` is None until ``planc.pipeline.cut.apply_auto_stages`` fills it
    (the flag stays set, so later passes and plan.json can say the range was chosen)."""

    index: int
    layers: tuple[int, int] | None
    first_device: int | None = None        # explicit stages only
    mesh_shape: tuple[int, ...] | None = None  # explicit stages only
    mesh_axes: tuple[str, ...] = ()         # explicit: as written or m0, m1; derived: filled by the checker
    span: Span = field(default=_NOSPAN, compare=False, repr=False)
    auto_layers: bool = False
    recompute: bool | None = None           # `stage I : ... recompute`; None: the train block's setting
    zero: int | None = None                 # `stage I : ... zero N`; None: the train block's setting
    # filled by planc.model.infer.decide_sequence for a stage with `tensor` > 1: its activations split along the
    # sequence over `tensor` (LANGUAGE.md "Hugging Face models"), else why not
    sequence_parallel: bool = False
    sequence_why: str | None = None

    @property
    def explicit_devices(self) -> tuple[int, ...] | None:
        if self.first_device is None or self.mesh_shape is None:
            return None
        return tuple(range(self.first_device, self.first_device + math.prod(self.mesh_shape)))


@dataclass(frozen=True, slots=True)
class Transfer:
    """A tensor sent between stages. In a plan with a model, ``dtype``/``shape`` and either spec may be
    None as written (measured and derived by ``planc.model.infer.infer_transfers``); after that pass, and
    always in a plan without a model, every field is set."""

    name: str
    dtype: str | None
    shape: tuple[int, ...] | None
    src_stage: int
    src_layer: int | None
    src_spec: ShardingSpec | None
    dst_stage: int
    dst_spec: ShardingSpec | None
    span: Span = field(default=_NOSPAN, compare=False, repr=False)
    # where the type and each spec are written (or, when omitted, the name / the `stage I` they belong to)
    type_span: Span = field(default=_NOSPAN, compare=False, repr=False)
    src_spec_span: Span = field(default=_NOSPAN, compare=False, repr=False)
    dst_spec_span: Span = field(default=_NOSPAN, compare=False, repr=False)

    @property
    def complete(self) -> bool:
        return None not in (self.dtype, self.shape, self.src_spec, self.dst_spec)

    @property
    def nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            raise ValueError(f"transfer '{self.name}' has no type yet; planc.model.infer.infer_transfers "
                             "measures it before it is sized")
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a P² reduction program: COLLECTIVE(slice=LEVEL, form=...)."""

    collective: Collective
    slice: str                 # a synthesis-hierarchy level name, or "root"
    form: FormKind
    form_level: str | None = None  # for parallel(e) / master(e)

    def __str__(self) -> str:
        form = str(self.form) if self.form is FormKind.INSIDE else f"{self.form}({self.form_level})"
        return f"{self.collective}(slice={self.slice}, form={form})"


def program_text(program: tuple[Instruction, ...]) -> str:
    return "; ".join(str(i) for i in program)


@dataclass(frozen=True, slots=True)
class Reduction:
    name: str                          # "gradients" or a standalone name
    axes: tuple[str, ...]
    mode: ReductionMode = ReductionMode.SYNTHESIZE
    program: tuple[Instruction, ...] | None = None   # mode == PROGRAM
    dtype: str | None = None           # standalone reductions
    shape: tuple[int, ...] | None = None
    span: Span = field(default=_NOSPAN, compare=False, repr=False)
    program_span: Span = field(default=_NOSPAN, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Resharding:
    strategy: Strategy = Strategy.AUTO
    chunks: int = 64
    scheduler: SchedulerKind = SchedulerKind.RANDOMIZED_GREEDY
    dfs_budget_s: float = 1.0
    trials: int = 64
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Synthesis:
    max_size: int = 5
    collectives: tuple[Collective, ...] = tuple(Collective)


@dataclass(frozen=True, slots=True)
class Optimizer:
    name: str = "adam"   # sgd | adam | adamw (planc.plan.OPTIMIZER_DEFAULTS)
    lr: float = 1e-3
    params: tuple[tuple[str, object], ...] = ()   # as written; plan.json fills in the defaults


@dataclass(frozen=True, slots=True)
class Train:
    micro_batch: int = 8
    micro_batches: int = 4
    steps: int = 10
    schedule: PipeSchedule = PipeSchedule.ONE_F_ONE_B
    virtual: int = 1                 # interleaved_1f1b(virtual = V): stages per pipe coordinate (else 1)
    optimizer: Optimizer = Optimizer()
    precision: Precision = Precision.FP32
    seed: int = 1234
    timeout: float | None = None     # seconds: collective timeout (None: the runtime's default)
    save_every: int | None = None    # checkpoint every N steps with `train.py --save DIR` (None: never)
    runtime: Runtime = Runtime()     # how the runtime executes the plan (plan.json `runtime`)
    lr_schedule: LrSchedule = LrSchedule()   # total = 0 until checked: the checker fills in `steps`
    zero: int = 0                    # 0 | 1 | 2 | 3 (ZeRO-1: master weights and optimizer state sharded over data;
                                     # ZeRO-2: the gradients too; ZeRO-3: the parameters too); every stage's
                                     # default, Stage.zero overrides
    zero_prefetch: bool = True       # zero = 3: the next layer's gather starts while this one computes
    zero_keep_gathered: bool = False  # zero = 3: gathered once a step, kept across its micro-batches
    recompute: Recompute = Recompute.NONE   # every stage's default; Stage.recompute overrides
    clip: float | None = None        # global gradient-norm bound (None: no clipping)
    sequence_parallel: bool = True   # where a stage has tensor > 1 and its model can (`= false`: nowhere)
    schedule_span: Span = field(default=_NOSPAN, compare=False, repr=False)   # `schedule = ...` as written
    # (setting, span of its value) as written: a setting that cannot be honoured is reported there
    setting_spans: tuple[tuple[str, Span], ...] = field(default=(), compare=False, repr=False)

    def span_of(self, setting: str, default: Span) -> Span:
        """Where ``setting`` is written in the plan, else ``default``."""
        return dict(self.setting_spans).get(setting, default)


@dataclass(frozen=True, slots=True)
class Program:
    """A checked plan. Paths in CodeRef/deepspeed are relative to ``source_dir``."""

    name: str
    source_path: str
    source_sha256: str
    source_dir: str
    cluster: Cluster
    parallel: Parallel | None
    stage_mode: StageMode
    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...] = ()
    reductions: tuple[Reduction, ...] = ()
    model: CodeRef | HfModel | None = None
    loss: CodeRef | None = None   # None with an HfModel: the model's causal-LM loss
    data: CodeRef | None = None
    resharding: Resharding = Resharding()
    synthesis: Synthesis = Synthesis()
    train: Train = Train()
    deepspeed_overrides: str | None = None

    @property
    def auto_stages(self) -> bool:
        """Some stage's layer range is left to the compiler and not cut yet."""
        return any(s.auto_layers and s.layers is None for s in self.stages)

    @property
    def pipe_axis(self) -> MeshAxis | None:
        if self.parallel is None:
            return None
        return MeshAxis.PIPE if MeshAxis.PIPE in self.parallel.axis_names() else None

    def stage_mesh(self, index: int) -> Mesh | None:
        """Stage ``index``'s mesh (shape, axis names); see :func:`stage_mesh`."""
        return stage_mesh(self.stage(index), self.parallel)

    def stage(self, index: int) -> Stage:
        for s in self.stages:
            if s.index == index:
                return s
        raise KeyError(index)
