"""The memory model (docs/memory.md) and the simulator's training regime, on a probed MLP.

Every expected byte count is computed here by hand from the MLP's layer sizes (parameters ``in x out +
out`` per layer, what autograd keeps ``rows x in`` for each Linear's input and ``rows x out`` for each
tanh's output), never by the model code under test."""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from pathlib import Path

import pytest

from planc import ir
from planc.driver.compile import compile_program
from planc.lang import load_text
from planc.pipeline.cut import apply_auto_stages, cut_layers
from planc.pipeline.fit import NoFit
from planc.pipeline.schedules import build
from planc.pipeline.siminput import StageCompute, sim_input, stage_compute
from planc.pipeline.simulate import predict
from planc.model.probe import ModelProbe, probe_model

EX = str(Path(__file__).resolve().parents[2] / "examples")
ROWS, HIDDEN, DATA = 512, 64, 4
SIZES = [8] + [HIDDEN] * 5 + [4]                       # mlp.build(layers = 6, hidden = 64, inputs = 8, outputs = 4)
PARAMS = [SIZES[i] * SIZES[i + 1] + SIZES[i + 1] for i in range(6)]
LAYERS = [(0, 3), (3, 6)]

PLAN = """\
plan mem {
  cluster {
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu x 4 : bandwidth 150 GB/s, latency 2 us
    flops = 100 TFLOP/s
  }
  parallel { pipe = 2, data = 4 }
  model "EX/mlp.py:build" { layers = 6, hidden = 64, inputs = 8, outputs = 4 }
  loss "EX/mlp.py:loss"
  data "EX/mlp.py:batches"
  stage 0 : layers 0..3
  stage 1 : layers 3..6
  transfer h from stage 0 to stage 1
  train { micro_batch = ROWS, micro_batches = 4, schedule = SCHEDULE, optimizer = OPT, precision = PREC }
}
"""


def program(schedule="1f1b", opt="adam(lr = 1e-3)", prec="fp32", rows=ROWS, memory=None, zero=0,
            recompute=(False, False)) -> ir.Program:
    text = (PLAN.replace("EX", EX).replace("ROWS", str(rows)).replace("SCHEDULE", schedule)
            .replace("OPT", opt).replace("PREC", prec))
    p = load_text(textwrap.dedent(text), "<mem>")
    stages = tuple(dataclasses.replace(s, recompute=recompute[s.index]) for s in p.stages)
    return dataclasses.replace(p, stages=stages, cluster=dataclasses.replace(p.cluster, memory=memory),
                               train=dataclasses.replace(p.train, zero=zero))


@pytest.fixture(scope="module")
def probe():
    return probe_model(program())


def expected(stage, prec, zero, recompute, states, in_flight, rows=ROWS):
    """One device of ``stage``, by hand (docs/memory.md)."""
    a, b = LAYERS[stage]
    P = sum(PARAMS[a:b])
    elem = 4 if prec == "fp32" else 2
    master = 0 if prec == "fp32" and not zero else 4   # ZeRO-1's shard is updated in its own fp32 copy
    mine = rows // DATA                                      # this device's rows of a micro-batch
    # what autograd keeps: each Dense's Linear saves its input, its tanh (every layer but the last) its output,
    # which the next Linear saves again (one storage): the stage's first input, then each tanh's output
    outputs = (mine * SIZES[a] + sum(mine * SIZES[i + 1] for i in range(a, b) if i < len(PARAMS) - 1)) * elem
    inputs = (mine * SIZES[a] * elem) if stage > 0 else 0   # stage 1 received h: layer 2's output
    act = in_flight * inputs + outputs if recompute else in_flight * (inputs + outputs)
    held = math.ceil(P / DATA) if zero else P
    parts = {"parameters": P * elem, "gradients": P * 4, "optimizer": (4 * states + master) * held}
    # the last stage's logits [rows, 4], one micro-batch slice: in the precision, upcast, the loss's
    # probabilities and their gradient; adam's step: one fp32 temporary per master (sgd without decay: none)
    logits = mine * SIZES[-1] * (elem + (4 if elem != 4 else 0) + 8) if b == len(PARAMS) else 0
    step = 4 * held if states == 2 else 0
    # the build at start (no tensor axis here: nothing drawn whole beyond the share): fp32 draw, + the cast copy
    build = 4 * P + (elem * P if elem != 4 else 0)
    return dict(parts, activations=act, logits=logits, step=step,
                total=sum(parts.values()) + max(act + logits, step), build=build)


OPTIMIZERS = {"sgd(lr = 0.1)": 0, "sgd(lr = 0.1, momentum = 0.9)": 1, "adam(lr = 1e-3)": 2}


@pytest.mark.parametrize("prec, zero, recompute, opt", [
    (prec, zero, rc, opt) for prec, zero, rc, opt in itertools.product(
        ("fp32", "bf16", "fp16"), (0, 1), (False, True), ("sgd(lr = 0.1, momentum = 0.9)", "adam(lr = 1e-3)"))
] + [("bf16", 1, True, "sgd(lr = 0.1)")])
def test_stage_memory_by_part_in_plan_json(probe, prec, zero, recompute, opt):
    p = program(opt=opt, prec=prec, zero=zero, recompute=(recompute, recompute))
    plan = compile_program(p, probe).plan_json
    stages = plan["pipeline"]["stages"]
    for i, in_flight in enumerate((2, 1)):             # 1f1b on 2 stages, 4 micro-batches: min(4, S - i)
        assert stages[i]["memory"] == expected(i, prec, zero, recompute, OPTIMIZERS[opt], in_flight), i


def test_in_flight_follows_the_schedule(probe):
    for schedule, flights in (("gpipe", (4, 4)), ("eager_1f1b", (3, 1))):
        stages = compile_program(program(schedule), probe).plan_json["pipeline"]["stages"]
        for i, k in enumerate(flights):
            assert stages[i]["memory"] == expected(i, "fp32", 0, False, 2, k)


# ---------------------------------------------------------------- schedule = auto within the memory

def need(schedule_flights, **kw):
    return max(expected(i, kw.get("prec", "fp32"), kw.get("zero", 0), kw.get("recompute", False), 2, k)["total"]
               for i, k in enumerate(schedule_flights))


def test_auto_chooses_within_memory(probe):
    eager, one = need((3, 1)), need((2, 1))
    assert one < eager
    plan = compile_program(program("auto", memory=(one + eager) / 2), probe).plan_json
    assert plan["pipeline"]["schedule"] == "1f1b"
    assert "eager_1f1b would need" in plan["choices"]["schedule"] and "gpipe would need" in plan["choices"]["schedule"]
    assert max(s["memory"]["total"] for s in plan["pipeline"]["stages"]) <= (one + eager) / 2
    # without a limit, or with room for all, the fastest predicted: no memory in the reason's way
    free = compile_program(program("auto"), probe).plan_json
    assert "no device memory limit given" in free["choices"]["schedule"]


def apply(p: ir.Program, change) -> ir.Program:
    """A suggestion's change applied to the program, as a user would write it."""
    for key, value in change:
        if key == "zero":
            p = dataclasses.replace(p, train=dataclasses.replace(p.train, zero=value))
        elif key == "recompute":
            p = dataclasses.replace(p, stages=tuple(dataclasses.replace(s, recompute=True) if s.index in value else s
                                                    for s in p.stages))
        elif key == "schedule":
            p = dataclasses.replace(p, train=dataclasses.replace(p.train, schedule=ir.PipeSchedule(value)))
        elif key == "micro_batch":
            p = dataclasses.replace(p, train=dataclasses.replace(p.train, micro_batch=value))
        else:
            raise AssertionError(f"unexpected suggestion {key}")
    return p


def test_nothing_fits_is_a_located_error_with_settings_that_do_fit(probe):
    one = need((2, 1))                              # stage 0: 142336 static + 2 x 98304 activations
    limit = 305_000
    assert one > limit and expected(1, "fp32", 0, False, 2, 1)["total"] <= limit
    p = program("auto", memory=limit)
    with pytest.raises(NoFit) as ei:
        compile_program(p, probe)
    d = ei.value.diagnostics[0]
    line = textwrap.dedent(PLAN).splitlines()[13].replace("ROWS", str(ROWS))
    assert (d.span.line, d.span.col) == (14, line.index("SCHEDULE") + 1)   # at `auto` of `schedule = auto`
    stage0 = expected(0, "fp32", 0, False, 2, 2)
    assert "no schedule fits in memory = 305 KB per device; under 1f1b:" in d.message
    def kb(x):
        return f"{x / 1e3:.3g} KB"
    assert (f"stage 0 needs {kb(stage0['total'])} (parameters {kb(stage0['parameters'])}, gradients "
            f"{kb(stage0['gradients'])}, optimizer {kb(stage0['optimizer'])}, activations {kb(stage0['activations'])}: "
            f"2 micro-batches in flight x {kb(stage0['activations'] / 2)})") in d.message
    assert "stage 1 needs" not in d.message
    # zero: a quarter of the states and of the fp32 master copy; recompute: stage 0 keeps its outputs once;
    # micro_batch: the largest multiple of the data degree whose stage 0 fits, worked out by hand
    assert expected(0, "fp32", 1, False, 2, 2)["total"] <= limit and expected(0, "fp32", 0, True, 2, 2)["total"] <= limit
    rows = max(m for m in range(DATA, ROWS, DATA) if expected(0, "fp32", 0, False, 2, 2, rows=m)["total"] <= limit)
    changes = [s.change for s in ei.value.suggestions]
    assert changes == [(("zero", 1),), (("recompute", (0,)),), (("micro_batch", rows),)]
    assert "settings that would fit: zero = 1" in d.message and "recompute on stage 0" in d.message
    assert f"micro_batch = {rows}" in d.message
    for change in changes:   # each, applied, compiles (a new micro_batch is probed anew)
        q = apply(p, change)
        plan = compile_program(q, probe if q.train.micro_batch == ROWS else probe_model(q)).plan_json
        assert max(s["memory"]["total"] for s in plan["pipeline"]["stages"]) <= limit


def test_a_pinned_schedule_that_does_not_fit_is_the_same_error(probe):
    limit = 400_000
    p = program("gpipe", memory=limit)
    with pytest.raises(NoFit) as ei:
        compile_program(p, probe)
    d = ei.value.diagnostics[0]
    assert d.message.startswith("schedule = gpipe does not fit in memory = 400 KB per device; under gpipe:")
    assert "stage 0 needs" in d.message and "stage 1 needs" in d.message
    changes = [s.change for s in ei.value.suggestions]
    # zero = 1 leaves stage 0 at 482176 B under gpipe: not listed
    assert expected(0, "fp32", 1, False, 2, 4)["total"] > limit
    rows = max(m for m in range(4, ROWS, 4)      # by hand: the largest micro_batch that fits under gpipe
               if all(expected(i, "fp32", 0, False, 2, 4, rows=m)["total"] <= limit for i in (0, 1)))
    assert changes == [(("recompute", (0, 1)),), (("schedule", "1f1b"),), (("micro_batch", rows),)]
    for change in changes[:2]:
        compile_program(apply(p, change), probe)
    # no limit: no error, whatever the schedule needs
    compile_program(program("gpipe"), probe)


# ---------------------------------------------------------------- the simulator's training regime

def test_simulator_uses_the_precisions_flops(probe):
    # (the compute model directly: this branch's runtime trains fp32 only, so a bf16 plan is not simulated)
    p = program(prec="bf16")
    fast = dataclasses.replace(p, cluster=dataclasses.replace(p.cluster, flops_by_precision=(("bf16", 400e12),)))
    mine = ROWS // DATA
    compute, rate = stage_compute(fast, fast.stages, probe)
    assert rate == 400e12
    # layer 1 forward: 2 x 64 x 64 FLOPs per row, a device's 128 rows at 400 TFLOP/s
    assert compute[0].forward[1] == pytest.approx(2 * 64 * 64 * mine / 400e12)
    compute, rate = stage_compute(p, p.stages, probe)
    assert rate == 100e12 and compute[0].forward[1] == pytest.approx(2 * 64 * 64 * mine / 100e12)
    # fp32 gradients: 4 B a parameter whatever the precision; the parameters themselves at 2 B
    assert compute[0].grad_bytes == tuple(4.0 * x for x in PARAMS[:3])
    assert compute[0].param_bytes == tuple(2.0 * x for x in PARAMS[:3])
    # an fp32 plan that is simulated records the rate it used
    pred = compile_program(program(), probe).plan_json["pipeline"]["predicted"]
    assert pred["flops"] == 100e12 and pred["flops_given"] is True


def test_recompute_adds_the_forward_to_the_backward(probe):
    base = compile_program(program(), probe).plan_json["pipeline"]["predicted"]
    redo = compile_program(program(recompute=(False, True)), probe).plan_json["pipeline"]["predicted"]
    assert redo["stages"][0]["layer_backward"] == base["stages"][0]["layer_backward"]
    for f, b, b2 in zip(base["stages"][1]["layer_forward"], base["stages"][1]["layer_backward"],
                        redo["stages"][1]["layer_backward"]):
        assert b2 == pytest.approx(b + f)
    assert redo["schedules"]["1f1b"]["iteration"] > base["schedules"]["1f1b"]["iteration"]
    # what it holds: its inputs per micro-batch in flight, its outputs while it recomputes
    m = expected(1, "fp32", 0, True, 2, 1)
    assert redo["stages"][1]["activation_bytes"] == ROWS // DATA * HIDDEN * 4
    assert redo["stages"][1]["recompute_bytes"] == m["activations"] - ROWS // DATA * HIDDEN * 4


def test_the_weight_gradients_are_half_the_backward_without_the_recompute(probe):
    """StageCompute.weight (a split backward's W, docs/simulator.md): half of each layer's backward FLOPs for
    a layer with parameters (dX and dW of a matmul are equal FLOPs), the recompute's forward left in B."""
    for recompute in ((False, False), (False, True)):
        p = program(recompute=recompute)
        compute, _ = stage_compute(p, p.stages, probe)
        for c, redo in zip(compute, recompute):
            for f, b, w in zip(c.forward, c.backward, c.weight):
                assert w == pytest.approx((b - (f if redo else 0.0)) / 2)
    zb = compile_program(program("zb_h1"), probe).plan_json["pipeline"]
    assert zb["predicted"]["stages"][0]["layer_weight"] == [b / 2 for b in zb["predicted"]["stages"][0]["layer_backward"]]
    assert zb["predicted_iteration"] == zb["predicted"]["schedules"]["zb_h1"]["iteration"]


def zero_cluster(bw=1e9):
    return ir.Cluster((ir.Level("node", 2, bw, 0.0),), "node", flops=1e12)


def test_zero_programs_appear_in_the_timeline():
    """ZeRO-1's gradients reduce-scatter during the last backward and its parameters all-gather after
    the step, each moving its closed-form bytes: (k-1)/k x G and (k-1) x P/k per ring edge."""
    G, P, bw = 8e6, 4e6, 1e9
    comp = StageCompute((1e-3,), (2e-3,), (G,), param_bytes=(P,))
    reds = [{"name": "gradients", "target": "reduce_scatter", "groups": [[0, 1]], "mode": "synthesize",
             "program": {"unit": 2, "steps": [{"collective": "reduce_scatter", "groups": [[0, 1]],
                                               "regions": [[0, 2]]}]}},
            {"name": "parameters", "target": "all_gather", "groups": [[0, 1]], "mode": "synthesize",
             "program": {"unit": 2, "steps": [{"collective": "all_gather", "groups": [[0, 1]],
                                               "regions": [[0, 2]]}]}}]
    sim = sim_input(zero_cluster(bw), [{"index": 0, "devices": [0, 1]}], [], reds, [comp],
                    {"grad_bucket_bytes": 1e12})
    assert [(r.after_step, r.held) for r in sim.reductions] == [(False, (1.0,)), (True, (0.5,))]
    lists = build("1f1b", 1, 2).actions
    pred = predict(sim, lists, timeline=True)
    spans = {}
    for _, a, b, tag in pred.traffic:
        spans.setdefault(tag[0], []).append((a, b))
    assert set(spans) == {"reduce", "gather"}
    (ra, rb), (ga, gb) = spans["reduce"][0], spans["gather"][0]
    compute_end = max(end for *_, end in pred.compute)
    assert ra == pytest.approx(compute_end) and rb - ra == pytest.approx(G / 2 / bw)
    assert ga == pytest.approx(rb) and gb - ga == pytest.approx((P / 2) / bw)
    assert pred.iteration == pytest.approx(gb)


# ---------------------------------------------------------------- the automatic cut fits the memory

def test_cut_layers_keeps_to_the_allowed_ranges():
    costs = [1, 1, 1, 1]
    assert cut_layers(costs, 2) == [(0, 2), (2, 4)]
    assert cut_layers(costs, 2, allowed=lambda s, a, b: s != 0 or b - a == 1) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="within the memory limit"):
        cut_layers(costs, 2, allowed=lambda s, a, b: False)


AUTO = """\
cluster {
  level gpu x 2 : bandwidth 150 GB/s
  memory = LIMIT
}
parallel { pipe = 2 }
model "m.py:build" { layers = 4 }
loss  "m.py:loss"
data  "m.py:batches"
stages = auto(2)
train { micro_batches = 4, schedule = auto, optimizer = adam(lr = 1e-3) }
"""


def chain_probe(out_bytes):
    n = len(out_bytes)
    return ModelProbe(layer_params=(1000,) * n, layer_shapes=((8, 4),) * n, layer_dtypes=("f32",) * n,
                      micro_batch=8, layer_output_bytes=tuple(out_bytes), layer_flops=((1, 2),) * n, chain=True)


def test_auto_cut_fits_the_memory_when_a_cut_does():
    # 4 equal layers of 1000 fp32 parameters (16 B each with Adam); outputs 20000, 20000, 100, 100 B.
    # 1f1b: stage 0 keeps 2 micro-batches, stage 1 one (its input = stage 0's last output, + its outputs).
    #   0..2 | 2..4: 32000 + 2 x 40000 = 112000 | 32000 + 20000 + 200 = 52200   (the fastest)
    #   0..1 | 1..4: 16000 + 2 x 20000 =  56000 | 48000 + 20000 + 20200 = 88200
    #   0..3 | 3..4: 48000 + 2 x 40100 = 128200 | ...
    probe = chain_probe([20000, 20000, 100, 100])
    free = load_text(AUTO.replace("  memory = LIMIT\n", ""), "<cut>")
    assert [s.layers for s in apply_auto_stages(free, probe)[0].stages] == [(0, 2), (2, 4)]
    capped = load_text(AUTO.replace("LIMIT", "90 KB"), "<cut>")
    cut, why = apply_auto_stages(capped, probe)
    assert [s.layers for s in cut.stages] == [(0, 1), (1, 4)]
    assert "shaped the cut: the fastest, 0..2 | 2..4, does not fit" in why
    # no cut fits: the fastest, and the schedule pass reports what would fit
    tight = load_text(AUTO.replace("LIMIT", "50 KB"), "<cut>")
    cut, why = apply_auto_stages(tight, probe)
    assert [s.layers for s in cut.stages] == [(0, 2), (2, 4)] and "no cut into this many stages fits" in why


def test_explain_shows_memory_by_part_the_limit_and_the_savings(probe):
    from planc.commands.explain import explain, explain_data
    plan = compile_program(program(zero=1, recompute=(True, False), memory=2e6), probe).plan_json
    mem = explain_data(plan)["pipeline"]["memory"]
    s0 = expected(0, "fp32", 1, True, 2, 2)
    assert mem["limit"] == 2e6 and {k: mem["stages"][0][k] for k in s0} == s0
    full = expected(0, "fp32", 0, False, 2, 2)
    assert mem["stages"][0]["saved"] == {"zero": full["optimizer"] - s0["optimizer"],
                                         "recompute": full["activations"] - s0["activations"]}
    text = " ".join(explain(plan).split())   # the text as read, whatever the wrapping
    assert "memory per device by stage" in text and "limit 1.9 MiB" in text
    assert f"stage 0: zero = 1 saved {(full['optimizer'] - s0['optimizer']) / 1024:.1f} KiB of optimizer state; " \
           f"recompute saved {(full['activations'] - s0['activations']) / 1024:.1f} KiB of activations" in text
