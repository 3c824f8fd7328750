"""planc.pipeline.deadlock: the compiled plans cannot hang under rendezvous semantics; broken ones are named.

- every bundled plan (plans/*.plan) and every plan of tests/plans is accepted under NCCL and gloo,
  in the training step and the --comm-only step, for several receive-ahead depths;
- valid plan files that hang are refused with both ranks and both operations named: forward orders
  that differ between a sender and a receiver stage (NCCL only: gloo matches by tag), a backward the
  sender needs before the forward the receiver needs (both backends), a broadcast group with a member
  that never joins (NCCL only: gloo relays along the receivers), reduction collectives met in
  different orders (both backends);
- property: over random valid per-stage lists of small plans, the verdict is the stage-level one of
  ``planc.pipeline.simulate`` (sends buffered, receives block) -- plus, under NCCL, equal F orders and
  equal B orders on every pair of stages a transfer connects, because NCCL pairs the k-th send of a
  peer pair with its k-th receive whatever the tags. docs/deadlock.md says why that is exact there.
"""
from __future__ import annotations

import copy
import glob
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from schedule_util import compute_lists, set_compute_lists
from planc.driver.compile import compile_file
from planc.pipeline.deadlock import Hang, check_rendezvous
from planc.pipeline.schedules import stage_ops
from planc.pipeline.simulate import DeadlockError, simulate
from planc import plan as planfile

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = sorted(glob.glob(str(ROOT / "plans" / "*.plan")))
TEST_PLANS = sorted(glob.glob(str(ROOT / "tests" / "plans" / "*.plan")))


@lru_cache(maxsize=None)
def _doc(path: str) -> dict:
    # every plan here declares its transfer shapes (a bundled plan's inferred ones: its spelled copy),
    # so the model probe is not needed for the routes
    from e2e_util import spelled
    return compile_file(spelled(path), probe=False).plan_json


def doc(path) -> dict:
    return copy.deepcopy(_doc(str(path)))


def plan_of(d: dict) -> planfile.Plan:
    return planfile.Plan.from_json(d)


def bundled(name: str) -> str:
    return str(ROOT / "plans" / name)


# ---------------------------------------------------------------- the compiled plans are safe

@pytest.mark.parametrize("backend", ["nccl", "gloo"])
@pytest.mark.parametrize("path", BUNDLED + TEST_PLANS, ids=lambda p: Path(p).name)
def test_compiled_plans_cannot_hang(path, backend):
    plan = plan_of(doc(path))
    for ahead in (0, 1, 2, 5):
        hangs = check_rendezvous(plan, ahead=ahead, backend=backend)
        assert hangs == [], "\n".join(map(str, hangs))


def test_a_probed_plan_is_checked_too():
    """The compiler's real output (model probed), training step and comm-only step, both backends."""
    plan = compile_file(ROOT / "tests" / "plans" / "unet-skip-unequal.plan").plan
    assert plan.train is not None and plan.train.trainable
    for backend in ("nccl", "gloo"):
        assert check_rendezvous(plan, backend=backend) == []
        assert check_rendezvous(plan, backend=backend, mode="train") == []
        assert check_rendezvous(plan, backend=backend, mode="comm_only") == []


def test_arguments_are_checked():
    plan = plan_of(doc(bundled("gpt-bench-2x2.plan")))
    with pytest.raises(ValueError, match="backend"):
        check_rendezvous(plan, backend="mpi")
    with pytest.raises(ValueError, match="ahead"):
        check_rendezvous(plan, ahead=-1)
    with pytest.raises(ValueError, match="mode"):
        check_rendezvous(plan, mode="inference")
    with pytest.raises(ValueError, match="pipeline"):
        check_rendezvous(plan_of(doc(bundled("alpacomm-2x4.plan"))), mode="train")


# ---------------------------------------------------------------- plans that hang

def with_lists(d: dict, *lists) -> planfile.Plan:
    d = copy.deepcopy(d)
    set_compute_lists(d, [list(x) for x in lists])
    return plan_of(d)


def alternate(m: int, first: int = 0) -> list[str]:
    return [x for i in range(first, m) for x in (f"F{i}", f"B{i}")]


def f1_first(ops):
    """The list with F1 moved to the front: F1 runs before F0 (a valid list, a different order)."""
    ops = [op for op in ops if op != "F1"]
    return ["F1", *ops]


def only_train(hangs):
    return [h for h in hangs if h.mode == "train"]


def test_forward_orders_that_differ_hang_under_nccl_only():
    """Stage 1 runs F1 before F0; stage 0 sends F0 first. gloo matches the tags; NCCL pairs the first send
    of rank 0 -> 2 with the first receive, so rank 2 waits for micro-batch 1 while rank 0 waits for the
    gradient of micro-batch 0."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    s0, s1 = compute_lists(d)
    s1 = f1_first(s1)
    plan = with_lists(d, s0, s1)
    assert check_rendezvous(plan, backend="gloo") == []
    hangs = check_rendezvous(plan, backend="nccl")
    assert hangs and all(isinstance(h, Hang) and h.kind == "cycle" for h in hangs)
    assert {h.ranks for h in hangs} == {(0, 2), (1, 3)}
    text = str(next(h for h in hangs if h.ranks == (0, 2)))
    assert ("rank 0 waits in backward recv of transfer 'hidden' task 0 (micro-batch 0) from rank 2 "
            "on communicator p2p/backward") in text
    assert "rank 2 waits in forward recv of transfer 'hidden' task 0 (micro-batch 1) from rank 0 " \
           "on communicator p2p/forward" in text
    assert "forward send of transfer 'hidden' task 0 (micro-batch 0) to rank 2" in text
    assert "out of order" in text
    assert "stage 1 op 0 (F1)" in text and "stage 0 op 3 (B0)" in text


def test_a_backward_needed_before_the_forward_it_waits_for_hangs_under_both():
    """Stage 0 needs B0's gradient before it runs F1; stage 1 runs F1 before F0."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    m = d["pipeline"]["micro_batches"]
    plan = with_lists(d, alternate(m), ["F1", "F0", "B0", "B1"] + alternate(m, 2))
    for backend in ("nccl", "gloo"):
        hangs = check_rendezvous(plan, backend=backend)
        assert {h.ranks for h in hangs} == {(0, 2), (1, 3)}, backend
        text = str(next(h for h in hangs if h.ranks == (1, 3)))
        assert "rank 1 waits in backward recv of transfer 'hidden' task 1 (micro-batch 0) from rank 3" in text
        assert "rank 3 waits in forward recv of transfer 'hidden' task 1 (micro-batch 1) from rank 1" in text
        assert "rank 3 has not issued the matching send" in text
        assert f"under {backend} in the training step" in text


def test_a_broadcast_group_with_a_member_that_never_joins_hangs_under_nccl():
    """Task 1 of 'hidden' broadcasts from 4 to 6 and 7, but its group also lists 5 (4's tensor peer),
    which receives nothing of it: under NCCL 6 and 7 wait in the broadcast for 5 forever, and 5 waits
    for the gradients 6 never computes. gloo relays along the receivers and never uses the group."""
    d = doc(bundled("gpt-2x4.plan"))
    task = d["transfers"][0]["tasks"][1]
    assert (task["sender"], task["receivers"]) == (4, [6, 7])
    task["group"] = [4, 5, 6, 7]
    d["groups"].append([4, 5, 6, 7])
    plan = plan_of(d)
    assert check_rendezvous(plan, backend="gloo") == []
    hangs = check_rendezvous(plan, backend="nccl")
    assert {h.mode for h in hangs} == {"train", "comm_only"}
    text = "\n".join(map(str, only_train(hangs)))
    assert ("forward broadcast of transfer 'hidden' task 1 (micro-batch 0) on communicator "
            "transfer/forward/[4, 5, 6, 7]") in text
    assert "rank 5 has not issued it" in text
    pair = next(h for h in only_train(hangs) if h.ranks == (5, 6))
    assert pair.kind == "cycle"
    assert pair.waits[0].rank == 5 and "backward broadcast of transfer 'hidden' task 1" in pair.waits[0].op
    assert pair.waits[1].rank == 6 and "transfer/forward/[4, 5, 6, 7]" in pair.waits[1].op
    comm_only = [h for h in hangs if h.mode == "comm_only"]
    assert comm_only and "transfer/forward/[4, 5, 6, 7]" in str(comm_only[0])


def test_reduction_collectives_met_in_different_orders_hang_under_both():
    """Stage 0's program all-reduces over its data group, then with stage 1's ranks; stage 1's the other
    way round: on [0, 2] rank 0 is at its step 1 while rank 2 is at its step 0, and neither moves."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    red = d["reductions"][0]

    def program(stage, groups, steps):
        r = copy.deepcopy(red)
        r["stage"], r["groups"] = stage, groups
        r["program"]["unit"] = 1
        r["program"]["steps"] = [{"collective": "allreduce", "groups": g, "regions": [[0, 1]] * len(g)}
                                 for g in steps]
        return r

    cross = [[0, 2], [1, 3]]
    d["reductions"] = [program(0, [[0, 1]], [[[0, 1]], cross]), program(1, [[2, 3]], [cross, [[2, 3]]])]
    plan = plan_of(d)
    for backend in ("nccl", "gloo"):
        hangs = only_train(check_rendezvous(plan, backend=backend, mode="train"))
        assert hangs, backend
        text = "\n".join(map(str, hangs))
        assert "rank 0 waits in gradient reduction step 1 (allreduce) on communicator group [0, 2]" in text
        assert "gradient reduction step 0 (allreduce) on communicator group [2, 3]" in text or \
               "rank 2 is first at gradient reduction step 0 (allreduce) on communicator group [0, 2]" in text
        assert "different orders" in text


def test_the_hang_names_two_ranks_and_operations():
    d = doc(bundled("unet-skip.plan"))
    s0, s1, s2 = compute_lists(d)
    s2 = f1_first(s2)                      # the last stage runs F1 before F0 on every pair
    hangs = check_rendezvous(with_lists(d, s0, s1, s2), backend="nccl", mode="train")
    assert hangs
    h = hangs[0]
    assert len(h.ranks) == 2 and len(h.waits) == 2
    assert {w.rank for w in h.waits} == set(h.ranks)
    assert str(h).count(" waits in ") == 2


# ---------------------------------------------------------------- size

def test_ten_thousand_unit_task_operations_in_a_few_seconds():
    """gpt-bench-2x2 with 100 micro-batches and 50 unit tasks per route: 2 x 50 x 100 = 10^4 task
    operations sent and as many received."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    m = 100
    for t in d["transfers"]:
        for route in (t, t["backward"]):
            route["tasks"] = [copy.deepcopy(route["tasks"][i % len(route["tasks"])]) for i in range(50)]
            for k, task in enumerate(route["tasks"]):
                task["start"] = float(k)
    d["pipeline"]["micro_batches"] = m
    set_compute_lists(d, [[f"{k}{i}" for k, i in stage_ops("1f1b", 2, s, m)] for s in range(2)])
    plan = plan_of(d)
    for backend in ("nccl", "gloo"):    # (its time is in docs/limits.md; no test times it)
        assert check_rendezvous(plan, backend=backend, mode="train") == []
    # and a hang of that size is found
    assert check_rendezvous(with_lists(d, alternate(m), ["F1", "F0", "B0", "B1"] + alternate(m, 2)),
                            backend="nccl", mode="train")


# ---------------------------------------------------------------- property: agrees with the stage-level condition

@st.composite
def stage_list(draw, m: int):
    """A valid per-stage list: every F and B once, each B after its F, otherwise any order."""
    fwd_left, bwd_ready, out = list(range(m)), [], []
    while fwd_left or bwd_ready:
        options = [("F", i) for i in fwd_left] + [("B", i) for i in bwd_ready]
        kind, i = draw(st.sampled_from(options))
        out.append(f"{kind}{i}")
        if kind == "F":
            fwd_left.remove(i)
            bwd_ready.append(i)
        else:
            bwd_ready.remove(i)
    return out


def _order(ops, kind):
    return [op for op in ops if op[0] == kind]


def _reference(d: dict, lists, backend: str) -> bool:
    """True when the stage-level condition says the lists cannot hang."""
    edges = tuple(sorted({(t["src"]["stage"], t["dst"]["stage"]) for t in d["transfers"]}))
    try:
        simulate([tuple((op[0], int(op[1:])) for op in ops) for ops in lists], edges)
    except DeadlockError:
        return False
    if backend == "gloo":
        return True
    return all(_order(lists[a], k) == _order(lists[b], k) for a, b in edges for k in "FB")


def _with_micro_batches(path: str, m: int) -> dict:
    d = doc(path)
    d["pipeline"]["micro_batches"] = m
    return d


PROPERTY_PLANS = {
    "gpt-bench-2x2": (bundled("gpt-bench-2x2.plan"), 2),      # send_recv, 2 devices per stage
    "gpt-2x4": (bundled("gpt-2x4.plan"), 2),                  # NCCL broadcast collectives, tensor groups
    "unet-skip": (bundled("unet-skip.plan"), 3),              # 3 stages, skip transfers 0 -> 2
}


@pytest.mark.parametrize("name", sorted(PROPERTY_PLANS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_verdict_agrees_with_the_stage_level_condition(name, data):
    path, stages = PROPERTY_PLANS[name]
    m = data.draw(st.integers(1, 3), label="micro-batches")
    d = _with_micro_batches(path, m)
    lists = [data.draw(stage_list(m), label=f"stage {s}") for s in range(stages)]
    ahead = data.draw(st.integers(0, 3), label="ahead")
    plan = with_lists(d, *lists)
    for backend in ("nccl", "gloo"):
        got = check_rendezvous(plan, ahead=ahead, backend=backend, mode="train")
        want = _reference(d, lists, backend)
        assert (got == []) == want, (backend, lists, ahead, [str(h) for h in got])
        for h in got:
            assert h.waits and all(w.op for w in h.waits)


# ---------------------------------------------------------------- the other strategies

def _as_allgather(d: dict, split: bool) -> dict:
    """gpt-2x4 with every route an allgather: parts of one receiver each (p2p only) or all receivers."""
    for t in d["transfers"]:
        for route in (t, t["backward"]):
            route["strategy"] = "local_allgather" if split else "global_allgather"
            for task in route["tasks"]:
                task["parts"] = [[r] for r in task["receivers"]] if split else [sorted(task["receivers"])]
    return d


@pytest.mark.parametrize("split", [False, True], ids=["gather", "split"])
def test_allgather_routes(split):
    d = _as_allgather(doc(bundled("gpt-2x4.plan")), split)
    plan = plan_of(d)
    for backend in ("nccl", "gloo"):
        assert check_rendezvous(plan, backend=backend) == []
    s0, s1 = compute_lists(d)
    s1 = f1_first(s1)
    hangs = check_rendezvous(with_lists(d, s0, s1), backend="nccl", mode="train")
    assert hangs
    assert "forward recv of transfer 'hidden' task 0 (micro-batch 1) from rank 0" in "\n".join(map(str, hangs))


def test_comm_only_reduction_a_rank_never_runs():
    """A step group lists rank 4, whose reduction it is not: ranks 0-3 wait for it in 'grads' while it
    waits for them in 'weights'."""
    d = doc(bundled("p2-running-example.plan"))
    grads = next(r for r in d["reductions"] if r["name"] == "grads")
    grads["groups"] = [[0, 1, 2, 3]]
    grads["program"]["unit"] = 1
    grads["program"]["steps"] = [{"collective": "allreduce", "groups": [[0, 1, 2, 3, 4]], "regions": [[0, 1]]}]
    d["groups"].append([0, 1, 2, 3, 4])
    hangs = check_rendezvous(plan_of(d), backend="gloo")
    assert hangs and all(h.mode == "comm_only" for h in hangs)
    text = "\n".join(map(str, hangs))
    assert "reduction 'grads' step 0 (allreduce) on communicator group [0, 1, 2, 3, 4]" in text
    assert "rank 4 has not issued it" in text
    assert "rank 4 waits in reduction 'weights' step 0 (allreduce)" in text


# ---------------------------------------------------------------- the action list, read as written

def test_a_send_moved_after_a_receive_hangs_as_written():
    """pipeline.actions is run as written: stage 0's list with its send of micro-batch 0's activations
    swapped with the receive of that micro-batch's gradient (still after F0 and before B0, so the list
    reads as valid) makes stage 0 wait for a gradient that needs the activations it has not sent."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    assert check_rendezvous(plan_of(d)) == []
    lst = d["pipeline"]["actions"][0]["list"]
    send = lst.index(["SEND", 0, 0, "hidden", "forward"])
    recv = lst.index(["RECV", 0, 0, "hidden", "backward"])
    lst[send], lst[recv] = lst[recv], lst[send]
    plan = plan_of(d)                      # the contract's checks pass: the order is legal, it just hangs
    for backend in ("nccl", "gloo"):
        hangs = check_rendezvous(plan, backend=backend, mode="train")
        assert hangs, backend
        text = "\n".join(map(str, hangs))
        assert "backward recv of transfer 'hidden' task 0 (micro-batch 0)" in text, text
        assert "forward recv of transfer 'hidden' task 0 (micro-batch 0)" in text, text
