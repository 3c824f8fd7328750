"""Resharding executor: N-process gloo runs against the single-process truth.

Every plan here is compiled from plan text by the real compiler (comm-only
plans on a 2 host x 4 cluster for the forward route of many spec pairs and
meshes; one small model plan on examples/mlp.py for the backward route), and
read back through ``planfile.Plan``. What each rank must end up with is
computed in this file from the stage declaration and the spec alone (the
language's semantics: row-major explicit meshes, ``S0``/``S1``/``S01``/``R``),
never read from the plan: a wrong region in plan.json fails here just as a
wrong byte on the wire does. Every destination rank must end with exactly its
region of a known pattern tensor, bit for bit, for all four strategies.
"""
from __future__ import annotations

import copy
import functools
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc.driver.compile import compile_program  # noqa: E402
from planc.lang import load_text  # noqa: E402
from planc import plan as planfile  # noqa: E402
from planc.plan import Direction, PlanFileError, Strategy  # noqa: E402
from planc.runtime.regions import intersect, numel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTS = ((0, 1, 2, 3), (4, 5, 6, 7))
STRATEGIES = [str(s) for s in Strategy]
CHUNKS = 3

# (name, shape, dtype, (first device, mesh dims) of stage 0, spec, (first device, mesh dims) of stage 1, spec)
CASES = [
    ("S0->S0", (4, 4, 2), "f32", (0, (2, 2)), "S0 R R", (4, (2, 2)), "S0 R R"),
    ("R->S0", (4, 2, 2), "i32", (0, (2, 2)), "R R R", (4, (2, 2)), "S0 R R"),
    ("RS0->S0", (4, 4, 2), "f32", (0, (2, 2)), "R S0 R", (4, (2, 2)), "S0 R R"),
    ("S1->S0", (4, 2, 3), "f64", (0, (2, 2)), "S1 R R", (4, (2, 2)), "S0 R R"),
    ("S01->R", (8, 3), "bf16", (0, (2, 2)), "S01 R", (4, (2, 2)), "R R"),
    ("1-to-(2,2)", (4, 6), "f32", (0, (1, 1)), "R R", (4, (2, 2)), "S0 S1"),
    ("(2,2)-to-1", (4, 6), "i64", (0, (2, 2)), "S1 S0", (7, (1, 1)), "R R"),
    ("(1,4)->(2,1)", (6, 4), "i64", (0, (1, 4)), "R S1", (4, (2, 1)), "S0 R"),
    ("(4,)->(1,3) odd", (4, 6), "f32", (0, (4,)), "S0 R", (5, (1, 3)), "R S1"),
    ("cross-host src", (4, 6), "f32", (3, (1, 2)), "S1 R", (0, (1, 3)), "R S1"),
    ("cross-host dst", (4, 5), "f32", (0, (2,)), "S0 R", (2, (2, 2)), "R R"),
    ("S01 R->R S01", (4, 4), "f32", (0, (2, 2)), "S01 R", (4, (2, 2)), "R S01"),
]
IDS = [c[0] for c in CASES]


# ----------------------------------------------------------------- the truth, from the spec alone
def mesh_position(first: int, dims, device: int):
    """Position of ``device`` on the explicit mesh ``on devices first.. as (dims)`` (row-major)."""
    flat = device - first
    if not 0 <= flat < math.prod(dims):
        return None
    pos = []
    for n in reversed(dims):
        pos.append(flat % n)
        flat //= n
    return tuple(reversed(pos))


def spec_region(shape, dims, pos, spec: str):
    """The box a device at ``pos`` of a mesh of ``dims`` holds under ``spec`` (LANGUAGE.md semantics)."""
    entries = spec.split()
    assert len(entries) == len(shape), (spec, shape)
    out = []
    for n, e in zip(shape, entries):
        if e == "R":
            out.append((0, n))
            continue
        assert e[0] == "S" and e[1:].isdigit(), e
        parts, idx = 1, 0
        for a in map(int, e[1:]):          # S01: mesh dim 0 major
            parts *= dims[a]
            idx = idx * dims[a] + pos[a]
        assert n % parts == 0, (n, parts)
        step = n // parts
        out.append((idx * step, (idx + 1) * step))
    return tuple(out)


def expected_regions(shape, first, dims, spec) -> dict[int, tuple]:
    return {d: spec_region(shape, dims, mesh_position(first, dims, d), spec)
            for d in range(first, first + math.prod(dims))}


def case_truth(case):
    """{device: region} on the sending and on the receiving mesh."""
    _, shape, _, (s0, sd), sspec, (d0, dd), dspec = case
    return expected_regions(shape, s0, sd, sspec), expected_regions(shape, d0, dd, dspec)


# ----------------------------------------------------------------- plans from the real compiler
CLUSTER = """  cluster {
    level node x 2 : bandwidth 1.25 GB/s, latency 20 us
    level gpu  x 4 : bandwidth 15 GB/s, latency 2 us
  }"""


def _stage_line(index, first, dims):
    return f"  stage {index} on devices {first}..{first + math.prod(dims)} as ({', '.join(map(str, dims))})"


def case_text(case, strategy: str) -> str:
    name, shape, dtype, (s0, sd), sspec, (d0, dd), dspec = case
    return "\n".join([
        "plan reshard_case {", CLUSTER, _stage_line(0, s0, sd), _stage_line(1, d0, dd),
        f"  transfer t : {dtype}[{', '.join(map(str, shape))}] from stage 0 as {sspec} to stage 1 as {dspec}",
        f"  resharding {{ strategy = {strategy}, chunks = {CHUNKS} }}", "}", ""])


@functools.lru_cache(maxsize=None)
def _case_json(i: int, strategy: str) -> dict:
    return compile_program(load_text(case_text(CASES[i], strategy), f"{CASES[i][0]}.plan"), probe=None).plan_json


def case_plan(i: int, strategy: str) -> dict:
    return copy.deepcopy(_case_json(i, strategy))


# The model plan: examples/mlp.py on three explicit stages; transfers a (0 -> 1) and b (1 -> 2),
# both with their backward routes (gradients, the other way). Stage 1 crosses the host boundary.
MODEL_TEXT = """
plan mlp_routes {
CLUSTER
  model "ROOT/examples/mlp.py:build" { layers = 4, hidden = 6, inputs = 8, outputs = 4 }
  loss  "ROOT/examples/mlp.py:loss"
  data  "ROOT/examples/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..3 on devices 3..7 as (data = 2, m1 = 2)
  stage 2 : layers 3..4 on devices 7..8 as (data = 1)
  transfer a : f32[8, 6] from stage 0 as S0 R to stage 1 as S0 R
  transfer b : f32[8, 6] from stage 1 as S0 R to stage 2 as R R
  reduce gradients over data
  resharding { strategy = STRATEGY, chunks = 3 }
  train { micro_batch = 8, micro_batches = 4, steps = 1, schedule = 1f1b, optimizer = sgd(lr = 0.1),
          precision = fp32, seed = 1 }
}
""".replace("CLUSTER", CLUSTER).replace("ROOT", ROOT)
MODEL_STAGES = {0: (0, (2,)), 1: (3, (2, 2)), 2: (7, (1,))}
# (name, shape, src stage, src spec, dst stage, dst spec) as written above
MODEL_TRANSFERS = [("a", (8, 6), 0, "S0 R", 1, "S0 R"), ("b", (8, 6), 1, "S0 R", 2, "R R")]


@functools.lru_cache(maxsize=None)
def _model_probe():
    from planc.model.probe import probe_model
    return probe_model(load_text(MODEL_TEXT.replace("STRATEGY", "send_recv"), "mlp_routes.plan"))


@functools.lru_cache(maxsize=None)
def _model_json(strategy: str) -> dict:
    """Compiled with the model probe (the real sizes of examples/mlp.py's layers)."""
    c = compile_program(load_text(MODEL_TEXT.replace("STRATEGY", strategy), "mlp_routes.plan"), _model_probe())
    assert not c.untrainable, c.untrainable
    return c.plan_json


def model_truth(k: int, direction: Direction):
    """{device: region} on the sending and receiving side of transfer k in one direction."""
    _, shape, s, sspec, d, dspec = MODEL_TRANSFERS[k]
    fwd_src = expected_regions(shape, *MODEL_STAGES[s], sspec)
    fwd_dst = expected_regions(shape, *MODEL_STAGES[d], dspec)
    return (fwd_src, fwd_dst) if direction is Direction.FORWARD else (fwd_dst, fwd_src)


def fake_groups(plan: planfile.Plan) -> dict:
    """Every group the plan lists, as ``create_groups`` keys them, with no communicator behind it."""
    out = {tuple(g): None for g in plan.groups}
    out.update({("backward", *g): None for g in plan.backward_groups})
    return out


# ----------------------------------------------------------------- pure tests
def _check_route(route: planfile.Route, src_truth: dict, dst_truth: dict, what: str):
    """The route's regions are the spec's, its tasks cover every receiver exactly and senders hold."""
    assert dict(route.src_regions) == src_truth, what
    assert dict(route.dst_regions) == dst_truth, what
    for d, box in dst_truth.items():
        mine = [t.slice for t in route.tasks if d in t.receivers]
        assert sum(numel(s) for s in mine) == numel(box), (what, d)
        for i, a in enumerate(mine):
            assert intersect(a, box) == a, (what, d, a)
            assert all(intersect(a, b) is None for b in mine[i + 1:]), (what, d, a)
    host = {d: h for h, ds in enumerate(HOSTS) for d in ds}
    for t in route.tasks:
        assert t.sender in t.holders and intersect(t.slice, src_truth[t.sender]) == t.slice, (what, t)
        if route.strategy is Strategy.GLOBAL_ALLGATHER:
            assert t.parts == (tuple(sorted(t.receivers)),), (what, t)
        elif route.strategy is Strategy.LOCAL_ALLGATHER:
            assert sorted(d for p in t.parts for d in p) == sorted(t.receivers), (what, t)
            assert all(len({host[d] for d in p}) == 1 for p in t.parts), (what, t)
            assert len({host[p[0]] for p in t.parts}) == len(t.parts), (what, t)
        else:
            assert t.parts == (), (what, t)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_compiled_plans_cover_every_region(i, strategy):
    """The plans fed to the executor are valid: regions as the spec says, receivers covered exactly."""
    plan = planfile.Plan.from_json(case_plan(i, strategy))
    (t,) = plan.transfers
    assert t.forward.strategy is Strategy(strategy) and t.forward.chunks == CHUNKS and t.backward is None
    _check_route(t.forward, *case_truth(CASES[i]), f"{CASES[i][0]}/{strategy}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_plan_routes_cover_every_region(strategy):
    plan = planfile.Plan.from_json(_model_json(strategy))
    assert [t.name for t in plan.transfers] == [t[0] for t in MODEL_TRANSFERS]
    for k, t in enumerate(plan.transfers):
        for direction in Direction:
            route = t.route(direction)
            assert route.strategy is Strategy(strategy)
            _check_route(route, *model_truth(k, direction), f"{t.name}/{direction}/{strategy}")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_executor_regions_are_the_specs(strategy):
    """Every rank's executor sends and receives exactly the region the spec gives it (no process group)."""
    from planc.runtime.reshard import TransferExecutor
    for i, case in enumerate(CASES):
        plan = planfile.Plan.from_json(case_plan(i, strategy))
        src, dst = case_truth(case)
        (t,) = plan.transfers
        for rank in range(plan.cluster.devices):
            ex = TransferExecutor(t, Direction.FORWARD, rank, fake_groups(plan), plan.tag_layout(), 0,
                                  backend="gloo")
            assert (ex.my_src, ex.my_dst) == (src.get(rank), dst.get(rank)), (case[0], rank)
            assert ex.is_sender == any(task.sender == rank for task in t.forward.tasks)
            assert ex.is_sender <= (rank in src) and ex.is_receiver == (rank in dst)
            # the executor issues tasks in the plan's schedule order on every rank
            assert [x.index for x in ex.tasks] == [k for k, _ in t.forward.ordered_tasks()]


def test_executor_refuses_what_the_plan_does_not_say():
    import torch

    from planc.runtime.dist_util import GroupMissing
    from planc.runtime.reshard import TransferExecutor
    i = IDS.index("R->S0")
    plan = planfile.Plan.from_json(case_plan(i, "global_allgather"))
    (t,) = plan.transfers
    src, dst = case_truth(CASES[i])
    tags = plan.tag_layout()
    # an allgather part of more than one receiver needs its group: a missing one is named before any traffic
    rank = next(r for task in t.forward.tasks for p in task.parts if len(p) > 1 for r in p)
    with pytest.raises(GroupMissing, match=r"is not in plan.json \"groups\""):
        TransferExecutor(t, Direction.FORWARD, rank, {}, tags, 0, backend="gloo")
    groups = fake_groups(plan)
    sender = next(task.sender for task in t.forward.tasks)
    ex = TransferExecutor(t, Direction.FORWARD, sender, groups, tags, 0, backend="gloo")
    wrong = tuple(b - a + 1 for a, b in src[sender])
    with pytest.raises(ValueError, match=r"sends a shard of shape"):
        ex.send(torch.zeros(wrong, dtype=torch.int32))
    with pytest.raises(PlanFileError, match="receives nothing"):
        ex.recv()
    receiver = min(dst)
    ex = TransferExecutor(t, Direction.FORWARD, receiver, groups, tags, 0, backend="gloo")
    with pytest.raises(PlanFileError, match="holds nothing"):
        ex.send(torch.zeros(1))
    # a comm-only plan has no backward route
    with pytest.raises(PlanFileError, match="has no backward route"):
        TransferExecutor(t, Direction.BACKWARD, receiver, groups, tags, 0, backend="gloo")


# ----------------------------------------------------------------- worker (runs in each rank)
def pattern(shape, dtype: str, salt: int):
    """A tensor whose every element differs (exactly representable in every dtype used here)."""
    import torch

    from planc.runtime.reshard import DTYPES
    n = math.prod(shape)
    x = torch.arange(n, dtype=torch.int64).reshape(shape) * (1 if salt == 0 else -3) + salt
    return x.to(DTYPES[dtype])


def _box(t, region):
    return t[tuple(slice(a, b) for a, b in region)]


def _create_groups_reusing(plan, pool: dict) -> dict:
    """``create_groups(plan)`` with communicators reused from this rank's earlier jobs: the n-th
    ``dist.new_group`` of a member set within this call gets ``pool``'s n-th communicator of that
    set, made when a call first needs it. Within a job every key create_groups makes still has its
    own communicator (as in a real run); across jobs one of the same members is reused instead of
    made again (a new gloo group costs a store rendezvous of all 8 ranks: most of the test's time,
    ~10 per job). Every rank makes the same calls in the same order, so all agree on which are made."""
    import collections

    import torch.distributed as dist

    from planc.runtime.topology import create_groups
    real, made = dist.new_group, collections.Counter()

    def new_group(ranks=None, **kwargs):
        key = tuple(ranks)
        have, n = pool.setdefault(key, []), made[key]
        made[key] += 1
        if n == len(have):
            have.append(real(ranks=ranks, **kwargs))
        return have[n]

    dist.new_group = new_group
    try:
        return create_groups(plan)
    finally:
        dist.new_group = real


def reshard_worker(rank, world, payload):
    """For every job: build the plan's groups, send this rank's shard of every micro-batch, receive
    in reverse micro-batch order (tags keep them apart), compare bit for bit with the truth."""
    import torch

    from planc import plan as PF
    from planc.runtime.reshard import TransferExecutor
    checked, pool = 0, {}
    for job in payload:
        plan = PF.Plan.from_json(job["plan"])
        groups = _create_groups_reusing(plan, pool)
        if plan.pipeline is not None:          # a model plan: the plan's own tags
            assert plan.pipeline.micro_batches == job["micro_batches"]
            tags = plan.tag_layout()
        else:                                  # comm-only: one micro-batch in the plan; room for more here
            tags = PF.TagLayout.for_sizes(len(plan.transfers), job["micro_batches"],
                                          max(len(t.forward.tasks) for t in plan.transfers))
        for k, direction, src, dst, salt in job["moves"]:
            direction = PF.Direction(direction)
            t = plan.transfers[k]
            what = f"{job['name']} {t.name} {direction}: rank {rank}"
            ex = TransferExecutor(t, direction, rank, groups, tags, index=k, signal=bool(job.get("signal")))
            want_src, want_dst = src.get(rank), dst.get(rank)
            assert ex.my_src == want_src, f"{what}: sends region {ex.my_src}, the spec says {want_src}"
            assert ex.my_dst == want_dst, f"{what}: receives region {ex.my_dst}, the spec says {want_dst}"
            ref = pattern(t.shape, t.dtype, salt)
            mbs = list(range(job["micro_batches"]))
            works, keep = [], []
            if want_src is not None:
                for mb in mbs:
                    shard = _box(ref, want_src).clone() + mb
                    keep.append(shard)
                    works += ex.send(shard, micro_batch=mb)
            if want_dst is not None:
                if job.get("posted"):     # every micro-batch's receives posted before any is finished
                    handles = {mb: ex.post(micro_batch=mb) for mb in mbs}
                    received = ((mb, ex.finish(handles.pop(mb))) for mb in mbs)
                else:
                    received = ((mb, ex.recv(micro_batch=mb)) for mb in reversed(mbs))
                for mb, got in received:
                    want = (_box(ref, want_dst) + mb).contiguous()
                    if job.get("signal"):   # one element per task on the wire, zeros of the planned shape
                        want = torch.zeros_like(want)
                    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape)
                    if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                        bad = (got != want).nonzero()[:4].tolist()
                        raise AssertionError(f"{what} mb{mb}: region {want_dst} differs from the truth at {bad}")
                    checked += 1
            for w in works:
                w.wait()
            del keep
    return checked


def _expected_checks(payload) -> dict[int, int]:
    out = dict.fromkeys(range(8), 0)
    for job in payload:
        for _, _, _, dst, _ in job["moves"]:
            for r in dst:
                out[r] += job["micro_batches"]
    return out


def _run(payload):
    out = H.run_ranks(reshard_worker, 8, payload)
    assert {r: int(v) for r, v in out.items()} == _expected_checks(payload)


# ----------------------------------------------------------------- multi-process
def test_reshard_gloo_forward_bit_exact():
    """Every comm-only case under every strategy, in one spawn of 8 ranks; two micro-batches received
    out of order."""
    payload = []
    for strategy in STRATEGIES:
        for i, case in enumerate(CASES):
            src, dst = case_truth(case)
            payload.append({"name": f"{case[0]}/{strategy}", "plan": case_plan(i, strategy), "micro_batches": 2,
                            "moves": [(0, "forward", src, dst, 0)]})
    _run(payload)


def test_reshard_gloo_model_plan_both_directions():
    """The model plan: forward activations and backward gradients of both transfers, every strategy,
    the plan's four micro-batches received in reverse order; then every micro-batch's receives
    posted before the first is finished (what the receive thread does); then, with
    signal transfers (plan.json runtime.signal_transfers), one element per task and zeros of the planned regions delivered.
    One spawn of 8 ranks for all of it."""
    payload = []
    for strategy, mode in [(s, None) for s in STRATEGIES] + [(s, "posted") for s in STRATEGIES] + [
            ("send_recv", "signal"), ("broadcast", "signal")]:
        plan = _model_json(strategy)
        moves = []
        for k in range(len(MODEL_TRANSFERS)):
            for direction, salt in ((Direction.FORWARD, 0), (Direction.BACKWARD, 1000 + k)):
                src, dst = model_truth(k, direction)
                moves.append((k, str(direction), src, dst, salt))
        job = {"name": f"mlp/{strategy}/{mode}", "plan": plan, "micro_batches": plan["pipeline"]["micro_batches"],
               "moves": moves}
        if mode:
            job[mode] = True
        payload.append(job)
    _run(payload)
