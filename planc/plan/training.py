"""The plan file's pipeline, training settings and message tags.

Frozen, slotted, validated once in their ``read``; stdlib only (the contract package, ``planc.plan``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .actions import RankClass, class_stages
from .jsonpath import At, PlanFileError, extra, with_extra
from .optim import LossScale, LrSchedule, Optimizer, Zero3
from .runtime import positive_seconds
from .vocab import Direction, Precision, Schedule

__all__ = ["Pipeline", "in_flight", "CodeRef", "HfModel", "VocabSplit", "padded_vocab", "vocab_rows", "Train", "TagLayout"]


# ---------------------------------------------------------------- pipeline and training

@dataclass(frozen=True, slots=True)
class Pipeline:
    schedule: Schedule
    micro_batches: int
    actions: tuple[RankClass, ...]    # the schedule: per rank class its ordered actions (actions.py)
    extra: tuple = ()
    # per host (index), its cross-host sends in the order its NIC runs them, one at a time:
    # ((host, ((rank, transfer, direction, micro-batch), ...)), ...); empty: sends go as they come
    nic_order: tuple = ()
    virtual: int = 1     # interleaved_1f1b: stages per mesh (plan.json ``virtual``, written for it only)

    KEYS = ("schedule", "micro_batches", "virtual", "actions", "nic_order")

    @staticmethod
    def read(at: At, stages: int) -> "Pipeline":
        m = at.key("micro_batches").int(1)
        schedule = at.key("schedule").enum(Schedule)
        interleaved = schedule is Schedule.INTERLEAVED_1F1B
        v = at.key("virtual", None)
        if interleaved and v.value is None:
            v.fail("interleaved_1f1b needs its virtual degree (stages per mesh)")
        if not interleaved and v.value is not None:
            v.fail(f"only interleaved_1f1b has a virtual degree, the schedule is {schedule}")
        virtual = v.int(2) if interleaved else 1
        classes = tuple(RankClass.read(c, m) for c in at.key("actions").items())
        try:
            want = class_stages(schedule, stages, virtual)
        except ValueError as e:
            at.key("actions").fail(str(e))
        got = sorted(tuple(sorted(c.stages)) for c in classes)
        covered = sorted(x for c in got for x in c) == list(range(stages))   # else check_transfers names the gap
        if covered and got != sorted(tuple(sorted(c)) for c in want):
            at.key("actions").fail(f"{schedule} runs the stages in classes {[list(c) for c in want]}, the lists run "
                                   f"{[list(c.stages) for c in classes]}")
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
        return Pipeline(schedule, m, classes, extra(at, Pipeline.KEYS), tuple(nic), virtual)

    def class_of(self, stage: int) -> RankClass:
        """The rank class that runs ``stage``."""
        return next(c for c in self.actions if stage in c.stages)

    @property
    def per_stage(self) -> tuple[tuple[str, ...], ...]:
        """Per stage its forwards and backwards in list order (``"F3"``, ``"B0"``): read from the actions,
        for the figures that only count micro-batches in flight (``W`` left out: it frees nothing ``B``
        kept for the previous stage, and holds only what the weight gradients need)."""
        out = {}
        for c in self.actions:
            for a in c.compute():
                if a.kind != "W":
                    out.setdefault(a.stage, []).append(f"{a.kind}{a.micro_batch}")
        return tuple(tuple(out.get(s, ())) for s in range(max(out, default=-1) + 1))

    def in_flight_bound(self, stage: int) -> int:
        """Most micro-batches whose forward ran and that still hold activations, at any point of the
        stage's list: until their backward, or with a split backward until their ``W`` (what ``B`` keeps
        for the weight gradients is held until then)."""
        return in_flight(self.class_of(stage).compute(stage))

    def to_json(self) -> dict:
        out = {"schedule": str(self.schedule), "micro_batches": self.micro_batches}
        if self.schedule is Schedule.INTERLEAVED_1F1B:
            out["virtual"] = self.virtual
        out["actions"] = [c.to_json() for c in self.actions]
        if self.nic_order:
            out["nic_order"] = [{"host": h, "sends": [list(k) for k in keys]} for h, keys in self.nic_order]
        return with_extra(out, self.extra)

    def nic_order_of(self, host: int) -> tuple:
        """Host ``host``'s send order (empty when it has none)."""
        return next((keys for h, keys in self.nic_order if h == host), ())


def in_flight(compute) -> int:
    """The peak of micro-batches in flight over one stage's compute actions (``Action`` records, or
    ``(kind, m)`` pairs): from ``F`` until ``W`` where the list splits the backward, else until ``B``."""
    ops = [(a.kind, a.micro_batch) if hasattr(a, "kind") else (a[0], a[1]) for a in compute]
    end = "W" if any(k == "W" for k, _ in ops) else "B"
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1 if kind == end else 0
        peak = max(peak, live)
    return peak


# functions of the runtime a plan may name instead of the user's (``{"builtin": NAME}``)
BUILTINS = ("causal_lm_loss",)


@dataclass(frozen=True, slots=True)
class CodeRef:
    """A function of the user's code in OUT/ (``file``, ``function``), or with ``builtin`` one of the runtime's
    (``{"builtin": "causal_lm_loss"}``: ``planc_runtime.hf.causal_lm_loss``, a Hugging Face model's default loss)."""

    file: str
    function: str
    args: tuple = ()       # (key, JSON value) pairs: the model's, or the data function's when its line has some
    builtin: bool = False

    @staticmethod
    def read(at: At) -> "CodeRef":
        if isinstance(at.value, dict) and "builtin" in at.value:
            name = at.key("builtin").str()
            if name not in BUILTINS:
                at.key("builtin").fail(f"expected one of {', '.join(BUILTINS)}, got {name!r}")
            return CodeRef("", name, (), True)
        args = at.key("args", None)
        return CodeRef(at.key("file").str(), at.key("function").str(),
                       tuple(args.value.items()) if isinstance(args.value, dict) else ())

    def to_json(self, with_args: bool) -> dict:
        if self.builtin:
            return {"builtin": self.function}
        out = {"file": self.file, "function": self.function}
        if with_args or self.args:
            out["args"] = dict(self.args)
        return out


def padded_vocab(size: int, degrees) -> int:
    """The rows a vocabulary of ``size`` is padded to when holders of the tensor ``degrees`` split it: the
    least multiple of their least common multiple that is >= ``size`` (``size`` itself when none splits)."""
    m = math.lcm(*(max(1, int(d)) for d in degrees)) if degrees else 1
    return -(-int(size) // m) * m


def vocab_rows(size: int, padded: int, degree: int, coord: int) -> tuple[int, int]:
    """The rows [lo, hi) of the padded table a holder at tensor coordinate ``coord`` of ``degree`` keeps: the
    ``coord``-th of ``degree`` equal parts of ``padded`` rows (degree 1: the ``size`` real rows, unpadded)."""
    if degree <= 1:
        return 0, int(size)
    n = int(padded) // int(degree)
    return coord * n, (coord + 1) * n


@dataclass(frozen=True, slots=True)
class VocabSplit:
    """``train.model.hf.vocab`` (docs/plan-format.md): the vocabulary split of the embedding table and
    ``lm_head`` over tensor axes. ``size``: the model's vocabulary (``vocab_size``: the rows checkpoints
    hold); ``embedding``, ``lm_head``: the rows each is padded to, a multiple of every holding stage's
    tensor degree (of their least common multiple when tied across stages): a holder of degree k keeps
    ``padded / k`` rows (:func:`vocab_rows`), the padding zero, never trained nor written."""
    size: int
    embedding: int
    lm_head: int

    @staticmethod
    def read(at: At) -> "VocabSplit":
        size = at.key("size").int(1)
        rows = []
        for key in ("embedding", "lm_head"):
            n = at.key(key).int(1)
            if n < size:
                at.key(key).fail(f"{n} rows: fewer than the vocabulary's {size}")
            rows.append(n)
        return VocabSplit(size, rows[0], rows[1])

    def padded(self, part: str) -> int:
        return self.embedding if part == "embedding" else self.lm_head

    def to_json(self) -> dict:
        return {"size": self.size, "embedding": self.embedding, "lm_head": self.lm_head}


@dataclass(frozen=True, slots=True)
class HfModel:
    """``train.model`` of a Hugging Face causal LM (``{"hf": {...}}``): ``architecture`` (a transformers
    class), ``config`` (every key of its config after defaults, dropout probabilities 0: what the runtime
    builds from), ``keys`` (the plan's own keys), ``attn_implementation`` (``sdpa`` or ``eager``: what it is
    built with), ``folder`` (OUT/-relative or absolute; None: built from the config) and ``weights`` (the
    folder's weights are loaded; else the model is initialised from ``train.seed``)."""

    architecture: str
    config: tuple                 # (key, JSON value) pairs
    attn_implementation: str
    keys: tuple = ()
    folder: str | None = None
    weights: bool = False
    vocab: VocabSplit | None = None   # the embedding's and lm_head's vocabulary split, where a stage splits them

    @staticmethod
    def read(at: At) -> "HfModel":
        cfg = at.key("config")
        if not isinstance(cfg.value, dict):
            cfg.fail("expected an object of config keys")
        keys = at.key("keys", {})
        if not isinstance(keys.value, dict):
            keys.fail("expected an object of config keys")
        attn = at.key("attn_implementation").str()
        if attn not in ("sdpa", "eager"):
            at.key("attn_implementation").fail(f"expected sdpa or eager, got {attn!r}")
        folder = at.key("folder", None)
        vocab = at.key("vocab", None)
        return HfModel(at.key("architecture").str(), tuple(cfg.value.items()), attn, tuple(keys.value.items()),
                       None if folder.value is None else folder.str(), at.key("weights", False).bool(),
                       None if vocab.value is None else VocabSplit.read(vocab))

    @property
    def builtin(self) -> bool:
        return False

    def to_json(self, with_args: bool = True) -> dict:
        out = {"architecture": self.architecture, "attn_implementation": self.attn_implementation,
               "keys": dict(self.keys), "config": dict(self.config)}
        if self.folder is not None:
            out.update(folder=self.folder, weights=self.weights)
        if self.vocab is not None:
            out["vocab"] = self.vocab.to_json()
        return {"hf": out}

    @property
    def args(self) -> tuple:
        return ()


def _model_ref(at: At) -> "CodeRef | HfModel":
    if isinstance(at.value, dict) and "hf" in at.value:
        return HfModel.read(at.key("hf"))
    return CodeRef.read(at)


@dataclass(frozen=True, slots=True)
class Train:
    """Training settings, and who counts the loss.

    ``loss_devices``: last-stage devices, one per row range, whose losses add up
    to the micro-batch's loss; each device's loss is weighted by its share of
    the rows so that every gradient is the gradient of the global mean loss.

    The training regime (LANGUAGE.md, "Training settings"): ``optimizer`` with every argument,
    ``lr_schedule``, ``precision``, ``zero`` (1: fp32 master weights and optimizer state sharded over
    each stage's data group, gradients reduce-scattered and parameters all-gathered by the plan's
    ``reductions`` of those targets; 2: also only the owned shard of each gradient accumulated, every
    micro-batch's gradient reduce-scattered; 3: also the parameters sharded, each layer's all-gathered before
    its forward and its backward, as ``zero3`` says; a stage's ``zero`` overrides it, ``Plan.zero_of``), ``recompute`` (per stage, in stage order), ``clip`` (the global
    gradient-norm bound, None: no clipping), ``loss_scale`` (fp16 only) and ``norm_group``: every device
    of every stage, sorted, the group the global gradient norm and fp16's overflow vote are summed over
    (listed in ``groups`` when it has more than one member; empty when neither clip nor fp16 needs it).
    """

    model: CodeRef | HfModel
    loss: CodeRef
    data: CodeRef
    micro_batch: int
    micro_batches: int
    steps: int
    schedule: Schedule
    optimizer: Optimizer
    precision: Precision
    seed: int
    trainable: bool
    not_trainable_because: tuple[str, ...]
    loss_devices: tuple[int, ...] = ()
    timeout: float | None = None        # collective timeout in seconds (train { timeout = ... })
    save_every: int | None = None       # checkpoint every N steps when train.py --save DIR is given
    extra: tuple = ()
    lr_schedule: LrSchedule = LrSchedule()
    zero: int = 0
    recompute: tuple[bool, ...] = ()    # per stage; empty: no stage recomputes
    clip: float | None = None
    loss_scale: LossScale | None = None
    norm_group: tuple[int, ...] = ()
    zero3: Zero3 | None = None          # present where a stage has zero = 3

    KEYS = ("model", "loss", "data", "micro_batch", "micro_batches", "steps", "schedule", "optimizer",
            "precision", "seed", "trainable", "not_trainable_because", "loss_devices", "timeout", "save_every",
            "lr_schedule", "zero", "recompute", "clip", "loss_scale", "norm_group", "zero3")

    @staticmethod
    def read(at: At) -> "Train":
        precision = at.key("precision").enum(Precision)
        zero = at.key("zero", 0).int(0)
        if zero > 3:
            at.key("zero").fail(f"expected 0, 1, 2 or 3, got {zero}")
        zero3 = at.key("zero3", None)
        clip = at.key("clip", None)
        if clip.value is not None and not clip.num() > 0:
            clip.fail(f"expected a positive norm, got {clip.value}")
        scale = at.key("loss_scale", None)
        if (scale.value is not None) != (precision is Precision.FP16):
            scale.fail("fp16 plans, and only they, have a loss_scale")
        group = at.key("norm_group", [])
        members = group.ints()
        if list(members) != sorted(set(members)):
            group.fail(f"members must be sorted and distinct, got {list(members)}")
        return Train(_model_ref(at.key("model")), CodeRef.read(at.key("loss")), CodeRef.read(at.key("data")),
                     at.key("micro_batch").int(1), at.key("micro_batches").int(1), at.key("steps").int(0),
                     at.key("schedule").enum(Schedule), Optimizer.read(at.key("optimizer")), precision,
                     at.key("seed").int(), at.key("trainable", True).bool(),
                     tuple(x.str() for x in at.key("not_trainable_because", []).items()),
                     at.key("loss_devices", []).ints(), positive_seconds(at.key("timeout", None)),
                     at.key("save_every", None).opt_int(1), extra(at, Train.KEYS),
                     LrSchedule.read(at.key("lr_schedule", {"name": "constant"})), zero,
                     tuple(x.bool() for x in at.key("recompute", []).items()),
                     None if clip.value is None else float(clip.value),
                     None if scale.value is None else LossScale.read(scale), members,
                     None if zero3.value is None else Zero3.read(zero3))

    def recomputes(self, stage: int) -> bool:
        """Stage ``stage`` keeps only its inputs per in-flight micro-batch and reruns its forward in backward."""
        return bool(self.recompute) and self.recompute[stage]

    def to_json(self) -> dict:
        out = {"model": self.model.to_json(True), "loss": self.loss.to_json(False), "data": self.data.to_json(False),
               "micro_batch": self.micro_batch, "micro_batches": self.micro_batches, "steps": self.steps,
               "schedule": str(self.schedule), "optimizer": self.optimizer.to_json(),
               "lr_schedule": self.lr_schedule.to_json(), "precision": str(self.precision), "zero": self.zero,
               "recompute": list(self.recompute), "clip": self.clip, "seed": self.seed}
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale.to_json()
        if self.norm_group:
            out["norm_group"] = list(self.norm_group)
        if self.zero3 is not None:
            out["zero3"] = self.zero3.to_json()
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
