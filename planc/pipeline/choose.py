"""``schedule = auto``: the best pipeline schedule that fits in the devices' memory.

With the model probe the compiler simulates every schedule (``planc.pipeline.simulate``,
docs/simulator.md) and :func:`choose_by_prediction` picks the fastest predicted one whose
parameters, gradients, optimizer state and simulated peak of activations fit ``cluster.memory``.
:func:`choose_schedule` below is the rule without a simulation: the known order of the
schedules (AlpaComm §4): ``eager_1f1b`` runs forwards ahead, so every
cross-mesh transfer overlaps computation; ``1f1b`` keeps the fewest
micro-batches in flight. ``gpipe`` keeps every micro-batch in flight (the most
memory) and gains nothing over ``1f1b`` in planc's runtime, so ``auto`` never
picks it. The rule: ``eager_1f1b`` if it fits ``cluster.memory`` on every
stage, else ``1f1b`` if it fits; if even ``1f1b`` does not fit, a located
error (at ``schedule = auto``): the estimate counts only what certainly stays
in memory, so the plan would run out of it.

Memory of one device of stage ``i`` under a schedule, estimated:

    static_i + in_flight_i(schedule) x activations_i

* ``static_i``: the device's parameters (its tensor-parallel shard of the
  stage's layers) x the precision's bytes x (2 + optimizer states): weights and
  gradients, plus Adam's two moments (``sgd`` with ``momentum`` one, plain
  ``sgd`` none).
* ``activations_i``: what one micro-batch leaves on one device until its
  backward: the bytes of every tensor each of the stage's layers returns plus
  the stage's incoming transfers, as measured by the model probe for the whole
  micro-batch, divided by the stage's data degree (its rows are split over
  ``data``; layer outputs are taken as replicated over ``tensor``). Autograd
  keeps more inside a layer, so this is a lower bound.
* ``in_flight_i``: the schedule's exact peak of micro-batches whose forward
  ran on the stage and whose backward has not
  (:func:`planc.pipeline.schedules.peak_in_flight`; ``min(B, S - i)`` for
  1f1b, ``min(B, 2(S - i) - 1)`` for eager_1f1b, ``B`` for gpipe).

Without ``memory`` in the cluster there is no limit: ``eager_1f1b``. Without a
model probe (``--no-probe``) the memory cannot be estimated: ``1f1b`` (the
default) when a limit is given.
"""

from __future__ import annotations

from planc import ir
from planc.lang.errors import Diagnostic, PlanError
from planc.pipeline.memory import PRECISION_BYTES, stage_memory  # noqa: F401  (PRECISION_BYTES: named here too)
from planc.pipeline.schedules import build, peak_in_flight
from planc.pipeline.simulate import predict

__all__ = ["choose_schedule", "stage_memory", "OVERLAP", "FALLBACK"]

OVERLAP = ir.PipeSchedule.EAGER_1F1B    # preferred: overlaps cross-mesh communication
FALLBACK = ir.PipeSchedule.ONE_F_ONE_B  # the fewest micro-batches in flight


def _bytes_text(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def _peaks(schedule: ir.PipeSchedule, memory, num_stages: int, micro_batches: int):
    """Per stage ``(index, peak bytes, in flight)`` under ``schedule``."""
    return [(i, static + peak_in_flight(schedule, num_stages, k, micro_batches) * act,
             peak_in_flight(schedule, num_stages, k, micro_batches))
            for k, (i, static, act) in enumerate(memory)]


def choose_schedule(program: ir.Program, stages, probe) -> tuple[ir.PipeSchedule, str]:
    """The schedule for ``schedule = auto`` and why (for ``planc explain``).

    ``stages``: the placed ``ir.StageLayout``s (or the program's ``ir.Stage``s), with their layer
    ranges cut; ``probe``: the model probe of the program as compiled (None: ``--no-probe``). A located
    ``PlanError`` (at ``schedule = auto``) when even 1f1b is predicted not to fit ``cluster.memory``.
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
    S, B = len(memory), program.train.micro_batches

    def worst(schedule):
        return max(_peaks(schedule, memory, S, B), key=lambda r: (r[1], -r[0]))

    def detail(schedule, row):
        i, peak, k = row
        _, static, act = next(m for m in memory if m[0] == i)
        return (f"{_bytes_text(peak)} (stage {i}: {_bytes_text(static)} parameters, gradients and optimizer "
                f"state + {k} micro-batch{'es' if k != 1 else ''} in flight x {_bytes_text(act)} activations)")

    eager = worst(OVERLAP)
    if eager[1] <= limit:
        return OVERLAP, (f"{OVERLAP}: fits memory = {_bytes_text(limit)} on every stage, needing at most "
                         f"{detail(OVERLAP, eager)}; it sends activations ahead so cross-mesh transfers "
                         "overlap compute (AlpaComm §4)")
    one = worst(FALLBACK)
    if one[1] <= limit:
        return FALLBACK, (f"{FALLBACK}: eager_1f1b would need {detail(OVERLAP, eager)}, more than memory = "
                          f"{_bytes_text(limit)}; 1f1b needs at most {detail(FALLBACK, one)}")
    raise PlanError(Diagnostic(
        f"schedule = auto: no schedule fits in memory = {_bytes_text(limit)} per device; even 1f1b, which keeps "
        f"the fewest micro-batches in flight, needs an estimated {detail(FALLBACK, one)}. Use more stages or "
        "devices, a smaller micro_batch, or give the devices' real memory", program.train.schedule_span))


# ---------------------------------------------------------------- the simulator's predictions

CANDIDATES = (ir.PipeSchedule.EAGER_1F1B, ir.PipeSchedule.ONE_F_ONE_B, ir.PipeSchedule.GPIPE)   # tie order


MAX_EVENTS = 60_000   # simulated operations per schedule above which the compiler predicts nothing


def sim_size(sim, micro_batches: int) -> int:
    """Roughly the simulation's node count: per device and operation a begin, a compute and its receives;
    per unit task and micro-batch, one per direction."""
    ops = sum(len(d) for d in sim.stage_devices) * 2 * micro_batches * 3
    return ops + 2 * micro_batches * sum(len(t.forward) + len(t.backward) for t in sim.transfers)


def simulate_schedules(sim, num_stages: int, micro_batches: int, edges=None, nic: bool = True) -> dict | None:
    """Per concrete schedule: ``(PipelinePlan, Prediction)`` of its lists on ``sim``; None when the
    simulation would be larger than :data:`MAX_EVENTS` (it would slow the compiler by seconds).
    ``nic`` False: no host NIC order is tried (the compiler's retry when one could hang the lists)."""
    if sim_size(sim, micro_batches) > MAX_EVENTS:
        return None
    out = {}
    for schedule in (ir.PipeSchedule.GPIPE, ir.PipeSchedule.ONE_F_ONE_B, ir.PipeSchedule.EAGER_1F1B):
        plan = build(schedule, num_stages, micro_batches, edges)
        out[schedule] = (plan, predict(sim, plan.per_stage, nic=nic))
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


def choose_by_prediction(program: ir.Program, stages, probe, runs: dict) -> tuple[ir.PipeSchedule, str]:
    """``schedule = auto`` with the simulator: the fastest predicted schedule that fits ``cluster.memory``
    (static bytes + the simulated peak activation bytes of every stage); ties go to eager_1f1b, then 1f1b.
    A located error when none fits."""
    limit = program.cluster.memory
    memory = {i: static for i, static, _ in stage_memory(program, stages, probe)}
    order = sorted(memory)

    def need(pred):
        return max(((memory[order[k]] + f.peak_activation_bytes, order[k]) for k, f in enumerate(pred.stages)),
                   default=(0.0, 0))

    times = ", ".join(f"{s} {_time_text(runs[s][1].iteration)}" for s in CANDIDATES)
    fits = [s for s in CANDIDATES if limit is None or need(runs[s][1])[0] <= limit]
    if not fits:
        peak, stage = need(runs[FALLBACK][1])
        raise PlanError(Diagnostic(
            f"schedule = auto: no schedule fits in memory = {_bytes_text(limit)} per device; even 1f1b needs an "
            f"estimated {_bytes_text(peak)} on stage {stage} (parameters, gradients and optimizer state + the "
            "simulated peak of activations). Use more stages or devices, a smaller micro_batch, or give the "
            "devices' real memory", program.train.schedule_span))
    best = min(fits, key=lambda s: runs[s][1].iteration)   # min keeps the first of equal ones: the tie order
    left = [s for s in CANDIDATES if s not in fits]
    why = f"{best}: the fastest predicted iteration ({times})"
    why += (f", within memory = {_bytes_text(limit)} (needs at most {_bytes_text(need(runs[best][1])[0])})"
            if limit is not None else " (no device memory limit given)")
    if left:
        why += "; " + ", ".join(f"{s} would need {_bytes_text(need(runs[s][1])[0])}" for s in left)
    return best, why


def _time_text(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"
