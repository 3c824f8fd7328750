"""Transfers completed from the model: types measured by the probe (the plan's stage dataflow on one
micro-batch), layouts derived from each stage's mesh, declared parts checked against both; tensor-parallel
gradient sizes and reductions. Uses the real probe (a subprocess with torch) on examples/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planc import ir
from planc.driver.compile import compile_program
from planc.model.infer import derived_spec, infer_transfers, same_layout
from planc.lang import load, load_text
from planc.lang.errors import PlanError
from planc.model.probe import ModelProbe, check_against_model, check_model_reductions, probe_model
from test_compile import check_plan_json  # tests/ is on sys.path (rootdir-relative test modules)

ROOT = Path(__file__).resolve().parents[2]
EX = str(ROOT / "examples")
S = ir.ShardingSpec.parse

GPT = """plan t {
  cluster { level node x 2 : bandwidth 12.5 GB/s, latency 20 us
            level gpu x 4 : bandwidth 150 GB/s, latency 2 us }
  parallel { pipe = 2, data = 2, tensor = 2 }
  model "EX/gpt.py:build" { layers = 4, hidden = 64, heads = 4, seq = 32, vocab = 256 }
  loss "EX/gpt.py:loss"
  data "EX/gpt.py:batches"
  stage 0 : layers 0..3
  stage 1 : layers 3..6
TRANSFER
REDUCE
  train { micro_batch = 8, micro_batches = 4 }
}
"""
UNET = """plan u {
  cluster { level node x 3 : bandwidth 12.5 GB/s
            level gpu x 2 : bandwidth 150 GB/s }
  parallel { pipe = 3, data = 2 }
  model "EX/unet.py:build" { channels = 4, inputs = 2, length = 16 }
  loss "EX/unet.py:loss"
  data "EX/unet.py:batches"
STAGES
TRANSFERS
  train { micro_batch = 4 }
}
"""
MLP = """plan m {
  cluster { level node x 2 : bandwidth 12.5 GB/s
            level gpu x 4 : bandwidth 150 GB/s }
  model "EX/mlp.py:build" { layers = 4, hidden = HIDDEN }
  loss "EX/mlp.py:loss"
  data "EX/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..4 as (MESH0)
  stage 1 : layers 2..4 on devices 4..8 as (MESH1)
TRANSFER
REDUCE
  train { micro_batch = 8 }
}
"""


def plan(tmp_path, template: str, **parts) -> ir.Program:
    text = template.replace("EX", EX)
    for k, v in parts.items():
        text = text.replace(k.upper(), v)
    path = tmp_path / "t.plan"
    path.write_text(text)
    return load(path)


def gpt(tmp_path, transfer="  transfer hidden from stage 0 to stage 1", reduce="  reduce gradients over data"):
    return plan(tmp_path, GPT, transfer=transfer, reduce=reduce)


def mlp(tmp_path, transfer="  transfer h from stage 0 to stage 1", reduce="", mesh0="data = 2, tensor = 2",
        mesh1="4", hidden="16"):
    return plan(tmp_path, MLP, transfer=transfer, reduce=reduce, mesh0=mesh0, mesh1=mesh1, hidden=hidden)


def render(e: pytest.ExceptionInfo) -> str:
    """As the CLI shows it: with the plan's lines (the driver attaches the source to errors of the passes)."""
    for d in e.value.diagnostics:
        e.value.with_source(d.span.file, Path(d.span.file).read_text())
    return e.value.render()


def passes(program: ir.Program, probe: ModelProbe | None) -> ir.Program:
    """The driver's sequence (planc.driver.compile): probe, check against it, infer."""
    if probe is not None:
        check_against_model(program, probe)
        check_model_reductions(program, probe)
    return infer_transfers(program, probe)


# ---------------------------------------------------------------- measured and derived

def test_gpt_transfer_measured_and_derived_and_gradients_per_shard(tmp_path):
    p = gpt(tmp_path)
    probe = probe_model(p)
    assert probe.tensor_parallel and probe.micro_batch == 8 and probe.graph_errors == ()
    assert probe.layer_params == (18432, 49984, 49984, 49984, 49984, 16768)
    # one device of a tensor group of 2 holds half of qkv, proj and the MLP of every block, and all of the rest
    assert probe.params_per_device(2) == (18432, 25184, 25184, 25184, 25184, 16768)
    assert dict(probe.stage_tensor) == {0: 2, 1: 2}
    assert probe.layer_shapes[-1] == (8, 32, 256) and probe.layer_dtypes[0] == "f32"
    q = passes(p, probe)
    (t,) = q.transfers
    assert (t.dtype, t.shape, t.src_spec, t.dst_spec) == ("f32", (8, 32, 64), S("S0 R R"), S("S0 R R"))
    assert t.complete and t.nbytes == 8 * 32 * 64 * 4
    per_stage = probe.stage_param_bytes(q.stages, q.train.precision)
    assert per_stage == {0: (18432 + 2 * 25184) * 4, 1: (2 * 25184 + 16768) * 4}
    unsplit = {s.index: sum(probe.layer_params[s.layers[0]:s.layers[1]]) * 4 for s in q.stages}
    assert unsplit[0] / per_stage[0] > 1.7             # what plan.json used to report
    c = compile_program(q, probe)                      # the rest of the driver takes the completed program
    check_plan_json(c.plan_json)
    grads = {s["stage"]: s["bytes"] for s in c.plan_json["reductions"][0]["per_stage_bytes"]}
    assert grads == per_stage
    assert c.plan_json["transfers"][0]["shape"] == [8, 32, 64]
    assert c.plan_json["transfers"][0]["src"]["spec"] == "S0 R R"
    # placed meshes (StageLayout) size the same as the plan's stages
    from planc.placement import place
    assert probe.stage_param_bytes(place(q, per_stage).stages, q.train.precision) == per_stage


def test_unet_skips_and_multi_input_stage_are_measured(tmp_path):
    stages = "  stage 0 : layers 0..2\n  stage 1 : layers 2..3\n  stage 2 : layers 3..6"
    transfers = ("  transfer down from stage 0 to stage 1\n  transfer mid from stage 1 to stage 2\n"
                 "  transfer e2 from stage 0 layer 1 to stage 2\n  transfer e1 from stage 0 layer 0 to stage 2 as S0 R R")
    p = plan(tmp_path, UNET, stages=stages, transfers=transfers)
    probe = probe_model(p)
    assert not probe.tensor_parallel and probe.graph_errors == ()
    assert all(s is not None for s in probe.layer_shapes)          # every layer ran, Dec2 on three inputs
    q = passes(p, probe)
    got = [(t.name, t.dtype, t.shape, str(t.src_spec), str(t.dst_spec)) for t in q.transfers]
    assert got == [("down", "f32", (4, 8, 8), "S0 R R", "S0 R R"), ("mid", "f32", (4, 8, 8), "S0 R R", "S0 R R"),
                   ("e2", "f32", (4, 8, 8), "S0 R R", "S0 R R"), ("e1", "f32", (4, 4, 16), "S0 R R", "S0 R R")]
    # the bundled plan leaves the types to the probe; its spelled copy (for --no-probe tests) writes
    # exactly what is measured
    from e2e_util import spelled
    assert [(t.dtype, t.shape) for t in load(ROOT / "plans" / "unet-skip.plan").transfers] == [(None, None)] * 4
    copy = load(spelled("unet-skip.plan"))
    assert [(t.dtype, t.shape) for t in copy.transfers] == [(t.dtype, t.shape) for t in q.transfers]


def test_mlp_explicit_meshes_derive_per_stage_layouts(tmp_path):
    """Stage 0 (data = 2, tensor = 2) splits the batch rows; stage 1's anonymous mesh has no data axis."""
    p = mlp(tmp_path, reduce="  reduce gradients over data, tensor")
    probe = probe_model(p)
    q = passes(p, probe)          # mlp.py does not opt in to tensor parallelism: its tensor axis holds replicas
    (t,) = q.transfers
    assert (t.shape, t.src_spec, t.dst_spec) == ((8, 16), S("S0 R"), S("R R"))
    assert not probe.tensor_parallel and dict(probe.stage_tensor) == {0: 2, 1: 1}
    per_stage = probe.stage_param_bytes(q.stages, q.train.precision)
    assert per_stage == {0: (8 * 16 + 16 + 16 * 16 + 16) * 4, 1: (16 * 16 + 16 + 16 * 4 + 4) * 4}


def test_derived_spec_rules():
    assert derived_spec(3, ((2, 2), ("data", "tensor"))) == S("S0 R R")
    assert derived_spec(2, ((2, 4), ("tensor", "data"))) == S("S1 R")
    assert derived_spec(2, ((1, 4), ("data", "tensor"))) == S("R R")      # data of size 1: nothing to split
    assert derived_spec(2, ((4,), ("m0",))) == S("R R")
    assert derived_spec(0, ((4,), ("data",))) == ir.ShardingSpec(())
    assert same_layout(S("S0 R"), S("R R"), ((1, 4), ("data", "tensor")))
    assert not same_layout(S("S0 R"), S("R R"), ((2, 2), ("data", "tensor")))
    assert not same_layout(S("S0 R"), S("S0 R R"), ((2, 2), ("data", "tensor")))


# ---------------------------------------------------------------- written parts must agree

def test_declared_type_is_checked_against_the_model(tmp_path):
    p = gpt(tmp_path, "  transfer hidden : f32[8, 32, 65] from stage 0 to stage 1")
    probe = probe_model(p)
    with pytest.raises(PlanError) as e:
        check_against_model(p, probe)
    assert render(e).splitlines()[0] == (
        f"{tmp_path / 't.plan'}:10:21: error: transfer 'hidden' declares f32[8, 32, 65] but stage 0 layer 2 "
        "produces f32[8, 32, 64] for a micro-batch of 8")
    p = gpt(tmp_path, "  transfer hidden : f16[8, 32, 64] from stage 0 layer 1 to stage 1")
    with pytest.raises(PlanError) as e:
        check_against_model(p, probe_model(p))
    assert "transfer 'hidden' declares f16[8, 32, 64] but stage 0 layer 1 produces f32[8, 32, 64]" in render(e)


def test_written_spec_must_be_what_the_stage_computes(tmp_path):
    p = gpt(tmp_path, "  transfer hidden : f32[8, 32, 64] from stage 0 as S(data) R R to stage 1 as R R R")
    with pytest.raises(PlanError) as e:
        infer_transfers(p, None)
    (d,) = e.value.diagnostics
    assert d.message == ("transfer 'hidden': stage 1 computes S0 R R (batch rows split over data = 2, replicated "
                         "over tensor), but the plan says R R R")
    assert (d.span.line, d.span.col, d.span.end_col) == (10, 78, 83)
    p = gpt(tmp_path, "  transfer hidden : f32[8, 32, 64] from stage 0 as R S0 R to stage 1")
    with pytest.raises(PlanError, match=r"stage 0 computes S0 R R \(.*\), but the plan says R S0 R"):
        infer_transfers(p, None)


def test_equivalent_written_forms_are_accepted(tmp_path):
    p = gpt(tmp_path, "  transfer hidden : f32[8, 32, 64] from stage 0 as S(data) R R to stage 1 as S0RR")
    (t,) = infer_transfers(p, None).transfers
    assert t.src_spec == t.dst_spec == S("S0 R R")
    # a split over a mesh axis of size 1 is no split: the stage's layout is R R
    p = mlp(tmp_path, "  transfer h : f32[8, 16] from stage 0 as S(data) R to stage 1 as R R",
            mesh0="data = 1, tensor = 4")
    (t,) = infer_transfers(p, None).transfers
    assert t.src_spec == S("R R")


def test_spec_without_data_axis_names_the_reason(tmp_path):
    p = mlp(tmp_path, "  transfer h : f32[8, 16] from stage 0 as S0 R to stage 1 as S0 R")
    with pytest.raises(PlanError) as e:
        infer_transfers(p, None)
    assert [d.message for d in e.value.diagnostics] == [
        "transfer 'h': stage 1 computes R R (replicated over m0; no mesh axis is named data), but the plan says S0 R"]


def test_spec_entries_and_divisibility_checked_once_measured(tmp_path):
    p = gpt(tmp_path, "  transfer hidden from stage 0 as S0 R to stage 1")
    with pytest.raises(PlanError) as e:
        passes(p, probe_model(p))
    (d,) = e.value.diagnostics
    assert d.message == ("transfer 'hidden' (source spec): the spec has 2 entries but the tensor has 3 dimensions "
                         "[8, 32, 64]; write one entry per dimension")
    assert (d.span.line, d.span.col) == (10, 35)
    p = mlp(tmp_path, "  transfer h from stage 0 to stage 1 as R S(data)", mesh1="data = 4", hidden="6")
    with pytest.raises(PlanError) as e:
        passes(p, probe_model(p))
    assert [d.message for d in e.value.diagnostics] == [
        "transfer 'h' (destination spec): tensor dimension 1 of size 6 does not divide evenly over mesh size 4 "
        "(stage 1, S0)"]


def test_missing_type_without_a_probe_is_located(tmp_path):
    p = gpt(tmp_path)
    with pytest.raises(PlanError) as e:
        infer_transfers(p, None)
    assert render(e).splitlines() == [
        f"{tmp_path / 't.plan'}:10:12: error: transfer 'hidden' has no type and the model was not probed: declare "
        "it ('transfer hidden : f32[...] from ...') or allow probing (drop --no-probe) so planc measures it on the "
        "model",
        "  10 |   transfer hidden from stage 0 to stage 1",
        "                  ^^^^^^"]
    # the specs alone need no probe
    (t,) = infer_transfers(gpt(tmp_path, "  transfer hidden : f32[8, 32, 64] from stage 0 to stage 1"), None).transfers
    assert t.src_spec == t.dst_spec == S("S0 R R")


def test_unmeasurable_transfer_says_why(tmp_path):
    """Stage 1 hands the decoder only one of its three inputs: what it would send is never computed. The
    probe's exercise of the user's code (planc.runtime.usererrors) says so first, at stage 1's line; without
    it, inference says why the transfer could not be measured."""
    stages = "  stage 0 : layers 0..2\n  stage 1 : layers 2..4\n  stage 2 : layers 4..6"
    transfers = "  transfer m from stage 0 to stage 1\n  transfer d from stage 1 to stage 2"
    p = plan(tmp_path, UNET, stages=stages, transfers=transfers)
    with pytest.raises(PlanError) as e:
        probe_model(p)
    (d,) = e.value.diagnostics
    assert d.message == ("stage 1 layer 3 (Dec2) takes (m, e2, e1) but gets 1 input(s) (f32[2, 8, 8]): missing a "
                         "required argument: 'e2'; it gets layer 2's output (a tuple is spread), so a layer that "
                         "takes skip inputs must start the stage its transfers arrive at"), d.message
    assert d.span.line == 9
    p = dataclasses.replace(p, loss=None)   # nothing to exercise: the measurement alone
    probe = probe_model(p)
    assert probe.measured("m").shape == (4, 8, 8) and probe.measured("d").shape is None
    with pytest.raises(PlanError) as e:
        passes(p, probe)
    (d,) = e.value.diagnostics
    assert d.message.startswith("transfer 'd' has no type and planc could not measure it on the model (stage 1 "
                                "layer 3 (Dec2) failed on inputs (f32[4, 8, 8]): TypeError: ")
    assert d.message.endswith("; declare it ('transfer d : f32[...] from ...')") and d.span.line == 12


def test_a_plan_without_a_model_is_returned_unchanged(tmp_path):
    path = tmp_path / "c.plan"
    path.write_text("cluster { level gpu x 4 : bandwidth 100 GB/s }\n"
                    "stage 0 on devices 0..2 as (data = 2)\nstage 1 on devices 2..4 as (2)\n"
                    "transfer x : f32[6, 4] from stage 0 as R R to stage 1 as R S0\n")
    p = load(path)
    assert infer_transfers(p, None) is p
    path.write_text(path.read_text().replace("transfer x : f32[6, 4]", "transfer x"))
    with pytest.raises(PlanError, match="transfer 'x' needs its type"):
        load(path)


# ---------------------------------------------------------------- tensor parallelism

def test_reducing_tensor_parallel_shards_over_tensor_is_an_error(tmp_path):
    p = gpt(tmp_path, "  transfer hidden : f32[8, 32, 64] from stage 0 to stage 1",
            "  reduce gradients over data, tensor")
    probe = probe_model(p)
    with pytest.raises(PlanError) as e:
        check_model_reductions(p, probe)
    lines = render(e).splitlines()
    assert lines[0] == (
        f"{tmp_path / 't.plan'}:11:3: error: gradients of tensor-parallel shards must not be reduced over 'tensor': "
        f"the model ({EX}/gpt.py:build) splits its layers over the 'tensor' axis of stage 0, 1, so each device "
        "along it holds a different shard; reduce gradients over data only")
    assert lines[1] == "  11 |   reduce gradients over data, tensor"
    check_model_reductions(dataclasses.replace(p, reductions=p.reductions[:0]), probe)


def test_a_tensor_degree_the_model_refuses_is_located(tmp_path):
    path = tmp_path / "t.plan"
    path.write_text(f"""cluster {{ level gpu x 3 : bandwidth 100 GB/s }}
parallel {{ tensor = 3 }}
model "{EX}/gpt.py:build" {{ layers = 1, hidden = 16, heads = 4, seq = 8, vocab = 32 }}
loss "{EX}/gpt.py:loss"
data "{EX}/gpt.py:batches"
""")
    with pytest.raises(PlanError) as e:
        probe_model(load(path))
    assert render(e).splitlines()[0] == (
        f"{path}:3:1: error: the model cannot be split over a tensor group of 3 (the 'tensor' axis of stage 0): "
        f"{EX}/gpt.py:build says ValueError: heads = 4 do not divide over a tensor group of 3")


def test_model_probe_is_a_frozen_slotted_record():
    probe = ModelProbe((1, 2), ((4,), None))
    assert not hasattr(probe, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        probe.tensor_parallel = True
    stage = ir.Stage(0, (0, 2), mesh_shape=(2, 2), mesh_axes=("data", "tensor"), first_device=0)
    assert probe.stage_param_bytes([stage], ir.Precision.BF16) == {0: 6}    # not tensor-parallel: replicas


ROWS = """plan rows {
  cluster { level node x 4 : bandwidth 12.5 GB/s, latency 20 us
            level gpu x 8 : bandwidth 150 GB/s, latency 2 us }
  parallel { pipe = 2, data = 8, tensor = 2 }
  model "EX/gpt.py:build" { layers = 4, hidden = 16, heads = 2, seq = 8, vocab = 64 }
  loss "EX/gpt.py:loss"
  data "EX/gpt.py:batches"
  STAGES
  reduce gradients over data
  train { micro_batch = 256, micro_batches = 2, steps = 1, optimizer = sgd(lr = 0.1), seed = 3 }
}
"""


@pytest.mark.parametrize("stages", ["stage 0 : layers 0..3\n  stage 1 : layers 3..6\n  transfer h from stage 0 to stage 1",
                                    "stages = auto(2)"], ids=["explicit", "chain"])
def test_the_probe_runs_a_fixed_number_of_rows_and_answers_as_for_the_whole_micro_batch(stages):
    """A micro-batch that grows with the data axis (256 rows, data = 8) is probed on 64 of its rows
    (probe_rows: PROBE_ROWS, above a device's 32): the answer, scaled, is the one the whole micro-batch gives
    (shapes, bytes, saved bytes, FLOPs, tensor traffic), so the probe's time and memory stay put as the
    cluster grows."""
    from planc.model.probe import PROBE_ROWS, probe_request, probe_rows
    from planc.runtime.probe import _request
    program = load_text(ROWS.replace("EX", EX).replace("STAGES", stages), "rows.plan")
    assert probe_rows(program) == PROBE_ROWS == 64
    req = probe_request(program)
    assert req["rows"] == 64 and req["micro_batch"] == 256
    cut, whole = _request(req), _request({k: v for k, v in req.items() if k != "rows"})
    assert cut == whole
    assert any(o and o["shape"][0] == 256 for o in whole["layer_outputs"])
    small = load_text(ROWS.replace("EX", EX).replace("STAGES", stages).replace("micro_batch = 256", "micro_batch = 64"),
                 "rows.plan")
    assert probe_rows(small) == 64 and "rows" not in probe_request(small)   # at most PROBE_ROWS: all of them
