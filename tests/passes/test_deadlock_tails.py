"""The tails (reductions, then the world collectives) by classes of ranks (planc.pipeline.deadlock.tails).

- the per-rank sequences the classes are formed from are, rank for rank, the reduction collectives the
  builder writes into the tail (communicator and key), on every bundled and test plan, both modes;
- ``tails_finish`` says True exactly when simulating every rank's tail finishes, on those plans and on
  tails built to hang (one replica's reduction steps in the other order, a step group with a rank
  that never runs it);
- the classes are real: data replicas' reduction groups are components of one class; a replica whose
  steps differ is a class of its own.
"""
from __future__ import annotations

import copy
import glob
from pathlib import Path

import pytest

from planc.pipeline.deadlock import check_rendezvous
from planc.pipeline.deadlock.build import Builder
from planc.pipeline.deadlock.events import ISSUE, Sim, Thread
from planc.pipeline.deadlock.tails import _sequences, tail_classes, tails_finish
from test_deadlock import bundled, doc, plan_of

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted(glob.glob(str(ROOT / "plans" / "*.plan"))) + sorted(glob.glob(str(ROOT / "tests" / "plans" / "*.plan")))


def modes(plan):
    trains = plan.pipeline is not None and plan.train is not None and plan.train.trainable
    return ("train", "comm_only") if trains else ("comm_only",)


def builder_tails(plan, mode):
    """Every rank's whole tail program, as the builder writes it."""
    b = Builder(plan, "nccl", 4, True)
    progs = []
    for rank in range(plan.cluster.devices):
        prog = []
        if mode == "train":
            b.train_tail(rank, prog)
        else:
            b.comm_only_head(rank, prog)
            b.comm_only_tail(rank, prog)
        progs.append(prog)
    return b, progs


def all_tails_finish(plan, mode) -> bool:
    _, progs = builder_tails(plan, mode)
    threads = [Thread(r, "main", p) for r, p in enumerate(progs)]
    Sim(threads).run()
    return all(t.finished for t in threads)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: Path(p).name)
def test_sequences_are_the_builders_reduction_collectives(path):
    plan = plan_of(doc(path))
    for mode in modes(plan):
        b, progs = builder_tails(plan, mode)
        key_of = {id(c): k for k, c in b.comms.items()}
        world = b._world()
        seqs, members = _sequences(Builder(plan, "nccl", 4, True), mode)
        for rank, prog in enumerate(progs):
            want = [(key_of[id(ev.comm)], ev.key) for code, ev, _ in prog if code == ISSUE and ev.comm is not world]
            assert [(members[cid], key) for cid, key in seqs[rank]] == want, (mode, rank)


@pytest.mark.parametrize("path", PLANS, ids=lambda p: Path(p).name)
def test_the_verdict_is_every_ranks(path):
    plan = plan_of(doc(path))
    for mode in modes(plan):
        assert tails_finish(Builder(plan, "gloo", 4, True), mode) == all_tails_finish(plan, mode) is True


def two_replicas():
    """gpt-bench-2x2 (pipe 2 x data 2: stage 0 is ranks 0, 1, stage 1 ranks 2, 3) with its gradients
    reduced in two all-reduce steps over each stage's data group."""
    d = doc(bundled("gpt-bench-2x2.plan"))
    red = d["reductions"][0]
    assert red["groups"] == [[0, 1], [2, 3]]
    red["program"]["steps"] = [{"collective": "allreduce", "groups": [[0, 1], [2, 3]], "regions": [[0, 1]] * 2}
                               for _ in range(2)]
    return d


def test_replicas_form_one_class_and_a_different_one_its_own():
    plan = plan_of(two_replicas())
    for mode in ("train", "comm_only"):
        assert [len(c) for c in tail_classes(Builder(plan, "nccl", 4, True), mode)] == [2]
        assert tails_finish(Builder(plan, "nccl", 4, True), mode) and all_tails_finish(plan, mode)
    d = two_replicas()
    d["reductions"][0]["program"]["steps"].append({"collective": "allreduce", "groups": [[2, 3]],
                                                   "regions": [[0, 1]]})
    plan = plan_of(d)
    for mode in ("train", "comm_only"):
        assert [len(c) for c in tail_classes(Builder(plan, "nccl", 4, True), mode)] == [1, 1]
        assert tails_finish(Builder(plan, "nccl", 4, True), mode) and all_tails_finish(plan, mode)


def x_and_y():
    """(fine, broken): ``--comm-only`` runs every reduction holding a rank, in plan order. Y (every rank)
    runs {0, 1}, {2, 3} then {0, 2}, {1, 3}: fine. Broken: X (held by ranks 0, 1) first runs one step
    over {0, 2} and {1, 3}; on {0, 2} rank 0's first collective is X's step and rank 2's is Y's second:
    the heads differ forever."""
    d = two_replicas()
    red = d["reductions"][0]

    def reduction(name, groups, steps):
        r = copy.deepcopy(red)
        r["name"], r["groups"] = name, groups
        r["program"]["steps"] = [{"collective": "allreduce", "groups": g, "regions": [[0, 1]] * len(g)}
                                 for g in steps]
        return r

    d["groups"].append([0, 1, 2, 3])
    fine = copy.deepcopy(d)
    fine["reductions"] = [reduction("Y", [[0, 1, 2, 3]], [[[0, 1], [2, 3]], [[0, 2], [1, 3]]])]
    d["reductions"] = [reduction("X", [[0, 1]], [[[0, 2], [1, 3]]])] + fine["reductions"]
    return plan_of(fine), plan_of(d)


def test_a_collective_met_in_another_order_is_found():
    plan, broken = x_and_y()
    assert all_tails_finish(plan, "comm_only") and tails_finish(Builder(plan, "nccl", 4, True), "comm_only")
    assert not all_tails_finish(broken, "comm_only")
    assert not tails_finish(Builder(broken, "nccl", 4, True), "comm_only")
    for backend in ("nccl", "gloo"):
        full = check_rendezvous(broken, backend=backend, mode="comm_only", method="full")
        got = check_rendezvous(broken, backend=backend, mode="comm_only")
        assert full and list(map(str, got)) == list(map(str, full))


def test_the_tails_verdict_is_shared_between_backends_only_when_they_finish():
    plan = plan_of(two_replicas())
    shared: dict = {}

    def verdicts():   # shared also keeps the per-rank lookups every Builder of the plan reads
        return {k: v for k, v in shared.items() if k != "builder lookups"}

    assert check_rendezvous(plan, shared=shared) == []
    assert verdicts() == {("tails finish", "train"): True, ("tails finish", "comm_only"): True}
    assert shared["builder lookups"][0] is plan
    assert check_rendezvous(plan, backend="gloo", shared=shared) == []
    _, broken = x_and_y()
    shared = {}
    for backend in ("nccl", "gloo"):
        hangs = check_rendezvous(broken, backend=backend, mode="comm_only", shared=shared)
        assert hangs and verdicts() == {}
        assert list(map(str, hangs)) == list(map(str, check_rendezvous(broken, backend=backend, mode="comm_only",
                                                                       method="full")))
