"""planc.pipeline.deadlock over classes of ranks agrees with the whole simulation of every rank.

- every bundled plan (plans/*.plan) and every test plan (tests/plans/*.plan), both backends, both
  modes, several receive-ahead depths: the same verdict and the same hangs;
- plans built to hang (the constructions of tests/passes/test_deadlock.py, a hang in one data replica only,
  random per-stage lists, random broken tasks): the same verdict, and every wait the class-based check
  reports is one the whole simulation stops in;
- the classes are real: a plan of two data replicas has two components in one class, a replica whose
  tasks differ is a class of its own; where the pipeline part and the tail share a communicator the
  classes are not formed and the whole simulation answers.
"""
from __future__ import annotations

import copy
import glob
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from schedule_util import compute_lists, set_compute_lists
from planc.pipeline.deadlock import check_rendezvous
from planc.pipeline.deadlock.build import Builder
from planc.pipeline.deadlock.classes import check_mode, classes, components
from planc.pipeline.deadlock.events import Sim
from planc.pipeline.deadlock.report import _explain
from test_deadlock import (PROPERTY_PLANS, alternate, bundled, doc, f1_first, plan_of, stage_list, with_lists,
                           _as_allgather, _with_micro_batches)

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted(glob.glob(str(ROOT / "plans" / "*.plan"))) + sorted(glob.glob(str(ROOT / "tests" / "plans" / "*.plan")))


def blocked(plan, backend, mode, ahead) -> set:
    """Every (rank, thread, where, op) the whole simulation stops in."""
    b = Builder(plan, backend, ahead, True)
    threads = [t for r in range(plan.cluster.devices)
               for t in (b.train_threads(r) if mode == "train" else b.comm_only_threads(r))]
    if b.invalid:
        return {(r, text) for r, text in b.invalid}
    Sim(threads).run()
    out = set()
    for t in threads:
        if not t.finished:
            w = _explain(t, set(), b.turns)
            if w is not None:
                out.add((w.rank, w.thread, w.where, w.op))
    return out


def agree(plan, ahead: int = 4, modes=None, same_hangs: bool = False) -> list:
    """Assert the two methods agree on ``plan``; the class-based hangs."""
    trains = plan.pipeline is not None and plan.train is not None and plan.train.trainable
    modes = modes or (("train", "comm_only") if trains else ("comm_only",))
    out = []
    for backend in ("nccl", "gloo"):
        for mode in modes:
            full = check_rendezvous(plan, ahead=ahead, backend=backend, mode=mode, method="full")
            got = check_rendezvous(plan, ahead=ahead, backend=backend, mode=mode)
            assert bool(full) == bool(got), (backend, mode, [str(h) for h in full], [str(h) for h in got])
            if same_hangs:
                assert list(map(str, got)) == list(map(str, full)), (backend, mode)
            if got:
                stops = blocked(plan, backend, mode, ahead)
                for h in got:
                    for w in h.waits:
                        key = (w.rank, w.op) if h.kind == "invalid" else (w.rank, w.thread, w.where, w.op)
                        assert key in stops, (backend, mode, str(h))
            out += got
    return out


# ---------------------------------------------------------------- every plan we ship or test

@pytest.mark.parametrize("path", PLANS, ids=lambda p: Path(p).name)
def test_every_plan_agrees(path):
    plan = plan_of(doc(path))
    for ahead in (0, 2, 4):
        assert agree(plan, ahead, same_hangs=True) == []


# ---------------------------------------------------------------- plans built to hang

def test_forward_orders_that_differ():
    d = doc(bundled("gpt-bench-2x2.plan"))
    s0, s1 = compute_lists(d)
    hangs = agree(with_lists(d, s0, f1_first(s1)), same_hangs=True)
    assert {h.ranks for h in hangs if h.backend == "nccl"} == {(0, 2), (1, 3)}   # both replicas named


def test_a_backward_needed_before_its_forward():
    d = doc(bundled("gpt-bench-2x2.plan"))
    m = d["pipeline"]["micro_batches"]
    assert agree(with_lists(d, alternate(m), ["F1", "F0", "B0", "B1"] + alternate(m, 2)), same_hangs=True)


def test_a_hang_in_one_data_replica_only():
    """gpt-2x4's replica 1 (task 1: rank 4 -> 6, 7) broadcasts on a group with a member that never joins:
    that replica is a class of its own, and its hang is found under NCCL; replica 0 stays safe."""
    d = doc(bundled("gpt-2x4.plan"))
    plan = plan_of(d)
    assert [len(c) for c in classes(Builder(plan, "nccl", 4, True), "train")] == [2]
    task = d["transfers"][0]["tasks"][1]
    task["group"] = [4, 5, 6, 7]
    d["groups"].append([4, 5, 6, 7])
    broken = plan_of(d)
    assert [len(c) for c in classes(Builder(broken, "nccl", 4, True), "train")] == [1, 1]
    hangs = agree(broken)
    assert hangs and {h.backend for h in hangs} == {"nccl"}
    assert all(r in (4, 5, 6, 7) for h in hangs for r in h.ranks)


def test_reduction_collectives_in_different_orders():
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
    assert agree(plan_of(d), same_hangs=True)


def test_a_reduction_a_rank_never_runs():
    d = doc(bundled("p2-running-example.plan"))
    grads = next(r for r in d["reductions"] if r["name"] == "grads")
    grads["groups"] = [[0, 1, 2, 3]]
    grads["program"]["unit"] = 1
    grads["program"]["steps"] = [{"collective": "allreduce", "groups": [[0, 1, 2, 3, 4]], "regions": [[0, 1]]}]
    d["groups"].append([0, 1, 2, 3, 4])
    assert agree(plan_of(d), same_hangs=True)


@pytest.mark.parametrize("split", [False, True], ids=["gather", "split"])
def test_allgather_routes(split):
    d = _as_allgather(doc(bundled("gpt-2x4.plan")), split)
    assert agree(plan_of(d)) == []
    s0, s1 = compute_lists(d)
    assert agree(with_lists(d, s0, f1_first(s1)), same_hangs=True)


@pytest.mark.parametrize("name", sorted(PROPERTY_PLANS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_lists_agree(name, data):
    path, stages = PROPERTY_PLANS[name]
    m = data.draw(st.integers(1, 3), label="micro-batches")
    d = _with_micro_batches(path, m)
    lists = [data.draw(stage_list(m), label=f"stage {s}") for s in range(stages)]
    agree(with_lists(d, *lists), data.draw(st.integers(0, 3), label="ahead"), modes=("train",), same_hangs=True)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_broken_tasks_agree(data):
    """gpt-2x4 (two replicas, broadcast routes, tensor groups) with a random task of a random route given
    another sender, fewer or reordered receivers, a larger group, or its schedule order changed: both
    methods say the same."""
    d = doc(bundled("gpt-2x4.plan"))
    t = d["transfers"][0]
    route = data.draw(st.sampled_from([t, t["backward"]]), label="route")
    k = data.draw(st.integers(0, len(route["tasks"]) - 1), label="task")
    task = route["tasks"][k]
    ranks = list(range(8))
    what = data.draw(st.sampled_from(["sender", "receivers", "group", "start"]), label="change")
    if what == "sender":
        task["sender"] = data.draw(st.sampled_from(task["holders"]), label="sender")
    elif what == "receivers":
        # fewer receivers, or the same in another order (a relay chain's order under gloo)
        task["receivers"] = data.draw(st.lists(st.sampled_from(task["receivers"]), min_size=1, unique=True))
    elif what == "group":
        g = sorted(set(data.draw(st.lists(st.sampled_from(ranks), min_size=2, max_size=4, unique=True)))
                   | {task["sender"]} | set(task["receivers"]))
        task["group"] = g
        d["groups"].append(g)
    else:
        task["start"] = -1.0
    route["strategy"] = data.draw(st.sampled_from(["broadcast", "send_recv"]), label="strategy")
    # (the same verdict and waits; a "why" may differ: where the class-based check stops a rank at the end
    # of its pipeline part, the whole simulation has it go on into its tail)
    agree(plan_of(d))


# ---------------------------------------------------------------- where classes cannot be formed

def test_a_tensor_group_that_is_also_a_reduction_group_falls_back():
    """gpt-2x4's gradients reduced over its tensor groups: one communicator in both parts, so the classes
    are not formed (check_mode says None) and check_rendezvous simulates every rank."""
    d = doc(bundled("gpt-2x4.plan"))
    red = d["reductions"][0]
    tensor = [list(g) for g in d["tensor_groups"]]
    red["groups"] = tensor
    red["program"]["unit"] = 1
    red["program"]["steps"] = [{"collective": "allreduce", "groups": tensor, "regions": [[0, 1]] * len(tensor)}]
    red.pop("stage", None)
    plan = plan_of(d)
    assert check_mode(plan, "train", "nccl", 4, True, 8) is None
    assert check_mode(plan, "train", "nccl", 4, False, 8) is not None   # no tensor all_reduce modelled
    agree(plan, same_hangs=True)


def test_components_follow_the_communicators():
    """gpt-bench-2x2 (pipe 2 x data 2, send_recv): replica d is ranks {d, d + 2}."""
    plan = plan_of(doc(bundled("gpt-bench-2x2.plan")))
    assert components(Builder(plan, "nccl", 4, True), "train") == [[0, 2], [1, 3]]
