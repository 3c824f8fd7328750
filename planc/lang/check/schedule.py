"""The pipeline schedule of the ``train`` block and what it asks of the stages (LANGUAGE.md, "Pipeline
schedules").

``schedule = gpipe | 1f1b | eager_1f1b | interleaved_1f1b(virtual = V) | zb_h1 | zbv | auto``. The
schedule is read before the stages (:func:`check_schedule`), because two of them run several stages on
one mesh: ``interleaved_1f1b(virtual = V)`` runs V stages on each pipe coordinate (stage ``p + kP`` on
coordinate ``p``), ``zbv`` two in a V (stage ``I`` on ``I`` for ``I < P``, else on ``2P - 1 - I``). The
stage count a ``pipe`` axis of size P needs is P x :attr:`Choice.per`; explicit meshes are shared whole or
not at all, and only by those schedules, in their pattern (:func:`check_meshes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planc import ir
from planc.lang import ast
from planc.lang.check.values import Diagnostics, did_you_mean, int_of
from planc.lang.vocabulary import ENUM_FORMS
from planc.plan import class_stages, stages_per_class
from planc.span import Span

__all__ = ["Choice", "check_schedule", "check_meshes", "check_micro_batches", "FORMS"]

FORMS = ENUM_FORMS["schedule"]
_NOSPAN = Span(0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Choice:
    """The schedule as written: ``virtual`` its V (1 but for interleaved_1f1b), ``span`` where it is
    written (the train block, or nothing, when it is not)."""

    schedule: ir.PipeSchedule = ir.PipeSchedule.ONE_F_ONE_B
    virtual: int = 1
    span: Span = field(default=_NOSPAN, compare=False)
    broken: bool = False   # written wrong (said already): the stage checks that depend on it wait

    @property
    def per(self) -> int:
        """Stages on each mesh (pipe coordinate)."""
        return stages_per_class(str(self.schedule), self.virtual)

    @property
    def shares(self) -> bool:
        return self.per > 1

    def text(self) -> str:
        if self.schedule is ir.PipeSchedule.INTERLEAVED_1F1B:
            return f"interleaved_1f1b(virtual = {self.virtual})"
        return str(self.schedule)


def check_schedule(errs: Diagnostics, kv: ast.KeyValue | None) -> Choice:
    """``schedule = ...`` of the train block (None: not written, 1f1b)."""
    if kv is None:
        return Choice()
    v = kv.value
    names = [s.value for s in ir.PipeSchedule]
    if isinstance(v, ast.Call):
        name = v.name.value
        if name != ir.PipeSchedule.INTERLEAVED_1F1B:
            what = f"{name}() takes no arguments: write schedule = {name}" if name in names else \
                f"'{name}' is not a schedule: schedule must be one of {FORMS}"
            errs.add(what, v.span if name in names else v.name.span,
                     None if name in names else did_you_mean(name, names))
            return Choice(span=v.span, broken=True)
        virtual = None
        for arg in v.args:
            if arg.key.value != "virtual":
                errs.add(f"interleaved_1f1b() has no argument '{arg.key.value}'; expected virtual",
                         arg.key.span, did_you_mean(arg.key.value, ["virtual"]))
            elif not isinstance(arg.value, ast.Num):
                errs.add("virtual must be a whole number (the stages each pipe coordinate runs)", arg.value.span)
            else:
                virtual = int_of(errs, arg.value, "virtual", minimum=1)
                if virtual == 1:
                    errs.add("interleaved_1f1b(virtual = 1) runs one stage per pipe coordinate: write "
                             "schedule = 1f1b, or virtual = 2 or more", arg.value.span)
                    virtual = None
        if virtual is None:
            if not v.args:
                errs.add("interleaved_1f1b needs its virtual degree: interleaved_1f1b(virtual = V), V the stages "
                         "each pipe coordinate runs (2 or more)", v.span)
            return Choice(span=v.span, broken=True)
        return Choice(ir.PipeSchedule.INTERLEAVED_1F1B, virtual, v.span)
    text = v.value if isinstance(v, ast.Name) else (v.text if isinstance(v, ast.Num) else None)
    if text == ir.PipeSchedule.INTERLEAVED_1F1B:
        errs.add("interleaved_1f1b needs its virtual degree: interleaved_1f1b(virtual = V), V the stages each "
                 "pipe coordinate runs (2 or more)", v.span)
        return Choice(span=v.span, broken=True)
    if text not in names:
        near = [c for c in names if text and c.lower() == str(text).lower()]
        hint = (f"did you mean '{near[0]}'? (spellings are lower case)" if near else
                did_you_mean(str(text), names) if text else None)
        errs.add(f"schedule must be one of {FORMS}", v.span, hint)
        return Choice(span=v.span, broken=True)
    return Choice(ir.PipeSchedule(text), 1, v.span)


def check_meshes(errs: Diagnostics, stages: list[ir.Stage], choice: Choice, has_model: bool) -> None:
    """Explicit stage meshes: disjoint, or, under interleaved_1f1b and zbv, shared whole (the same devices
    and mesh) by exactly :attr:`Choice.per` stages each, in the schedule's pattern."""
    owner: dict[int, ir.Stage] = {}
    meshes: list[list[ir.Stage]] = []
    of: dict[int, int] = {}
    for s in stages:
        devs = s.explicit_devices
        if devs is None:
            continue
        clash = sorted({owner[d].index for d in devs if d in owner})
        if clash:
            other = next(st for st in stages if st.index == clash[0])
            same = _mesh(other) == _mesh(s)
            if not same and not choice.shares:
                errs.add(f"stage {s.index} devices {devs[0]}..{devs[-1] + 1} overlap stage {clash[0]}'s; stage "
                         f"meshes must be disjoint under schedule = {choice.text()} (interleaved_1f1b(virtual = V) "
                         "and zbv run several stages on one whole mesh)", s.span)
            elif not same:
                errs.add(f"stage {s.index} devices {devs[0]}..{devs[-1] + 1} overlap stage {clash[0]}'s; stages "
                         "that share devices must name the same devices and mesh "
                         f"('on devices {other.first_device}..{other.first_device + len(other.explicit_devices)} "
                         f"as {_shape(other)}')", s.span)
            elif not has_model:
                errs.add(f"stage {s.index} is on stage {clash[0]}'s mesh; stages share a mesh only in a training "
                         "pipeline, and this plan has no model", s.span)
            elif not choice.shares:
                errs.add(f"stage {s.index} is on stage {clash[0]}'s mesh; stage meshes must be disjoint under "
                         f"schedule = {choice.text()} (only interleaved_1f1b(virtual = V) and zbv run several "
                         "stages on one mesh)", s.span)
            else:
                meshes[of[clash[0]]].append(s)
                of[s.index] = of[clash[0]]
            continue
        for d in devs:
            owner[d] = s
        of[s.index] = len(meshes)
        meshes.append([s])
    if errs.found or choice.broken or not choice.shares or not has_model or not meshes or len(of) != len(stages):
        return
    _check_pattern(errs, stages, meshes, of, choice)


def _check_pattern(errs: Diagnostics, stages, meshes, of, choice: Choice) -> None:
    """Each mesh runs ``per`` stages, the ones the schedule puts together (``planc.plan.class_stages``)."""
    P = len(meshes)
    need = P * choice.per
    if len(stages) != need:
        wrong = next((m for m in meshes if len(m) != choice.per), meshes[-1])
        errs.add(f"schedule = {choice.text()} runs {choice.per} stages on each mesh: the plan's {P} mesh"
                 f"{'es' if P != 1 else ''} need {need} stages, {len(stages)} are declared (stage "
                 f"{wrong[0].index}'s mesh runs {len(wrong)})", wrong[-1].span)
        return
    classes = class_stages(str(choice.schedule), need, choice.virtual)
    want = {s: set(c) for c in classes for s in c}
    for s in sorted(stages, key=lambda s: s.index):
        mates = {t.index for t in meshes[of[s.index]]}
        if mates != want[s.index]:
            other = min(mates - {s.index}, default=s.index)
            groups = ", ".join(" and ".join(map(str, c)) for c in classes)
            errs.add(f"under schedule = {choice.text()} the {P} meshes run stages {groups}; stage {s.index} is on "
                     f"stage {other}'s mesh", s.span)
            return


def _mesh(s: ir.Stage) -> tuple:
    return s.first_device, s.mesh_shape, s.mesh_axes


def _shape(s: ir.Stage) -> str:
    dims = [f"{a} = {n}" if not a.startswith("m") or not a[1:].isdigit() else str(n)
            for a, n in zip(s.mesh_axes, s.mesh_shape)]
    return "(" + ", ".join(dims) + ")"


def check_micro_batches(errs: Diagnostics, choice: Choice, micro_batches: int, meshes: int, span: Span) -> None:
    """interleaved_1f1b(virtual = V) on P meshes runs the micro-batches in rounds of P (Megatron's
    virtual pipeline): micro_batches must be a multiple of P."""
    if choice.schedule is ir.PipeSchedule.INTERLEAVED_1F1B and meshes > 1 and micro_batches % meshes:
        lo = micro_batches // meshes * meshes
        near = ", ".join(str(x) for x in (lo, lo + meshes) if x > 0)
        errs.add(f"schedule = {choice.text()} runs the micro-batches in rounds of one per pipe coordinate: "
                 f"micro_batches must be a multiple of {meshes}, got {micro_batches} (e.g. {near})", span)
