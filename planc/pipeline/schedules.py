"""The schedules as generators of action lists: gpipe, 1f1b and eager_1f1b (AlpaComm §4).

A schedule first orders each stage's compute: ``("F", m)`` runs micro-batch ``m`` forward,
``("B", m)`` backward (:func:`stage_ops`). :func:`actions_of` then writes plan.json's
``pipeline.actions`` (``planc.plan.actions``), the one list every reader runs: before each ``F`` the
receives of the stage's incoming transfers, after it the sends of its outgoing ones; before each ``B``
the receives of the output gradients, after it the sends of the input gradients (transfers in
declaration order); the stage's ``REDUCE`` last. The transfer graph decides whether the compute
orders can run at all (:func:`simulate` below, which :func:`build` runs).

Warm-up forwards before the first backward, stage ``i`` of ``S``, ``B``
micro-batches:

========== ======================= =====================================
schedule   warm-up forwards        peak in-flight micro-batches on stage i
========== ======================= =====================================
gpipe      B                       B
1f1b       min(B, S-i-1)           min(B, S-i)
eager_1f1b min(B, 2(S-i-1))        min(B, 2(S-i)-1)
========== ======================= =====================================

"In flight" counts micro-batches whose forward has run on the stage and
whose backward has not; it bounds the activations a stage keeps. After the
warm-up, 1f1b and eager_1f1b alternate one forward and one backward, then
drain the remaining backwards. Eager 1F1B runs more forwards early, so each
activation is sent further ahead of its use and the cross-mesh transfer
overlaps computation, at the price of about twice 1f1b's activation memory. Each hop gets one extra
forward of lead, so the last stage, whose outputs go nowhere, runs no
warm-up at all: a forward there ahead of its backward would only hold back
the gradient it sends (measured: with ``2(S-i)-1`` warm-ups, the last stage's
extra forward cost eager_1f1b 5-20 % against 1f1b on link-bound rates).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planc import plan as planfile
from planc.ir import PipeSchedule
from planc.pipeline.orders import class_orders

Op = tuple[str, int]   # ("F" | "B", micro-batch)


def warmup(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int) -> int:
    """Forwards stage ``stage`` runs before its first backward (gpipe, 1f1b, eager_1f1b; zb_h1's is 1f1b's)."""
    schedule = PipeSchedule(schedule)
    remaining = num_stages - stage
    if schedule is PipeSchedule.GPIPE:
        return micro_batches
    if schedule in (PipeSchedule.ONE_F_ONE_B, PipeSchedule.ZB_H1):
        return min(micro_batches, remaining - 1)
    if schedule is PipeSchedule.EAGER_1F1B:
        return min(micro_batches, 2 * (remaining - 1))
    raise ValueError(f"{schedule} runs several stages per mesh: see planc.pipeline.orders")


def peak_in_flight(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int,
                   virtual: int = 1) -> int:
    """The exact peak number of in-flight micro-batches the schedule gives stage ``stage``: from its ``F``
    to its ``B``, or with a split backward (zb_h1, zbv) to its ``W`` (``planc.plan.in_flight``)."""
    schedule = PipeSchedule(schedule)
    if schedule in (PipeSchedule.GPIPE, PipeSchedule.ONE_F_ONE_B, PipeSchedule.EAGER_1F1B):
        return min(micro_batches, warmup(schedule, num_stages, stage, micro_batches) + 1)
    for stages, ops in class_orders(str(schedule), num_stages, micro_batches, virtual):
        if stage in stages:
            return planfile.in_flight([(k, m) for k, s, m in ops if s == stage])
    raise ValueError(f"no stage {stage} of {num_stages}")


def stage_ops(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int) -> tuple[Op, ...]:
    """The instruction order of one stage (the schedules of one stage per mesh and no W)."""
    w = warmup(schedule, num_stages, stage, micro_batches)
    ops: list[Op] = [("F", m) for m in range(w)]
    for k in range(micro_batches - w):        # steady state: one forward, one backward
        ops.append(("F", w + k))
        ops.append(("B", k))
    ops.extend(("B", m) for m in range(micro_batches - w, micro_batches))
    return tuple(ops)


def orders(schedule: PipeSchedule | str, num_stages: int, micro_batches: int, virtual: int = 1):
    """Per rank class ``(stages, compute order)``, the order as ``(kind, stage, micro-batch)``: gpipe, 1f1b and
    eager_1f1b one class per stage (:func:`stage_ops`); interleaved_1f1b, zb_h1 and zbv as
    ``planc.pipeline.orders`` generates them."""
    schedule = PipeSchedule(schedule)
    if schedule in (PipeSchedule.GPIPE, PipeSchedule.ONE_F_ONE_B, PipeSchedule.EAGER_1F1B):
        return tuple(((s,), tuple((k, s, m) for k, m in stage_ops(schedule, num_stages, s, micro_batches)))
                     for s in range(num_stages))
    return class_orders(str(schedule), num_stages, micro_batches, virtual)


def actions_of(per_stage, transfers=()) -> tuple[planfile.RankClass, ...]:
    """plan.json ``pipeline.actions`` for per-stage compute orders (each stage on its own mesh: a list of
    ``(kind, m)`` per stage): :func:`class_actions` of one class per stage."""
    return class_actions(tuple(((s,), tuple((k, s, m) for k, m in ops)) for s, ops in enumerate(per_stage)),
                         transfers)


def class_actions(classes, transfers=()) -> tuple[planfile.RankClass, ...]:
    """plan.json ``pipeline.actions`` for per-class compute orders (``(stages, ((kind, stage, m), ...))``, as
    :func:`orders` gives them): each class's compute with each transfer's receives before the action that
    consumes them and its sends after the one that produced them (a transfer between two stages of the
    class: both in its list, the send first), then one reduce per stage, in the order the stages finish.
    ``transfers``: the plan's, in declaration order (anything with ``name``, ``src_stage`` and
    ``dst_stage``). ``W`` moves nothing."""
    fwd, bwd = planfile.Direction.FORWARD, planfile.Direction.BACKWARD
    out = []
    for stages, ops in classes:
        incoming = {s: [t.name for t in transfers if t.dst_stage == s] for s in stages}
        outgoing = {s: [t.name for t in transfers if t.src_stage == s] for s in stages}
        acts = []
        last = {}
        for i, (kind, s, m) in enumerate(ops):
            last[s] = i
            if kind == "W":
                acts.append(planfile.Action(kind, s, m))
                continue
            waits, sends, d = (incoming[s], outgoing[s], fwd) if kind == "F" else (outgoing[s], incoming[s], bwd)
            acts += [planfile.Action("RECV", s, m, t, d) for t in waits]
            acts.append(planfile.Action(kind, s, m))
            acts += [planfile.Action("SEND", s, m, t, d) for t in sends]
        acts += [planfile.Action("REDUCE", s) for s in sorted(stages, key=lambda s: last.get(s, -1))]
        out.append(planfile.RankClass(tuple(stages), tuple(acts)))
    return tuple(out)


def plan_actions(plan_json: dict) -> tuple[planfile.RankClass, ...]:
    """A plan.json document's ``pipeline.actions``, read and checked on their own (``RankClass.read``)."""
    pipe = plan_json["pipeline"]
    m = int(pipe["micro_batches"])
    return tuple(planfile.RankClass.read(planfile.At(c, f"pipeline.actions[{i}]"), m)
                 for i, c in enumerate(pipe["actions"]))


def op_text(op: Op) -> str:
    return f"{op[0]}{op[1]}"


def parse_op(text: str) -> Op:
    if len(text) < 2 or text[0] not in "FB" or not text[1:].isdigit():
        raise ValueError(f"bad pipeline instruction {text!r} (expected F<n> or B<n>)")
    return text[0], int(text[1:])


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    schedule: PipeSchedule
    micro_batches: int
    per_stage: tuple[tuple[Op, ...], ...]             # each stage's compute order
    actions: tuple = ()                                # plan.json pipeline.actions (actions_of)
    predicted_iteration: float | None = None
    predicted: dict | None = field(default=None, compare=False)   # the simulator's figures (docs/simulator.md)
    # per host, its cross-host sends one at a time in this order: ((host, ((rank, transfer, direction, m), ...)), ...)
    nic_order: tuple = ()
    # per stage (index order) the memory model's bytes per device by part (planc.pipeline.memory); None: no probe
    memory: tuple | None = field(default=None, compare=False)
    virtual: int = 1                                   # interleaved_1f1b's V (plan.json pipeline.virtual)

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        for i, ops in enumerate(self.per_stage):
            kinds = "FBW" if any(k == "W" for k, _ in ops) else "FB"
            want = {(k, m) for k in kinds for m in range(self.micro_batches)}
            if len(ops) != len(want) or set(ops) != want:
                raise ValueError(f"stage {i}: every micro-batch must run {', '.join(kinds)} exactly once")
            seen: set[tuple] = set()
            for kind, m in ops:
                if kind != "F" and ("FB"[kinds.index(kind) - 1], m) not in seen:
                    raise ValueError(f"stage {i}: {kind}{m} before {'FB'[kinds.index(kind) - 1]}{m}")
                seen.add((kind, m))

    @property
    def num_stages(self) -> int:
        return len(self.per_stage)

    def to_json(self) -> dict:
        return {
            "schedule": str(self.schedule),
            "micro_batches": self.micro_batches,
            **({"virtual": self.virtual} if self.schedule is PipeSchedule.INTERLEAVED_1F1B else {}),
            "actions": [c.to_json() for c in self.actions],
            "predicted_iteration": self.predicted_iteration,
            "stages": self._stage_figures(),
            **({"predicted": self.predicted} if self.predicted is not None else {}),
            **({"nic_order": [{"host": h, "sends": [list(k) for k in keys]} for h, keys in self.nic_order]}
               if self.nic_order else {}),
        }

    def record(self) -> planfile.Pipeline:
        """The plan file's ``pipeline``: the lists and the host NIC order; the simulator's figures in
        ``extra`` (plan.json carries them; the runtime does not read them)."""
        extra = (("predicted_iteration", self.predicted_iteration), ("stages", self._stage_figures()))
        if self.predicted is not None:
            extra += (("predicted", self.predicted),)
        return planfile.Pipeline(planfile.Schedule(str(self.schedule)), self.micro_batches, self.actions, extra,
                                 tuple((h, tuple(tuple(k) for k in keys)) for h, keys in self.nic_order),
                                 self.virtual)

    def _stage_figures(self) -> list[dict]:
        """PLAN_FORMAT.md's ``pipeline.stages``: per stage the simulated ``busy``, ``bubble`` and
        ``peak_activation_bytes`` (one device, the stage's worst), from ``predicted``, and ``memory``: the
        memory model's bytes per device of its largest device by part (docs/memory.md), with
        ``memory_saved`` (``zero``, ``recompute``: the bytes each saves) where the stage uses them, ``zero3`` (the
        gathers' bytes and prices, ``planc.pipeline.zero3price.zero3_notes``) on a stage that shards its parameters; ``null`` figures
        where nothing was simulated (no probe, or a plan the runtime cannot train) or sized (no probe)."""
        sim = {int(st["stage"]): st for st in (self.predicted or {}).get("stages") or ()}
        mem = self.memory or ()
        out = []
        for i in range(self.num_stages):
            m = dict(mem[i]) if i < len(mem) and mem[i] is not None else None
            saved = m.pop("saved", None) if m else None
            z3 = m.pop("zero3", None) if m else None
            out.append({"stage": i, **{k: sim.get(i, {}).get(k) for k in ("busy", "bubble", "peak_activation_bytes")},
                        "memory": m, **({"memory_saved": dict(saved)} if saved else {}), **({"zero3": z3} if z3 else {})})
        return out

    @staticmethod
    def from_json(data: dict) -> "PipelinePlan":
        m = int(data["micro_batches"])
        actions = tuple(planfile.RankClass.read(planfile.At(c, f"actions[{i}]"), m)
                        for i, c in enumerate(data["actions"]))
        stages = sorted(s for c in actions for s in c.stages)
        return PipelinePlan(
            schedule=PipeSchedule(data["schedule"]),
            micro_batches=m,
            per_stage=tuple(tuple((a.kind, a.micro_batch) for c in actions for a in c.compute(s)) for s in stages),
            virtual=int(data.get("virtual", 1)),
            actions=actions,
            predicted_iteration=data.get("predicted_iteration"),
            predicted=data.get("predicted"),
            nic_order=tuple((int(e["host"]), tuple((int(r), str(t), str(d), int(m)) for r, t, d, m in e["sends"]))
                            for e in data.get("nic_order") or ()),
            memory=(tuple(dict(st["memory"], **({"saved": st["memory_saved"]} if st.get("memory_saved") else {}),
                               **({"zero3": st["zero3"]} if st.get("zero3") else {}))
                          if st.get("memory") else None for st in data["stages"])
                    if any(st.get("memory") for st in data.get("stages") or ()) else None),
        )


def build(schedule: PipeSchedule | str, num_stages: int, micro_batches: int, transfers=(),
          check: bool = True, virtual: int = 1) -> PipelinePlan:
    """``schedule``'s compute orders and action lists (:func:`orders`, :func:`class_actions` with
    ``transfers``: the plan's, anything with ``name``, ``src_stage`` and ``dst_stage``); ``virtual``:
    interleaved_1f1b's V.

    ``check``: the compute orders are run in the event simulation over the transfers' edges first: a
    plan whose lists would deadlock is rejected here, not on the cluster.
    """
    if num_stages < 1:
        raise ValueError("num_stages must be at least 1")
    if str(schedule) == "auto":
        raise ValueError("schedule = auto must be resolved (planc.pipeline.choose) before the lists are built")
    classes = orders(schedule, num_stages, micro_batches, virtual)
    if check:
        simulate(classes, tuple((t.src_stage, t.dst_stage) for t in transfers))   # raises DeadlockError
    per_stage = tuple(tuple((k, m) for stages, ops in classes if s in stages for k, t, m in ops if t == s)
                      for s in range(num_stages))
    return PipelinePlan(schedule=PipeSchedule(schedule), micro_batches=micro_batches, per_stage=per_stage,
                        actions=class_actions(classes, transfers),
                        virtual=virtual if PipeSchedule(schedule) is PipeSchedule.INTERLEAVED_1F1B else 1)


# ---------------------------------------------------------------- the lists' own deadlock check

class DeadlockError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Timeline:
    start: dict            # (stage, op) -> start time
    finish: dict           # (stage, op) -> finish time
    makespan: float
    peak_in_flight: tuple[int, ...]   # per stage


def simulate(lists, edges, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0,
             weight: float | None = None) -> Timeline:
    """Run every rank class's list; times are in units of ``forward``.

    ``lists``: per stage its order of ``(kind, m)`` (each stage its own class), or per class
    ``(stages, ((kind, stage, m), ...))`` (:func:`orders`). The abstract simulation :func:`build` checks
    the lists with: each class runs its list in order on one clock (its stages share the devices); sends
    are buffered (a class never waits for its receiver); receives block. ``F(s, m)`` needs ``F(src, m)``
    for every transfer ``src -> s``; ``B(s, m)`` needs ``B(dst, m)`` for every transfer ``s -> dst`` (the
    gradient of each output comes back over the same transfer) and ``F(s, m)``; ``W(s, m)`` needs
    ``B(s, m)``. ``backward`` is a whole backward; where a stage splits it, its ``W`` takes ``weight``
    (default half of it) and its ``B`` the rest. Transfers between stages of one class cost no ``comm``.
    Skip transfers to non-adjacent stages are ordinary edges. Lists that can never finish raise
    :class:`DeadlockError` naming the blocked instructions. ``start`` and ``finish`` are keyed by
    ``(stage, (kind, m))``."""
    if lists and not (isinstance(lists[0], tuple) and len(lists[0]) == 2 and isinstance(lists[0][0], tuple)
                      and (not lists[0][0] or isinstance(lists[0][0][0], int))):
        lists = tuple(((s,), tuple((k, s, m) for k, m in ops)) for s, ops in enumerate(lists))
    n = sum(len(stages) for stages, _ in lists)
    class_of = {s: c for c, (stages, _) in enumerate(lists) for s in stages}
    if sorted(class_of) != list(range(n)):
        raise ValueError(f"the classes run stages {sorted(class_of)}, not 0..{n - 1}")
    inputs = {s: sorted({a for a, b in edges if b == s}) for s in range(n)}
    outputs = {s: sorted({b for a, b in edges if a == s}) for s in range(n)}
    for a, b in edges:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"bad transfer edge {a} -> {b} for {n} stages")
    split = {s for _, ops in lists for k, s, _ in ops if k == "W"}
    w = backward / 2 if weight is None else weight
    cost = {"F": lambda s: forward, "B": lambda s: backward - w if s in split else backward, "W": lambda s: w}
    pos = [0] * len(lists)
    clock = [0.0] * len(lists)
    start: dict = {}
    finish: dict = {}
    total = sum(len(ops) for _, ops in lists)
    while len(finish) < total:
        progressed = False
        for c, (_, ops) in enumerate(lists):
            while pos[c] < len(ops):
                kind, s, m = ops[pos[c]]
                if kind == "F":
                    deps = [(src, ("F", m)) for src in inputs[s]]
                elif kind == "B":
                    deps = [(dst, ("B", m)) for dst in outputs[s]] + [(s, ("F", m))]
                else:
                    deps = [(s, ("B", m))]
                if any(d not in finish for d in deps):
                    break
                ready = max([clock[c]] + [finish[d] + (comm if class_of[d[0]] != c else 0.0) for d in deps])
                start[(s, (kind, m))] = ready
                finish[(s, (kind, m))] = clock[c] = ready + cost[kind](s)
                pos[c] += 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"class {list(stages)}: {k}{s}.{m}" for c, (stages, ops) in enumerate(lists)
                                if pos[c] < len(ops) for k, s, m in [ops[pos[c]]])
            raise DeadlockError(f"pipeline lists deadlock; blocked at {blocked}")
    peaks = [0] * n
    for _, ops in lists:
        for s in {t for _, t, _ in ops}:
            peaks[s] = planfile.in_flight([(k, m) for k, t, m in ops if t == s])
    return Timeline(start, finish, max(finish.values(), default=0.0), tuple(peaks))
