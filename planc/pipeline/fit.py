"""Whether a plan fits ``cluster.memory`` under a schedule, and if not, which settings would make it fit.

The model is ``planc.pipeline.memory`` (docs/memory.md); a stage's need under a schedule is its static
bytes plus the activations of the schedule's in-flight bound on it. :func:`no_fit` is the located error
for a plan that fits under none of the schedules it may run: it names each stage over the limit, its
bytes by part and the limit, and lists the single settings that would make every stage fit by the same
model: the least of ``zero = 1``, ``2`` and ``3`` that fits (above the plan's), recompute on the stages over the limit, ``schedule = 1f1b`` (fewer micro-batches in
flight than a pinned gpipe or eager_1f1b), the largest smaller ``micro_batch`` that still splits over
every stage's data axis, and ``stages = auto(N')`` with more stages for a plan whose stages are cut by
planc (the same devices, the data axis shrunk to match).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from planc import ir
from planc.diagnostics import Diagnostic, PlanError
from planc.pipeline.memory import StageMemory
from planc.pipeline.schedules import orders
from planc.plan import in_flight as in_flight_of, stages_per_class

__all__ = ["Need", "needs", "worst", "fits", "bytes_text", "NoFit", "no_fit", "Suggestion"]


def bytes_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


@dataclass(frozen=True, slots=True)
class Need:
    """One stage's bytes per device under a schedule: ``in_flight`` micro-batches and the parts. A stage that
    shares its devices with others (interleaved_1f1b, zbv: one rank class) has them as ``mates`` (each with
    its own in-flight peak) and ``joint``, the peak of the activations of all the class's stages at once over
    its list; its ``total`` is then the device's: every stage's static bytes, and the larger of the joint
    activations with the logits and the largest optimizer step (the steps run after the list, one by one)."""

    memory: StageMemory
    in_flight: int
    mates: tuple = ()      # ((StageMemory, in flight), ...) of the class's other stages
    joint: int = 0

    @property
    def stage(self) -> int:
        return self.memory.stage

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(sorted((self.memory.stage,) + tuple(m.stage for m, _ in self.mates)))

    @property
    def total(self) -> int:
        if not self.mates:
            return self.memory.total(self.in_flight)
        every = (self.memory,) + tuple(m for m, _ in self.mates)
        return (sum(m.static for m in every) + max(self.joint + sum(m.logits for m in every),
                                                   max(m.step for m in every)))

    def parts(self) -> dict:
        return self.memory.parts(self.in_flight)

    def text(self) -> str:
        """``"80 KB (parameters 8 KB, gradients 8 KB, optimizer 16 KB, activations 48 KB: 2 micro-batches in
        flight x 24 KB)"``; a stage with mates: the device's total and each stage's part."""
        if self.mates:
            every = sorted(((self.memory, self.in_flight),) + self.mates, key=lambda x: x[0].stage)
            each = "; ".join(f"stage {m.stage}: static {bytes_text(m.static)}, {k} micro-batch"
                             f"{'es' if k != 1 else ''} in flight x {bytes_text(m.activations(1))}" for m, k in every)
            return f"{bytes_text(self.total)} (activations at once {bytes_text(self.joint)}; {each})"
        m, k = self.memory, self.in_flight
        p = self.parts()
        if m.recompute:
            act = (f"{k} micro-batch{'es' if k != 1 else ''} in flight x {bytes_text(m.slice_inputs)} inputs + "
                   f"{bytes_text(m.slice_outputs)} recomputed")
        else:
            act = f"{k} micro-batch{'es' if k != 1 else ''} in flight x {bytes_text(m.slice_inputs + m.slice_outputs)}"
        extra = f", logits {bytes_text(p['logits'])}" if p.get("logits") else ""
        if p.get("step", 0) > p["activations"] + p.get("logits", 0):
            extra += f"; the optimizer step's {bytes_text(p['step'])} is the larger"
        return (f"{bytes_text(p['total'])} (parameters {bytes_text(p['parameters'])}, gradients "
                f"{bytes_text(p['gradients'])}, optimizer {bytes_text(p['optimizer'])}, activations "
                f"{bytes_text(p['activations'])}: {act}{extra})")


def needs(memory, schedule, micro_batches: int, virtual: int = 1) -> list[Need]:
    """Per stage (index order) its need under ``schedule`` (``virtual``: interleaved_1f1b's V): micro-batches
    in flight from the schedule's lists (``planc.plan.in_flight``: until ``B``, or ``W`` where the backward
    is split), with the stages of its rank class as mates."""
    out: dict[int, Need] = {}
    for stages, ops, own in _flights(str(schedule), len(memory), micro_batches, virtual):
        joint = _joint(memory, ops) if len(stages) > 1 else 0
        for s in stages:
            mates = tuple((memory[t], own[t]) for t in stages if t != s)
            out[s] = Need(memory[s], own[s], mates, joint)
    return [out[s] for s in range(len(memory))]


@lru_cache(maxsize=256)
def _flights(schedule: str, stages: int, micro_batches: int, virtual: int) -> tuple:
    """Per rank class ``(stages, compute order, {stage: its in-flight peak})`` (cached: the memory checks
    weigh many settings under one schedule)."""
    out = []
    for members, ops in orders(schedule, stages, micro_batches, virtual):
        out.append((members, ops, {s: in_flight_of([(k, m) for k, t, m in ops if t == s]) for s in members}))
    return tuple(out)


def _joint(memory, ops) -> int:
    """The peak over a class's list of its stages' activations at once (each stage's micro-batches in
    flight, from ``F`` until ``B``, or ``W`` where the backward is split)."""
    ends = {s: "W" if any(k == "W" and t == s for k, t, _ in ops) else "B" for _, s, _ in ops}
    live = dict.fromkeys(ends, 0)
    peak = 0
    for kind, s, _ in ops:
        live[s] += 1 if kind == "F" else -1 if kind == ends[s] else 0
        peak = max(peak, sum(memory[t].activations(k) if k else 0 for t, k in live.items()))
    return peak


def worst(memory, schedule, micro_batches: int, virtual: int = 1) -> Need:
    """The stage needing the most (the first of equal ones)."""
    return max(needs(memory, schedule, micro_batches, virtual), key=lambda n: (n.total, -n.stage))


def fits(memory, schedule, micro_batches: int, limit: float | None, virtual: int = 1) -> bool:
    return limit is None or worst(memory, schedule, micro_batches, virtual).total <= limit


@dataclass(frozen=True, slots=True)
class Suggestion:
    """A setting that would fit: its text, and the change as data (``zero``, ``recompute``: stage
    indices, ``schedule``, ``micro_batch``, ``stages``: the N of ``auto(N)`` with ``data``, its data degree)."""

    text: str
    change: tuple


ZERO_TEXT = ((1, "optimizer state and master weights sharded over the data axis"),
             (2, "gradients sharded too: reduce-scattered every micro-batch"),
             (3, "parameters sharded too: each layer's all-gathered before its forward and its backward"))


class NoFit(PlanError):
    """The plan does not fit ``cluster.memory``; ``suggestions``: the settings that would."""

    def __init__(self, diagnostic: Diagnostic, suggestions: tuple[Suggestion, ...]):
        super().__init__(diagnostic)
        self.suggestions = suggestions


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _suggest(program: ir.Program, memory, schedules, limit: float, more_stages=None) -> list[Suggestion]:
    """The single settings under which some schedule of ``schedules`` fits every stage."""
    B, V = program.train.micro_batches, program.train.virtual

    def ok(mem, scheds=schedules, b=B):
        return any(fits(mem, s, b, limit, V) for s in scheds)

    out = []
    if any(m.data > 1 for m in memory):   # the least ZeRO degree above the plan's that fits
        for z, what in ZERO_TEXT:
            if z > program.train.zero and ok([m.with_(zero=max(z, m.zero)) for m in memory]):
                out.append(Suggestion(f"zero = {z} ({what})", (("zero", z),)))
                break
    # recompute on the stages over the limit, under the least demanding schedule for which that fits
    for s in sorted(schedules, key=lambda s: worst(memory, s, B, V).total):
        redo = sorted({t for n in needs(memory, s, B, V) if n.total > limit for t in n.stages
                       if not memory[t].recompute})
        if redo and fits([m.with_(recompute=True) if m.stage in redo else m for m in memory], s, B, limit, V):
            which = ", ".join(map(str, redo))
            out.append(Suggestion(f"recompute on stage{'s' if len(redo) > 1 else ''} {which} ('stage I : layers "
                                  "A..B recompute', or 'recompute = full' in train)", (("recompute", tuple(redo)),)))
            break
    one = ir.PipeSchedule.ONE_F_ONE_B
    shared = any(stages_per_class(str(s), V) > 1 for s in schedules)   # 1f1b would need other stages
    if one not in schedules and not shared and fits(memory, one, B, limit):
        out.append(Suggestion("schedule = 1f1b (fewer micro-batches in flight)", (("schedule", str(one)),)))
    step = _lcm(m.data for m in memory)
    m0 = program.train.micro_batch
    for rows in range((m0 - 1) // step * step, 0, -step):
        if ok([m.with_(micro_batch=rows) for m in memory]):
            out.append(Suggestion(f"micro_batch = {rows}" + (" (and the transfers' declared shapes)"
                                                              if any(t.shape for t in program.transfers) else ""),
                                  (("micro_batch", rows),)))
            break
    if more_stages is not None:
        found = more_stages(lambda mem: ok(mem))
        if found is not None:
            n, data = found
            out.append(Suggestion(f"stages = auto({n}) with pipe = {n}, data = {data} (more stages on the same "
                                  "devices)", (("stages", n), ("data", data))))
    return out


def no_fit(program: ir.Program, memory, schedules, span, more_stages=None) -> NoFit:
    """The located error for a plan that fits under none of ``schedules`` (the auto candidates, or the
    pinned one): each stage over the limit under the least demanding of them, by part, and the settings
    that would fit (module docstring). ``more_stages(ok)``: the smallest larger stage count whose cut
    ``ok`` accepts (None: none, or the stages are not planc's to cut)."""
    limit = program.cluster.memory
    B, V = program.train.micro_batches, program.train.virtual
    best = min(schedules, key=lambda s: (worst(memory, s, B, V).total, list(schedules).index(s)))
    over = [n for n in needs(memory, best, B, V) if n.total > limit]
    what = ("schedule = auto: no schedule fits" if program.train.schedule is ir.PipeSchedule.AUTO
            else f"schedule = {program.train.schedule} does not fit")
    lines = [f"{what} in memory = {bytes_text(limit)} per device; under {best}:"]
    lines += [f"  stage {n.stage} needs {n.text()}" if not n.mates else
              f"  stages {', '.join(map(str, n.stages))} (one mesh) need {n.text()}"
              for n in over if n.stage == n.stages[0]]
    sugg = _suggest(program, memory, schedules, limit, more_stages)
    if sugg:
        lines.append("settings that would fit: " + "; ".join(s.text for s in sugg))
    else:
        lines.append("no single setting planc can weigh (zero = 1, 2 or 3, recompute, 1f1b, a smaller micro_batch, more "
                     "stages) fits: use more devices, or give the devices' real memory")
    return NoFit(Diagnostic("\n".join(lines), span), tuple(sugg))
