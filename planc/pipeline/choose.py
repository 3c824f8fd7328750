"""``schedule = auto``: the best pipeline schedule that fits in the devices' memory.

With the model probe the compiler simulates every schedule (``planc.pipeline.simulate``,
docs/simulator.md) and :func:`choose_by_prediction` picks the fastest predicted one that fits
``cluster.memory`` by the memory model (``planc.pipeline.memory``, docs/memory.md).
:func:`choose_schedule` below is the rule without a simulation: the known order of the
schedules (AlpaComm §4): ``eager_1f1b`` runs forwards ahead, so every
cross-mesh transfer overlaps computation; ``1f1b`` keeps the fewest
micro-batches in flight. ``gpipe`` keeps every micro-batch in flight (the most
memory) and gains nothing over ``1f1b`` in planc's runtime, so this rule never
picks it: ``eager_1f1b`` if it fits ``cluster.memory`` on every stage, else ``1f1b``
if it fits. When no candidate fits, and when a pinned schedule does not fit
(:func:`check_pinned`), a located error names each stage over the limit, its bytes
by part, and the settings that would fit (``planc.pipeline.fit``).

One device of stage ``i`` needs, under a schedule, its parameters, gradients and
optimizer state plus ``in_flight_i(schedule)`` micro-batches' activations, where
``in_flight_i`` is the schedule's exact peak of micro-batches whose forward ran on
the stage and whose backward has not (:func:`planc.pipeline.schedules.peak_in_flight`;
``min(B, S - i)`` for 1f1b, ``min(B, 2(S - i) - 1)`` for eager_1f1b, ``B`` for gpipe).

Without ``memory`` in the cluster there is no limit: ``eager_1f1b``. Without a
model probe (``--no-probe``) the memory cannot be estimated: ``1f1b`` (the
default) when a limit is given.
"""

from __future__ import annotations

from planc import ir
from planc.pipeline.fit import bytes_text as _bytes_text, fits, no_fit, worst
from planc.pipeline.memory import PRECISION_BYTES, stage_memory  # noqa: F401  (PRECISION_BYTES: named here too)
from planc.pipeline.schedules import build
from planc.pipeline.simulate import predict
from planc.plan import stages_per_class

__all__ = ["choose_schedule", "choose_by_prediction", "check_pinned", "stage_memory", "OVERLAP", "FALLBACK"]

OVERLAP = ir.PipeSchedule.EAGER_1F1B    # preferred: overlaps cross-mesh communication
FALLBACK = ir.PipeSchedule.ONE_F_ONE_B  # the fewest micro-batches in flight


def _span(program: ir.Program, memory, schedule):
    """Where a memory error points: the schedule as written, else the stage that needs the most."""
    if program.train.schedule_span.line > 0:
        return program.train.schedule_span
    stage = worst(memory, schedule, program.train.micro_batches, program.train.virtual).stage
    return program.stage(stage).span


def choose_schedule(program: ir.Program, stages, probe, more_stages=None) -> tuple[ir.PipeSchedule, str]:
    """The schedule for ``schedule = auto`` and why (for ``planc explain``), without a simulation.

    ``stages``: the placed ``ir.StageLayout``s (or the program's ``ir.Stage``s), with their layer
    ranges cut; ``probe``: the model probe of the program as compiled (None: ``--no-probe``). A located
    ``planc.pipeline.fit.NoFit`` when even 1f1b does not fit ``cluster.memory``.
    """
    limit = program.cluster.memory
    if limit is None:
        return OVERLAP, (f"{OVERLAP}: no device memory limit given (cluster 'memory = ...'), so the schedule "
                         "that sends activations ahead and overlaps cross-mesh transfers with compute (AlpaComm §4)")
    if probe is None:
        return FALLBACK, (f"{FALLBACK}: without the model probe (--no-probe) the activation memory cannot be "
                          f"estimated against memory = {_bytes_text(limit)}; 1f1b keeps the fewest micro-batches "
                          "in flight")
    memory = stage_memory(program, stages, probe)
    B = program.train.micro_batches
    eager, one = worst(memory, OVERLAP, B), worst(memory, FALLBACK, B)
    if eager.total <= limit:
        return OVERLAP, (f"{OVERLAP}: fits memory = {_bytes_text(limit)} on every stage, needing at most "
                         f"{eager.text()} on stage {eager.stage}; it sends activations ahead so cross-mesh "
                         "transfers overlap compute (AlpaComm §4)")
    if one.total <= limit:
        return FALLBACK, (f"{FALLBACK}: eager_1f1b would need {eager.text()} on stage {eager.stage}, more than "
                          f"memory = {_bytes_text(limit)}; 1f1b needs at most {one.text()} on stage {one.stage}")
    raise no_fit(program, memory, (OVERLAP, FALLBACK), _span(program, memory, FALLBACK), more_stages)


def check_pinned(program: ir.Program, stages, probe, more_stages=None) -> None:
    """A pinned schedule that does not fit ``cluster.memory`` is the same located error as auto's
    (``planc.pipeline.fit.no_fit``); nothing without a limit or a probe."""
    limit = program.cluster.memory
    schedule = program.train.schedule
    if limit is None or probe is None or schedule is ir.PipeSchedule.AUTO:
        return
    memory = stage_memory(program, stages, probe)
    if not fits(memory, schedule, program.train.micro_batches, limit, program.train.virtual):
        raise no_fit(program, memory, (schedule,), _span(program, memory, schedule), more_stages)


# ---------------------------------------------------------------- the simulator's predictions

# tie order; ``auto`` weighs those whose stages sit one per mesh (the plan's placement): interleaved_1f1b and
# zbv need other stages, so a plan names them
CANDIDATES = (ir.PipeSchedule.EAGER_1F1B, ir.PipeSchedule.ONE_F_ONE_B, ir.PipeSchedule.ZB_H1, ir.PipeSchedule.GPIPE)


MAX_EVENTS = 60_000   # simulated operations per schedule above which the compiler predicts nothing


def sim_size(sim, micro_batches: int) -> int:
    """Roughly the simulation's node count: per device and operation a begin, a compute and its receives;
    per unit task and micro-batch, one per direction; per layer of a zero-3 stage its gathers and compute."""
    ops = sum(len(d) for d in sim.stage_devices) * 2 * micro_batches * 3
    layered = sum(len(sim.stage_devices[r.stage]) * 2 * micro_batches * len(sim.compute[r.stage].forward)
                  * (len(r.steps) + 2) for r in sim.reductions if getattr(r, "per_layer", False))   # ZeRO-3's
    return ops + layered + 2 * micro_batches * sum(len(t.forward) + len(t.backward) for t in sim.transfers)


def simulate_schedules(sim, num_stages: int, micro_batches: int, transfers=(), nic: bool = True,
                       schedule=None, virtual: int = 1) -> dict | None:
    """Per schedule the plan can run: ``(PipelinePlan, Prediction)`` of its lists on ``sim``; None when the
    simulation would be larger than :data:`MAX_EVENTS` (it would slow the compiler by seconds).
    ``nic`` False: no host NIC order is tried (the compiler's retry when one could hang the lists).
    ``schedule``: the plan's; one that runs several stages per mesh (interleaved_1f1b with ``virtual``, zbv)
    is the only one its placement can run, else every schedule of :data:`CANDIDATES` is simulated."""
    if sim_size(sim, micro_batches) > MAX_EVENTS:
        return None
    shared = schedule is not None and stages_per_class(str(schedule), virtual) > 1
    out = {}
    for s in ((ir.PipeSchedule(schedule),) if shared else (ir.PipeSchedule.GPIPE, ir.PipeSchedule.ONE_F_ONE_B,
                                                              ir.PipeSchedule.EAGER_1F1B, ir.PipeSchedule.ZB_H1)):
        plan = build(s, num_stages, micro_batches, transfers, virtual=virtual if shared else 1)
        out[s] = (plan, predict(sim, plan.actions, nic=nic))
    return out


def predicted_record(sim, prediction, rate: float, given: bool, runs: dict) -> dict:
    """plan.json ``pipeline.predicted`` (docs/plan-format.md)."""
    return {
        "flops": rate, "flops_given": given,
        "iteration_free_communication": prediction.free_iteration,
        "exposed_communication": prediction.exposed_communication,
        "stages": [dict(f.to_json(), **c.to_json()) for f, c in zip(prediction.stages, sim.compute)],
        "schedules": {str(k): {"iteration": p.iteration, "exposed_communication": p.exposed_communication,
                               "bubble": max(f.bubble for f in p.stages) if p.stages else 0.0,
                               "unordered_iteration": p.unordered_iteration, "nic_ordered": bool(p.nic_order)}
                      for k, (_, p) in runs.items()},
    }


def choose_by_prediction(program: ir.Program, stages, probe, runs: dict, more_stages=None
                         ) -> tuple[ir.PipeSchedule, str]:
    """``schedule = auto`` with the simulator: the fastest predicted schedule that fits ``cluster.memory``
    by the memory model; ties go to eager_1f1b, then 1f1b. A located ``NoFit`` when none fits."""
    limit = program.cluster.memory
    memory = stage_memory(program, stages, probe)
    B = program.train.micro_batches
    times = ", ".join(f"{s} {_time_text(runs[s][1].iteration)}" for s in CANDIDATES if s in runs)
    fitting = [s for s in CANDIDATES if s in runs and fits(memory, s, B, limit)]
    if not fitting:
        raise no_fit(program, memory, CANDIDATES, _span(program, memory, FALLBACK), more_stages)
    best = min(fitting, key=lambda s: runs[s][1].iteration)   # min keeps the first of equal ones: the tie order
    left = [s for s in CANDIDATES if s not in fitting]
    why = f"{best}: the fastest predicted iteration ({times})"
    why += (f", within memory = {_bytes_text(limit)} (needs at most {_bytes_text(worst(memory, best, B).total)})"
            if limit is not None else " (no device memory limit given)")
    if left:
        why += "; " + ", ".join(f"{s} would need {_bytes_text(worst(memory, s, B).total)}" for s in left)
    return best, why


def _time_text(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"
