"""Tensor-parallel traffic derived from the model: the probe measures the bytes a model's Megatron f/g
operators all-reduce per micro-batch, and placement costs them with no declaration in the plan.

Independent references: the Megatron count (a block of examples/gpt.py all-reduces its
``[rows, seq, hidden]`` activations twice forward (g after attention and after the MLP) and twice
backward (f before them)), and a count of the all-reduces a real ``TensorParallel`` issues when the
sharded model is trained one step in this process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planc.driver.compile import compile_program
from planc.lang import load_text
from planc.model.probe import probe_model
from planc import plan as planfile

from e2e_util import ROOT

F32 = 4
GPT = {"layers": 3, "hidden": 16, "heads": 2, "seq": 8, "vocab": 32}


def megatron_bytes(rows: int, blocks: int, seq: int, hidden: int) -> list[int]:
    """Per direction: 2 all-reduces of the block's activations per block."""
    return [rows * seq * hidden * F32] * (2 * blocks)


def _request(**extra):
    from planc.runtime.probe import _request as run
    req = {"model_file": str(ROOT / "examples" / "gpt.py"), "function": "build", "args": dict(GPT),
           "data_file": str(ROOT / "examples" / "gpt.py"), "data_function": "batches", "micro_batch": 8, "seed": 3,
           "stages": [[0, 2], [2, 5]],
           "transfers": [{"name": "h", "src_stage": 0, "src_layer": None, "dst_stage": 1}],
           "tensor_degrees": [2],
           # stage 0 (embedding, block 1) on (data 2, tensor 2): 4 rows a device; stage 1 (blocks 2-3,
           # head) on (tensor 2): all 8 rows
           "tensor_stages": [{"stage": 0, "layers": [0, 2], "degree": 2, "rows": 4},
                             {"stage": 1, "layers": [2, 5], "degree": 2, "rows": 8}]}
    req.update(extra)
    return run(req)


def test_probe_counts_the_megatron_all_reduces():
    doc = _request()
    by_stage = {t["stage"]: t for t in doc["tensor_traffic"]}
    seq, hidden = GPT["seq"], GPT["hidden"]
    assert by_stage[0]["forward"] == megatron_bytes(4, 1, seq, hidden) == by_stage[0]["backward"]
    assert by_stage[1]["forward"] == megatron_bytes(8, 2, seq, hidden) == by_stage[1]["backward"]
    assert all(not t["errors"] and t["degree"] == 2 for t in doc["tensor_traffic"])
    # a builder that does not opt in holds replicas: no tensor traffic
    mlp = _request(model_file=str(ROOT / "examples" / "mlp.py"), data_file=str(ROOT / "examples" / "mlp.py"),
                   args={"layers": 4, "hidden": 16, "inputs": 8, "outputs": 4}, stages=[[0, 2], [2, 4]])
    assert mlp["tensor_traffic"] == [] and not mlp["tensor_parallel"]


def test_probe_bytes_equal_a_real_tensor_group_step():
    """Rank 1 of a real TensorParallel of 2 (its all-reduce a no-op that counts) trains one micro-batch of
    4 rows through blocks 2-3 and the head: it issues exactly what the probe logged for stage 1's layers."""
    import torch
    from planc.runtime.tensor_parallel import TensorParallel
    from test_tensor_parallel import gpt

    issued = []

    class Counting(TensorParallel):
        def all_reduce(self, t):
            issued.append(t.numel() * t.element_size())
            return t

    torch.manual_seed(3)
    layers = gpt.build(**GPT, tensor_parallel=Counting(None, 1, 2))
    x, y = next(gpt.batches(4, 3, **GPT))
    h = x
    for layer in layers[:2]:
        h = layer(h)
    h = h.detach().requires_grad_(True)
    issued.clear()
    out = h
    for layer in layers[2:]:
        out = layer(out)
    forward = list(issued)
    issued.clear()
    gpt.loss(out, y).backward()
    backward = list(issued)
    doc = _request(tensor_stages=[{"stage": 1, "layers": [2, 5], "degree": 2, "rows": 4}])
    (st,) = doc["tensor_traffic"]
    assert (st["forward"], st["backward"]) == (forward, backward)
    assert len(forward) == len(backward) == 4


GPT_2X4 = ROOT / "plans" / "gpt-2x4.plan"


def _without_declaration(text: str) -> str:
    return "\n".join(line for line in text.splitlines()
                     if "tensor_traffic" not in line and "all-reduces, 4 per" not in line)


@pytest.fixture(scope="module")
def gpt_2x4():
    """plans/gpt-2x4.plan (pipe 2 x data 2 x tensor 2 on 2 nodes of 4) with and without its declared
    `reduce tensor_traffic`, probed once (the probe does not depend on reductions)."""
    text = GPT_2X4.read_text().replace('"../examples/', f'"{ROOT}/examples/')
    assert "tensor_traffic" not in text        # the bundled plan declares nothing: the probe measures it
    declared = load_text(text.replace("  reduce gradients over data ", "  reduce tensor_traffic over tensor : "
                                      "f32[1048576]\n  reduce gradients over data "), str(GPT_2X4))
    bare_text = _without_declaration(text)
    bare = load_text(bare_text, str(GPT_2X4))
    return declared, bare, probe_model(bare)


def test_placement_costs_probed_traffic_without_a_declaration(gpt_2x4):
    declared, bare, probe = gpt_2x4
    with_decl = compile_program(declared, probe).plan_json["placement"]
    derived = compile_program(bare, probe).plan_json["placement"]
    blind = compile_program(bare, dataclasses.replace(probe, tensor_traffic=())).plan_json["placement"]

    # the same matrix as with the hand-written declaration: tensor inside a node ([2, 1] on the gpu level)
    assert derived["matrix"] == with_decl["matrix"] == [[1, 2], [2, 1], [1, 2]]
    # without the measurement (and without the declaration) placement does not see the traffic and
    # splits tensor across the slow node link; under the full cost model that choice is worse
    assert blind["matrix"] != derived["matrix"]
    by_matrix = {json.dumps(r["matrix"]): r for r in derived["ranked"]}
    assert by_matrix[json.dumps(blind["matrix"])]["predicted"] > derived["ranked"][0]["predicted"]

    best = derived["ranked"][0]["breakdown"]
    assert "tensor traffic" in best and "reduce tensor_traffic" not in best
    assert best["tensor traffic"] == max(t["predicted"] for t in derived["tensor_traffic"])

    # the probed bytes: micro_batch 8 over data 2 = 4 rows; seq 32, hidden 64; 2 blocks per stage
    args = dict(bare.model.args)
    rows = bare.train.micro_batch // 2
    per_direction = megatron_bytes(rows, 2, args["seq"], args["hidden"])
    assert [(t.stage, t.degree, t.rows, list(t.forward), list(t.backward)) for t in probe.tensor_traffic] == [
        (0, 2, rows, per_direction, per_direction), (1, 2, rows, per_direction, per_direction)]
    for rec in derived["tensor_traffic"]:
        assert rec["forward"] == rec["backward"] == {"all_reduces": 4, "bytes": sum(per_direction)}
        assert rec["bytes_per_micro_batch"] == 2 * sum(per_direction) and rec["micro_batches"] == 8
        # its groups are the stage's tensor groups: 2 devices of one node each
        assert all(len(g) == 2 and g[0] // 4 == g[1] // 4 for g in rec["groups"]) and len(rec["groups"]) == 2


def test_plan_json_keeps_the_costed_traffic(gpt_2x4, tmp_path):
    _, bare, probe = gpt_2x4
    c = compile_program(bare, probe)
    text = planfile.dumps(planfile.Plan.from_json(c.plan_json))
    back = json.loads(text)
    assert back["placement"]["tensor_traffic"] == c.plan_json["placement"]["tensor_traffic"]
    assert [t["stage"] for t in back["placement"]["tensor_traffic"]] == [0, 1]
    from planc.commands.explain import explain
    assert "tensor traffic" in explain(back)   # the breakdown of each ranked matrix names it


def test_explicit_stages_get_their_tensor_groups_costed():
    """Explicit meshes (tests/plans/gpt-1-to-data2-tensor2.plan: stage 1 is (data 2, tensor 2) on devices
    1..4, hosts of 3 devices): no matrix is ranked, but placement still costs each tensor group's
    all-reduces: groups {1, 2} and {3, 4} each inside a host, so each all-reduce of S bytes is a ring of 2
    on the 10 GB/s, 2 us level: 2(k-1)/k * S/B + 2(k-1) * latency = S/B + 2 * latency (DESIGN.md)."""
    from planc.lang import load
    from planc.placement import place
    program = load(ROOT / "tests" / "plans" / "gpt-1-to-data2-tensor2.plan")
    ops = (4096, 4096)
    placement = place(program, None, tensor_traffic={1: (ops, ops)})
    assert placement.matrix is None and placement.to_json() is None
    (rec,) = placement.tensor_traffic
    assert rec["stage"] == 1 and rec["groups"] == [[1, 2], [3, 4]]
    assert rec["forward"] == rec["backward"] == {"all_reduces": 2, "bytes": 8192}
    m = program.train.micro_batches
    want = m * sum(s / 10e9 + 2 * 2e-6 for s in ops + ops)
    assert rec["predicted"] == pytest.approx(want, rel=1e-9)
