"""The schedule as one action list: plan.json ``pipeline.actions`` (stdlib only; the contract package).

Per rank class (the ranks that run the same stages: one mesh; one stage per class, but under
interleaved_1f1b and zbv, :func:`class_stages`) the ordered actions that rank runs in one training step,
every stage of the class on one compute stream. The hang check, the simulator, the memory model and the
runtime's engine read them; nothing else derives an order (DESIGN.md, "Schedules as one action
list"). JSON, one array per action:

========================================= ==============================================================
``["F", s, m]``                            stage ``s``'s forward of micro-batch ``m``
``["B", s, m]``                            its backward (with a ``W`` of ``m``: the input gradients only)
``["W", s, m]``                            the weight gradients of ``m`` (zero-bubble schedules)
``["RECV", s, m, transfer, direction]``    wait for the rank's part of a transfer (posted ahead)
``["SEND", s, m, transfer, direction]``    issue the rank's sends of a transfer (non-blocking)
``["REDUCE", s]``                          the stage's gradient reduction and optimizer step
========================================= ==============================================================

A rank runs its list in order on its compute thread: a compute action computes, a SEND issues the
rank's sends (they never block), a RECV waits until the rank's part of the transfer has arrived. The
receive thread posts the RECVs in list order ahead of the compute thread, gated by
:func:`planc.plan.gates.post_gates` over the compute actions: :meth:`RankClass.turns` cuts the list into
turns, each compute action with the actions listed between it and the compute action before it, and
says where in them the turn *begins* (its first RECV, else its compute), the point the gates count.
The SENDs after the last compute action end the list with the REDUCEs, one per stage, which run after
every send has completed. A transfer between two stages of one class has both its SEND and its RECV in the
list, the SEND first; when its route is ``local`` (plan.json ``transfers[].local``) nothing moves: the
SEND hands the output over on the device, the receive thread posts nothing and the RECV does not count for
the gates.

ZeRO-3's layer gathers and ZeRO-2/3's per-micro-batch reduce-scatters are issued by the layers' hooks
inside ``F`` and ``B`` in layer order, on communicators of their own: their order is the compute
order, so they are not listed (docs/plan-format.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from .jsonpath import At, PlanFileError
from .vocab import Direction

__all__ = ["Action", "Turn", "RankClass", "COMPUTE", "KINDS", "SHARED_MESH", "stages_per_class", "class_stages"]

COMPUTE = ("F", "B", "W")
KINDS = COMPUTE + ("SEND", "RECV", "REDUCE")
_SHORT = {Direction.FORWARD: "fwd", Direction.BACKWARD: "bwd"}
SHARED_MESH = ("interleaved_1f1b", "zbv")   # the schedules whose rank classes run several stages on one mesh


def stages_per_class(schedule: str, virtual: int = 1) -> int:
    """How many stages each rank class (each mesh) runs under ``schedule``: ``virtual`` under
    interleaved_1f1b, 2 under zbv, else 1."""
    return {"interleaved_1f1b": virtual, "zbv": 2}.get(str(schedule), 1)


def class_stages(schedule: str, num_stages: int, virtual: int = 1) -> tuple[tuple[int, ...], ...]:
    """The stages of each rank class, class ``p`` on pipe coordinate (mesh) ``p`` of ``P = num_stages /
    stages_per_class``: interleaved_1f1b ``(p, p + P, p + 2P, ...)`` (Megatron's virtual pipeline), zbv
    ``(p, 2P - 1 - p)`` (the V: the first mesh runs the first and the last stage), else ``(p,)``. A
    ``ValueError`` when the stages do not divide into the classes."""
    per = stages_per_class(schedule, virtual)
    if per < 1 or num_stages % per:
        raise ValueError(f"{schedule} runs {per} stages per mesh; {num_stages} stages do not divide into them")
    P = num_stages // per
    if str(schedule) == "zbv":
        return tuple((p, 2 * P - 1 - p) for p in range(P))
    return tuple(tuple(p + k * P for k in range(per)) for p in range(P))


@dataclass(frozen=True, slots=True)
class Action:
    kind: str
    stage: int
    micro_batch: int | None = None
    transfer: str | None = None
    direction: Direction | None = None

    @property
    def key(self) -> tuple:
        """A transfer action's ``(transfer, direction, micro-batch)``; a compute action's ``(kind, m)``."""
        if self.transfer is not None:
            return self.transfer, self.direction, self.micro_batch
        return self.kind, self.micro_batch

    def to_json(self) -> list:
        if self.kind in COMPUTE:
            return [self.kind, self.stage, self.micro_batch]
        if self.kind == "REDUCE":
            return [self.kind, self.stage]
        return [self.kind, self.stage, self.micro_batch, self.transfer, str(self.direction)]

    def text(self) -> str:
        """``F0.3``, ``recv(h,fwd,3)``, ``reduce(0)``: how explain and error messages write it (no spaces: a
        wrapped list breaks between actions)."""
        if self.kind in COMPUTE:
            return f"{self.kind}{self.stage}.{self.micro_batch}"
        if self.kind == "REDUCE":
            return f"reduce({self.stage})"
        return f"{self.kind.lower()}({self.transfer},{_SHORT[self.direction]},{self.micro_batch})"

    @staticmethod
    def read(at: At, micro_batches: int) -> "Action":
        parts = at.items()
        if not parts:
            at.fail("expected [kind, stage, ...], got []")
        kind = parts[0].str()
        want = {"F": 3, "B": 3, "W": 3, "REDUCE": 2, "SEND": 5, "RECV": 5}.get(kind)
        if want is None:
            parts[0].fail(f"unknown action {kind!r} (expected one of {', '.join(KINDS)})")
        if len(parts) != want:
            at.fail(f"a {kind} action has {want} items, got {len(parts)}")
        stage = parts[1].int(0)
        if kind == "REDUCE":
            return Action(kind, stage)
        m = parts[2].int(0)
        if m >= micro_batches:
            parts[2].fail(f"micro-batch {m} of {micro_batches}")
        if kind in COMPUTE:
            return Action(kind, stage, m)
        return Action(kind, stage, m, parts[3].str(), parts[4].enum(Direction))


@dataclass(frozen=True, slots=True)
class Turn:
    """One compute action and the RECVs and SENDs listed before it (after the previous compute action), in
    list order. ``begin``: the position in ``before`` where the turn begins (its first RECV; else
    ``len(before)``, at the compute): what :func:`planc.plan.gates.post_gates` counts as the turn's beginning."""
    compute: Action
    before: tuple[Action, ...]

    @property
    def begin(self) -> int:
        return next((i for i, a in enumerate(self.before) if a.kind == "RECV"), len(self.before))

    @property
    def recvs(self) -> tuple[Action, ...]:
        return tuple(a for a in self.before if a.kind == "RECV")


@dataclass(frozen=True, slots=True)
class RankClass:
    """The ranks that run ``stages`` (one mesh) and the actions each of them runs, in order."""
    stages: tuple[int, ...]
    actions: tuple[Action, ...]

    def turns(self) -> tuple[Turn, ...]:
        """The list cut at its compute actions (module docstring); the SENDs after the last one are
        :meth:`tail`, the REDUCEs :meth:`reduces`."""
        out, before = [], []
        for a in self.actions:
            if a.kind in COMPUTE:
                out.append(Turn(a, tuple(before)))
                before = []
            elif a.kind != "REDUCE":
                before.append(a)
        return tuple(out)

    def tail(self) -> tuple[Action, ...]:
        """The SENDs after the last compute action (the list's end, before the REDUCEs)."""
        last = max((i for i, a in enumerate(self.actions) if a.kind in COMPUTE), default=-1)
        return tuple(a for a in self.actions[last + 1:] if a.kind == "SEND")

    def reduces(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind == "REDUCE")

    def compute(self, stage: int | None = None) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind in COMPUTE and (stage is None or a.stage == stage))

    def to_json(self) -> dict:
        return {"stages": list(self.stages), "list": [a.to_json() for a in self.actions]}

    @staticmethod
    def read(at: At, micro_batches: int) -> "RankClass":
        """A class's list, checked on its own: stages of the class, every micro-batch's ``F`` and ``B`` once
        per stage (``W`` for all or none), ``B`` after ``F`` and ``W`` after ``B``, a SEND after some compute
        action and a RECV before one, and one REDUCE per stage ending the list. Against the transfers:
        :func:`check_transfers` (the plan's cross-record check)."""
        stages = at.key("stages").ints(0)
        if not stages or len(set(stages)) != len(stages):
            at.key("stages").fail(f"expected distinct stages, got {list(stages)}")
        items = at.key("list").items()
        actions = tuple(Action.read(a, micro_batches) for a in items)
        seen: dict[tuple, int] = {}
        tail = False
        computed = False
        for a, where in zip(actions, items):
            if a.stage not in stages:
                where.fail(f"{a.text()}: stage {a.stage} is not one of the class's stages {list(stages)}")
            if a.kind == "REDUCE":
                tail = True
            elif tail:
                where.fail(f"{a.text()} after a reduce: the reduces end the list")
            if a.kind == "SEND" and not computed:
                where.fail(f"{a.text()} before any compute action: a send follows the action that computed it")
            computed |= a.kind in COMPUTE
            k = (a.kind, a.stage) + a.key
            if k in seen:
                where.fail(f"{a.text()} is listed twice (first at list[{seen[k]}])")
            seen[k] = len(seen)
            if a.kind == "B" and ("F", a.stage, "F", a.micro_batch) not in seen:
                where.fail(f"{a.text()} runs before F{a.stage}.{a.micro_batch}")
            if a.kind == "W" and ("B", a.stage, "B", a.micro_batch) not in seen:
                where.fail(f"{a.text()} runs before B{a.stage}.{a.micro_batch}")
        if actions and actions[-1].kind == "RECV":
            items[-1].fail(f"{actions[-1].text()}: no compute action after it waits for it")
        cls = RankClass(tuple(stages), actions)
        for s in stages:
            for kind in COMPUTE:
                got = sorted(a.micro_batch for a in cls.compute(s) if a.kind == kind)
                if kind == "W" and not got:
                    continue
                if got != list(range(micro_batches)):
                    missing = sorted(set(range(micro_batches)) - set(got))
                    at.key("list").fail(f"stage {s} must run {kind} of every micro-batch 0..{micro_batches - 1} "
                                        f"once (missing {', '.join(map(str, missing))})")
            if ("REDUCE", s, "REDUCE", None) not in seen:
                at.key("list").fail(f"no reduce of stage {s} (the list ends with one per stage)")
        return cls


def check_transfers(classes, transfers, stage_devices, micro_batches: int) -> None:
    """The classes against the plan: they partition the stages, the stages of one class share one
    mesh, and for every transfer and micro-batch the class of its source stage SENDs the forward after
    that stage's F and RECVs the backward before its B, and the class of its destination RECVs the forward
    before its F and SENDs the backward after its B (``B``: the input gradients). Raises
    :class:`PlanFileError` naming the class and action."""
    owner: dict[int, int] = {}
    for c, cls in enumerate(classes):
        where = f"plan.json: pipeline.actions[{c}]"
        for s in cls.stages:
            if s >= len(stage_devices):
                raise PlanFileError(f"{where}.stages: no stage {s}")
            if s in owner:
                raise PlanFileError(f"{where}.stages: stage {s} is also in pipeline.actions[{owner[s]}]")
            owner[s] = c
            if tuple(stage_devices[s]) != tuple(stage_devices[cls.stages[0]]):
                raise PlanFileError(f"{where}.stages: stages {cls.stages[0]} and {s} are on different devices; "
                                    "the stages of one class share a mesh")
    missing = sorted(set(range(len(stage_devices))) - set(owner))
    if missing:
        raise PlanFileError(f"plan.json: pipeline.actions: no list runs stage(s) {', '.join(map(str, missing))}")
    names = {t.name for t in transfers}
    for c, cls in enumerate(classes):
        position = {(a.kind, a.stage) + a.key: i for i, a in enumerate(cls.actions)}
        for i, a in enumerate(cls.actions):
            if a.transfer is not None and a.transfer not in names:
                raise PlanFileError(f"plan.json: pipeline.actions[{c}].list[{i}]: {a.text()}: no transfer "
                                    f"{a.transfer!r}")
        for t in transfers:
            for kind, stage, direction, compute, before in (
                    ("SEND", t.src_stage, Direction.FORWARD, "F", False),
                    ("RECV", t.src_stage, Direction.BACKWARD, "B", True),
                    ("RECV", t.dst_stage, Direction.FORWARD, "F", True),
                    ("SEND", t.dst_stage, Direction.BACKWARD, "B", False)):
                if stage not in cls.stages:
                    continue
                for m in range(micro_batches):
                    a = Action(kind, stage, m, t.name, direction)
                    at = position.get((kind, stage) + a.key)
                    if at is None:
                        raise PlanFileError(f"plan.json: pipeline.actions[{c}].list: no {a.text()} of stage {stage}")
                    ref = position[(compute, stage, compute, m)]
                    if (at > ref) == before:
                        raise PlanFileError(
                            f"plan.json: pipeline.actions[{c}].list[{at}]: {a.text()} must come "
                            f"{'before' if before else 'after'} {compute}{stage}.{m}")
        for t in transfers:   # a transfer between two stages of this class: its SEND before its RECV
            if t.src_stage in cls.stages and t.dst_stage in cls.stages:
                for a in cls.actions:
                    if a.kind == "RECV" and a.transfer == t.name:
                        send = position.get(("SEND",) + ((t.src_stage if a.direction is Direction.FORWARD
                                                          else t.dst_stage),) + a.key)
                        if send is not None and send > position[(a.kind, a.stage) + a.key]:
                            raise PlanFileError(f"plan.json: pipeline.actions[{c}].list[{send}]: the send of "
                                                f"{a.text()} comes after it in the same list: it would wait forever")
        extra = [a for a in cls.actions if a.transfer is not None
                 and not any(a.transfer == t.name and a.stage == (t.src_stage if (a.kind == "SEND") ==
                                                                  (a.direction is Direction.FORWARD) else t.dst_stage)
                             for t in transfers)]
        if extra:
            i = cls.actions.index(extra[0])
            raise PlanFileError(f"plan.json: pipeline.actions[{c}].list[{i}]: {extra[0].text()}: stage "
                                f"{extra[0].stage} is not that side of the transfer")
