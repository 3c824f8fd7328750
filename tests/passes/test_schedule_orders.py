"""The generators of interleaved_1f1b(virtual = V), zb_h1 and zbv (planc.pipeline.orders) against the
references: torch pipelining's own orders (its schedule classes' per-rank computation, built here without
process groups), the papers' in-flight bounds, and the list-level simulation (every list can finish,
bubbles as the papers derive them). torch's ``I`` is planc's ``B`` (input gradients), torch's ``B`` a fused
backward."""
from __future__ import annotations

from typing import NamedTuple

import pytest

from planc import plan as planfile
from planc.pipeline.orders import interleaved, zb_h1, zbv
from planc.pipeline.schedules import build, orders, simulate

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")


class T(NamedTuple):
    name: str
    src_stage: int
    dst_stage: int


def chain(n: int) -> list[T]:
    return [T(f"s{i}", i, i + 1) for i in range(n - 1)]


def torch_order(cls, P: int, micro_batches: int, rank: int, **attrs) -> list[tuple[str, int, int]]:
    """torch's compute actions of ``rank`` as ``(kind, stage, micro-batch)`` in planc's words, from the schedule
    class's own per-rank computation on an instance given only what that computation reads."""
    sched = object.__new__(cls)
    sched.pp_group_size, sched._n_microbatches = P, micro_batches
    for k, v in attrs.items():
        setattr(sched, k, v)
    kind = {"F": "F", "I": "B", "W": "W", "B": "B"}
    return [(kind[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in sched._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize("P, V, B", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (3, 2, 9), (4, 4, 12)])
def test_interleaved_is_torchs_interleaved_1f1b(P, V, B):
    for p in range(P):
        want = torch_order(pipelining.ScheduleInterleaved1F1B, P, B, p, n_local_stages=V,
                           microbatches_per_round=P)
        assert list(interleaved(P, V, p, B)) == want, (P, V, B, p)


@pytest.mark.parametrize("P, B", [(2, 1), (2, 2), (2, 5), (4, 2), (4, 4), (4, 8), (5, 11)])
def test_zb_h1_is_torchs_zero_bubble_with_one_stage_per_rank(P, B):
    """torch's ScheduleInterleavedZeroBubble (ZB1P) with one local stage is ZB-H1."""
    for p in range(P):
        want = torch_order(pipelining.ScheduleInterleavedZeroBubble, P, B, p, n_local_stages=1,
                           microbatches_per_round=B // max(1, B // P))
        assert list(zb_h1(P, p, B)) == want, (P, B, p)


@pytest.mark.parametrize("P, B", [(1, 3), (2, 1), (2, 3), (2, 4), (2, 8), (3, 2), (3, 5), (4, 8), (4, 16)])
def test_zbv_is_torchs_zbv(P, B):
    for p in range(P):
        want = torch_order(pipelining.ScheduleZBVZeroBubble, P, B, p, num_stages=2 * P)
        assert list(zbv(P, p, B)) == want, (P, B, p)


CASES = [("interleaved_1f1b", 4, 4, 2), ("interleaved_1f1b", 6, 6, 3), ("interleaved_1f1b", 8, 8, 2),
         ("zb_h1", 4, 8, 1), ("zb_h1", 3, 2, 1), ("zbv", 4, 6, 1), ("zbv", 6, 2, 1), ("zbv", 8, 8, 1),
         ("1f1b", 4, 6, 1), ("gpipe", 3, 4, 1), ("eager_1f1b", 4, 6, 1)]


@pytest.mark.parametrize("schedule, S, B, V", CASES)
def test_every_generated_list_is_valid_and_finishes(schedule, S, B, V):
    """Read back by the contract (RankClass.read), checked against a chain of transfers (check_transfers,
    classes on one mesh each), and run by the list-level simulation (raises on a deadlock)."""
    plan = build(schedule, S, B, chain(S), virtual=V)
    classes = planfile.class_stages(schedule, S, V)
    assert sorted(c.stages for c in plan.actions) == sorted(classes)
    read = tuple(planfile.RankClass.read(planfile.At(c.to_json(), f"actions[{i}]"), B)
                 for i, c in enumerate(plan.actions))
    assert read == plan.actions
    devices = {s: (i,) for i, c in enumerate(classes) for s in c}
    planfile.actions.check_transfers(read, chain(S), [devices[s] for s in range(S)], B)
    simulate(orders(schedule, S, B, V), [(i, i + 1) for i in range(S - 1)])


def test_a_transfer_inside_a_class_is_sent_before_it_is_received():
    """zbv: stage P - 1 feeds stage P on the same mesh; both its SEND and its RECV are in that class's list."""
    plan = build("zbv", 4, 4, chain(4))
    cls = next(c for c in plan.actions if set(c.stages) == {1, 2})
    for m in range(4):
        at = {(a.kind, a.direction): i for i, a in enumerate(cls.actions) if a.transfer == "s1" and a.micro_batch == m}
        fwd, bwd = planfile.Direction.FORWARD, planfile.Direction.BACKWARD
        assert at[("SEND", fwd)] < at[("RECV", fwd)] and at[("SEND", bwd)] < at[("RECV", bwd)]
    assert [a.stage for a in cls.reduces()] == [2, 1]   # one per stage, in the order the stages finish


def joint_in_flight(ops) -> int:
    """Most stage-micro-batches in flight at once over a class's list (F until B, or W where split)."""
    ends = {s: "W" if any(k == "W" and t == s for k, t, _ in ops) else "B" for _, s, _ in ops}
    live = peak = 0
    for kind, s, _ in ops:
        live += 1 if kind == "F" else -1 if kind == ends[s] else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("P, V, B", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 3)])
def test_interleaved_holds_megatrons_in_flight(P, V, B):
    """Megatron (Narayanan et al. 2021): coordinate p runs (V - 1) P + 2 (P - 1 - p) warm-up forwards and
    holds one more stage-micro-batch at its peak; each stage is 1/V of a 1F1B stage, so coordinate 0 holds
    P + (P - 1)/V 1F1B-stage micro-batches (1F1B: P)."""
    for p in range(P):
        assert joint_in_flight(interleaved(P, V, p, B)) == min(V * B, (V - 1) * P + 2 * (P - 1 - p) + 1)


@pytest.mark.parametrize("P, B", [(2, 4), (4, 8), (4, 3), (6, 12)])
def test_zb_h1_holds_1f1bs_peak(P, B):
    """ZB-H1 keeps 1F1B's peak memory: from its F to its W every stage holds at most min(B, P) micro-batches,
    1F1B's first stage's peak (the later stages catch up by deferring their W)."""
    one = max(planfile.in_flight(ops) for ops in build("1f1b", P, B).per_stage)
    assert one == min(B, P)
    assert max(planfile.in_flight([(k, m) for k, _, m in zb_h1(P, p, B)]) for p in range(P)) == one


@pytest.mark.parametrize("P, B", [(2, 4), (4, 8), (3, 6)])
def test_zbv_holds_1f1bs_peak(P, B):
    """ZB-V (Qi et al. 2024, §6): each of the 2P stages is half a 1F1B stage; a mesh holds at most 2P of its
    stage-micro-batches at once, 1F1B's peak of P whole ones."""
    assert max(joint_in_flight(zbv(P, p, B)) for p in range(P)) <= 2 * P


def span(schedule, S, B, V=1, f=1.0, b=2.0, w=None):
    return simulate(orders(schedule, S, B, V), [(i, i + 1) for i in range(S - 1)], forward=f, backward=b,
                    weight=w).makespan


def test_bubbles_as_the_papers_derive_them():
    """Free communication, f = 1, b = 2 (a fused backward) per whole stage of the model.

    1F1B, S stages, B micro-batches: every stage computes B (f + b) and the pipeline fills and drains once,
    (S - 1)(f + b): 4 stages, 8 micro-batches: 8 x 3 + 3 x 3 = 33, bubble 9 / 33 = (S - 1) / (B + S - 1).
    Interleaved V = 2 on P = 4 coordinates (8 stages, each f/2, b/2): the fill and drain shrink to
    (P - 1)(f + b) / V = 4.5, so 24 + 4.5 = 28.5.
    ZB-H1 with B = W = 1: the bubble (S - 1)(f + b - w) = 3 x 1 = 3 against 1F1B's 9 (a third): 27.
    ZB-V, the same model on P = 2 meshes of two half stages each (f = b = w = 0.5 a half): each mesh computes
    2 x 8 x 1.5 = 24, and only the last mesh waits, one f = 0.5, for the first forward to reach it: 24.5
    (1F1B on those 2 meshes: 8 x 3 + 1 x 3 = 27)."""
    assert span("1f1b", 4, 8) == 33.0
    assert span("interleaved_1f1b", 8, 8, V=2, f=0.5, b=1.0) == 28.5
    assert span("zb_h1", 4, 8, w=1.0) == 27.0
    assert (33.0 - 24.0) / 3 == 27.0 - 24.0
    assert span("zbv", 4, 8, f=0.5, b=1.0, w=0.5) == 24.5
    assert span("1f1b", 2, 8) == 27.0
