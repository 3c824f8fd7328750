"""ZeRO-1's reduction targets: reduce-scatter and all-gather programs — synthesis, the independent
checker, planning and ranking, the compile pass, plan.json and explain.

References: ``planc.reduction.check`` (shares no code with the synthesizer's semantics) replays every
program; predicted times are recomputed with the cost model's ``program_time`` on the lowered steps.
"""

from __future__ import annotations

import dataclasses
import math
import os
from fractions import Fraction as F

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planc import ir
from planc import plan as planfile
from planc.cost import Network, program_time
from planc.commands.explain import explain
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.placement import place
from planc.reduction import PARAMETERS, check, plan_reductions, plan_zero, semantics
from planc.reduction.hierarchy import Hierarchy
from planc.reduction.language import parse_program as P
from planc.reduction.lower import lower_program
from planc.reduction.synthesize import canonical_assignment, synthesize_all_gather, synthesize_reduce_scatter
from planc.reduction.zero import FLAT_REDUCE_SCATTER, mirror
from planc.driver.verify import VERIFIERS

C = ir.Collective
GB = 1e9
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H24 = Hierarchy((("node", 2), ("gpu", 4)))
FLAT_RS = "reduce_scatter(slice=root, form=inside)"
FLAT_AG = "all_gather(slice=root, form=inside)"
IN_THEN_ACROSS = "reduce_scatter(slice=node, form=inside); reduce_scatter(slice=node, form=parallel(root))"
ACROSS_THEN_IN = "reduce_scatter(slice=node, form=parallel(root)); reduce_scatter(slice=node, form=inside)"
ITS_MIRROR = "all_gather(slice=node, form=parallel(root)); all_gather(slice=node, form=inside)"


def two_by_four():
    return ir.Cluster((ir.Level("node", 2, 12.5 * GB, 2e-5), ir.Level("gpu", 4, 150 * GB, 2e-6)), "node")


def texts(programs):
    return [ir.program_text(p) for p in programs]


def lowered(text, hierarchy=H24, groups=1):
    """A program lowered on ``groups`` copies of the canonical layout (devices numbered group-major)."""
    n = hierarchy.size
    positions = {g * n + d: (g, pos) for g in range(groups) for d, (_, pos) in hierarchy.canonical_positions().items()}
    steps = lower_program(P(text) if isinstance(text, str) else text, hierarchy, positions)
    return [(str(c), gs) for c, gs in steps], [tuple(range(g * n, (g + 1) * n)) for g in range(groups)]


def units(owned_row):
    unit = math.lcm(*(x.denominator for ab in owned_row for x in ab))
    return unit, [[(int(a * unit), int(b * unit)) for a, b in owned_row]]


# ---------------------------------------------------------------- synthesis

def test_synthesis_finds_the_hierarchical_reduce_scatters_on_2x4_and_nothing_shorter():
    assert texts(synthesize_reduce_scatter(H24, max_size=1)) == [FLAT_RS]   # the hierarchical ones need 2 steps
    found = texts(synthesize_reduce_scatter(H24, max_size=5))
    assert found == [FLAT_RS, IN_THEN_ACROSS, ACROSS_THEN_IN]
    # in-host first permutes the pieces: device 1 (gpu 1 of node 0) owns the third eighth
    assert canonical_assignment(P(IN_THEN_ACROSS), H24)[:2] == ((F(0), F(1, 8)), (F(1, 4), F(3, 8)))
    assert canonical_assignment(P(ACROSS_THEN_IN), H24) == tuple((F(i, 8), F(i + 1, 8)) for i in range(8))


def test_all_gathers_are_synthesized_from_the_assignment_they_start_from():
    permuted = canonical_assignment(P(IN_THEN_ACROSS), H24)
    from_permuted = texts(synthesize_all_gather(H24, permuted))
    assert from_permuted[0] == ITS_MIRROR and FLAT_AG not in from_permuted   # rank order is not where it starts
    in_order = texts(synthesize_all_gather(H24, canonical_assignment(P(FLAT_RS), H24)))
    assert FLAT_AG in in_order and ITS_MIRROR not in in_order
    assert texts(synthesize_all_gather(H24, permuted, max_size=1)) == []    # the mirror needs both levels
    with pytest.raises(ValueError, match="an assignment of 2 pieces"):
        synthesize_all_gather(H24, permuted[:2])


def test_mirror_reverses_a_reduce_scatter_only_program():
    assert ir.program_text(mirror(P(IN_THEN_ACROSS))) == ITS_MIRROR
    assert mirror(P("allreduce(slice=root, form=inside)")) is None and mirror(()) is None


# ---------------------------------------------------------------- the independent checker

def test_checker_accepts_the_targets_and_rejects_wrong_final_pieces():
    steps, groups = lowered(IN_THEN_ACROSS)
    assert check.check_program(steps, groups, target="reduce_scatter") is None
    # an allreduce program leaves whole sums, a lone in-host reduce_scatter pieces summed over one host
    for text in ("allreduce(slice=root, form=inside)", "reduce_scatter(slice=node, form=inside)",
                 "reduce_scatter(slice=node, form=inside); allreduce(slice=node, form=parallel(root))"):
        bad, _ = lowered(text)
        assert "does not end with one piece of 1/8" in check.check_program(bad, groups, target="reduce_scatter")
    assert check.check_program(steps, groups) == "device 0 does not end with the full sum over its group"
    assert check.check_program(steps, groups, target="broadcast") == "unknown target 'broadcast'"


def test_checker_rejects_overlapping_owners():
    group = (tuple(range(4)),)
    same = {d: ((F(0), F(1, 4), frozenset(range(4))),) for d in range(2)}
    same.update({2: ((F(1, 2), F(3, 4), frozenset(range(4))),), 3: ((F(3, 4), F(1), frozenset(range(4))),)})
    assert semantics.goal_reason(same, group, C.REDUCE_SCATTER) == "devices 0 and 1 end holding overlapping pieces"
    ag, _ = lowered(FLAT_AG, Hierarchy((("gpu", 4),)))
    overlapping = [[[0, 1], [0, 1], [2, 3], [3, 4]]]
    assert "are not its 1/4 pieces" in check.check_program(ag, group, unit=4, target="all_gather", owned=overlapping)
    doc = {"name": PARAMETERS, "axes": ["data"], "bytes": 0, "groups": [[0, 1, 2, 3]], "target": "all_gather",
           "owned": overlapping, "program": {"text": FLAT_AG, "unit": 4, "predicted": 0.0,
                                             "steps": [{"collective": "all_gather", "groups": [[0, 1, 2, 3]],
                                                        "regions": [[0, 4]]}]}}
    with pytest.raises(planfile.PlanFileError, match=r"reductions\[1\]\.owned\[0\]: the members' ranges"):
        planfile.Reduction.read(planfile.At(doc, "reductions[1]"))


def test_checker_rejects_an_all_gather_from_another_assignment_and_a_tampered_owned():
    rs, groups = lowered(IN_THEN_ACROSS)
    unit, owned = units(canonical_assignment(P(IN_THEN_ACROSS), H24))
    assert check.final_owned(rs, groups, unit) == owned
    ag, _ = lowered(ITS_MIRROR)
    assert check.check_pair((rs, groups, unit, owned), (ag, groups, unit, owned)) is None
    # the flat all_gather from the flat pieces is valid on its own, not after this reduce-scatter
    flat_ag, _ = lowered(FLAT_AG)
    flat_owned = [[(i, i + 1) for i in range(8)]]
    assert check.check_program(flat_ag, groups, unit=8, target="all_gather", owned=flat_owned) is None
    why = check.check_pair((rs, groups, unit, owned), (flat_ag, groups, unit, flat_owned))
    assert why == "the all-gather starts device 1 from [1, 2) of 1/8, but the reduce-scatter leaves it [2, 3)"
    # owned that is not what the steps leave: two members swapped (still a valid partition)
    swapped = [list(owned[0])]
    swapped[0][1], swapped[0][2] = swapped[0][2], swapped[0][1]
    assert "device 1 ends with [2, 3) of 1/8, but owned says [4, 5) of 1/8" in check.check_program(
        rs, groups, unit=unit, target="reduce_scatter", owned=swapped)
    assert check.check_pair((rs, groups, unit, swapped), (ag, groups, unit, swapped)).startswith("reduce-scatter: ")
    # the mirror started from the swapped pieces does not end with the whole buffer
    assert check.check_program(ag, groups, unit=unit, target="all_gather", owned=swapped) is not None
    assert "unit" in check.check_pair((rs, groups, unit, owned), (ag, groups, 2 * unit, owned))


def test_verify_rejects_a_plan_json_whose_owned_was_tampered():
    doc = _compiled(TWO_BY_TWO)
    plan = planfile.Plan.from_json(doc)
    assert VERIFIERS["assemble"](plan, None) == []
    for which in ((0,), (1,), (0, 1)):          # the gradients' entry, the parameters', both alike
        bad = dict(doc, reductions=[dict(r) for r in doc["reductions"]])
        for i in which:
            owned = [list(row) for row in bad["reductions"][i]["owned"]]
            owned[0][1], owned[0][2] = owned[0][2], owned[0][1]
            bad["reductions"][i]["owned"] = owned
        problems = VERIFIERS["assemble"](planfile.Plan.from_json(bad), None)
        assert problems and all(p.startswith("plan.json reduction ") for p in problems), problems
    unpaired = dict(doc, reductions=doc["reductions"][:1])
    assert VERIFIERS["assemble"](planfile.Plan.from_json(unpaired), None) == [
        "reduction 'gradients': 0 all-gather programs over its groups, not one"]


# ---------------------------------------------------------------- properties

FACTORS = st.lists(st.integers(2, 4), min_size=1, max_size=3).filter(lambda f: math.prod(f) <= 16)


@settings(max_examples=25, deadline=None)
@given(FACTORS, st.integers(1, 4))
def test_every_synthesized_program_passes_the_independent_checker(factors, max_size):
    """On random hierarchies, lowered on two reduction groups: every reduce-scatter program meets its
    target, and every all-gather synthesized from its assignment returns the buffer (as a pair)."""
    hier = Hierarchy(tuple((f"l{i}", f) for i, f in enumerate(factors)))
    programs = synthesize_reduce_scatter(hier, max_size)
    assert FLAT_REDUCE_SCATTER in programs
    for program in programs:
        rs, groups = lowered(program, hier, groups=2)
        assert check.check_program(rs, groups, target="reduce_scatter") is None, ir.program_text(program)
        start = canonical_assignment(program, hier)
        unit = math.lcm(*(x.denominator for ab in start for x in ab))
        owned = check.final_owned(rs, groups, unit)
        assert owned == [[(int(a * unit), int(b * unit)) for a, b in start]] * 2
        gathers = synthesize_all_gather(hier, start, max_size)
        if mirror(program) is not None:      # as long as the reduce-scatter, so within max_size
            assert mirror(program) in gathers, ir.program_text(program)
        for back in gathers:
            ag, _ = lowered(back, hier, groups=2)
            why = check.check_pair((rs, groups, unit, owned), (ag, groups, unit, owned))
            assert why is None, (ir.program_text(program), ir.program_text(back), why)


@settings(max_examples=20, deadline=None)
@given(FACTORS, st.sampled_from([1 << 10, 1 << 26]))
def test_planned_pairs_are_valid_and_never_slower_than_the_flat_pair(factors, nbytes):
    levels = tuple(ir.Level(f"l{i}", f, 10 ** (9 + i) * 1.0, 10.0 ** -(4 + i)) for i, f in enumerate(factors))
    cluster = ir.Cluster(levels, levels[0].name)
    n = math.prod(factors)
    scatter, gather = plan_zero(cluster, ir.Reduction("gradients", ("data",)), [tuple(range(n))], nbytes)
    unit, owned = units(scatter.owned[0])
    steps = [[(str(c), g) for c, g in p.steps] for p in (scatter, gather)]
    assert check.check_pair((steps[0], scatter.groups, unit, owned), (steps[1], gather.groups, unit, owned)) is None
    net = Network(cluster)
    assert scatter.predicted == pytest.approx(program_time(net, scatter.steps, nbytes), rel=1e-9)
    assert gather.predicted == pytest.approx(program_time(net, gather.steps, nbytes / n), rel=1e-9)
    flat = program_time(net, ((C.REDUCE_SCATTER, scatter.groups),), nbytes) + program_time(
        net, ((C.ALL_GATHER, scatter.groups),), nbytes / n)
    assert scatter.flat_predicted + gather.flat_predicted == pytest.approx(flat, rel=1e-9)
    assert scatter.predicted + gather.predicted <= flat * (1 + 1e-9)


# ---------------------------------------------------------------- planning and ranking

def test_plan_zero_on_2x4_ranks_the_hierarchical_pair_by_the_cost_model():
    cluster, nbytes = two_by_four(), 1 << 26
    scatter, gather = plan_zero(cluster, ir.Reduction("gradients", ("data",)), [tuple(range(8))], nbytes)
    net = Network(cluster)

    def time(text, size):
        return program_time(net, lower_program(P(text), H24, H24.canonical_positions()), size)

    # the cost model, program by program: every pair's total, each all-gather from its own pieces
    totals = {}
    for rs in synthesize_reduce_scatter(H24):
        gathers = synthesize_all_gather(H24, canonical_assignment(rs, H24))
        totals[ir.program_text(rs)] = time(ir.program_text(rs), nbytes) + min(
            time(ir.program_text(g), nbytes / 8) for g in gathers)
    assert min(totals, key=totals.get) == scatter.text == IN_THEN_ACROSS
    assert gather.text == ITS_MIRROR
    assert scatter.predicted == pytest.approx(time(IN_THEN_ACROSS, nbytes), rel=1e-12)
    assert scatter.flat_predicted == pytest.approx(time(FLAT_RS, nbytes), rel=1e-12)
    assert gather.flat_predicted == pytest.approx(time(FLAT_AG, nbytes / 8), rel=1e-12)
    assert scatter.predicted < scatter.flat_predicted and gather.predicted < gather.flat_predicted
    assert [t for t, _ in scatter.alternatives] == [FLAT_RS, ACROSS_THEN_IN]   # next best, by time
    assert scatter.candidates == 3 and gather.candidates == 1
    assert (scatter.name, scatter.target, gather.name, gather.target) == ("gradients", C.REDUCE_SCATTER,
                                                                        PARAMETERS, C.ALL_GATHER)
    assert scatter.owned == gather.owned and scatter.unit == gather.unit == 8
    j, k = scatter.to_json(), gather.to_json()
    assert j["owned"] == k["owned"] == [[[0, 1], [2, 3], [4, 5], [6, 7], [1, 2], [3, 4], [5, 6], [7, 8]]]
    assert "allreduce_predicted" not in j and j["flat_predicted"] == scatter.flat_predicted
    assert j["target"] == "reduce_scatter" and k["target"] == "all_gather"


# ---------------------------------------------------------------- the compile pass

CLUSTER = """cluster {
  level node x 3 : bandwidth 1 GB/s, latency 20 us
  level gpu  x 4 : bandwidth 150 GB/s, latency 2 us
}
"""
STAGES = """stage 0 : layers 0..1 on devices 0..4  as (data = 2, tensor = 2)
stage 1 : layers 1..2 on devices 6..10 as (data = 4)
stage 2 : layers 2..3 on devices 10..12 as (data = 1, tensor = 2)
"""
MODEL = 'model "m.py:build"\nloss "m.py:loss"\ndata "m.py:batches"\n'
SIZES = {0: 1 << 26, 1: 3 << 24, 2: 300}
TWO_BY_TWO = """plan zero_2x2 {{
  cluster {{
    level node x 2 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 2 : bandwidth 100 GB/s, latency 2 us
  }}
  parallel {{ data = 4 }}
  model "../examples/mlp.py:build" {{ layers = 2, hidden = 8, inputs = 4, outputs = 2 }}
  loss  "../examples/mlp.py:loss"
  data  "../examples/mlp.py:batches"
  stage 0 : layers 0..2
  reduce gradients over data{using}
  train {{ micro_batch = 8, micro_batches = 2, steps = 1 }}
}}
"""


def zero(program: ir.Program, z: int = 1) -> ir.Program:
    """The checked program with ``train { zero = z }`` (set here: the front end's setting is not relied on)."""
    return dataclasses.replace(program, train=dataclasses.replace(program.train, zero=z))


def _stages(line: str, z: int = 1):
    program = zero(load_text(CLUSTER + STAGES + line + MODEL, "stages.plan"), z)
    placement = place(program, SIZES)
    return plan_reductions(program, placement.coords, placement.stages, placement.matrix, SIZES)


def _compiled(text: str, using: str = "", z: int = 1) -> dict:
    from planc.driver.compile import compile_program
    program = zero(load_text(text.format(using=using), os.path.join(ROOT, "plans", "zero-test.plan")), z)
    return compile_program(program, None, verify=True).plan_json


def test_explicit_stages_get_a_pair_each_and_a_stage_without_data_an_empty_pair():
    plans = _stages("reduce gradients over data\n")
    assert [(p.name, p.stage, str(p.target)) for p in plans] == [
        ("gradients", s, "reduce_scatter") if i % 2 == 0 else (PARAMETERS, s, "all_gather")
        for s in range(3) for i in range(2)]
    for rs, ag in zip(plans[::2], plans[1::2]):
        assert rs.groups == ag.groups and rs.owned == ag.owned and rs.nbytes == ag.nbytes == SIZES[rs.stage]
        assert rs.regions()[0] == ag.regions()[0]
    assert plans[0].text == FLAT_RS and plans[0].groups == ((0, 2), (1, 3))          # data pairs in one host
    assert plans[2].text == IN_THEN_ACROSS and plans[3].text == ITS_MIRROR
    assert plans[2].owned == (((F(0), F(1, 4)), (F(1, 2), F(3, 4)), (F(1, 4), F(1, 2)), (F(3, 4), F(1))),)
    empty = plans[4:]
    assert all(p.groups == () and p.program == () and p.candidates == 0 for p in empty)
    assert empty[0].record().to_json()["owned"] == [] and empty[1].record().to_json()["target"] == "all_gather"


def test_zero_0_keeps_the_allreduce_entries():
    plans = _stages("reduce gradients over data\n", z=0)
    assert [(p.name, p.stage, str(p.target)) for p in plans] == [("gradients", s, "allreduce") for s in range(3)]
    j = plans[1].record(ir.ReductionMode.SYNTHESIZE, ()).to_json()
    assert "target" not in j and "owned" not in j and "flat_predicted" not in j and "allreduce_predicted" in j


def test_using_allreduce_with_zero_is_the_flat_pair():
    plans = _stages("reduce gradients over data using allreduce\n")
    assert [p.text for p in plans[:4]] == [FLAT_RS, FLAT_AG, FLAT_RS, FLAT_AG]
    assert all(p.predicted == p.flat_predicted for p in plans[:4])
    assert plans[2].owned == (tuple((F(i, 4), F(i + 1, 4)) for i in range(4)),)
    assert {str(p.mode) for p in plans} == {"allreduce"}


def test_a_pinned_allreduce_program_with_zero_is_a_located_error_saying_which_target_it_meets():
    line = "reduce gradients over data using reduce_scatter(slice=root, form=inside); all_gather(slice=root, form=inside)\n"
    text = TWO_BY_TWO.replace("reduce gradients over data{using}", line.strip())
    with pytest.raises(PlanError) as e:
        _compiled(text)
    d = e.value.diagnostics[0]
    assert d.message.startswith("reduction program for 'gradients' is invalid: with zero = 1 the gradients are "
                                "reduce-scattered")
    assert "it meets the allreduce target, not the reduce-scatter target" in d.message
    assert (d.span.line, d.span.col) == (11, len("  reduce gradients over data using ") + 1)
    assert "Traceback" not in e.value.render()
    # the same program is what zero = 0 pins
    assert _compiled(text, z=0)["reductions"][0]["program"]["text"].startswith(FLAT_RS)


def test_a_pinned_program_meeting_no_target_names_the_reduce_scatter_target():
    with pytest.raises(PlanError) as e:
        _compiled(TWO_BY_TWO, using=" using reduce_scatter(slice=node, form=inside)")
    msg = e.value.diagnostics[0].message
    assert "must meet the reduce-scatter target" in msg and "it meets none: after step 1: device 0 ends" in msg


def test_a_pinned_reduce_scatter_gets_its_all_gather_synthesized():
    doc = _compiled(TWO_BY_TWO, using=f" using {ACROSS_THEN_IN}")
    rs, ag = doc["reductions"]
    assert (rs["program"]["text"], rs["mode"]) == (ACROSS_THEN_IN, "program")
    # its pieces are in rank order: the flat all_gather is valid too, but the mirror is predicted faster
    assert ag["mode"] == "synthesize" and ag["program"]["text"] == ir.program_text(mirror(P(ACROSS_THEN_IN)))
    assert [a["text"] for a in ag["alternatives"]] == [FLAT_AG]
    assert ag["alternatives"][0]["predicted"] > ag["program"]["predicted"]
    assert rs["owned"] == ag["owned"] == [[[0, 1], [1, 2], [2, 3], [3, 4]]]


def test_compiled_zero_plan_json_and_explain():
    """Compiled without a probe (sizes 0): the hierarchical orders tie on latency, in-host first by text."""
    doc = _compiled(TWO_BY_TWO)
    rs, ag = doc["reductions"]
    assert [g for st in rs["program"]["steps"] for g in st["groups"]] == [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert rs["program"]["unit"] == ag["program"]["unit"] == 4
    assert rs["owned"] == ag["owned"] == [[[0, 1], [2, 3], [1, 2], [3, 4]]]
    assert set(rs) >= {"flat_predicted", "candidates", "alternatives", "hierarchy", "target", "owned"}
    text = explain(doc)
    assert "reduce-scatter gradients over data (zero = 1)" in text and "all-gather parameters over data (zero = 1)" in text
    flat = " ".join(text.split())
    assert f"program: {IN_THEN_ACROSS} " in flat and f"program: {ITS_MIRROR} " in flat
    assert "flat reduce_scatter" in flat and "flat all_gather" in flat
    assert ("pieces after the reduce-scatter (in 1/4 of the buffer): [0, 1) device 0, [1, 2) device 2, "
            "[2, 3) device 1, [3, 4) device 3") in flat
    assert "pieces where the all-gather starts (in 1/4 of the buffer)" in flat
    assert "with the gradients' reduce-scatter:" in flat and "against the flat reduce_scatter + all_gather" in flat
