"""The memory model on rank classes of several stages (interleaved_1f1b, zbv) and split backwards (zb_h1):
a device holds every stage of its class, its activations counted from the class's list; with W a micro-batch
stays in flight until its W (planc.pipeline.fit.needs), derived here by hand."""
from __future__ import annotations

import pytest

from planc import ir
from planc.pipeline.fit import needs, worst
from planc.pipeline.memory import StageMemory


def stage(i: int, params: int = 1000, act: int = 100) -> StageMemory:
    """One device (data 1) of fp32 sgd without momentum: parameters and gradients 4 bytes each a parameter,
    no optimizer state; ``act`` bytes of layer outputs a micro-batch, no received inputs."""
    return StageMemory(i, params, 1, 8, act, 0, ir.Precision.FP32, 0)


def test_one_stage_per_mesh_is_the_stage_alone():
    mem = [stage(i) for i in range(4)]
    for n in needs(mem, "1f1b", 8):
        assert not n.mates and n.in_flight == 4 - n.stage and n.total == 8000 + 100 * (4 - n.stage)


def test_zb_h1_holds_a_micro_batch_until_its_w():
    """ZB-H1 defers stage i's W by i micro-batches: every stage holds min(B, S) = 4 from F to W."""
    mem = [stage(i) for i in range(4)]
    assert [n.in_flight for n in needs(mem, "zb_h1", 8)] == [4, 4, 4, 4]
    assert worst(mem, "zb_h1", 8).total == worst(mem, "1f1b", 8).total == 8400


def test_interleaved_counts_the_whole_class():
    """interleaved_1f1b(virtual = 2) on P = 2, B = 4: coordinate 0 runs stages 0 and 2, warm-up (V - 1)P +
    2(P - 1) = 4 forwards (F0.0 F0.1 F2.0 F2.1), then F0.2 B2.0 ...: at most 5 stage-micro-batches at once,
    after F0.2 (stage 0: 3, stage 2: 2). With stage 0's micro-batch 100 bytes and stage 2's 300: the peak
    is when stage 2 holds 2 and stage 0 holds 3, 3 x 100 + 2 x 300 = 900 (stage 0 alone never holds more
    than 4 x 100); the device's total is both stages' static bytes (8000 + 8000) plus that."""
    mem = [stage(0, act=100), stage(1), stage(2, act=300), stage(3)]
    got = {n.stage: n for n in needs(mem, "interleaved_1f1b", 4, 2)}
    zero = got[0]
    assert {m.stage for m, _ in zero.mates} == {2} and zero.stages == (0, 2)
    assert (zero.in_flight, got[2].in_flight) == (4, 2)
    assert zero.joint == 900 and zero.total == got[2].total == 16000 + 900
    assert "stages 0, 2" not in zero.text() and "activations at once 900 B" in zero.text()


def test_zbv_counts_the_v():
    """zbv on P = 2 meshes: mesh 0 runs stages 0 and 3 (the V's first and last), until each one's W."""
    mem = [stage(i) for i in range(4)]
    got = {n.stage: n for n in needs(mem, "zbv", 4)}
    assert got[0].stages == got[3].stages == (0, 3) and got[1].stages == (1, 2)
    assert got[0].total == 16000 + got[0].joint and got[0].joint <= 100 * 2 * 2 * 2


def test_a_pinned_schedule_that_does_not_fit_names_the_mesh():
    from planc.pipeline.fit import no_fit
    from planc.lang import load_text
    program = load_text("cluster { level node x 4 : bandwidth 1 GB/s\n memory = 10 KB }\n"
                        "parallel { pipe = 2, data = 2 }\nmodel \"m.py:build\" { layers = 4 }\nloss \"m.py:loss\"\n"
                        "data \"m.py:batches\"\nstages = auto(4)\n"
                        "train { schedule = interleaved_1f1b(virtual = 2), micro_batch = 8 }\n", "p.plan")
    mem = [stage(0, act=100), stage(1), stage(2, act=300), stage(3)]
    err = no_fit(program, mem, (program.train.schedule,), program.train.schedule_span)
    text = str(err)
    assert "stages 0, 2 (one mesh) need 16.9 KB" in text and "stages 1, 3 (one mesh)" in text
    assert "schedule = 1f1b" not in text   # 1f1b would need other stages


@pytest.mark.parametrize("schedule, V", [("interleaved_1f1b", 2), ("zbv", 1)])
def test_recompute_is_suggested_for_every_stage_of_the_mesh(schedule, V):
    from planc.pipeline.fit import _suggest
    from planc.lang import load_text
    program = load_text("cluster { level node x 4 : bandwidth 1 GB/s\n memory = 10 KB }\n"
                        "parallel { pipe = 2, data = 2 }\nmodel \"m.py:build\" { layers = 4 }\nloss \"m.py:loss\"\n"
                        "data \"m.py:batches\"\nstages = auto(4)\n"
                        f"train {{ schedule = {schedule}{'(virtual = 2)' if V > 1 else ''}, micro_batch = 8 }}\n",
                        "p.plan")
    mem = [stage(i, params=100, act=5000) for i in range(4)]
    got = _suggest(program, mem, (program.train.schedule,), 12e3)   # recomputed: 2 x 800 + 2 x 5000
    redo = [s for s in got if s.change[0][0] == "recompute"]
    assert redo and set(redo[0].change[0][1]) == {0, 1, 2, 3}
