"""End-to-end: the real compiler on the bundled plans (and variants edited in tmp_path),
the compiled output launched with its own launch.sh (the `deepspeed` launcher, CPU/gloo),
3 training steps, every rank's parameters compared with an independent plain-torch single-process
reference (e2e_util.independent_reference, its dataflow read from the plan text) trained on the same
data, and the same comparison failing for the reference trained with a fault (gradients x2, a data rank's rows
missing; no launch of their own). 8 launches of 6-8 ranks, ~25-30 s each on 2 cores."""

import json
import os
import re

import pytest

from planc.driver.compile import compile_file
from planc.output.codegen import write_output

from e2e_util import (ROOT, assert_controls_fail, compare_dumps, independent_reference, launch_sh, rank_devices,
                      spelled, step_lines)

STEPS = 3

def variant(tmp_path, plan_name, schedule=None, edits=()):
    """Copy plans/<plan_name>'s spelled copy (e2e_util.spelled: its transfers' types written out, the
    placement the probe leads to pinned; these tests are not about the probe, so they compile it with
    ``probe=False``) into tmp_path with the model path fixed to the repo's examples/, optionally
    another train schedule, and ``edits`` (pattern, replacement) regex substitutions."""
    text = spelled(plan_name).read_text().replace('"../../examples/', f'"{ROOT}/examples/')
    if schedule is not None:
        text, n = re.subn(r"schedule = (gpipe|1f1b|eager_1f1b)\b", f"schedule = {schedule}", text)
        assert n == 1
    for pattern, repl in edits:
        text, n = re.subn(pattern, repl, text)
        assert n >= 1, pattern
    path = tmp_path / plan_name
    path.write_text(text)
    return path


def compile_to(tmp_path, plan_path, probe=False):
    c = compile_file(plan_path, probe=probe)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    return c, out


def train_and_compare(tmp_path, plan_path, ranks, data_parts):
    """Compile and launch ``plan_path``, then compare the run with the independent reference (losses,
    every rank's parameters, and where rank 0 prints it every step's gradient norm), and the negative
    controls (e2e_util.assert_controls_fail: gradients x2, one data rank's rows missing) with the same
    comparison: each must fail it. An SGD run sees a gradient scale in its parameters; Adam's update
    barely does (its step is g / sqrt(v)), so an Adam run must clip (``clip = 1e6`` never scales) for
    rank 0 to print the norm the x2 control must fail on."""
    c, out = compile_to(tmp_path, plan_path)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"]["devices"] == ranks
    r = launch_sh(out, "--steps", str(STEPS), "--dump-params", str(tmp_path / "dump"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    got = step_lines(r.stdout)
    assert sorted(got) == list(range(STEPS)), r.stdout[-3000:]
    sgd = c.program.train.optimizer.name == "sgd"
    norms = [got[s]["grad_norm"] for s in range(STEPS)]
    assert sgd or None not in norms, "an Adam run must print its gradient norms (clip): its parameters barely see a scale"
    # SGD carries gradient rounding linearly; Adam divides by sqrt(v) and lifts it for
    # near-zero gradients (observed <= 4e-5 after 3 steps at lr 1e-3), hence two tolerances
    atol = 1e-6 if sgd else 1e-4

    def compare(ref_losses, ref_state, record):
        assert [got[s]["loss"] for s in range(STEPS)] == pytest.approx(ref_losses, rel=1e-4, abs=1e-5), "losses"
        if None not in norms:
            assert norms == pytest.approx(record["grad_norm"], rel=1e-4), "gradient norms"
        # tensor-parallel shards are compared with their slice of the reference and must tile it
        return compare_dumps(tmp_path / "dump", ranks, ref_state, rtol=1e-5, atol=atol)

    # plain torch, knowing nothing of planc's runtime (never the output's own code: no test compares the
    # product with itself), its dataflow read from the plan text
    record: dict = {}
    ref_losses, ref_state = independent_reference(plan, out, STEPS, record=record, source=plan_path)
    sharded = compare(ref_losses, ref_state, record)
    failed = assert_controls_fail(compare, plan, out, STEPS, source=plan_path, data_parts=data_parts)
    if not sgd:   # Adam: the norm is what must see the scale
        def norms_only(_losses, _state, rec):
            assert norms == pytest.approx(rec["grad_norm"], rel=1e-4), "gradient norms"
        assert_controls_fail(norms_only, plan, out, STEPS, source=plan_path, data_parts=data_parts, only=["gradients"])
    return plan, r.stdout, sharded, failed


@pytest.mark.slow
# gpipe here; 1f1b and eager_1f1b train tensor-parallel stages in test_e2e_unequal (and eager in `make demo`);
# the hierarchical reduce_scatter / allreduce / all_gather program across hosts: test_e2e_unequal's check_hierarchical
@pytest.mark.parametrize("schedule", ["gpipe"])
def test_gpt_2x4_schedules_match_reference(tmp_path, schedule):
    """plans/gpt-2x4.plan: pipe 2 x data 2 x tensor 2 on 2 hosts of 4, synthesized program;
    the blocks really split over the tensor axis (Megatron-style)."""
    # 4 micro-batches a step (the bundled 8 add time, not coverage: the schedule's order is the same)
    # Adam: clip = 1e6 (never scales) makes rank 0 print every step's gradient norm, the check a gradient-scale
    # error must fail (Adam's parameters barely see it)
    path = variant(tmp_path, "gpt-2x4.plan", schedule, edits=[(r"micro_batches = 8\b", "micro_batches = 4"),
                                                              (r"optimizer = adam\(lr = 1e-3\)", "optimizer = adam(lr = 1e-3), clip = 1e6")])
    plan, stdout, sharded, _ = train_and_compare(tmp_path, path, 8, data_parts=2)
    assert plan["train"]["clip"] == 1e6
    assert plan["pipeline"]["schedule"] == schedule
    assert len(plan["tensor_groups"]) == 4 and all(
        len(g) == 2 and g in plan["groups"] and any(set(g) <= set(st["devices"]) for st in plan["stages"])
        for g in plan["tensor_groups"])
    # 4 blocks x (qkv.weight, qkv.bias, proj.weight, fc1.weight, fc1.bias, fc2.weight), each in 2 parts
    assert len(sharded) == 24 and all(parts == 2 for _, parts, _ in sharded.values())
    assert sharded["layers.1.qkv.weight"] == (0, 2, 3) and sharded["layers.4.mlp.2.weight"] == (1, 2, 1)
    # every rank says where it ran (the line the GPU tier reads to refuse a fallback to gloo)
    assert rank_devices(stdout) == {r: ("gloo", "cpu") for r in range(8)}, stdout[-2000:]
    # launched without OMP_NUM_THREADS (launch_env): each rank takes its share of this machine's cores
    threads = max(1, len(os.sched_getaffinity(0)) // 8)
    assert (f"cpu threads: {threads} per rank ({len(os.sched_getaffinity(0))} core(s) ÷ 8 rank(s) on this "
            f"machine (LOCAL_SIZE); OMP_NUM_THREADS overrides)") in stdout, stdout[-2000:]


@pytest.mark.slow
def test_unet_skips_using_allreduce_match_reference(tmp_path):
    """plans/unet-skip.plan as bundled (3 stages, skips from stage 0 to stage 2, eager_1f1b) with its
    gradients reduced by DeepSpeed's own data-parallel all-reduce (`using allreduce`); the synthesized
    program path on U-Net skips: test_e2e_unequal's unet-skip-unequal."""
    path = variant(tmp_path, "unet-skip.plan",
                   edits=[(r"reduce gradients over data[^\n]*", "reduce gradients over data using allreduce")])
    plan, stdout, sharded, _ = train_and_compare(tmp_path, path, 6, data_parts=2)
    assert not sharded and plan["pipeline"]["schedule"] == "eager_1f1b"
    assert {(t["src"]["stage"], t["dst"]["stage"]) for t in plan["transfers"]} >= {(0, 2)}
    assert plan["reductions"][0]["program"]["text"] == "allreduce(slice=root, form=inside)"
    assert "gradients: DeepSpeed's data-parallel all-reduce" in stdout


@pytest.mark.slow
def test_shape_mismatch_is_reported(tmp_path):
    """A stage whose real output differs from its transfer: the compiler rejects a wrong declared
    shape, so plan.json is edited after compiling, consistently (shape, every region and task
    slice of 'h' one column narrower), and the runtime's start-up check must name stage,
    transfer and both shapes. (Two ranks, the quickest launch; on the multi-host testbed:
    tests/testbed/test_testbed_failures.py::test_start_up_refusals_on_the_testbed. Communication only on
    a bundled plan's skips: tests/runtime/test_runtime_reshard.py and tests/e2e/test_comm_only.py.)"""
    src = tmp_path / "two.plan"
    src.write_text(SHAPE_PLAN.replace("EXAMPLES", str(ROOT / "examples")))
    _, out = compile_to(tmp_path, src)
    plan = json.loads((out / "plan.json").read_text())
    h = next(t for t in plan["transfers"] if t["name"] == "h")

    def narrow(box):
        box[1] = [box[1][0], min(box[1][1], 15)]

    h["shape"] = [8, 15]
    for route in (h, h["backward"]):
        for task in route["tasks"]:
            narrow(task["slice"])
        for side in route["regions"].values():
            for box in side.values():
                narrow(box)
    (out / "plan.json").write_text(json.dumps(plan, indent=2))
    r = launch_sh(out, "--steps", "1")
    assert r.returncode != 0
    assert ("stage 0, transfer 'h': the plan moves a [8, 15] shard from rank 0 (of f32[8, 15]) "
            "but the stage produces [8, 16]" in r.stdout + r.stderr), r.stdout[-3000:] + r.stderr[-3000:]


SHAPE_PLAN = """
plan two_stages {
  cluster {
    level node x 2 : bandwidth 100 MB/s, latency 50 us
    level gpu  x 1 : bandwidth 10 GB/s,  latency 2 us
  }
  model "EXAMPLES/mlp.py:build" { layers = 4, hidden = 16, inputs = 8, outputs = 4 }
  loss  "EXAMPLES/mlp.py:loss"
  data  "EXAMPLES/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..1 as (data = 1)
  stage 1 : layers 2..4 on devices 1..2 as (data = 1)
  transfer h : f32[8, 16] from stage 0 as R R to stage 1 as R R
  train { micro_batch = 8, micro_batches = 2, steps = 1, schedule = 1f1b, optimizer = sgd(lr = 0.1) }
}
"""


def test_grid_topology_is_the_plans_placement(tmp_path):
    """DeepSpeed's (pipe, data, model) view of the compiled plan's rank mapping (no processes)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from planc import plan as planfile
    from planc.runtime.engine import PlanEngine
    from planc.runtime.topology import StageTopology
    assert issubclass(PlanEngine, PipelineEngine)
    c = compile_file(variant(tmp_path, "gpt-2x4.plan"), probe=False)
    plan = planfile.Plan.from_json(c.plan_json)
    t = StageTopology(plan)
    assert t.axes == ["pipe", "data", "model"] and t.dims == [2, 2, 2]
    for st in plan.stages:
        k = st.mesh_axes.index("data")
        for d in st.devices:
            coord = t.get_coord(d)
            assert coord.pipe == st.index and coord.data == st.position(d)[k]
    assert sorted(map(sorted, t.get_axis_comm_lists("data"))) == sorted(
        sorted(g) for g in c.plan_json["reductions"][0]["groups"])
