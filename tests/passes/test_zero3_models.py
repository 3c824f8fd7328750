"""``zero = 3`` in the compiler's models (the runtime's numbers: tests/e2e/test_e2e_zero3.py): the memory model
(parameters divided by d plus the gathered buffers, x2 with prefetch, the whole stage kept gathered, ZeRO-2's
gradients), the simulator (each layer gathered before its forward and backward, 3 with recompute, once a step
kept; prefetched gathers hidden behind compute), the cut's memory, fit's hint and explain's prices."""
from __future__ import annotations

import pytest

from planc import ir
from planc.pipeline.memory import StageMemory, saved
from planc.pipeline.schedules import build
from planc.pipeline.siminput import StageCompute, sim_input
from planc.pipeline.simulate import predict, predict_schedule
from planc.pipeline.zero3price import gather_seconds
from planc.pipeline.zero3sim import gathers_per_micro_batch

from test_zero2 import compiled_deep, deep, text, worst


# ---------------------------------------------------------------- memory model

def mem(zero=3, data=2, prefetch=True, keep=False, tied=0, precision=ir.Precision.BF16, params=1000, largest=300):
    return StageMemory(0, params, data, 8, 0, 0, precision, 2, zero, tied=tied, bucket=10, largest=largest,
                       prefetch=prefetch, keep_gathered=keep)


def test_zero3_parameters_are_the_gathered_layers():
    # bf16 (2 bytes), 1000 parameters, the largest layer 300; the shard's values are the fp32 masters
    # (under optimizer): no shard in bf16 is kept, as runtime/zero3.py does (measured: bench regime)
    assert mem(data=2).parameters == 2 * 300 * 2                    # d = 2, prefetch: two layers gathered
    assert mem(data=4).parameters == 2 * 300 * 2                    # d = 4: the same layers
    assert mem(data=4, prefetch=False).parameters == 300 * 2        # one layer without prefetch
    assert mem(data=4, keep=True).parameters == 1000 * 2            # kept gathered: the whole stage, as ZeRO-2
    assert mem(data=4, keep=True).parameters == mem(2, data=4).parameters
    assert mem(data=4, largest=700).parameters == 1000 * 2          # never more than the stage's parameters
    # recompute: the layer in backward (and its prefetched predecessor) beside the recomputed ones
    assert mem(data=4, largest=200).with_(recompute=True).parameters == 4 * 200 * 2
    assert mem(data=4, prefetch=False).with_(recompute=True).parameters == 2 * 300 * 2
    # tied parameters stay whole and are never gathered
    m = mem(data=4, tied=100)
    assert (m.sharded, m.gathered) == (225 + 100, 600) and m.parameters == (100 + 600) * 2
    assert mem(data=4, tied=100, largest=500).gathered == 900
    # one data member: nothing sharded, nothing gathered
    assert mem(data=1).parameters == 1000 * 2 and mem(data=1).gathered == 0


def test_zero3_keeps_zero2s_gradients_and_optimizer_and_says_what_it_saved():
    for d in (2, 4):
        # the owned shard as ZeRO-2's, staged: 3 buckets of at most a layer (none straddles two layers)
        assert mem(3, data=d).gradients == (1000 // d + 3 * 300) * 4 <= mem(2, data=d).gradients
        assert mem(3, data=d).optimizer == mem(2, data=d).optimizer == (2 * 4 + 4) * (1000 // d)
    s = saved(mem(data=4, prefetch=False), 1)
    assert s["zero_parameters"] == (1000 - 300) * 2
    assert {"zero", "zero_gradients"} <= set(s)
    assert saved(mem(data=4, keep=True), 1)["zero_parameters"] == 0
    assert "zero_parameters" not in saved(mem(2, data=4), 1)
    m = mem(data=4)
    assert m.total(2) == m.parameters + m.gradients + m.optimizer


def test_the_cut_sizes_zero3_stages_with_the_plans_gather_settings(tmp_path):
    from planc.lang import load_text
    from planc.pipeline.cut import cut_memory
    from planc.model.probe import probe_model
    prog = load_text(deep(text(train="zero = 3, zero_prefetch = false")), "z.plan")
    probe = probe_model(prog)
    m = cut_memory(prog, probe, [(0, 8), (8, 16)])
    assert [(x.zero, x.prefetch, x.keep_gathered, x.data) for x in m] == [(3, False, False, 4)] * 2
    assert m[0].gathered == m[0].largest and m[0].parameters < m[0].with_(zero=2).parameters


# ---------------------------------------------------------------- simulator

def z3_sim(zero=3, prefetch=True, keep=False, forward=1e-3, layers=4, micro_batches=2, recompute=False):
    """One stage on 2 devices at 1 GB/s; per layer 8 MB of gradients and 4 MB of parameters: a gather moves
    2 MB a member, 2 ms."""
    cluster = ir.Cluster((ir.Level("node", 2, 1e9, 0.0),), "node", flops=1e12)
    comp = StageCompute((forward,) * layers, (2 * forward,) * layers, (8e6,) * layers, param_bytes=(4e6,) * layers)

    def prog(c):
        return {"unit": 2, "steps": [{"collective": c, "groups": [[0, 1]], "regions": [[0, 2]]}]}
    reds = [{"name": "gradients", "target": "reduce_scatter", "groups": [[0, 1]], "mode": "synthesize",
             "program": prog("reduce_scatter")},
            {"name": "parameters", "target": "all_gather", "groups": [[0, 1]], "mode": "synthesize",
             "program": prog("all_gather")}]
    sim = sim_input(cluster, [{"index": 0, "devices": [0, 1]}], [], reds, [comp], {"grad_bucket_bytes": 1e12},
                    zero=zero, zero3={"prefetch": prefetch, "keep_gathered": keep}, recompute=[recompute])
    return sim, predict_schedule(sim, "1f1b", micro_batches, timeline=True)


def gathers(p) -> int:
    """ZeRO-3's gathers in the timeline: ("gather", stage, micro-batch, layer, F or B, repeat, collective)."""
    return len({tag for *_, tag in p.traffic if tag[0] == "gather" and len(tag) == 7})


def test_the_simulator_gathers_every_layer_before_its_forward_and_backward():
    sim, p = z3_sim()
    assert [(r.per_layer, r.after_step) for r in sim.reductions] == [(False, False), (True, False)]
    assert gathers(p) == 2 * 4 * 2 == gathers_per_micro_batch(4, False, False) * 2
    # the recomputed forward gathers too, but for the layer whose backward starts the recompute
    assert gathers(z3_sim(recompute=True)[1]) == (3 * 4 - 1) * 2 == gathers_per_micro_batch(4, True, False) * 2
    assert gathers(z3_sim(keep=True)[1]) == 4                     # once a layer per step
    assert gathers(z3_sim(2)[1]) == 0                             # ZeRO-2 gathers after the step only
    # one micro-batch's gathers alone: 8 x 2 ms; kept: 4 x 2 ms a step; with recompute 11 x 2 ms
    assert gather_seconds(sim, 0) == pytest.approx(16e-3)
    assert gather_seconds(z3_sim(keep=True)[0], 0) == pytest.approx(8e-3)
    assert gather_seconds(z3_sim(recompute=True)[0], 0) == pytest.approx(22e-3)


def test_gathers_cost_time_and_prefetch_hides_them_behind_compute():
    # communication-bound (1 ms layers, 2 ms gathers): every gather costs, and without prefetch more
    two, pre, crit = (z3_sim(2)[1].iteration, z3_sim()[1].iteration, z3_sim(prefetch=False)[1].iteration)
    assert two < pre < crit
    # 16 gathers of 2 ms on the critical path: at least their time over prefetching's
    assert crit - pre >= 16e-3 * 0.5
    # compute-bound (100 ms layers): prefetched gathers are hidden (no slower than ZeRO-2, whose step ends
    # with the parameters' all-gather), unprefetched ones are not: at least 16 x 2 ms more
    big = dict(forward=0.1)
    two, pre, crit = (z3_sim(2, **big)[1].iteration, z3_sim(**big)[1].iteration,
                      z3_sim(prefetch=False, **big)[1].iteration)
    assert pre <= two * (1 + 1e-9) and crit - pre >= 32e-3
    free = z3_sim(**big)[1].free_iteration
    assert pre - free < 0.02 * free
    # kept gathered: 4 gathers a step instead of 16
    assert z3_sim(keep=True)[1].iteration < z3_sim()[1].iteration


# ---------------------------------------------------------------- compiled: explain, fit, schedule = auto

@pytest.fixture(scope="module")
def compiled_z3(tmp_path_factory):
    from planc.driver.compile import compile_file
    src = tmp_path_factory.mktemp("z3") / "z.plan"
    src.write_text(deep(text(stage0="zero 3", train="grad_bucket = 1 KiB")))
    return compile_file(src).plan_json


def test_plan_json_prices_both_ways_and_explain_shows_the_gather_program(compiled_z3):
    from planc.commands.explain import explain
    st = {s["stage"]: s for s in compiled_z3["pipeline"]["stages"]}
    z = st[0]["zero3"]
    assert "zero3" not in st[1]
    assert (z["prefetch"], z["keep_gathered"]) == (True, False)
    assert z["whole"] + z["gathered"] == st[0]["memory"]["parameters"]
    assert (z["freed"]["gathers"], z["kept"]["gathers"]) == (16, 8)          # 8 layers
    assert z["freed"]["total"] == st[0]["memory"]["total"] < z["kept"]["total"]
    assert z["freed"]["gather_seconds"] == pytest.approx(2 * z["kept"]["gather_seconds"])
    assert z["freed"]["iteration"] > 0 and z["kept"]["iteration"] > 0
    assert st[0]["memory_saved"]["zero_parameters"] > 0
    words = " ".join(explain(compiled_z3).split())
    assert "all-gather parameters over data (stage 0) (zero = 3)" in words
    assert "program: all_gather(slice=root, form=inside)" in words
    assert ("zero 3: each layer's parameters gathered by this program before its forward and again before its "
            "backward, freed after each; prefetched") in words
    assert "price per micro-batch: 16 gathers" in words
    assert "zero_keep_gathered = false (the plan): 16 gathers per micro-batch" in words
    assert "zero_keep_gathered = true: 8 gathers per step" in words
    for w in (z["freed"], z["kept"]):
        from planc.commands import ui
        assert f"needs {ui.human_bytes(w['total'])} per device" in words
    assert "of parameters (gathered" in words


def test_a_plan_that_only_zero3_fits_is_told_so(tmp_path):
    from planc.pipeline.fit import NoFit

    def compiled(train, memory=None):
        return compiled_deep(tmp_path, train, memory)

    two, three = worst(compiled("zero = 2")), worst(compiled("zero = 3"))
    assert three < two
    limit = (two + three) // 2
    with pytest.raises(NoFit) as ei:
        compiled("zero = 0", f"{limit} B")
    changes = [s.change for s in ei.value.suggestions]
    assert (("zero", 3),) in changes and (("zero", 2),) not in changes
    assert "zero = 3 (parameters sharded too" in ei.value.diagnostics[0].message


def test_schedule_auto_sees_the_gathers(tmp_path):
    """The schedules' predictions come from the same simulator: without prefetch each is slower."""
    from planc.driver.compile import compile_file

    def schedules(train):
        src = tmp_path / "z.plan"
        src.write_text(deep(text(train=train)).replace("schedule = 1f1b", "schedule = auto"))
        return {k: v["iteration"] for k, v in compile_file(src).plan_json["pipeline"]["predicted"]["schedules"].items()}

    two, three = schedules("zero = 2"), schedules("zero = 3, zero_prefetch = false")
    assert set(two) == set(three) and all(three[k] > two[k] for k in two)


def test_the_placement_ranking_prices_zero3_gathers(tmp_path):
    """Pipe-axis stages: under zero 3 each matrix's breakdown has the gradients per micro-batch (as zero 2) and
    the per-layer gathers: 2 a micro-batch, priced as half an all-reduce of their bytes; once a step kept."""
    from planc.driver.compile import compile_file
    from planc.commands.explain import explain_data
    from test_zero2 import EX, PIPE
    parts = {}
    for name, zero in (("two", "2"), ("three", "3"), ("kept", "3, zero_keep_gathered = true")):
        src = tmp_path / f"p{name}.plan"
        src.write_text(PIPE.replace("EX", EX).replace("ZERO", zero))
        data = explain_data(compile_file(src).plan_json)
        parts[name] = {tuple(map(tuple, r["matrix"])): r["breakdown"] for r in data["placement"]["ranked"]}
    for matrix, two in parts["two"].items():
        three, kept = parts["three"][matrix], parts["kept"][matrix]
        assert three["reduce gradients"] == two["reduce gradients"]
        assert "reduce parameters (zero 3 gathers)" not in two
        assert three["reduce parameters (zero 3 gathers)"] > kept["reduce parameters (zero 3 gathers)"] > 0
