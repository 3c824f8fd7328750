"""Pipeline schedules: dependencies, deadlock freedom with skips, in-flight bounds."""

import itertools

import pytest

from schedule_util import T
from planc.pipeline.schedules import PipelinePlan, build, peak_in_flight, stage_ops, warmup
from planc.pipeline.simulate import DeadlockError, simulate

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")


def chain(n):
    return tuple((i, i + 1) for i in range(n - 1))


def u_shape(n):
    """Chain plus a skip from each stage i to its mirror n-1-i."""
    return chain(n) + tuple((i, n - 1 - i) for i in range(n // 2) if n - 1 - i > i + 1)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2), (4, 8), (5, 3), (6, 13)])
def test_lists_run_to_completion_with_and_without_skips(schedule, stages, micro):
    plan = build(schedule, stages, micro)
    for edges in (chain(stages), u_shape(stages), tuple((0, j) for j in range(1, stages)) + chain(stages)):
        t = simulate(plan.per_stage, edges, comm=0.5)
        for (s, (kind, m)), st in t.start.items():   # dependencies respected in time
            if kind == "F":
                for a, b in edges:
                    if b == s:
                        assert t.finish[(a, ("F", m))] <= st
            else:
                assert t.finish[(s, ("F", m))] <= st
                for a, b in edges:
                    if a == s:
                        assert t.finish[(b, ("B", m))] <= st


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_peak_in_flight_is_exact(schedule):
    for stages, micro in itertools.product(range(1, 7), range(1, 12)):
        plan = build(schedule, stages, micro)
        t = simulate(plan.per_stage, chain(stages))
        for i in range(stages):
            assert t.peak_in_flight[i] == peak_in_flight(schedule, stages, i, micro)
            bound = {"gpipe": micro, "1f1b": min(micro, stages - i),
                     "eager_1f1b": min(micro, 2 * (stages - i) - 1)}[schedule]
            assert t.peak_in_flight[i] == bound


def test_warmup_counts_follow_alpacomm():
    assert [warmup("1f1b", 4, i, 8) for i in range(4)] == [3, 2, 1, 0]
    assert [warmup("eager_1f1b", 4, i, 8) for i in range(4)] == [6, 4, 2, 0]
    assert [warmup("eager_1f1b", 4, i, 4) for i in range(4)] == [4, 4, 2, 0]


def test_known_lists():
    assert stage_ops("1f1b", 2, 0, 4) == (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1),
                                          ("F", 3), ("B", 2), ("B", 3))
    assert stage_ops("1f1b", 2, 1, 3) == (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2))
    assert stage_ops("gpipe", 2, 1, 2) == (("F", 0), ("F", 1), ("B", 0), ("B", 1))
    assert stage_ops("eager_1f1b", 2, 1, 3) == stage_ops("1f1b", 2, 1, 3)   # the last stage: no warm-up
    assert stage_ops("eager_1f1b", 2, 0, 4) == (("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                ("B", 2), ("B", 3))


def test_json_round_trip_and_contract():
    plan = build("eager_1f1b", 2, 3, (T("h", 0, 1),))
    data = plan.to_json()
    # stage 0 sends h after each forward and receives its gradient before each backward; stage 1 the reverse
    s0 = ([["F", 0, 0], ["SEND", 0, 0, "h", "forward"], ["F", 0, 1], ["SEND", 0, 1, "h", "forward"],
           ["F", 0, 2], ["SEND", 0, 2, "h", "forward"]] +
          [x for m in range(3) for x in (["RECV", 0, m, "h", "backward"], ["B", 0, m])] + [["REDUCE", 0]])
    s1 = [x for m in range(3) for x in (["RECV", 1, m, "h", "forward"], ["F", 1, m], ["B", 1, m],
                                        ["SEND", 1, m, "h", "backward"])] + [["REDUCE", 1]]
    assert data == {"schedule": "eager_1f1b", "micro_batches": 3,
                    "actions": [{"stages": [0], "list": s0}, {"stages": [1], "list": s1}],
                    "predicted_iteration": None,
                    "stages": [{"stage": i, "busy": None, "bubble": None, "peak_activation_bytes": None,
                                    "memory": None}
                               for i in range(2)]}   # PLAN_FORMAT.md's per-stage figures: none simulated
    assert PipelinePlan.from_json(data) == plan


def test_invalid_lists_rejected():
    with pytest.raises(ValueError, match="B0 before F0"):
        PipelinePlan("gpipe", 1, ((("B", 0), ("F", 0)),))
    with pytest.raises(ValueError, match="exactly once"):
        PipelinePlan("gpipe", 2, ((("F", 0), ("B", 0)),))


def test_deadlock_detected():
    # stage 1 waits for B0 of stage 0, which needs stage 1's F0 gradient path: a cycle.
    per_stage = ((("F", 0), ("B", 0)), (("B", 0), ("F", 0)))
    with pytest.raises(ValueError):
        PipelinePlan("gpipe", 1, per_stage)
    bad = ((("F", 0), ("F", 1), ("B", 1), ("B", 0)), (("F", 0), ("B", 0), ("F", 1), ("B", 1)))
    # stage 0 waits for B1 from stage 1 before B0; fine. Make a real deadlock with a backward edge:
    with pytest.raises(DeadlockError, match="deadlock"):
        simulate(bad, ((0, 1), (1, 0)))


def test_eager_is_not_slower_with_slow_links():
    """With communication as slow as compute, eager 1F1B overlaps more."""
    for stages in (2, 3, 4):
        edges = u_shape(stages)
        one = simulate(build("1f1b", stages, 8).per_stage, edges, comm=1.0).makespan
        eager = simulate(build("eager_1f1b", stages, 8).per_stage, edges, comm=1.0).makespan
        assert eager <= one


def test_predicted_figures_round_trip_and_stay_out_of_equality():
    import dataclasses
    plan = build("1f1b", 2, 3, (T("h", 0, 1),))
    rich = dataclasses.replace(plan, predicted_iteration=1.5, predicted={"flops": 1e12, "stages": []})
    data = rich.to_json()
    assert data["predicted_iteration"] == 1.5 and data["predicted"] == {"flops": 1e12, "stages": []}
    back = PipelinePlan.from_json(data)
    assert back.predicted == rich.predicted and back == rich
    assert "predicted" not in plan.to_json()
