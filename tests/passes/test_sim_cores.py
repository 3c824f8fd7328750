"""Compute on a shared pool of cores (``cluster { cores = N per ... }``): the event simulation's
processor sharing against an independent closed-form reference, and the iteration simulator's
pipelines on one core (the core never idles, so an iteration is its total work) and on enough cores
(nothing changes)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planc import ir
from planc.cost import events
from planc.pipeline.schedules import build
from planc.pipeline.simulate import SimInput, SimTask, SimTransfer, StageCompute, predict

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")


def shared_finish(durations, cores):
    """Independent reference: jobs all ready at 0 on ``cores`` shared equally, each at most one core.
    Shortest work left finishes first; between two finishes every job left runs at min(1, cores/n)."""
    left = sorted((d, i) for i, d in enumerate(durations))
    out = [0.0] * len(durations)
    now, done = 0.0, 0.0          # done: work every job still running has received
    for k, (d, i) in enumerate(left):
        n = len(left) - k
        now += (d - done) / min(1.0, cores / n)
        done = d
        out[i] = now
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 10.0), min_size=1, max_size=8), st.integers(1, 6))
def test_independent_jobs_share_the_pool_as_the_closed_form_says(durations, cores):
    g = events.Graph()
    pool = g.add_pool(cores)
    nodes = [g.add([], duration=d, pool=pool) for d in durations]
    t = events.run(g, None)
    want = shared_finish(durations, cores)
    for node, w in zip(nodes, want):
        assert t.finish[node] == pytest.approx(w, rel=1e-9)
    # what no schedule can beat: the pool's total work over its cores, and the longest job
    assert t.makespan >= max(sum(durations) / cores, max(durations)) * (1 - 1e-9)


def test_no_more_jobs_than_cores_run_at_full_speed_and_unpooled_nodes_ignore_the_pool():
    g = events.Graph()
    pool = g.add_pool(2)
    a = g.add([], duration=1.0, pool=pool)
    b = g.add([], duration=3.0, pool=pool)
    c = g.add([], duration=2.0)                      # its own core
    d = g.add([a], duration=1.0, pool=pool)          # starts at 1, with b: still 2 jobs on 2 cores
    t = events.run(g, None)
    assert (t.finish[a], t.finish[b], t.finish[c], t.finish[d]) == pytest.approx((1.0, 3.0, 2.0, 2.0))


def test_two_pools_do_not_share():
    g = events.Graph()
    p, q = g.add_pool(1), g.add_pool(1)
    nodes = [g.add([], duration=1.0, pool=p), g.add([], duration=1.0, pool=p), g.add([], duration=1.0, pool=q)]
    assert [events.run(g, None).finish[n] for n in nodes] == pytest.approx([2.0, 2.0, 1.0])


def test_bad_pools_are_refused():
    g = events.Graph()
    with pytest.raises(ValueError, match="positive number of cores"):
        g.add_pool(0)
    with pytest.raises(ValueError, match="unknown core pool 0"):
        g.add([], duration=1.0, pool=0)
    p = g.add_pool(1)
    with pytest.raises(ValueError, match="moves no bytes"):
        g.add([], flows=((0, 1, 10.0),), pool=p)


def chain(S, f, b, cores=None, cores_level=None, per_host=1):
    """S stages of one device each on S hosts (of ``per_host`` devices: the rest idle), free transfers
    between neighbours (the pipeline's dependencies, no bytes)."""
    levels = (ir.Level("node", S, 1e9),) + ((ir.Level("gpu", per_host, 1e12),) if per_host > 1 else ())
    c = ir.Cluster(levels, "node", cores=cores, cores_level=cores_level)
    comp = tuple(StageCompute((f,), (b,), (0.0,)) for _ in range(S))
    dev = [s * per_host for s in range(S)]
    trs = tuple(SimTransfer(f"t{s}", s, s + 1, (SimTask(dev[s], (dev[s + 1],), 0.0, "send_recv"),),
                            (SimTask(dev[s + 1], (dev[s],), 0.0, "send_recv"),)) for s in range(S - 1))
    return SimInput(c, tuple((d,) for d in dev), comp, trs)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("S,B", [(2, 4), (3, 6), (4, 8)])
def test_a_pipeline_on_one_core_takes_its_total_work(schedule, S, B):
    """Some stage can always compute (free communication), so one shared core never idles."""
    f, b = 1.0, 2.0
    lists = build(schedule, S, B, chain(S, f, b).transfers).actions
    p = predict(chain(S, f, b, cores=1), lists)
    assert p.iteration == pytest.approx(S * B * (f + b))
    assert p.free_iteration == pytest.approx(S * B * (f + b))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_enough_cores_change_nothing_and_per_host_pools_are_separate(schedule):
    S, B, f, b = 3, 6, 1.0, 2.0
    lists = build(schedule, S, B, chain(S, f, b).transfers).actions
    alone = predict(chain(S, f, b), lists).iteration
    if schedule == "gpipe":
        assert alone == pytest.approx((B + S - 1) * (f + b))
    assert predict(chain(S, f, b, cores=S), lists).iteration == pytest.approx(alone)
    # one core per host, one stage per host: nothing shares
    assert predict(chain(S, f, b, cores=1, cores_level="node", per_host=2), lists).iteration == pytest.approx(alone)
    # one core for the whole cluster: more than alone, at most the total work
    one = predict(chain(S, f, b, cores=1, cores_level=None, per_host=2), lists).iteration
    assert alone < one == pytest.approx(S * B * (f + b))


def test_core_pools_follow_the_level():
    levels = (ir.Level("rack", 2, 1e9), ir.Level("node", 2, 1e9), ir.Level("gpu", 2, 1e12))
    c = ir.Cluster(levels, "node", cores=4)
    assert c.core_pools() == (tuple(range(8)),)
    assert dataclasses.replace(c, cores_level="rack").core_pools() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert dataclasses.replace(c, cores_level="node").core_pools() == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert dataclasses.replace(c, cores=None).core_pools() == ()
