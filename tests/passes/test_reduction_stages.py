"""Explicit stages of different sizes and shapes: each stage reduces its gradients with its own program."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planc import ir
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.placement import place
from planc.reduction import FLAT_ALLREDUCE, plan_reductions, stage_reduction_groups
from planc.reduction import check
from planc.reduction.hierarchy import group_positions
from planc.reduction.language import parse_program
from planc.reduction.lower import lower_program

HIER = ("reduce_scatter(slice=node, form=inside); allreduce(slice=node, form=parallel(root)); "
        "all_gather(slice=node, form=inside)")
RSAG = "reduce_scatter(slice=root, form=inside); all_gather(slice=root, form=inside)"

# 3 hosts x 4 GPUs, slow NICs. Stage 0: a 2 x 2 mesh inside host 0 (data pairs on one host);
# stage 1: data = 4 over devices 6..9, i.e. 2 hosts (1 and 2) x 2 devices; devices 4, 5, 10, 11 idle.
CLUSTER = """cluster {
  level node x 3 : bandwidth 1 GB/s, latency 20 us
  level gpu  x 4 : bandwidth 150 GB/s, latency 2 us
}
"""
STAGES = """stage 0 on devices 0..4  as (data = 2, tensor = 2)
stage 1 on devices 6..10 as (data = 4)
"""
SIZES = {0: 1 << 26, 1: 3 << 24}


def _with_model(text: str) -> str:
    """``reduce gradients`` needs a model (its parameters are what it reduces): each stage takes one layer,
    and the model lines go last, so the lines of everything the tests point at stay where they are.
    The reduction pass is handed its parameter bytes directly (``sizes``), so the model is never probed."""
    text = re.sub(r"^stage (\d+) on", lambda m: f"stage {m[1]} : layers {m[1]}..{int(m[1]) + 1} on", text,
                  flags=re.M)
    return text + 'model "m.py:build"\nloss "m.py:loss"\ndata "m.py:batches"\n'


def _plan(text: str, sizes=SIZES, path="stages.plan"):
    program = load_text(_with_model(text), path)
    placement = place(program, sizes)
    return program, placement.stages, plan_reductions(program, placement.coords, placement.stages,
                                                      placement.matrix, sizes)


def _recheck(plan) -> None:
    """The independent checker on the chosen program and on every alternative, lowered on the stage."""
    j = plan.to_json()
    steps = [(s["collective"], s["groups"]) for s in j["program"]["steps"]]
    assert check.check_program(steps, j["groups"]) is None
    if not plan.groups:
        return
    layout = group_positions(_cluster(), plan.groups)
    assert layout is not None
    for alt in j["alternatives"]:
        lowered = lower_program(parse_program(alt["text"]), *layout)
        assert check.check_program([(str(c), g) for c, g in lowered], j["groups"]) is None, alt["text"]


def _cluster() -> ir.Cluster:
    return load_text(CLUSTER + "stage 0 on devices 0..1 as (1)\n", "c.plan").cluster


def test_each_stage_gets_a_program_for_its_own_geometry():
    _, stages, plans = _plan(CLUSTER + STAGES + "reduce gradients over data\n")
    assert [p.stage for p in plans] == [0, 1]
    s0, s1 = plans
    assert s0.groups == ((0, 2), (1, 3)) == stage_reduction_groups(stages[:1], ("data",))
    assert s1.groups == ((6, 7, 8, 9),) == stage_reduction_groups(stages[1:], ("data",))
    assert (s0.nbytes, s1.nbytes) == (SIZES[0], SIZES[1])
    # stage 0: data pairs inside host 0, a flat allreduce
    assert s0.program == FLAT_ALLREDUCE and s0.steps == ((ir.Collective.ALLREDUCE, ((0, 2), (1, 3))),)
    assert s0.hierarchy.levels == (("gpu", 2),)
    # stage 1: 2 hosts x 2 devices over a slow NIC, the hierarchical program, cheaper than flat
    assert s1.hierarchy.levels == (("node", 2), ("gpu", 2))
    assert s1.text == HIER
    assert [(str(c), g) for c, g in s1.steps] == [
        ("reduce_scatter", ((6, 7), (8, 9))),        # inside each host
        ("allreduce", ((6, 8), (7, 9))),             # across the hosts, half the buffer each
        ("all_gather", ((6, 7), (8, 9)))]
    assert s1.predicted < s1.allreduce_predicted
    assert s1.candidates > s0.candidates > 1
    for p in plans:
        _recheck(p)


def test_per_stage_plan_json_shape():
    _, _, plans = _plan(CLUSTER + STAGES + "reduce gradients over data\n")
    for s, p in enumerate(plans):
        j = p.to_json()
        assert list(j)[:3] == ["name", "stage", "axes"] and j["stage"] == s and j["name"] == "gradients"
        assert "per_stage_bytes" not in j and j["bytes"] == SIZES[s]
        assert set(j) >= {"groups", "program", "allreduce_predicted", "candidates", "alternatives", "hierarchy"}


def test_stage_without_data_parallelism_keeps_an_empty_entry():
    text = CLUSTER + STAGES + "stage 2 on devices 10..12 as (data = 1, tensor = 2)\nreduce gradients over data\n"
    _, _, plans = _plan(text, {0: 100, 1: 200, 2: 300})
    assert [p.stage for p in plans] == [0, 1, 2]
    empty = plans[2]
    assert empty.groups == () and empty.program == () and empty.predicted == 0.0 and empty.candidates == 0
    j = empty.to_json()
    assert j["stage"] == 2 and j["bytes"] == 300 and j["groups"] == [] and j["program"]["steps"] == []


def test_standalone_reduction_stays_one_entry_over_every_stage():
    _, _, plans = _plan(CLUSTER + STAGES + "reduce gradients over data\nreduce r over data : f32[1024]\n")
    assert [(p.name, p.stage) for p in plans] == [("gradients", 0), ("gradients", 1), ("r", None)]
    assert plans[2].groups == ((0, 2), (1, 3), (6, 7, 8, 9)) and "stage" not in plans[2].to_json()
    assert plans[2].program == FLAT_ALLREDUCE           # differently shaped groups: flat only


def test_using_allreduce_and_a_pinned_program_apply_to_every_stage():
    _, _, flat = _plan(CLUSTER + STAGES + "reduce gradients over data using allreduce\n")
    assert [(p.stage, p.program) for p in flat] == [(0, FLAT_ALLREDUCE), (1, FLAT_ALLREDUCE)]
    assert all(p.predicted == p.allreduce_predicted for p in flat)
    _, _, pinned = _plan(CLUSTER + STAGES + f"reduce gradients over data using {RSAG}\n")
    assert [(p.stage, p.text) for p in pinned] == [(0, RSAG), (1, RSAG)]
    assert pinned[1].steps == ((ir.Collective.REDUCE_SCATTER, ((6, 7, 8, 9),)),
                               (ir.Collective.ALL_GATHER, ((6, 7, 8, 9),)))
    for p in flat + pinned:
        _recheck(p)


def test_pinned_program_invalid_on_one_stage_is_a_located_error_naming_it():
    """The hierarchical program needs a node level: stage 1 has one, stage 0 (inside one host) does not."""
    line = f"reduce gradients over data using {HIER}\n"
    text = CLUSTER + STAGES + line
    with pytest.raises(PlanError) as e:
        _plan(text)
    d = e.value.diagnostics[0]
    assert d.message.startswith("reduction program for 'gradients' is invalid on stage 0: step 1 ")
    assert "node" in d.message
    assert d.span.line == text.count("\n")                  # the reduce line
    assert d.span.col == line.index("reduce_scatter") + 1
    assert d.message.endswith("unknown level 'node' (synthesis hierarchy: root, gpu)")
    assert "every stage runs the pinned program on its own reduction groups" in (d.hint or "")
    rendered = e.value.render()
    assert "stages.plan:" in rendered and "Traceback" not in rendered
    # both stages across hosts: valid on each
    _, _, plans = _plan(CLUSTER + "stage 0 on devices 2..6 as (data = 4)\nstage 1 on devices 6..10 as (data = 4)\n"
                        + line)
    assert [(p.stage, p.text) for p in plans] == [(0, HIER), (1, HIER)]
    assert plans[0].steps[1] == (ir.Collective.ALLREDUCE, ((2, 4), (3, 5)))


def test_compiled_plan_lists_one_gradients_entry_per_stage():
    from planc.driver.compile import compile_program
    model = 'model "../examples/mlp.py:build" { layers = 2, hidden = 16, inputs = 8, outputs = 4 }\n'
    text = CLUSTER + model + 'loss "../examples/mlp.py:loss"\ndata "../examples/mlp.py:batches"\n'
    text += re.sub(r"^stage (\d+) on", lambda m: f"stage {m[1]} : layers {m[1]}..{int(m[1]) + 1} on", STAGES,
                   flags=re.M) + "transfer h : f32[8, 16] from stage 0 to stage 1\nreduce gradients over data\n"
    text += "train { micro_batch = 8, micro_batches = 2, steps = 1, schedule = 1f1b, optimizer = sgd(lr = 0.1) }\n"
    plan = compile_program(load_text(text, str(Path(__file__).parent / "stages.plan"))).plan_json
    grads = [r for r in plan["reductions"] if r["name"] == "gradients"]
    assert [r["stage"] for r in grads] == [0, 1]
    assert [r["groups"] for r in grads] == [[[0, 2], [1, 3]], [[6, 7, 8, 9]]]
    groups = {tuple(g) for g in plan["groups"]}
    for r in grads:
        steps = [(s["collective"], s["groups"]) for s in r["program"]["steps"]]
        assert check.check_program(steps, r["groups"]) is None
        assert all(tuple(g) in groups for _, gs in steps for g in gs)


@st.composite
def explicit_stages(draw):
    """2-3 explicit stages of random shapes on node x N, gpu x M (contiguous, maybe with idle gaps)."""
    nodes, gpus = draw(st.integers(1, 3)), draw(st.sampled_from([2, 4]))
    total = nodes * gpus
    lines, start = [], 0
    for i in range(draw(st.integers(2, 3))):
        data = draw(st.sampled_from([1, 2, 3, 4]))
        tensor = draw(st.sampled_from([1, 2]))
        gap = draw(st.integers(0, 1))
        if start + gap + data * tensor > total:
            break
        start += gap
        mesh = f"data = {data}" + (f", tensor = {tensor}" if tensor > 1 else "")
        lines.append(f"stage {i} on devices {start}..{start + data * tensor} as ({mesh})")
        start += data * tensor
    if not lines:
        lines.append("stage 0 on devices 0..1 as (data = 1)")
    bw = draw(st.sampled_from(["1 GB/s", "12.5 GB/s"]))
    cluster = (f"cluster {{\n  level node x {nodes} : bandwidth {bw}, latency 20 us\n"
               f"  level gpu x {gpus} : bandwidth 150 GB/s, latency 2 us\n}}\n")
    sizes = {i: draw(st.integers(0, 1 << 26)) for i in range(len(lines))}
    return cluster + "\n".join(lines) + "\nreduce gradients over data\n", sizes


@settings(max_examples=30, deadline=None)
@given(case=explicit_stages())
def test_random_explicit_stages_each_reduce_their_own_groups(case):
    text, sizes = case
    _, stages, plans = _plan(text, sizes)
    assert [p.stage for p in plans] == [s.index for s in sorted(stages, key=lambda s: s.index)]
    for p, s in zip(plans, sorted(stages, key=lambda s: s.index)):
        want = tuple(g for g in stage_reduction_groups((s,), ("data",)) if len(g) > 1)
        assert p.groups == want and p.nbytes == sizes[s.index]
        assert all(set(g) <= set(s.devices) for g in p.groups)
        j = p.to_json()
        steps = [(x["collective"], x["groups"]) for x in j["program"]["steps"]]
        assert check.check_program(steps, j["groups"]) is None
        if p.groups:
            assert p.predicted <= p.allreduce_predicted * (1 + 1e-9)
            assert math.isfinite(p.predicted)
