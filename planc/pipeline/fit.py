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

from planc import ir
from planc.diagnostics import Diagnostic, PlanError
from planc.pipeline.memory import StageMemory
from planc.pipeline.schedules import peak_in_flight

__all__ = ["Need", "needs", "worst", "fits", "bytes_text", "NoFit", "no_fit", "Suggestion"]


def bytes_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


@dataclass(frozen=True, slots=True)
class Need:
    """One stage's bytes per device under a schedule: ``in_flight`` micro-batches and the parts."""

    memory: StageMemory
    in_flight: int

    @property
    def stage(self) -> int:
        return self.memory.stage

    @property
    def total(self) -> int:
        return self.memory.total(self.in_flight)

    def parts(self) -> dict:
        return self.memory.parts(self.in_flight)

    def text(self) -> str:
        """``"80 KB (parameters 8 KB, gradients 8 KB, optimizer 16 KB, activations 48 KB: 2 micro-batches in
        flight x 24 KB)"``."""
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


def needs(memory, schedule, micro_batches: int) -> list[Need]:
    """Per stage (index order) its need under ``schedule``."""
    S = len(memory)
    return [Need(m, peak_in_flight(schedule, S, k, micro_batches)) for k, m in enumerate(memory)]


def worst(memory, schedule, micro_batches: int) -> Need:
    """The stage needing the most (the first of equal ones)."""
    return max(needs(memory, schedule, micro_batches), key=lambda n: (n.total, -n.stage))


def fits(memory, schedule, micro_batches: int, limit: float | None) -> bool:
    return limit is None or worst(memory, schedule, micro_batches).total <= limit


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
    B = program.train.micro_batches

    def ok(mem, scheds=schedules, b=B):
        return any(fits(mem, s, b, limit) for s in scheds)

    out = []
    if any(m.data > 1 for m in memory):   # the least ZeRO degree above the plan's that fits
        for z, what in ZERO_TEXT:
            if z > program.train.zero and ok([m.with_(zero=max(z, m.zero)) for m in memory]):
                out.append(Suggestion(f"zero = {z} ({what})", (("zero", z),)))
                break
    # recompute on the stages over the limit, under the least demanding schedule for which that fits
    for s in sorted(schedules, key=lambda s: worst(memory, s, B).total):
        redo = [n.stage for n in needs(memory, s, B) if n.total > limit and not n.memory.recompute]
        if redo and fits([m.with_(recompute=True) if m.stage in redo else m for m in memory], s, B, limit):
            which = ", ".join(map(str, redo))
            out.append(Suggestion(f"recompute on stage{'s' if len(redo) > 1 else ''} {which} ('stage I : layers "
                                  "A..B recompute', or 'recompute = full' in train)", (("recompute", tuple(redo)),)))
            break
    one = ir.PipeSchedule.ONE_F_ONE_B
    if one not in schedules and fits(memory, one, B, limit):
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
    B = program.train.micro_batches
    best = min(schedules, key=lambda s: (worst(memory, s, B).total, list(schedules).index(s)))
    over = [n for n in needs(memory, best, B) if n.total > limit]
    what = ("schedule = auto: no schedule fits" if program.train.schedule is ir.PipeSchedule.AUTO
            else f"schedule = {program.train.schedule} does not fit")
    lines = [f"{what} in memory = {bytes_text(limit)} per device; under {best}:"]
    lines += [f"  stage {n.stage} needs {n.text()}" for n in over]
    sugg = _suggest(program, memory, schedules, limit, more_stages)
    if sugg:
        lines.append("settings that would fit: " + "; ".join(s.text for s in sugg))
    else:
        lines.append("no single setting planc can weigh (zero = 1, 2 or 3, recompute, 1f1b, a smaller micro_batch, more "
                     "stages) fits: use more devices, or give the devices' real memory")
    return NoFit(Diagnostic("\n".join(lines), span), tuple(sugg))
