"""What the compiler says about its decisions: plan.json's keys the runtime does not read, typed.

The placement's ranking, each reduction's and transfer's predictions against the flat baseline, the
pipeline's simulated figures and memory, a Hugging Face model's layers, why a stage is not
sequence-parallel and what each ``auto`` became. The records keep these keys unread, in order, in their
``extra`` (and the plan in its ``head``), so plan.json is written exactly as the compiler built it and
the runtime never parses them; ``Notes.read(plan)`` reads them once, with the same validating reader
and key paths (``reductions[2].candidates: expected an integer``), for ``planc explain``, ``planc
compile``'s summary and the drawing. Stdlib only (the contract package, ``planc.plan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .jsonpath import At
from .vocab import Collective

if TYPE_CHECKING:
    from .file import Plan

__all__ = ["Ranked", "PlacementNotes", "ReductionNotes", "TransferNotes", "ScheduleFigures", "StageFigures",
           "PipelineNotes", "LayerNotes", "Notes"]

Matrix = tuple[tuple[int, ...], ...]


def _at(extra, path: str) -> At:
    """A record's ``extra`` (key, value) pairs as an object at ``path``."""
    return At(dict(extra), path)


def _matrix(at: At) -> Matrix:
    return tuple(row.ints() for row in at.items())


def _pairs(at: At) -> tuple[tuple[str, object], ...]:
    """An object of JSON values as (key, value) pairs, in order."""
    return tuple((k, v.value) for k, v in at.mapping())


@dataclass(frozen=True, slots=True)
class Ranked:
    """A parallelism matrix the placement costed: its predicted communication per iteration, by part."""
    matrix: Matrix
    predicted: float
    breakdown: tuple[tuple[str, float], ...] = ()

    @staticmethod
    def read(at: At) -> "Ranked":
        parts = at.key("breakdown", None)
        return Ranked(_matrix(at.key("matrix")), at.key("predicted").num(),
                      tuple((k, v.num()) for k, v in parts.mapping()) if parts.value else ())


@dataclass(frozen=True, slots=True)
class PlacementNotes:
    """plan.json ``placement``: the parallel axes, the chosen matrix (rows = axes, columns = levels), how many
    matrices fit, the ranking (best first), how it was searched and each device's axis coordinates."""
    axes: tuple[tuple[str, int], ...]
    matrix: Matrix
    candidates: int
    ranked: tuple[Ranked, ...]
    search: str | None = None
    evaluated: int | None = None
    coords: Matrix = ()

    @staticmethod
    def read(at: At) -> "PlacementNotes":
        search = at.key("search", None)
        return PlacementNotes(
            tuple((a.key("name").str(), a.key("size").int(1)) for a in at.key("axes").items()),
            _matrix(at.key("matrix")), at.key("candidates").int(0),
            tuple(Ranked.read(r) for r in at.key("ranked").items()),
            None if search.value is None else search.str(), at.key("evaluated", None).opt_int(0),
            _matrix(at.key("coords", [])))


@dataclass(frozen=True, slots=True)
class ReductionNotes:
    """A reduction's ranking: the flat collective of its target predicted (``allreduce_predicted``, else
    ``flat_predicted``), how many valid programs were found, the runners-up (predicted, text) and the
    synthesis hierarchy below the root ((level, factor), outermost first)."""
    flat_predicted: float
    candidates: int
    alternatives: tuple[tuple[float, str], ...] = ()
    hierarchy: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def read(at: At, allreduce: bool) -> "ReductionNotes":
        hierarchy = at.key("hierarchy", None)
        return ReductionNotes(
            at.key("allreduce_predicted" if allreduce else "flat_predicted").num(), at.key("candidates").int(0),
            tuple((a.key("predicted").num(), a.key("text").str()) for a in at.key("alternatives").items()),
            tuple((h.key("name").str(), h.key("factor").int(1)) for h in hierarchy.items()) if hierarchy.value else ())


@dataclass(frozen=True, slots=True)
class TransferNotes:
    """A transfer's forward schedule: its makespan, the NIC lower bound and the naive schedule's makespan."""
    makespan: float
    lower_bound: float
    naive_makespan: float

    @staticmethod
    def read(at: At) -> "TransferNotes":
        return TransferNotes(at.key("makespan").num(), at.key("lower_bound").num(), at.key("naive_makespan").num())


@dataclass(frozen=True, slots=True)
class ScheduleFigures:
    """One simulated schedule (``pipeline.predicted.schedules[name]``): the iteration, the iteration with the
    cross-host sends as they come, and whether the host NIC order was simulated."""
    iteration: float | None
    unordered_iteration: float | None
    nic_ordered: bool

    @staticmethod
    def read(at: At) -> "ScheduleFigures":
        return ScheduleFigures(at.key("iteration", None).opt_num(), at.key("unordered_iteration", None).opt_num(),
                               bool(at.key("nic_ordered", False).value))


@dataclass(frozen=True, slots=True)
class StageFigures:
    """``pipeline.stages[i]``: the memory model's bytes per device by part (docs/memory.md; None: not sized)
    and what zero and recompute saved, each as (part, bytes) in plan.json's order; ``zero3``: a zero-3 stage's
    gathers."""
    stage: int
    memory: tuple[tuple[str, object], ...] | None
    saved: tuple[tuple[str, object], ...] = ()
    zero3: dict | None = None   # a zero-3 stage's gathers: bytes and prices (docs/plan-format.md)

    @staticmethod
    def read(at: At) -> "StageFigures":
        mem, saved, z3 = at.key("memory", None), at.key("memory_saved", None), at.key("zero3", None)
        return StageFigures(at.key("stage").int(0), _pairs(mem) if mem.value else None,
                            _pairs(saved) if saved.value else (), dict(_pairs(z3)) if z3.value else None)


@dataclass(frozen=True, slots=True)
class PipelineNotes:
    """The pipeline's predictions: the iteration, each simulated schedule by name, each stage's figures."""
    predicted_iteration: float | None
    schedules: tuple[tuple[str, ScheduleFigures], ...] = ()
    stages: tuple[StageFigures, ...] = ()

    @staticmethod
    def read(at: At) -> "PipelineNotes":
        predicted, stages = at.key("predicted", None), at.key("stages", None)
        scheds = predicted.key("schedules", None) if predicted.value else predicted
        return PipelineNotes(
            at.key("predicted_iteration", None).opt_num(),
            tuple((k, ScheduleFigures.read(v)) for k, v in scheds.mapping()) if scheds.value else (),
            tuple(StageFigures.read(s) for s in stages.items()) if stages.value else ())

    def schedule(self, name: str) -> ScheduleFigures | None:
        return next((f for n, f in self.schedules if n == name), None)


@dataclass(frozen=True, slots=True)
class LayerNotes:
    """``train.layers[i]`` of a probed Hugging Face model: its name, parameters and (forward, backward) FLOPs
    for one micro-batch (None: not measured)."""
    name: str
    params: float
    flops: tuple[float, float] | None = None

    @staticmethod
    def read(at: At) -> "LayerNotes":
        flops = at.key("flops", None)
        pair = None if flops.value is None else tuple(x.num() for x in flops.items())
        return LayerNotes(at.key("name").str(), at.key("params").num(), pair)


@dataclass(frozen=True, slots=True)
class Notes:
    """Every note of a plan: per reduction and per transfer in plan order, per stage why it is not
    sequence-parallel (None: no reason given), the cluster's memory per device (None: not given)."""
    placement: PlacementNotes | None
    reductions: tuple[ReductionNotes, ...]
    transfers: tuple[TransferNotes, ...]
    sequence_why: tuple[str | None, ...]
    pipeline: PipelineNotes | None
    layers: tuple[LayerNotes, ...] = ()
    memory_limit: float | None = None
    choices: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def read(plan: "Plan") -> "Notes":
        """The notes of a ``planc.plan.Plan``; a malformed one is a ``PlanFileError`` naming its key."""
        head = At(dict(plan.head), "")
        pl = head.key("placement", None)
        train = _at(plan.train.extra if plan.train is not None else (), "train")
        layers = train.key("layers", None)
        why = []
        for i, s in enumerate(plan.stages):
            w = _at(s.extra, f"stages[{i}]").key("sequence_parallel_why", None)
            why.append(None if w.value is None else w.str())
        choices = head.key("choices", None)
        return Notes(
            PlacementNotes.read(pl) if pl.value else None,
            tuple(ReductionNotes.read(_at(r.extra, f"reductions[{i}]"), r.target is Collective.ALLREDUCE)
                  for i, r in enumerate(plan.reductions)),
            tuple(TransferNotes.read(_at(t.forward.extra, f"transfers[{i}]")) for i, t in enumerate(plan.transfers)),
            tuple(why),
            PipelineNotes.read(_at(plan.pipeline.extra, "pipeline")) if plan.pipeline is not None else None,
            tuple(LayerNotes.read(x) for x in layers.items()) if layers.value else (),
            _at(plan.cluster.extra, "cluster").key("memory", None).opt_num(),
            tuple((k, v.str()) for k, v in choices.mapping()) if choices.value else ())
