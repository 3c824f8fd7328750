"""The compute orders of the schedules that run several stages per mesh or split the backward.

Each returns, for one rank class (pipe coordinate ``p`` of ``P``), its compute actions in order as
``(kind, stage, micro-batch)``: ``F`` forward, ``B`` backward (with a ``W`` of the same micro-batch: the
input gradients only), ``W`` the weight gradients. ``planc.pipeline.schedules.actions_of`` adds the
transfers' receives and sends and the reductions. The orders are those of the references, tested
against them (tests/passes/test_schedule_orders.py):

* :func:`interleaved` (``interleaved_1f1b(virtual = V)``): Megatron-LM's virtual pipeline, as torch's
  ``ScheduleInterleaved1F1B`` orders it for micro-batches a multiple of P (Narayanan et al. 2021, §2.2).
  Coordinate ``p`` runs stages ``p + kP``; the micro-batches go in rounds of P, each round through the
  V stages of the coordinate in turn (forward: stage ``p`` first; backward: stage ``p + (V-1)P`` first).
  Warm-up: ``(V - 1) P + 2 (P - 1 - p)`` forwards (all ``V B`` if fewer), then one forward and one
  backward in turn, then the remaining backwards. Peak in flight on coordinate ``p``: warm-up + 1
  stage-micro-batches (each stage 1/V of a non-interleaved stage's layers).
* :func:`zb_h1` (``zb_h1``): ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1), as torch's
  ``ScheduleInterleavedZeroBubble`` orders it with one stage per rank: 1F1B's warm-up (``P - 1 - p``
  forwards), then ``F``, ``B`` in turn, the ``W`` of stage ``p`` lagging ``p`` micro-batches behind its
  ``B`` (the first stage runs each ``W`` right after its ``B``, the last defers ``P - 1``): the deferred
  ``W`` fill the bubbles that the shorter ``B`` leaves, bringing 1F1B's bubble ``(P - 1)(F + B + W)``
  to ``(P - 1)(F + B - W)``. From F to W every stage holds at most ``min(B, P)`` micro-batches, 1F1B's
  peak (its first stage's).
* :func:`zbv` (``zbv``): ZB-V (Qi et al. 2024, §6), as torch's ``ScheduleZBVZeroBubble`` orders it:
  coordinate ``p`` runs stage ``p`` (chunk 0) and ``2P - 1 - p`` (chunk 1); warm-up ``2(P - p) - 1``
  forwards of chunk 0, then ``p`` pairs of forwards (chunk 1, chunk 0), then ``P - p`` of chunk 1's
  ``F B W``; the steady state runs chunk 0's ``F B W`` and chunk 1's ``F B W``; the cool-down ``p`` pairs
  of ``B`` (chunk 0, chunk 1), ``P - p`` of chunk 0's ``B W``, then the ``W`` left, chunk 1's first. Generated
  for ``max(B, 2P - 1)`` micro-batches, the actions of those past ``B`` dropped (torch's rule).
"""

from __future__ import annotations

from planc.plan import class_stages

__all__ = ["Compute", "interleaved", "zb_h1", "zbv", "round_size"]

Compute = tuple[str, int, int]   # (kind, stage, micro-batch)


def round_size(P: int, micro_batches: int) -> int:
    """Micro-batches per round of the interleaved schedules: P (micro_batches a multiple of P)."""
    if micro_batches % P:
        raise ValueError(f"interleaved_1f1b runs micro-batches in rounds of {P} (the pipe size): "
                         f"{micro_batches} is not a multiple of {P}")
    return P


def interleaved(P: int, V: int, p: int, micro_batches: int) -> tuple[Compute, ...]:
    """Coordinate ``p``'s order under ``interleaved_1f1b(virtual = V)`` (module docstring)."""
    R = round_size(P, micro_batches)
    total = V * micro_batches
    warm = min(total, (V - 1) * R + 2 * (P - 1 - p))

    def forward(k: int) -> Compute:
        chunk = (k // R) % V
        return "F", chunk * P + p, (k // (R * V)) * R + k % R

    def backward(k: int) -> Compute:
        chunk = V - 1 - (k // R) % V
        return "B", chunk * P + p, (k // (R * V)) * R + k % R

    out = [forward(k) for k in range(warm)]
    for k in range(total - warm):
        out += [forward(warm + k), backward(k)]
    out += [backward(k) for k in range(total - warm, total)]
    return tuple(out)


def zb_h1(P: int, p: int, micro_batches: int) -> tuple[Compute, ...]:
    """Stage ``p``'s order under ZB-H1 (module docstring): W lags B by ``p`` micro-batches."""
    B = micro_batches
    warm = min(B, P - 1 - p)
    out: list[Compute] = [("F", p, m) for m in range(warm)]
    w = 0                       # the next micro-batch whose W runs
    for k in range(B):          # backward k, after forward k + warm (while there is one)
        if k + warm < B:
            out.append(("F", p, k + warm))
        out.append(("B", p, k))
        if k >= p:              # the first p W are deferred; then each B brings the oldest W
            out.append(("W", p, w))
            w += 1
    out += [("W", p, m) for m in range(w, B)]
    return tuple(out)


def zbv(P: int, p: int, micro_batches: int) -> tuple[Compute, ...]:
    """Coordinate ``p``'s order under ZB-V (module docstring)."""
    n = max(micro_batches, 2 * P - 1)
    first, second = p, 2 * P - 1 - p
    nxt = {("F", first): 0, ("F", second): 0, ("B", first): 0, ("B", second): 0, ("W", first): 0,
           ("W", second): 0}
    out: list[Compute] = []

    def run(kind: str, stage: int) -> None:
        out.append((kind, stage, nxt[kind, stage]))
        nxt[kind, stage] += 1

    def pass_of(stage: int) -> None:   # F, B and W of the stage's next micro-batch
        for kind in "FBW":
            run(kind, stage)

    for _ in range(2 * (P - p) - 1):
        run("F", first)
    for _ in range(p):
        run("F", second)
        run("F", first)
    for _ in range(P - p):
        pass_of(second)
    while nxt["F", second] < nxt["F", first] or nxt["F", first] < n:
        if nxt["F", first] < n:
            run("F", first)
        run("B", first)
        run("W", first)
        pass_of(second)
    for _ in range(p):
        run("B", first)
        run("B", second)
    for _ in range(P - p):
        run("B", first)
        run("W", first)
    while nxt["W", second] < nxt["B", second]:
        run("W", second)
    while nxt["W", first] < nxt["B", first]:
        run("W", first)
    return tuple(a for a in out if a[2] < micro_batches)


def class_orders(schedule: str, num_stages: int, micro_batches: int, virtual: int = 1):
    """Per rank class, ``(stages, compute order)`` for the schedules of this module (``planc.plan.class_stages``
    gives the stages; the order runs them as the module docstring says)."""
    classes = class_stages(schedule, num_stages, virtual)
    P = len(classes)
    out = []
    for p, stages in enumerate(classes):
        if schedule == "interleaved_1f1b":
            ops = interleaved(P, virtual, p, micro_batches)
        elif schedule == "zbv":
            ops = zbv(P, p, micro_batches)
        elif schedule == "zb_h1":
            ops = zb_h1(P, p, micro_batches)
        else:
            raise ValueError(f"{schedule} is not generated here")
        out.append((stages, ops))
    return tuple(out)
