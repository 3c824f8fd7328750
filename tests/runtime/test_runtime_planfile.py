"""planfile.py (the typed plan file), regions.py, dist_util.py start-up checks, topology.py's
StageTopology: pure tests on plans written by the real compiler, plus one small gloo job for
the collective start-up checks and group creation."""
from __future__ import annotations

import ast
import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.driver.compile import compile_file, compile_program  # noqa: E402
from planc.lang import load_text  # noqa: E402
from planc import plan as planfile
from planc.plan.file import encode  # noqa: E402
from planc.runtime import dist_util  # noqa: E402
from planc.runtime import regions as R  # noqa: E402
from planc.plan import Action, Direction, Pipeline, Plan, PlanFileError, RankClass, Schedule, TagLayout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = sorted((ROOT / "plans").glob("*.plan"))

CLUSTER = """  cluster {
    level node x 2 : bandwidth 1.25 GB/s, latency 20 us
    level gpu  x 4 : bandwidth 15 GB/s, latency 2 us
  }"""

# Communication only: stages of 4, 3 and 1 devices; a reduction over stage 0's data dimension.
# a: one source slice per receiver, b: one task (three of stage 0's devices send nothing),
# c: a sharded source (each sender holds a third).
COMM_TEXT = f"""
plan planfile_comm {{
{CLUSTER}
  stage 0 on devices 0..4 as (data = 2, tensor = 2)
  stage 1 on devices 4..7 as (1, 3)
  stage 2 on devices 7..8 as (1, 1)
  transfer a : f32[4, 6] from stage 0 as R R to stage 1 as R S1
  transfer b : f32[4, 6] from stage 0 as R R to stage 2 as R R
  transfer c : i32[4, 6] from stage 1 as R S1 to stage 2 as R R
  reduce grads over data : f32[1000]
  resharding {{ strategy = broadcast, chunks = 2 }}
}}
"""

# A model plan (examples/mlp.py) on three explicit stages of 2, 4 and 1 devices; device 2 is idle.
MODEL_TEXT = f"""
plan planfile_model {{
{CLUSTER}
  model "{ROOT}/examples/mlp.py:build" {{ layers = 4, hidden = 6, inputs = 8, outputs = 4 }}
  loss  "{ROOT}/examples/mlp.py:loss"
  data  "{ROOT}/examples/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..3 on devices 3..7 as (data = 2, m1 = 2)
  stage 2 : layers 3..4 on devices 7..8 as (data = 1)
  transfer a : f32[8, 6] from stage 0 as S0 R to stage 1 as S0 R
  transfer b : f32[8, 6] from stage 1 as S0 R to stage 2 as R R
  reduce gradients over data
  resharding {{ strategy = global_allgather, chunks = 2 }}
  train {{ micro_batch = 8, micro_batches = MB, steps = 1, schedule = SCHED, optimizer = sgd(lr = 0.1),
          precision = fp32, seed = 1 }}
}}
"""


def compiled(text: str, name: str = "t.plan") -> dict:
    return compile_program(load_text(text, name), probe=None).plan_json


def comm_json() -> dict:
    return compiled(COMM_TEXT, "comm.plan")


def model_json(micro_batches: int = 4, schedule: str = "1f1b") -> dict:
    return compiled(MODEL_TEXT.replace("MB", str(micro_batches)).replace("SCHED", schedule), "model.plan")


# ----------------------------------------------------------------- round trip
def _round_trip(d: dict) -> None:
    plan = Plan.from_json(d)
    assert plan.to_json() == d
    # key order too: the text every rank hashes is the text the compiler wrote
    assert planfile.dumps(plan) == encode(d)
    assert json.loads(planfile.dumps(plan)) == d
    assert Plan.from_json(json.loads(planfile.dumps(plan))) == plan


def test_bundled_plans_are_there():
    assert {p.name for p in BUNDLED} >= {"alpacomm-2x4.plan", "gpt-2x4.plan", "p2-running-example.plan",
                                         "unet-skip.plan"}


@pytest.mark.parametrize("path", BUNDLED, ids=[p.name for p in BUNDLED])
def test_round_trip_bundled_plan(path):
    from e2e_util import spelled
    _round_trip(compile_file(spelled(path), probe=False).plan_json)


def test_round_trip_comm_and_model_plans():
    _round_trip(comm_json())
    for schedule in ("gpipe", "1f1b", "eager_1f1b"):
        _round_trip(model_json(4, schedule))


def test_typed_records_hold_what_the_file_says():
    d = model_json()
    plan = Plan.from_json(d)
    assert plan.stage_mode is planfile.StageMode.EXPLICIT and plan.train is not None
    assert [s.index for s in plan.stages] == [0, 1, 2]
    st = plan.stages[1]
    assert st.layers == (2, 3) and st.mesh_shape == (2, 2) and st.mesh_axes == ("data", "m1")
    assert st.mesh_devices == (3, 4, 5, 6) and st.devices == (3, 4, 5, 6)
    # row-major: mesh[i][j] = 3 + 2 i + j; rows split over the data dimension (dim 0)
    for dev in st.devices:
        i, j = divmod(dev - 3, 2)
        assert st.position(dev) == (i, j)
        assert st.rows_of(dev) == (4 * i, 4 * i + 4)
        assert st.group_of("data", dev) == tuple(sorted({3 + j, 5 + j}))
        assert st.group_of("model", dev) == tuple(sorted({3 + 2 * i, 4 + 2 * i}))
    assert plan.stage_of(2) is None and plan.stage_of(7) is plan.stages[2]
    assert plan.cluster.host_of(3) == 0 and plan.cluster.host_of(4) == 1
    assert plan.train.loss_devices == (7,)
    for s in plan.stages:
        for dev in s.devices:
            red = plan.gradient_reduction(dev)
            assert (red is None) == (len(s.group_of("data", dev)) == 1)
            if red is not None:
                assert red.group_of(dev) == s.group_of("data", dev)
    for k, t in enumerate(plan.transfers):
        raw = d["transfers"][k]
        for direction, body in ((Direction.FORWARD, raw), (Direction.BACKWARD, raw["backward"])):
            route = t.route(direction)
            for side in ("src", "dst"):
                for dev, box in body["regions"][side].items():
                    assert route.region(side, int(dev)) == tuple(tuple(r) for r in box)
            assert route.region("dst", 2) is None
            order = [i for i, _ in route.ordered_tasks()]
            assert order == sorted(range(len(body["tasks"])), key=lambda i: (body["tasks"][i]["start"], i))
            for task, tj in zip(route.tasks, body["tasks"]):
                assert task.numel == math.prod(b - a for a, b in tj["slice"])
                assert task.parts == tuple(tuple(p) for p in tj["parts"])


# ----------------------------------------------------------------- validation names the key
def _first_task_with(tasks, pred):
    return next(i for i, t in enumerate(tasks) if pred(t))


def c_missing(d):
    del d["cluster"]["devices"]
    return "plan.json: cluster.devices: missing"


def c_missing_slice(d):
    del d["transfers"][2]["tasks"][1]["slice"]
    return "plan.json: transfers[2].tasks[1].slice: missing"


def c_wrong_type_list(d):
    d["stages"][1]["mesh_shape"] = "1x3"
    return "plan.json: stages[1].mesh_shape: expected a list, got a string"


def c_wrong_type_bool(d):
    d["cluster"]["devices"] = True
    return "plan.json: cluster.devices: expected an integer, got a boolean"


def c_wrong_type_float(d):
    d["transfers"][0]["chunks"] = 2.5
    return "plan.json: transfers[0].chunks: expected an integer, got 2.5"


def c_format(d):
    d["format"] = "planc/0"
    return "plan.json: format: expected 'planc/1', got 'planc/0'"


def c_sender_not_holder(d):
    t = d["transfers"][0]["tasks"][1]
    t["sender"] = 9
    return f"plan.json: transfers[0].tasks[1].sender: 9 is not one of the holders {t['holders']}"


def c_slice_outside_receiver(d):
    tr = d["transfers"][0]          # R R -> R S1: each receiver holds a third of dim 1
    t = tr["tasks"][0]
    r = t["receivers"][0]
    t["slice"] = [[0, 4], [0, 6]]   # the sender holds all of it, the receiver does not
    return (f"plan.json: transfers[0].tasks[0]: slice [[0, 4], [0, 6]] is outside receiver {r}'s region "
            f"{tuple(tuple(x) for x in tr['regions']['dst'][str(r)])}")


def c_sender_does_not_hold(d):
    tr = d["transfers"][2]          # R S1 -> R R: each sender holds a third of dim 1
    t = tr["tasks"][0]
    other = next(int(k) for k in tr["regions"]["src"] if int(k) != t["sender"])
    t["holders"] = sorted(set(t["holders"]) | {other})
    t["sender"] = other
    return (f"plan.json: transfers[2].tasks[0]: sender {other} does not hold slice {t['slice']} "
            f"(holds {tuple(tuple(x) for x in tr['regions']['src'][str(other)])})")


def c_receiver_region_missing(d):
    tr = d["transfers"][0]
    r = tr["tasks"][1]["receivers"][0]
    del tr["regions"]["dst"][str(r)]
    k = _first_task_with(tr["tasks"], lambda t: r in t["receivers"])
    return f"plan.json: transfers[0].tasks[{k}]: slice {tr['tasks'][k]['slice']} is outside receiver {r}'s region None"


def c_region_missing_for_stage_device(d):
    tr = d["transfers"][1]          # one task: the other three devices of stage 0 send nothing
    idle = sorted(int(k) for k in tr["regions"]["src"] if all(int(k) != t["sender"] for t in tr["tasks"]))
    assert idle, "the plan must have a source device that sends nothing"
    del tr["regions"]["src"][str(idle[0])]
    have = sorted(int(k) for k in tr["regions"]["src"])
    return (f"plan.json: transfers[1].regions.src: must give a region for every device of stage 0 "
            f"[0, 1, 2, 3], got {have}")


def c_region_wrong_rank(d):
    d["transfers"][1]["regions"]["dst"]["7"] = [[0, 4]]
    return "plan.json: transfers[1].regions.dst.7: 1 ranges for a tensor of 2 dimensions"


def c_step_group_not_listed(d):
    listed = {tuple(g) for g in d["groups"]}
    g = next([a, b] for a in range(8) for b in range(a + 1, 8) if (a, b) not in listed)
    step = d["reductions"][0]["program"]["steps"][0]
    step["groups"].append(g)
    step["regions"].append([0, d["reductions"][0]["program"]["unit"]])
    return f"plan.json: reductions[0].program.steps[0]: group {g} is not listed in groups"


def c_step_regions_not_one_per_group(d):
    d["reductions"][0]["program"]["steps"][0]["regions"].pop()
    n = len(d["reductions"][0]["program"]["steps"][0]["groups"])
    return f"plan.json: reductions[0].program.steps[0].regions: {n - 1} regions for {n} groups"


def c_task_group_not_listed(d):
    used = {tuple(g) for r in d["reductions"] for s in r["program"]["steps"] for g in s["groups"]}
    order = [(i, k, tuple(t["group"])) for i, tr in enumerate(d["transfers"]) for k, t in enumerate(tr["tasks"])]
    g = next(g for _, _, g in order if len(g) > 1 and g not in used)
    d["groups"].remove(list(g))
    i, k, _ = next(x for x in order if x[2] == g)
    return f"plan.json: transfers[{i}].tasks[{k}]: group {list(g)} is not listed in groups"


def c_stages_out_of_order(d):
    d["stages"][0], d["stages"][1] = d["stages"][1], d["stages"][0]
    return "plan.json: stages: stage indices must be 0..2 in order, got [1, 0, 2]"


def c_device_in_two_stages(d):
    st = d["stages"][2]
    st["devices"], st["mesh"], st["mesh_devices"] = [0], [[0]], [0]
    return "plan.json: stages: device 0 is in stages 0 and 2"


def c_device_outside_cluster(d):
    st = d["stages"][2]
    st["devices"], st["mesh"], st["mesh_devices"] = [8], [[8]], [8]
    return "plan.json: stages: stage 2 uses device 8, the cluster has 8"


def c_bad_dtype(d):
    d["transfers"][1]["dtype"] = "f8"
    return f"plan.json: transfers[1].dtype: 'f8' is not one of {list(planfile.DTYPE_NAMES)}"


def c_hosts_not_a_partition(d):
    d["cluster"]["hosts"] = [[0, 1, 2, 3], [4, 5, 6]]
    return "plan.json: cluster.hosts: hosts must partition devices 0..7"


def c_unsorted_group(d):
    d["groups"][0] = list(reversed(d["groups"][0]))
    return f"plan.json: groups[0]: group members must be sorted and distinct, got {d['groups'][0]}"


def c_bad_strategy(d):
    d["transfers"][0]["strategy"] = "carrier_pigeon"
    return ("plan.json: transfers[0].strategy: 'carrier_pigeon' is not one of "
            "['broadcast', 'send_recv', 'local_allgather', 'global_allgather']")


# model plans
def m_actions_missing_micro_batch(d):
    lst = d["pipeline"]["actions"][1]["list"]
    lst[:] = [a for a in lst if not (a[0] in ("F", "B") and a[2] == 3)]
    return "plan.json: pipeline.actions[1].list: stage 1 must run F of every micro-batch 0..3 once (missing 3)"


def m_actions_backward_first(d):
    ops = d["pipeline"]["actions"][2]["list"]
    f, b = ops.index(["F", 2, 0]), ops.index(["B", 2, 0])
    ops[f], ops[b] = ops[b], ops[f]
    return f"plan.json: pipeline.actions[2].list[{f}]: B2.0 runs before F2.0"


def m_actions_micro_batch_beyond(d):
    d["pipeline"]["actions"][0]["list"][0] = ["F", 0, 4]
    return "plan.json: pipeline.actions[0].list[0][2]: micro-batch 4 of 4"


def m_actions_count(d):
    d["pipeline"]["actions"].pop()
    return "plan.json: pipeline.actions: no list runs stage(s) 2"


def m_actions_unknown_kind(d):
    d["pipeline"]["actions"][0]["list"][0] = ["FWD", 0, 0]
    return "plan.json: pipeline.actions[0].list[0][0]: unknown action 'FWD' (expected one of F, B, W, SEND, RECV, REDUCE)"


def m_actions_receive_after_its_forward(d):
    lst = d["pipeline"]["actions"][1]["list"]
    recv = next(a for a in lst if a[0] == "RECV" and a[2] == 0 and a[4] == "forward")
    lst.remove(recv)
    at = lst.index(["F", 1, 0]) + 1
    lst.insert(at, recv)
    return f"plan.json: pipeline.actions[1].list[{at}]: recv({recv[3]},fwd,0) must come before F1.0"


def m_actions_send_of_another_stage(d):
    lst = d["pipeline"]["actions"][0]["list"]
    i = next(k for k, a in enumerate(lst) if a[0] == "SEND")
    lst[i] = ["SEND", 1, lst[i][2], lst[i][3], lst[i][4]]
    return f"plan.json: pipeline.actions[0].list[{i}]: send({lst[i][3]},fwd,{lst[i][2]}): stage 1 is not one of the class's stages [0]"


def m_backward_sender(d):
    t = d["transfers"][0]["backward"]["tasks"][0]
    t["sender"] = 9
    return f"plan.json: transfers[0].backward.tasks[0].sender: 9 is not one of the holders {t['holders']}"


def m_backward_region_missing(d):
    del d["transfers"][1]["backward"]["regions"]["src"]["7"]
    tasks = d["transfers"][1]["backward"]["tasks"]
    return (f"plan.json: transfers[1].backward.tasks[0]: sender 7 does not hold slice {tasks[0]['slice']} "
            "(holds None)")


def m_rows_missing(d):
    del d["stages"][1]["rows"]["4"]
    return "plan.json: stages[1].rows: must give a row range for every device of the stage"


def m_data_groups_not_a_partition(d):
    d["stages"][1]["data_groups"] = [[3, 5]]
    return "plan.json: stages[1].data_groups: must partition the stage's devices"


def m_loss_device(d):
    d["train"]["loss_devices"] = [0]
    return "plan.json: train.loss_devices: 0 is not a device of the last stage"


def m_train_without_pipeline(d):
    del d["pipeline"]
    return "plan.json: pipeline: missing (a plan with train settings has a pipeline)"


def m_region_outside_shape(d):
    t = d["transfers"][0]
    t["shape"] = [t["shape"][0] - 1] + t["shape"][1:]
    for side in ("src", "dst"):   # the reader checks src, then dst, devices in order
        for dev in sorted(t["regions"][side], key=int):
            reg = t["regions"][side][dev]
            if any(b > n for (_, b), n in zip(reg, t["shape"])):
                return (f"plan.json: transfers[0].regions.{side}.{dev}: region {reg} is outside the "
                        f"tensor's shape {t['shape']}")
    raise AssertionError("no region reaches the last row")


def m_bad_schedule(d):
    d["train"]["schedule"] = "zero_bubble"
    return ("plan.json: train.schedule: 'zero_bubble' is not one of ['gpipe', '1f1b', 'eager_1f1b', 'interleaved_1f1b', "
            "'zb_h1', 'zbv']")


COMM_CORRUPTIONS = [c_missing, c_missing_slice, c_wrong_type_list, c_wrong_type_bool, c_wrong_type_float,
                    c_format, c_sender_not_holder, c_slice_outside_receiver,
                    c_sender_does_not_hold, c_receiver_region_missing, c_region_missing_for_stage_device,
                    c_region_wrong_rank, c_step_group_not_listed, c_step_regions_not_one_per_group, c_task_group_not_listed, c_stages_out_of_order,
                    c_device_in_two_stages, c_device_outside_cluster, c_bad_dtype, c_hosts_not_a_partition,
                    c_unsorted_group, c_bad_strategy]
MODEL_CORRUPTIONS = [m_actions_missing_micro_batch, m_actions_backward_first, m_actions_micro_batch_beyond,
                     m_actions_count, m_actions_unknown_kind, m_actions_receive_after_its_forward,
                     m_actions_send_of_another_stage, m_backward_sender, m_backward_region_missing, m_rows_missing,
                     m_data_groups_not_a_partition, m_loss_device, m_train_without_pipeline, m_bad_schedule,
                     m_region_outside_shape]


@pytest.fixture(scope="module")
def bases():
    return {"comm": comm_json(), "model": model_json()}


@pytest.mark.parametrize("corrupt", [("comm", c) for c in COMM_CORRUPTIONS] + [("model", m) for m in MODEL_CORRUPTIONS],
                         ids=lambda c: c[1].__name__)
def test_validation_names_the_key(bases, corrupt):
    kind, mutate = corrupt
    d = copy.deepcopy(bases[kind])
    Plan.from_json(copy.deepcopy(d))        # the base is valid
    want = mutate(d)
    with pytest.raises(PlanFileError) as e:
        Plan.from_json(d)
    assert str(e.value) == want


def test_validation_of_the_top_level():
    with pytest.raises(PlanFileError, match=re.escape("plan.json: (top): expected an object, got a list")):
        Plan.from_json([])
    d = comm_json()
    del d["transfers"]
    with pytest.raises(PlanFileError, match=re.escape("plan.json: transfers: missing")):
        Plan.from_json(d)


# ----------------------------------------------------------------- load, digest
def test_load_and_digest(tmp_path):
    d = model_json()
    raw = json.dumps(d, indent=1).encode()          # not the writer's layout: the digest is of the bytes
    f = tmp_path / "plan.json"
    f.write_bytes(raw)
    plan = planfile.load(f)
    assert plan == Plan.from_json(d) and plan.raw == raw
    assert planfile.digest(plan) == hashlib.sha256(raw).hexdigest()
    assert planfile.digest(Plan.from_json(d)) == hashlib.sha256(planfile.dumps(plan).encode()).hexdigest()
    assert planfile.digest(plan) != planfile.digest(Plan.from_json(d))
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(PlanFileError, match=re.escape("plan.json: format: expected 'planc/1', got 'other'")):
        planfile.load(tmp_path / "bad.json")
    (tmp_path / "trunc.json").write_bytes(raw[:-10])
    with pytest.raises(PlanFileError, match="not valid JSON"):
        planfile.load(tmp_path / "trunc.json")


# ----------------------------------------------------------------- tags
def test_tag_layout_fields_never_wrap():
    """2000 micro-batches: every (transfer, direction, micro-batch, task) of a small plan gets its own tag."""
    plan = Plan.from_json(model_json(micro_batches=2000, schedule="gpipe"))
    assert plan.pipeline.micro_batches == 2000
    tags = plan.tag_layout()
    assert tags.micro_batch_bits == 11 and tags.total <= TagLayout.MAX_BITS
    seen = {}
    for i, t in enumerate(plan.transfers):
        for direction in Direction:
            for mb in range(2000):
                for k in range(len(t.route(direction).tasks)):
                    tag = tags.tag(i, direction, mb, k)
                    assert 0 <= tag < 2 ** 31
                    assert seen.setdefault(tag, (i, direction, mb, k)) == (i, direction, mb, k), tag
    most = max(len(r.tasks) for t in plan.transfers for r in (t.forward, t.backward))
    assert len(seen) == sum(len(r.tasks) for t in plan.transfers for r in (t.forward, t.backward)) * 2000
    # an index beyond its field is refused, never folded onto another's tag
    for args, what in (((0, Direction.FORWARD, 1 << tags.micro_batch_bits, 0), "micro-batch"),
                       ((0, Direction.BACKWARD, 0, 1 << tags.task_bits), "task"),
                       ((1 << tags.transfer_bits, Direction.FORWARD, 0, 0), "transfer"),
                       ((0, Direction.FORWARD, -1, 0), "micro-batch")):
        with pytest.raises(PlanFileError, match=f"{what} index -?\\d+ does not fit the plan's \\d+-bit tag field"):
            tags.tag(*args)
    assert (1 << tags.task_bits) >= most


def test_tag_layout_widths_are_minimal_and_sufficient():
    for n in (1, 2, 3, 4, 5, 8, 9, 1000, 2000, 2048, 2049):
        t = TagLayout.for_sizes(n, n, n)
        for bits in (t.transfer_bits, t.micro_batch_bits, t.task_bits):
            assert (1 << bits) >= n and (bits == 1 or (1 << (bits - 1)) < n), (n, bits)
        assert t.total == 3 * t.task_bits + 1
        # distinct along each field at its top value
        assert len({t.tag(n - 1, Direction.FORWARD, 0, 0), t.tag(0, Direction.FORWARD, n - 1, 0),
                    t.tag(0, Direction.FORWARD, 0, n - 1), t.tag(0, Direction.BACKWARD, 0, 0)}) == (4 if n > 1 else 2)
    # a comm-only plan: one micro-batch
    plan = Plan.from_json(comm_json())
    tags = plan.tag_layout()
    most = max(len(t.forward.tasks) for t in plan.transfers)
    assert tags == TagLayout.for_sizes(len(plan.transfers), 1, most)


# ----------------------------------------------------------------- pipeline
@pytest.mark.parametrize("ops, bound", [
    (("F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"), 4),        # gpipe
    (("F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"), 1),        # last stage of 1f1b
    (("F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"), 2),        # stage 0 of 2, 1f1b
    (("F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"), 3),        # stage 0 of 3, 1f1b
    (("F0", "F1", "B1", "F2", "B0", "F3", "B2", "B3"), 2),        # backward out of order
    (("F0", "F1", "F2", "B2", "B1", "F3", "B0", "B3"), 3),
])
def test_in_flight_bound_on_known_lists(ops, bound):
    def cls(s, ops):
        return RankClass((s,), tuple(Action(op[0], s, int(op[1:])) for op in ops) + (Action("REDUCE", s),))
    p = Pipeline(Schedule.GPIPE, 4, (cls(0, ops), cls(1, ("F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"))))
    assert p.in_flight_bound(0) == bound and p.in_flight_bound(1) == 1


def test_in_flight_bound_of_compiled_schedules():
    gp = Plan.from_json(model_json(4, "gpipe")).pipeline
    assert [gp.in_flight_bound(s) for s in range(3)] == [4, 4, 4]
    ob = Plan.from_json(model_json(4, "1f1b")).pipeline
    assert [ob.in_flight_bound(s) for s in range(3)] == [3, 2, 1]      # min(micro-batches, stages - s)


# ----------------------------------------------------------------- regions
def test_regions():
    assert R.intersect(((0, 4), (2, 6)), ((2, 8), (0, 3))) == ((2, 4), (2, 3))
    assert R.intersect(((0, 2), (0, 2)), ((2, 4), (0, 2))) is None
    assert R.numel(((2, 4), (0, 3), (1, 2))) == 6 and R.numel(()) == 1
    assert R.to_local(((3, 4), (1, 3)), ((2, 4), (0, 3))) == (slice(1, 2), slice(1, 3))
    with pytest.raises(ValueError, match="is not inside region"):
        R.to_local(((1, 3),), ((2, 4),))
    assert not hasattr(R, "region") and not hasattr(R, "parse_spec")   # no spec parser in the runtime


# ----------------------------------------------------------------- dist_util checks
def test_host_and_digest_checks():
    plan = Plan.from_json(comm_json())
    ok = [("a", 4)] * 4 + [("b", 4)] * 4
    assert dist_util.check_hosts(plan, ok) == []
    assert dist_util.check_hosts(plan, [("a", None)] * 4 + [("b", None)] * 4) == []
    assert dist_util.check_hosts(plan, [("one", 8)] * 8) == []          # emulated cluster
    msgs = dist_util.check_hosts(plan, [("a", 3)] * 3 + [("b", 5)] * 5)
    assert "host 'a' runs ranks [0, 1, 2], but the plan's hosts are [[0, 1, 2, 3], [4, 5, 6, 7]]" in msgs
    assert "host 'b' runs ranks [3, 4, 5, 6, 7], but the plan's hosts are [[0, 1, 2, 3], [4, 5, 6, 7]]" in msgs
    msgs = dist_util.check_hosts(plan, [("a", 4)] * 4 + [("b", 2)] * 4)
    assert msgs == ["rank 4 on 'b': LOCAL_WORLD_SIZE=2 but the plan puts 4 devices on its host"]
    m = dist_util.check_digests(["x" * 64, "x" * 64, "y" * 64])
    assert len(m) == 1 and "ranks [2]" in m[0] and "ranks [0, 1]" in m[0]
    assert dist_util.check_digests(["x" * 64] * 3) == []
    dist_util.check_world(plan, 8)
    with pytest.raises(dist_util.StartupError, match=re.escape(
            "world size 4 does not match the plan 'planfile_comm': cluster.devices = 8 (2 hosts of [4, 4] "
            "devices); launch 8 processes")):
        dist_util.check_world(plan, 4)


def test_the_timeout_is_the_plans(monkeypatch):
    """plan.json train.timeout, else 300 s; the environment variable that once overrode it is gone."""
    from types import SimpleNamespace
    timed = SimpleNamespace(train=SimpleNamespace(timeout=12.5))
    monkeypatch.setenv("PLANC_COLLECTIVE_TIMEOUT_S", "1")     # read by nothing any more
    assert dist_util.collective_timeout(timed).total_seconds() == 12.5
    assert dist_util.collective_timeout(SimpleNamespace(train=SimpleNamespace(timeout=None))).total_seconds() == 300
    assert dist_util.collective_timeout(SimpleNamespace(train=None, runtime=SimpleNamespace(timeout=None))
                                        ).total_seconds() == 300
    assert dist_util.collective_timeout().total_seconds() == dist_util.DEFAULT_TIMEOUT_S == 300
    assert not hasattr(dist_util, "TIMEOUT_ENV")


def test_a_plan_without_a_model_keeps_its_timeout_in_runtime(tmp_path):
    """A communication-only plan has no train record: its ``train { timeout }`` goes to plan.json
    ``runtime.timeout``, which its ranks use; a plan with a model keeps it in ``train.timeout`` only. The
    testbed's copy for another timeout (benchmarks.variant.with_timeout) changes exactly that field."""
    from benchmarks.variant import with_timeout
    from planc import plan as planfile
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    src = tmp_path / "comm.plan"
    src.write_text("plan comm {\n  cluster {\n    level gpu x 2 : bandwidth 10 GB/s, latency 5 us\n  }\n  stage 0 on devices 0..2 as (data = 2)\n"
                   "  reduce grads over data using allreduce : f32[8]\n  train { timeout = 7 s }\n}\n")
    c = compile_file(src, probe=False)
    assert c.plan_json["runtime"]["timeout"] == 7 and "train" not in c.plan_json
    plan = planfile.Plan.from_json(c.plan_json)
    assert dist_util.collective_timeout(plan).total_seconds() == 7
    out = write_output(c.plan_json, c.program, tmp_path / "out")
    assert with_timeout(out, 7) == out                     # it holds that one already: no copy
    copy = with_timeout(out, 45)
    assert copy.name == "out-timeout45"
    moved = planfile.load(copy / "plan.json")
    assert moved.runtime.timeout == 45 and dist_util.collective_timeout(moved).total_seconds() == 45
    assert dataclasses.replace(moved, runtime=plan.runtime) == plan    # nothing else differs


# ----------------------------------------------------------------- topology
def test_stage_topology_pipe_data_tensor():
    """gpt-2x4 (pipe 2 x data 2 x tensor 2, placed by the compiler): (pipe, data, model) = the
    placement's (pipe, data, tensor) coordinates of every device."""
    from planc.runtime.topology import StageTopology
    from e2e_util import spelled
    d = compile_file(spelled("gpt-2x4.plan"), probe=False).plan_json
    names = [a["name"] for a in d["placement"]["axes"]]
    assert names == ["pipe", "data", "tensor"]
    coords = d["placement"]["coords"]
    t = StageTopology(Plan.from_json(d))
    for dev, (p, da, te) in enumerate(coords):
        assert t.get_coord(dev) == t.ProcessCoord(p, da, te)
        assert t.get_rank(pipe=p, data=da, model=te) == dev
    for axis, k in (("pipe", 0), ("data", 1), ("model", 2)):
        want = {}
        for dev, c in enumerate(coords):
            want.setdefault(tuple(v for i, v in enumerate(c) if i != k), []).append(dev)
        assert sorted(t.get_axis_comm_lists(axis)) == sorted(want.values())
    assert t.get_axis_comm_lists("tensor") == []


def test_stage_topology_unequal_stages():
    """Stages of 2, 4 and 1 devices and an idle device: coordinates no device has are absent."""
    from planc.runtime.topology import StageTopology
    t = StageTopology(Plan.from_json(model_json()))
    # stage 0 (data = 2) on 0, 1; stage 1 (data = 2, m1 = 2) on [[3, 4], [5, 6]]; stage 2 on 7
    want = {0: (0, 0, 0), 1: (0, 1, 0), 3: (1, 0, 0), 4: (1, 0, 1), 5: (1, 1, 0), 6: (1, 1, 1), 7: (2, 0, 0)}
    assert {r: tuple(c) for c, r in t.mapping.items()} == want
    assert t.get_rank(pipe=1, data=1, model=1) == 6
    assert sorted(t.get_axis_comm_lists("data")) == [[0, 1], [3, 5], [4, 6], [7]]
    assert sorted(t.get_axis_comm_lists("pipe")) == [[0, 3, 7], [1, 5], [4], [6]]


# ----------------------------------------------------------------- one gloo job
STARTUP_TEXT = """
plan startup {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 20 us
    level gpu  x N : bandwidth 10 GB/s, latency 2 us
  }
  stage 0 on devices 0..1 as (1)
  stage 1 on devices 1..N as (M)
  transfer t : f32[2, 6] from stage 0 as R R to stage 1 as R S0
  resharding { strategy = broadcast, chunks = 2 }
}
"""


def startup_worker(rank, world, payload):
    from planc.runtime import dist_util as D
    from planc.plan import Plan as P
    from planc.runtime.topology import create_groups
    out = []
    for doc, digests, make_groups in payload:
        plan = P.from_json(doc)
        if make_groups:
            groups = create_groups(plan)
            # every group the plan lists, under its members; a communicator only on its members
            assert {k for k in groups if all(isinstance(x, int) for x in k)} == {tuple(g) for g in plan.groups}
            for key, pg in groups.items():
                members = tuple(x for x in key if isinstance(x, int))
                assert (pg is None) == (rank not in members), (key, pg)
            with pytest.raises(D.GroupMissing, match=r"\[0, 1, 2\]"):
                D.lookup_group(groups, (2, 1, 0))
        try:
            D.startup_checks(plan, digest=digests[rank] if digests else None)
            out.append("ok")
        except D.StartupError as e:
            out.append("StartupError: " + str(e).replace("\n", " "))
    return out


def test_startup_checks_gloo():
    three = compiled(STARTUP_TEXT.replace("N", "3").replace("M", "2"))
    four = compiled(STARTUP_TEXT.replace("N", "4").replace("M", "3"))
    assert [0, 1, 2] not in three["groups"] and three["groups"]
    payload = [(three, ["a" * 64] * 3, True), (three, ["a" * 64, "b" * 64, "a" * 64], False),
               (three, None, False), (four, None, False)]
    out = H.run_ranks(startup_worker, 3, payload)
    for rank, text in out.items():
        ok, disagree, own_digest, world = ast.literal_eval(text)   # repr of the worker's list
        assert ok == "ok" and own_digest == "ok", (rank, text)
        assert disagree.startswith(f"StartupError: rank {rank}: plan 'startup' cannot run here:")
        assert "ranks disagree on the plan" in disagree and "ranks [1] have sha256 bbbbbbbbbbbbbbbb" in disagree
        assert world.startswith(f"StartupError: rank {rank}: ") and "world size 3 does not match" in world
