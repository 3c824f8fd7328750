"""plan.json as typed records: the one reader and the one writer, shared by compiler and runtime.

The compiler assembles its decisions and writes them with ``Plan.to_json``;
every rank of a launched job reads them back with ``Plan.from_json``, which
validates the whole file once and names the key that is wrong
(``transfers[1].backward.tasks[3].sender: 9 is not one of the holders [4, 5]``).
After that the runtime only executes: every region, task, group, program and
row range it uses is a field here, none is derived from a spec string.

Only the standard library is used: this module and the rest of the contract
package ``planc.plan`` (``jsonpath``: reading with a path; ``vocab``: the closed
vocabularies; ``records``: cluster, stages, reductions; ``training``: pipeline,
training, tags; ``transfers``: tasks and routes; ``runtime``: how the runtime
executes) are imported by the compiler and copied into every output as
``OUT/planc/plan/``, where the runtime imports them.

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

from .jsonpath import At, Group, PlanFileError, kind, lists
from .records import Cluster, Reduction, Stage
from .runtime import Runtime
from .actions import check_transfers
from .training import Pipeline, TagLayout, Train
from .transfers import Transfer
from .vocab import StageMode, Strategy

__all__ = ["FORMAT", "Plan", "load", "digest", "dumps", "encode", "written"]

FORMAT = "planc/1"


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
    runtime: Runtime = Runtime()   # how the runtime executes it (runtime.py): never the environment
    head: tuple = ()          # source, compiler, placement, choices: written as read
    # the plan.json bytes: as read (load) or as the compiler will write them (written); never copied by
    # dataclasses.replace, whose new records would not be these bytes
    raw: bytes | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def timeout(self) -> float | None:
        """The collective timeout the plan sets (s): ``train.timeout``, or ``runtime.timeout`` for a plan
        without a model; None: the runtime's default."""
        return self.train.timeout if self.train is not None else self.runtime.timeout

    @staticmethod
    def from_json(doc) -> "Plan":
        at = At(doc, "")
        if not isinstance(doc, dict):
            at.fail(f"expected an object, got {kind(doc)}")
        fmt = at.key("format").str()
        if fmt != FORMAT:
            at.key("format").fail(f"expected {FORMAT!r}, got {fmt!r}")
        cluster = Cluster.read(at.key("cluster"))
        stages = tuple(Stage.read(s) for s in at.key("stages").items())
        _check_stages(cluster, stages)   # before the rest is read: a stage error is named first
        pipe = at.key("pipeline", None)
        train = at.key("train", None)
        plan = Plan(
            at.key("name").str(), cluster, at.key("groups").groups(), at.key("backward_groups", []).groups(),
            at.key("tensor_groups", []).groups(), at.key("stage_mode").enum(StageMode), stages,
            tuple(Reduction.read(r) for r in at.key("reductions").items()),
            tuple(Transfer.read(t) for t in at.key("transfers").items()),
            Pipeline.read(pipe, len(stages)) if pipe.value is not None else None,
            Train.read(train) if train.value is not None else None,
            Runtime.read(at.key("runtime", None)),
            tuple((k, doc[k]) for k in ("source", "compiler", "placement", "choices") if k in doc))
        plan._check_references()
        return plan

    @staticmethod
    def of(plan: "Plan | dict") -> "Plan":
        """``plan`` itself, or a plan.json document read (and validated) once with :meth:`from_json`: what
        the readers of a compiled plan (explain, codegen, the drawing) take."""
        return plan if isinstance(plan, Plan) else Plan.from_json(plan)

    def check(self) -> "Plan":
        """The plan's cross-record checks (the records themselves are checked where they are read):
        stage indices and disjoint devices, every group a step or task uses listed, every route's regions
        for every device of its stages, the NIC order's sends, the loss devices; the plan, or a
        ``PlanFileError`` naming the key. The compiler runs it on the records it assembles."""
        _check_stages(self.cluster, self.stages)
        self._check_references()
        return self

    def _check_references(self) -> None:
        listed = set(self.groups)
        for i, r in enumerate(self.reductions):
            for j, s in enumerate(r.steps):
                for g in s.groups:
                    if g not in listed:
                        raise PlanFileError(f"plan.json: reductions[{i}].program.steps[{j}]: group {list(g)} "
                                            "is not listed in groups")
        self._check_tied()
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
        _check_shared(self.stages, self.pipeline)
        if self.pipeline is not None:
            check_transfers(self.pipeline.actions, self.transfers, [st.devices for st in self.stages],
                            self.pipeline.micro_batches)
            self._check_nic_order()
        if self.train is not None:
            if self.pipeline is None:
                raise PlanFileError("plan.json: pipeline: missing (a plan with train settings has a pipeline)")
            last = self.stages[-1].devices if self.stages else ()
            if self.train.recompute and len(self.train.recompute) != len(self.stages):
                raise PlanFileError(f"plan.json: train.recompute: {len(self.train.recompute)} entries for "
                                    f"{len(self.stages)} stages")
            group = self.train.norm_group
            if len(group) > 1 and group not in listed:
                raise PlanFileError(f"plan.json: train.norm_group: {list(group)} is not listed in groups")
            for d in self.train.loss_devices:
                if d not in last:
                    raise PlanFileError(f"plan.json: train.loss_devices: {d} is not a device of the last stage")
            self._check_zero()

    def _check_zero(self) -> None:
        """A stage with ZeRO (1, 2 or 3) and data-parallel peers reduce-scatters its gradients; ``train.zero3``
        is there exactly where a stage has zero = 3."""
        for st in self.stages:
            zero = self.zero_of(st.index)
            peers = next((g for g in st.data_groups if len(g) > 1), None)
            red = self.gradient_reduction(peers[0]) if zero and peers else None
            if red is not None and str(red.target) != "reduce_scatter":
                raise PlanFileError(f"plan.json: stages[{st.index}]: zero = {zero} but its gradients reduction has "
                                    f"target {red.target}: ZeRO reduce-scatters the gradients (recompile the plan)")
        threes = [st.index for st in self.stages if self.zero_of(st.index) == 3]
        if self.train is not None and bool(threes) != (self.train.zero3 is not None):
            raise PlanFileError("plan.json: train.zero3: " + (f"missing, but stages {threes} have zero = 3" if threes
                                else "present, but no stage has zero = 3"))

    def _check_tied(self) -> None:
        """A tied reduction's holders are layers of their stages, and its groups partition exactly the
        devices of those stages."""
        for i, r in enumerate(self.reductions):
            if r.tied is None:
                continue
            where = f"plan.json: reductions[{i}].tied"
            for j, h in enumerate(r.tied.holders):
                st = self.stages[h.stage] if h.stage < len(self.stages) else None
                if st is None:
                    raise PlanFileError(f"{where}.holders[{j}].stage: no stage {h.stage}")
                if st.layers is not None and not st.layers[0] <= h.layer < st.layers[1]:
                    raise PlanFileError(f"{where}.holders[{j}].layer: layer {h.layer} is not in stage {h.stage}'s "
                                        f"layers {list(st.layers)}")
            want = sorted(d for s in sorted({h.stage for h in r.tied.holders}) for d in self.stages[s].devices)
            have = sorted(d for g in r.groups for d in g)
            if r.tied.split is not None:   # one piece per group: the pieces' groups lie inside the holders
                if not set(have) <= set(want) or len(have) != len(set(have)):
                    raise PlanFileError(f"plan.json: reductions[{i}].groups: a split tied parameter's groups must "
                                        f"be disjoint groups of the devices of the stages holding it {want}, "
                                        f"got {[list(g) for g in r.groups]}")
                continue
            if have != want:
                raise PlanFileError(f"plan.json: reductions[{i}].groups: a tied parameter's groups must partition "
                                    f"the devices of the stages holding it {want}, got {have}")
        self._check_vocab()

    def _check_vocab(self) -> None:
        """``train.model.hf.vocab``: each padded table splits into whole rows over the tensor axis of every
        stage holding it (the embedding: the stage of layer 0; ``lm_head``: the last stage)."""
        vocab = getattr(getattr(self.train, "model", None), "vocab", None)
        if vocab is None or not self.stages:
            return
        for part, stage in (("embedding", self.stages[0]), ("lm_head", self.stages[-1])):
            k = stage.mesh_shape[stage.mesh_axes.index("tensor")] if "tensor" in stage.mesh_axes else 1
            padded = vocab.padded(part)
            if padded % k:
                raise PlanFileError(f"plan.json: train.model.hf.vocab.{part}: {padded} rows do not split over stage "
                                    f"{stage.index}'s tensor axis of {k} (pad the vocabulary of {vocab.size} to a "
                                    f"multiple of {k})")
            for i, r in enumerate(self.reductions):   # one table tied across stages: one padding
                if r.tied is not None and r.tied.split is not None and r.tied.split.padded != padded:
                    raise PlanFileError(f"plan.json: train.model.hf.vocab.{part}: {padded} rows, but the tied table "
                                        f"of reductions[{i}].tied.split is padded to {r.tied.split.padded}")
            if k == 1 and padded != vocab.size and not any(r.tied is not None for r in self.reductions):
                raise PlanFileError(f"plan.json: train.model.hf.vocab.{part}: {padded} rows, but stage "
                                    f"{stage.index} does not split it (no tensor axis): it holds the "
                                    f"{vocab.size} rows unpadded")

    def tied_reductions(self, device: int) -> tuple[Reduction, ...]:
        """The tied-parameter reductions whose groups hold ``device``, in plan order."""
        return tuple(r for r in self.reductions if r.tied is not None and r.group_of(device) is not None)

    def _check_nic_order(self) -> None:
        """Every listed send is one the plan makes: its rank on the host, sending that transfer's route."""
        names = {t.name: t for t in self.transfers}
        for i, (h, keys) in enumerate(self.pipeline.nic_order):
            where = f"plan.json: pipeline.nic_order[{i}]"
            if h >= len(self.cluster.hosts):
                raise PlanFileError(f"{where}.host: no host {h} (the cluster has {len(self.cluster.hosts)})")
            for j, (rank, name, direction, _) in enumerate(keys):
                if rank not in self.cluster.hosts[h]:
                    raise PlanFileError(f"{where}.sends[{j}]: rank {rank} is not on host {h}")
                t = names.get(name)
                if t is None:
                    raise PlanFileError(f"{where}.sends[{j}]: no transfer {name!r}")
                route = t.forward if direction == "forward" else t.backward
                if route is None or not any(task.sender == rank for task in route.tasks):
                    raise PlanFileError(f"{where}.sends[{j}]: rank {rank} sends nothing of transfer {name!r} "
                                        f"({direction})")

    # ---- questions the runtime asks
    def stage_of(self, device: int) -> Stage | None:
        """The (first) stage on ``device``; under interleaved_1f1b and zbv a device runs several:
        :meth:`stages_of`."""
        for s in self.stages:
            if device in s.devices:
                return s
        return None

    def stages_of(self, device: int) -> tuple[Stage, ...]:
        """Every stage on ``device`` (its rank class's, one mesh), in index order."""
        return tuple(s for s in self.stages if device in s.devices)

    def zero_of(self, stage: int) -> int:
        """Stage ``stage``'s ZeRO degree: its own (``stages[i].zero``) or the train block's."""
        own = next(s for s in self.stages if s.index == stage).zero
        return own if own is not None else (self.train.zero if self.train is not None else 0)

    def gradient_reduction(self, device: int, stage: int | None = None) -> Reduction | None:
        """The ``gradients`` entry whose groups hold ``device`` (one per stage when stages differ); ``stage``:
        of that stage (a device may run several stages that share a mesh): its own entry, else one for
        every stage (no ``stage``)."""
        found = [r for r in self.reductions if r.name == "gradients" and r.group_of(device) is not None]
        if stage is not None:
            found = [r for r in found if r.stage == stage] or [r for r in found if r.stage is None]
        return found[0] if found else None

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
        out["groups"] = lists(self.groups)
        if self.backward_groups:
            out["backward_groups"] = lists(self.backward_groups)
        if self.tensor_groups:
            out["tensor_groups"] = lists(self.tensor_groups)
        out["stage_mode"] = str(self.stage_mode)
        out["stages"] = [s.to_json() for s in self.stages]
        if "choices" in head:   # why each `auto` of the plan became what it is
            out["choices"] = head["choices"]
        out["reductions"] = [r.to_json() for r in self.reductions]
        out["transfers"] = [t.to_json() for t in self.transfers]
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_json()
        if self.train is not None:
            out["train"] = self.train.to_json()
        out["runtime"] = self.runtime.to_json()
        return out


def _check_stages(cluster: Cluster, stages: tuple[Stage, ...]) -> None:
    """Stage indices 0..n-1 in order; every device of the cluster in at most one mesh: stages that share a
    device share their whole mesh (the same devices, shape and axes; :func:`_check_shared` then asks the
    pipeline to run them in one rank class)."""
    if [s.index for s in stages] != list(range(len(stages))):
        raise PlanFileError(f"plan.json: stages: stage indices must be 0..{len(stages) - 1} in order, got "
                            f"{[s.index for s in stages]}")
    seen: dict[int, Stage] = {}
    for s in stages:
        for d in s.devices:
            if d >= cluster.devices:
                raise PlanFileError(f"plan.json: stages: stage {s.index} uses device {d}, the cluster has "
                                    f"{cluster.devices}")
            other = seen.get(d)
            if other is not None and _mesh(other) != _mesh(s):   # (stages share a mesh whole or not at all)
                raise PlanFileError(f"plan.json: stages: device {d} is in stages {other.index} and {s.index}")
            seen[d] = s


def _mesh(s: Stage) -> tuple:
    return s.mesh_devices, s.mesh_shape, s.mesh_axes


def _check_shared(stages: tuple[Stage, ...], pipeline: Pipeline | None) -> None:
    """Stages on one mesh run in one rank class of ``pipeline.actions`` (interleaved_1f1b, zbv); a plan
    without a pipeline has disjoint meshes."""
    first: dict[tuple, int] = {}
    for s in stages:
        k = first.setdefault(_mesh(s), s.index)
        if k == s.index:
            continue
        if pipeline is None:
            raise PlanFileError(f"plan.json: stages: stages {k} and {s.index} share a mesh, which only a pipeline "
                                "running them in one rank class may do")
        if s.index not in pipeline.class_of(k).stages:
            raise PlanFileError(f"plan.json: stages: stages {k} and {s.index} share a mesh but pipeline.actions runs "
                                "them in different rank classes")


def dumps(plan: Plan) -> str:
    """plan.json text (:func:`encode` of ``to_json``)."""
    return encode(plan.to_json())


def encode(doc: dict) -> str:
    """plan.json text of a ``to_json`` document: keys in the order ``to_json`` builds them, one top-level
    key a line, each element of a list of objects (stages, reductions, transfers, ...) on a line of its
    own, compact inside (``json``'s C encoder: no spaces, no NaN), trailing newline. Valid JSON that any
    reader reads the same as any other layout; the same document always gives the same bytes."""
    one = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    lines = []
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            body = ",\n    ".join(one(x) for x in v)
            lines.append(f"  {one(k)}: [\n    {body}\n  ]")
        else:
            lines.append(f"  {one(k)}: {one(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def written(plan: Plan) -> Plan:
    """``plan`` holding, as ``raw``, the bytes :func:`dumps` gives for it: what the compiler writes and
    verifies (``planc.verify``: read back, they must give these records) and what ``digest`` hashes."""
    object.__setattr__(plan, "raw", dumps(plan).encode())
    return plan


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
