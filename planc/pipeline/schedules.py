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

Op = tuple[str, int]   # ("F" | "B", micro-batch)


def warmup(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int) -> int:
    """Forwards stage ``stage`` runs before its first backward."""
    schedule = PipeSchedule(schedule)
    remaining = num_stages - stage
    if schedule is PipeSchedule.GPIPE:
        return micro_batches
    if schedule is PipeSchedule.ONE_F_ONE_B:
        return min(micro_batches, remaining - 1)
    return min(micro_batches, 2 * (remaining - 1))


def peak_in_flight(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int) -> int:
    """The exact peak number of in-flight micro-batches the schedule gives stage ``stage``."""
    return min(micro_batches, warmup(schedule, num_stages, stage, micro_batches) + 1)


def stage_ops(schedule: PipeSchedule | str, num_stages: int, stage: int, micro_batches: int) -> tuple[Op, ...]:
    """The instruction order of one stage."""
    w = warmup(schedule, num_stages, stage, micro_batches)
    ops: list[Op] = [("F", m) for m in range(w)]
    for k in range(micro_batches - w):        # steady state: one forward, one backward
        ops.append(("F", w + k))
        ops.append(("B", k))
    ops.extend(("B", m) for m in range(micro_batches - w, micro_batches))
    return tuple(ops)


def actions_of(per_stage, transfers=()) -> tuple[planfile.RankClass, ...]:
    """plan.json ``pipeline.actions`` for per-stage compute orders: one rank class per stage (each stage
    on its own mesh), its compute with each transfer's receives before the action that consumes them and
    its sends after the one that produced them, then the stage's reduce. ``transfers``: the plan's, in
    declaration order (anything with ``name``, ``src_stage`` and ``dst_stage``)."""
    fwd, bwd = planfile.Direction.FORWARD, planfile.Direction.BACKWARD
    out = []
    for s, ops in enumerate(per_stage):
        incoming = [t.name for t in transfers if t.dst_stage == s]
        outgoing = [t.name for t in transfers if t.src_stage == s]
        acts = []
        for kind, m in ops:
            waits, sends, d = (incoming, outgoing, fwd) if kind == "F" else (outgoing, incoming, bwd)
            acts += [planfile.Action("RECV", s, m, t, d) for t in waits]
            acts.append(planfile.Action(kind, s, m))
            acts += [planfile.Action("SEND", s, m, t, d) for t in sends]
        acts.append(planfile.Action("REDUCE", s))
        out.append(planfile.RankClass((s,), tuple(acts)))
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

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError("micro_batches must be at least 1")
        want = {(k, m) for k in "FB" for m in range(self.micro_batches)}
        for i, ops in enumerate(self.per_stage):
            if len(ops) != len(want) or set(ops) != want:
                raise ValueError(f"stage {i}: every micro-batch must run F and B exactly once")
            seen: set[int] = set()
            for kind, m in ops:
                if kind == "F":
                    seen.add(m)
                elif m not in seen:
                    raise ValueError(f"stage {i}: B{m} before F{m}")

    @property
    def num_stages(self) -> int:
        return len(self.per_stage)

    def to_json(self) -> dict:
        return {
            "schedule": str(self.schedule),
            "micro_batches": self.micro_batches,
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
                                 tuple((h, tuple(tuple(k) for k in keys)) for h, keys in self.nic_order))

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
        return PipelinePlan(
            schedule=PipeSchedule(data["schedule"]),
            micro_batches=m,
            per_stage=tuple(tuple((a.kind, a.micro_batch) for a in c.compute()) for c in actions),
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
          check: bool = True) -> PipelinePlan:
    """``schedule``'s compute orders and action lists (:func:`actions_of` with ``transfers``: the plan's,
    anything with ``name``, ``src_stage`` and ``dst_stage``).

    ``check``: the compute orders are run in the event simulation over the transfers' edges first: a
    plan whose lists would deadlock is rejected here, not on the cluster.
    """
    if num_stages < 1:
        raise ValueError("num_stages must be at least 1")
    if str(schedule) == "auto":
        raise ValueError("schedule = auto must be resolved (planc.pipeline.choose) before the lists are built")
    per_stage = tuple(stage_ops(schedule, num_stages, i, micro_batches) for i in range(num_stages))
    if check:
        simulate(per_stage, tuple((t.src_stage, t.dst_stage) for t in transfers))   # raises DeadlockError
    return PipelinePlan(schedule=PipeSchedule(schedule), micro_batches=micro_batches, per_stage=per_stage,
                        actions=actions_of(per_stage, transfers))


# ---------------------------------------------------------------- the lists' own deadlock check

class DeadlockError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Timeline:
    start: dict            # (stage, op) -> start time
    finish: dict           # (stage, op) -> finish time
    makespan: float
    peak_in_flight: tuple[int, ...]   # per stage


def simulate(per_stage, edges, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Timeline:
    """Run every stage's list; times are in units of ``forward``.

    The abstract simulation :func:`build` checks the lists with: each stage runs its list in order;
    sends are buffered (a stage never waits for its receiver); receives block. ``F(s, m)`` needs
    ``F(src, m)`` for every transfer ``src -> s``; ``B(s, m)`` needs ``B(dst, m)`` for every transfer
    ``s -> dst`` (the gradient of each output comes back over the same transfer). Skip transfers to
    non-adjacent stages are ordinary edges. Lists that can never finish raise :class:`DeadlockError`
    naming the blocked instructions."""
    n = len(per_stage)
    inputs = {s: sorted({a for a, b in edges if b == s}) for s in range(n)}
    outputs = {s: sorted({b for a, b in edges if a == s}) for s in range(n)}
    for a, b in edges:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"bad transfer edge {a} -> {b} for {n} stages")
    pos = [0] * n
    clock = [0.0] * n
    start: dict = {}
    finish: dict = {}
    total = sum(len(ops) for ops in per_stage)
    while len(finish) < total:
        progressed = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                kind, m = per_stage[s][pos[s]]
                if kind == "F":
                    deps = [(src, ("F", m)) for src in inputs[s]]
                    cost = forward
                else:
                    deps = [(dst, ("B", m)) for dst in outputs[s]] + [(s, ("F", m))]
                    cost = backward
                if any(d not in finish for d in deps):
                    break
                ready = max([clock[s]] + [finish[d] + (comm if d[0] != s else 0.0) for d in deps])
                start[(s, (kind, m))] = ready
                finish[(s, (kind, m))] = clock[s] = ready + cost
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"stage {s}: {k}{m}" for s in range(n) if pos[s] < len(per_stage[s])
                                for k, m in [per_stage[s][pos[s]]])
            raise DeadlockError(f"pipeline lists deadlock; blocked at {blocked}")
    peaks = []
    for ops in per_stage:
        live = peak = 0
        for kind, _ in ops:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(start, finish, max(finish.values(), default=0.0), tuple(peaks))
