"""The hang check on rank classes of several stages (interleaved_1f1b, zbv) and split backwards (zb_h1):
the generated lists pass, hand-broken ones are caught, a local transfer (two stages of one mesh) hands
its data over inside the rank's own list, and why such plans run each transfer on communicators of its own
(plan.json ``runtime.p2p_per_transfer``)."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from planc import plan as planfile
from planc.driver.compile import compile_file
from planc.pipeline.deadlock import check_rendezvous

ROOT = Path(__file__).resolve().parents[2]
SHARED = ("gpt-interleaved-2x2.plan", "gpt-zbv-2.plan", "mlp-interleaved-meshes.plan", "mlp-zb-h1-data2-to-data4.plan")


def doc(name: str) -> dict:
    return copy.deepcopy(_docs(name))


_cache: dict = {}


def _docs(name: str) -> dict:
    if name not in _cache:
        _cache[name] = compile_file(ROOT / "tests" / "plans" / name, probe=False).plan_json
    return _cache[name]


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("method", ["classes", "full"])
def test_the_generated_lists_cannot_hang(name, method):
    plan = planfile.Plan.from_json(doc(name))
    for backend in ("nccl", "gloo"):
        assert check_rendezvous(plan, backend=backend, method=method) == [], (name, backend)


def test_a_stage_run_before_its_input_exists_hangs():
    """gpt-interleaved-2x2: the class of stages 1 and 3 runs F3.0 first; its input comes from stage 2, whose
    input comes from stage 1, which that class has not run yet: a cycle under both backends."""
    d = doc("gpt-interleaved-2x2.plan")
    cls = next(c for c in d["pipeline"]["actions"] if c["stages"] == [1, 3])
    moved = [a for a in cls["list"] if a[:3] in (["RECV", 3, 0], ["F", 3, 0]) and (a[0] == "F" or a[3] == "h23")]
    assert [a[0] for a in moved] == ["RECV", "F"]
    cls["list"] = moved + [a for a in cls["list"] if a not in moved]
    plan = planfile.Plan.from_json(d)    # each list is valid on its own
    for backend in ("nccl", "gloo"):
        hangs = check_rendezvous(plan, backend=backend)
        assert hangs, backend
        text = "\n".join(map(str, hangs))
        assert "transfer 'h23'" in text and "transfer 'h12'" in text
        assert "stage 3 op 0 (F3.0)" in text


def test_a_local_transfer_received_before_it_is_sent_is_refused_and_hangs():
    """gpt-zbv-2: h12 goes from stage 1 to stage 2 on one mesh: no tasks, its route ``local``. The reader
    refuses a list that receives it before it sends it; the hang check, given such lists anyway, finds the
    compute thread waiting for its own send."""
    d = doc("gpt-zbv-2.plan")
    t = next(t for t in d["transfers"] if t["name"] == "h12")
    assert t["local"] is True and t["tasks"] == [] and t["backward"]["local"] is True
    cls = next(c for c in d["pipeline"]["actions"] if c["stages"] == [1, 2])
    lst = cls["list"]
    send, recv = lst.index(["SEND", 1, 0, "h12", "forward"]), lst.index(["RECV", 2, 0, "h12", "forward"])
    assert send < recv
    good = planfile.Plan.from_json(copy.deepcopy(d))
    lst.insert(send, lst.pop(recv))
    with pytest.raises(planfile.PlanFileError, match="comes after it in the same list"):
        planfile.Plan.from_json(d)
    broken = planfile.RankClass.read(planfile.At(cls, "c"), d["pipeline"]["micro_batches"])
    actions = tuple(broken if c.stages == (1, 2) else c for c in good.pipeline.actions)
    plan = dataclasses.replace(good, pipeline=dataclasses.replace(good.pipeline, actions=actions))
    hangs = check_rendezvous(plan, backend="gloo")
    assert hangs and "stage 2 op" in str(hangs[0])


def test_one_communicator_per_direction_would_hang_a_pipe_that_comes_back():
    """Under interleaved_1f1b on 2 pipe coordinates, ranks 0 and 2 send each other activations (stage 0 to
    1, stage 1 to 2). On one p2p communicator per direction, rank 0's receive of h12, posted ahead, stands
    before the send of h01 that rank 2 waits for (NCCL pairs in order): the plan runs each transfer on
    communicators of its own (runtime.p2p_per_transfer), which the compiler writes for these schedules."""
    d = doc("gpt-interleaved-2x2.plan")
    assert d["runtime"]["p2p_per_transfer"] is True
    plan = planfile.Plan.from_json(d)
    shared = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, p2p_per_transfer=False))
    hangs = check_rendezvous(shared, backend="nccl")
    assert hangs and "p2p/forward" in str(hangs[0])
    assert check_rendezvous(shared, backend="gloo") == []    # gloo matches by tag
    assert "p2p_per_transfer" not in doc("mlp-zb-h1-data2-to-data4.plan")["runtime"]


def test_each_stage_reduces_its_gradients_in_list_order():
    """A rank of a class of two stages runs two gradient reductions, one per REDUCE, in its list's order
    (the stage that finishes first reduces first)."""
    from planc.pipeline.deadlock.build import Builder
    plan = planfile.Plan.from_json(doc("gpt-interleaved-2x2.plan"))
    b = Builder(plan, "nccl", 4, True)
    for rank in range(4):
        cls = plan.pipeline.class_of(plan.stages[0].index if rank in plan.stages[0].devices else 1)
        assert [k for k, _, _ in b.reductions_of(rank)] == [a.stage for a in cls.reduces()]
