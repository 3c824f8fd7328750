"""``zero = 2`` outside the runtime's numbers (those: tests/e2e/test_e2e_zero2.py): the language (train block
and stage lines, degrees beyond 3 refused), plan.json's ``stages[i].zero``, the memory model (gradients
divided by d, staged buckets, tied parameters whole), the simulator and the placement ranking (a
reduce-scatter after every backward), the no-fit suggestion, explain; and ``ShardedGradientBuckets`` on one
rank's buckets (a stand-in 2-member reduce-scatter executor)."""
from __future__ import annotations

import pytest

from planc import ir
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.lang.format import summary, to_text
from planc.pipeline.memory import GRADIENT_BYTES, ZERO2_WINDOW, StageMemory, saved, whole_tied
from planc.pipeline.schedules import build
from planc.pipeline.siminput import StageCompute, sim_input
from planc.pipeline.simulate import predict, predict_schedule
from planc.runtime.grads_zero2 import WINDOW

from e2e_util import ROOT

EX = str(ROOT / "examples")
PLAN = """\
plan z {
  cluster {
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu x 4 : bandwidth 150 GB/s, latency 2 us
  }
  model "EX/mlp.py:build" { layers = 4, hidden = 16, inputs = 8, outputs = 4 }
  loss "EX/mlp.py:loss"
  data "EX/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..4 as (data = 4) STAGE0
  stage 1 : layers 2..4 on devices 4..8 as (data = 4)
  transfer h : f32[8, 16] from stage 0 as S0 R to stage 1 as S0 R
  reduce gradients over data
  train { micro_batch = 8, micro_batches = 2, schedule = 1f1b, optimizer = sgd(lr = 0.1), TRAIN }
}
"""


def text(stage0="", train="precision = fp32"):
    return PLAN.replace("EX", EX).replace("STAGE0", stage0).replace("TRAIN", train)


def deep(src: str) -> str:
    """The plan with 16 layers of width 64 (8 a stage): stages many times wider than their widest layer."""
    return (src.replace("layers = 4, hidden = 16", "layers = 16, hidden = 64").replace("f32[8, 16]", "f32[8, 64]")
            .replace("layers 0..2", "layers 0..8").replace("layers 2..4", "layers 8..16"))


def errors(src: str) -> list[str]:
    with pytest.raises(PlanError) as ei:
        load_text(src, "z.plan")
    return [f"{d.span.line}:{d.span.col}: {d.message}" for d in ei.value.diagnostics]


# ---------------------------------------------------------------- language

def test_zero2_in_the_train_block_and_on_stage_lines_in_either_order():
    p = load_text(text(train="zero = 2"), "z.plan")
    assert p.train.zero == 2 and [s.zero for s in p.stages] == [None, None]
    for line in ("zero 2", "recompute zero 1", "zero 0 recompute"):
        p = load_text(text(stage0=line), "z.plan")
        assert p.stages[0].zero == int(line.split("zero ")[1][0]) and p.stages[1].zero is None
        assert p.stages[0].recompute == (True if "recompute" in line else None)
        again = load_text(to_text(p), "z.plan")     # the formatter writes the stage's zero back
        assert again.stages == p.stages
    lines = summary(load_text(text(stage0="zero 2", train="zero = 1"), "z.plan")).splitlines()
    assert [ln.split(", ")[-1] for ln in lines if ln.startswith("  stage ")] == ["ZeRO-2", "ZeRO-1"]


def at(src: str, culprit: str, skip: int = 0) -> str:
    """``line:col`` of the last occurrence of ``culprit`` in ``src``, ``skip`` characters into it."""
    line_no, line = [(i, ln) for i, ln in enumerate(src.splitlines(), 1) if culprit in ln][-1]
    return f"{line_no}:{line.rindex(culprit) + 1 + skip}"


def test_other_degrees_are_located_errors():
    src = text(stage0="recompute zero 5")
    assert errors(src) == [
        f"{at(src, 'zero 5', 5)}: stage 0: zero must be 0, 1, 2 or 3 (1: fp32 master weights and optimizer state "
        "sharded over each stage's data group, ZeRO stage 1; 2: the gradients too, ZeRO stage 2; 3: the parameters "
        "too, ZeRO stage 3), got 5"]


def test_plan_json_writes_a_stage_zero_where_the_line_sets_one(tmp_path):
    from planc.driver.compile import compile_file
    from planc import plan as P
    src = tmp_path / "z.plan"
    src.write_text(text(stage0="zero 2", train="zero = 1"))
    c = compile_file(src)
    doc = c.plan_json
    assert doc["train"]["zero"] == 1
    assert [st.get("zero") for st in sorted(doc["stages"], key=lambda s: s["index"])] == [2, None]
    plan = P.Plan.from_json(doc)
    assert [plan.zero_of(i) for i in (0, 1)] == [2, 1]
    mem = {st["index"] if "index" in st else i: st for i, st in enumerate(doc["pipeline"]["stages"])}
    saved0 = dict(mem[0]["memory_saved"])
    assert "zero_gradients" in saved0 and "zero_gradients" not in dict(mem[1].get("memory_saved") or {})


def test_the_plan_loader_refuses_zero_4():
    from planc.plan import PlanFileError
    from planc.plan.jsonpath import At
    from planc.plan.records import Stage
    with pytest.raises(PlanFileError, match=r"^plan.json: stages\[0\].zero: expected 0, 1, 2 or 3, got 4$"):
        Stage.read(At({"index": 0, "layers": [0, 1], "devices": [0], "mesh": [0], "mesh_axes": ["data"],
                       "mesh_shape": [1], "mesh_devices": [0], "zero": 4}, "stages[0]"))


# ---------------------------------------------------------------- memory model

def mem(zero, tied=0, bucket=10, data=4, params=1000):
    return StageMemory(0, params, data, 8, 0, 0, ir.Precision.FP32, 1, zero, tied=tied, bucket=bucket)


def test_zero2_divides_the_gradients_by_d_and_counts_the_staged_buckets():
    assert WINDOW == ZERO2_WINDOW == 2      # the model's window is the runtime's
    assert mem(0).gradients == mem(1).gradients == 1000 * GRADIENT_BYTES
    assert mem(2).gradients == (250 + 4 * 10) * GRADIENT_BYTES
    # a bucket is at most the stage's gradient, of which two micro-batches' copies may be alive
    assert mem(2, bucket=10_000).gradients == (250 + 4 * 1000) * GRADIENT_BYTES
    assert mem(2, data=1).gradients == 1000 * GRADIENT_BYTES                  # no peers: nothing sharded
    # tied parameters stay whole (their own buckets and masters)
    assert mem(2, tied=100).gradients == (900 // 4 + 100 + 40) * GRADIENT_BYTES
    assert mem(1, tied=100).optimizer == (4 + 4) * (225 + 100)
    s = saved(mem(2), 1)
    assert s["zero_gradients"] == (1000 - 290) * GRADIENT_BYTES and s["zero"] == mem(0).optimizer - mem(2).optimizer
    assert "zero_gradients" not in saved(mem(1), 1)


def test_whole_tied_counts_ties_that_cross_the_stage():
    ties = ((((0, "w"), (3, "w")), 64), (((1, "a"), (2, "a")), 8))
    probe = type("P", (), {"tied": ties})()
    assert whole_tied(probe, 0, 2) == 64 + 8
    assert whole_tied(probe, 0, 3) == 64
    assert whole_tied(probe, 0, 4) == 0


# ---------------------------------------------------------------- simulator

def zero_sim(zero, micro_batches=2, G=8e6, bw=1e9):
    cluster = ir.Cluster((ir.Level("node", 2, bw, 0.0),), "node", flops=1e12)
    comp = StageCompute((1e-3,), (2e-3,), (G,), param_bytes=(G,))
    reds = [{"name": "gradients", "target": "reduce_scatter", "groups": [[0, 1]], "mode": "synthesize",
             "program": {"unit": 2, "steps": [{"collective": "reduce_scatter", "groups": [[0, 1]],
                                               "regions": [[0, 2]]}]}},
            {"name": "parameters", "target": "all_gather", "groups": [[0, 1]], "mode": "synthesize",
             "program": {"unit": 2, "steps": [{"collective": "all_gather", "groups": [[0, 1]],
                                               "regions": [[0, 2]]}]}}]
    sim = sim_input(cluster, [{"index": 0, "devices": [0, 1]}], [], reds, [comp], {"grad_bucket_bytes": 1e12},
                    zero=zero)
    return sim, predict_schedule(sim, "1f1b", micro_batches, timeline=True)


def test_the_simulator_prices_a_reduce_scatter_after_every_backward():
    sim1, one = zero_sim(1, micro_batches=3)
    sim2, two = zero_sim(2, micro_batches=3)
    assert [r.every_micro_batch for r in sim2.reductions] == [True, False]
    assert [r.every_micro_batch for r in sim1.reductions] == [False, False]
    count = {z: len({tag for *_, tag in p.traffic if tag[0] == "reduce"}) for z, p in ((1, one), (2, two))}
    assert count == {1: 1, 2: 3}
    # 1f1b on one stage: F 1 ms, B 2 ms, 3 micro-batches (compute ends at 9 ms); a reduce-scatter or the
    # all-gather moves G/2 at 1 GB/s: 4 ms. ZeRO-1: one reduce-scatter at 9 ms, the gather after: 17 ms.
    # ZeRO-2: reduce-scatters from 3 ms (after B0), queued back to back: 3 + 3 x 4, then the gather: 19 ms
    assert one.iteration == pytest.approx(17e-3) and two.iteration == pytest.approx(19e-3)
    # a stage's own zero overrides the train block's
    _, own = zero_sim(0, micro_batches=3)
    assert len({tag for *_, tag in own.traffic if tag[0] == "reduce"}) == 1


# ---------------------------------------------------------------- the runtime's sharded buckets, one rank

class HalfOfTwo:
    """A reduce-scatter over 2 members seen from member 0, whose peer contributed the same gradient: the sum
    is twice this rank's, and member 0 owns the first half of every bucket."""

    granule = 2

    def __init__(self):
        self.runs = []

    def owned_slices(self, n):
        return [(0, n // 2)]

    def run(self, flat):
        self.runs.append(flat.numel())
        flat.mul_(2)
        return flat


def test_sharded_buckets_reduce_every_micro_batch_and_keep_only_the_owned_half():
    import torch
    from planc.runtime.grads_zero2 import ShardedGradientBuckets
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 6) for _ in range(3)]
    params = [p for layer in layers for p in layer.parameters()]
    ex = HalfOfTwo()
    buckets = ShardedGradientBuckets(params, ex, torch.device("cpu"), bucket_bytes=4 * 42)   # a layer a bucket
    n = len(buckets.buckets)
    assert n >= 3
    order, release = [], buckets._release
    buckets._release = lambda b: (order.append(b), release(b))[1]
    buckets.attach()
    xs = [torch.randn(4, 6) for _ in range(3)]
    whole = [torch.zeros_like(p) for p in params]
    for m, x in enumerate(xs):
        buckets.arm(last=m == 2)
        skip = m == 1          # layer 1 unused in micro-batch 1: its buckets still reduce, as zeros
        _forward(layers, x, skip).sum().backward()
        # the same micro-batch's gradient by autograd alone (no .grad, no hooks)
        grads = torch.autograd.grad(_forward(layers, x, skip).sum(), params, allow_unused=True)
        for w, g in zip(whole, grads):
            if g is not None:
                w += g
        assert all(p.grad is None for p in params)   # no whole gradient kept between micro-batches
    buckets._queue.join()
    assert len(ex.runs) == 3 * n        # one reduce-scatter per bucket per micro-batch
    # in bucket order, also in micro-batch 1, where layer 1's bucket waits for the end of the backward and
    # layer 0's, complete before it, waits for it (a member with layer 1's gradients releases them in order)
    assert order == list(range(n)) * 3, order
    assert all(s is None for s in buckets._staging)
    # the owned half of each bucket holds twice the accumulated gradient; nothing else is held
    for b, (meta, placed) in enumerate(buckets.buckets):
        half = meta.numel() // 2
        flat = torch.zeros(meta.numel())
        for p, off in placed:
            flat[off:off + p.numel()] = whole[[id(q) for q in params].index(id(p))].reshape(-1)
        torch.testing.assert_close(buckets.grad(b, 0, half), 2 * flat[:half])
        with pytest.raises(ValueError, match="not owned by this rank"):
            buckets.grad(b, half, half + 1)
    # held: the owned halves, plus the most staging alive at once: the bucket filling (one layer's) and WINDOW in
    # flight, whenever the reduce thread runs
    widest = max(meta.numel() for meta, _ in buckets.buckets) * 4
    assert 0 < buckets.peak_staged_bytes <= (WINDOW + 1) * widest and buckets.staged_bytes == 0
    assert buckets.held_bytes() == 4 * sum(meta.numel() // 2 for meta, _ in buckets.buckets) + buckets.peak_staged_bytes


def _forward(layers, x, skip):
    import torch
    h = x
    for i, layer in enumerate(layers):
        if not (skip and i == 1):
            h = torch.tanh(layer(h))
    return h


def test_explain_shows_zero2_programs_and_what_it_saves(tmp_path):
    """A stage of 4 data devices with zero 2 on its line and 1 KiB buckets: its programs say zero = 2, its
    gradients are (P/4 + 4 buckets) x 4 bytes and the note says what that saved against zero 1."""
    from planc.driver.compile import compile_file
    from planc.commands.explain import explain, explain_data
    src = tmp_path / "z.plan"
    src.write_text(deep(text(stage0="zero 2", train="grad_bucket = 1 KiB")))
    plan = compile_file(src).plan_json
    data = explain_data(plan)
    zeros = {(r["name"], r["stage"]): r.get("zero") for r in data["reductions"]}
    assert zeros == {("gradients", 0): 2, ("parameters", 0): 2, ("gradients", 1): None}
    st0 = data["pipeline"]["memory"]["stages"][0]
    L = 64 * 64 + 64                                       # the widest layer: larger than a bucket (256)
    P = 8 * 64 + 64 + 7 * L                                # mlp layers 0..8
    assert st0["zero"] == 2 and st0["gradients"] == (-(-P // 4) + 4 * L) * 4
    saved_gradients = P * 4 - st0["gradients"]
    assert st0["saved"]["zero_gradients"] == saved_gradients > 0
    words = " ".join(explain(plan).split())
    assert "reduce-scatter gradients over data (stage 0) (zero = 2)" in words
    # fp32 SGD without momentum: zero adds the fp32 master shard (ceil(P / 4) x 4 bytes), no state to shard
    assert st0["saved"]["zero"] == -(-(-P // 4) * 4)
    assert (f"stage 0: zero = 2 added {-(-P // 4) * 4 / 1024:.1f} KiB of optimizer state and saved "
            f"{saved_gradients / 1024:.1f} KiB of gradients (reduce-scattered every micro-batch; a few buckets "
            "staged whole)") in words


def compiled_deep(tmp_path, train: str, memory: str | None = None, optimizer: str | None = None):
    """``deep(text(...))`` compiled with ``train`` settings added (1 KiB gradient buckets), ``optimizer``
    in place of its SGD, and ``memory`` (e.g. ``"3 MB"``) per device when given."""
    from planc.driver.compile import compile_file
    extra = ", grad_bucket = 1 KiB" + (f", optimizer = {optimizer}" if optimizer else "")
    body = deep(text(train=train + extra))
    if optimizer:
        body = body.replace("optimizer = sgd(lr = 0.1), ", "")
    if memory:
        body = body.replace("latency 2 us\n", f"latency 2 us\n    memory = {memory}\n")
    src = tmp_path / "z.plan"
    src.write_text(body)
    return compile_file(src)


def worst(c) -> int:
    """The largest stage total of a compiled plan's memory model (bytes per device)."""
    return max(st["memory"]["total"] for st in c.plan_json["pipeline"]["stages"])


def test_a_plan_that_only_zero2_fits_is_told_so(tmp_path):
    """A memory limit between the zero 1 and the zero 2 totals: the no-fit error suggests zero = 2 (and
    not zero = 1), and the plan with it compiles within the limit."""
    from planc.pipeline.fit import NoFit

    def compiled(train, memory=None):
        return compiled_deep(tmp_path, train, memory, optimizer="adam(lr = 1e-3)")

    one, two = worst(compiled("zero = 1")), worst(compiled("zero = 2"))
    assert two < one
    limit = (one + two) // 2
    with pytest.raises(NoFit) as ei:
        compiled("zero = 0", f"{limit} B")
    changes = [s.change for s in ei.value.suggestions]
    assert (("zero", 2),) in changes and (("zero", 1),) not in changes
    assert "zero = 2 (gradients sharded too: reduce-scattered every micro-batch)" in ei.value.diagnostics[0].message
    assert worst(compiled("zero = 2", f"{limit} B")) <= limit


PIPE = """\
plan pipe {
  cluster {
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu x 4 : bandwidth 150 GB/s, latency 2 us
  }
  parallel { pipe = 2, data = 4 }
  model "EX/mlp.py:build" { layers = 16, hidden = 256, inputs = 8, outputs = 4 }
  loss "EX/mlp.py:loss"
  data "EX/mlp.py:batches"
  stage 0 : layers 0..8
  stage 1 : layers 8..16
  transfer h from stage 0 to stage 1
  reduce gradients over data
  train { micro_batch = 8, micro_batches = 2, schedule = 1f1b, optimizer = sgd(lr = 0.1), zero = ZERO }
}
"""


def test_the_placement_ranking_prices_zero2_gradients_per_micro_batch(tmp_path):
    """Pipe-axis stages: the matrix ranking's ``reduce gradients`` part under zero 2 is the same program's
    time on micro_batches times the bytes (ZeRO-2 reduce-scatters every micro-batch's gradient)."""
    from planc.driver.compile import compile_file
    from planc.commands.explain import explain_data
    parts = {}
    for zero in (1, 2):
        src = tmp_path / f"p{zero}.plan"
        src.write_text(PIPE.replace("EX", EX).replace("ZERO", str(zero)))
        data = explain_data(compile_file(src).plan_json)
        parts[zero] = {tuple(map(tuple, r["matrix"])): r["breakdown"]["reduce gradients"]
                       for r in data["placement"]["ranked"]}
    assert parts[1].keys() == parts[2].keys() and len(parts[1]) >= 2
    for matrix in parts[1]:
        assert parts[2][matrix] > 1.2 * parts[1][matrix], matrix
    # where the data axis crosses the slow host links the bytes dominate: twice the time for 2 micro-batches
    crossing = ((1, 2), (2, 2))
    assert parts[2][crossing] == pytest.approx(2 * parts[1][crossing], rel=0.1)


def test_a_stage_line_with_zero_or_recompute_twice_is_located():
    src = text(stage0="zero 2 recompute zero 1")
    assert errors(src) == [f"{at(src, 'zero 1')}: 'zero' is written twice on this stage line"]
    src = text(stage0="recompute zero 2 recompute")
    assert errors(src) == [f"{at(src, 'recompute')}: 'recompute' is written twice on this stage line"]
    src = text(stage0="zero two")
    assert errors(src) == [f"{at(src, 'two')}: unexpected 'two'; expected a number"]


def test_a_plan_json_with_zero_but_no_reduce_scatter_is_refused_at_load(tmp_path):
    """plan.json edited to zero = 2 (its gradients still all-reduced): the loader names the stage."""
    from planc.driver.compile import compile_file
    from planc import plan as P
    src = tmp_path / "z.plan"
    src.write_text(text())
    doc = compile_file(src).plan_json
    assert P.Plan.from_json(doc).zero_of(0) == 0
    doc["train"]["zero"] = 2
    with pytest.raises(P.PlanFileError) as ei:
        P.Plan.from_json(doc)
    assert str(ei.value) == ("plan.json: stages[0]: zero = 2 but its gradients reduction has target allreduce: "
                             "ZeRO reduce-scatters the gradients (recompile the plan)")
