"""A chain of stages needs no ``transfer`` lines (LANGUAGE.md): in a plan with a model and no transfer
line at all, each stage's output goes to the next stage, as transfers ``s0_to_s1``, ``s1_to_s2``, ...
with their dtype and shape measured by the probe and their layouts derived (the batch dimension over
the mesh axis ``data``, replicated over the others). Once any transfer is written, the written ones are
the plan's. The launch (slow) trains a 2-stage plan without transfer lines on 2 gloo ranks and matches
plain torch SGD (``independent_reference``)."""
from __future__ import annotations

import json
import re

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file
from planc.model.infer import chain_transfers
from planc.lang import load
from planc.lang.errors import PlanError

from e2e_util import ROOT, assert_controls_fail, compare_dumps, independent_reference, run_direct, stage_ranks

MLP = ROOT / "examples" / "mlp.py"


def plan_text(stages: str, transfers: str = "", data: int = 1, devices: int = 2) -> str:
    return f"""plan chain {{
  cluster {{ level node x 1 : bandwidth 1 GB/s
            level cpu x {devices} : bandwidth 10 GB/s }}
  model "{MLP}:build" {{ layers = 4, hidden = 8, inputs = 6, outputs = 3 }}
  loss  "{MLP}:loss"
  data  "{MLP}:batches"
{stages}
{transfers}
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 2, steps = 2, schedule = 1f1b, optimizer = sgd(lr = 0.1), seed = 5 }}
}}
"""


TWO = "  stage 0 : layers 0..2 on devices 0..1 as (data = 1)\n  stage 1 : layers 2..4 on devices 1..2 as (data = 1)"
THREE_DATA = ("  stage 0 : layers 0..1 on devices 0..2 as (data = 2)\n"
              "  stage 1 : layers 1..3 on devices 2..4 as (data = 2)\n"
              "  stage 2 : layers 3..4 on devices 4..6 as (data = 2)")


def write(tmp_path, text: str):
    path = tmp_path / "chain.plan"
    path.write_text(text)
    return path


def test_no_transfer_line_is_a_chain(tmp_path):
    c = compile_file(write(tmp_path, plan_text(THREE_DATA, devices=6)))
    ts = c.plan_json["transfers"]
    assert [(t["name"], t["src"]["stage"], t["dst"]["stage"]) for t in ts] == [("s0_to_s1", 0, 1), ("s1_to_s2", 1, 2)]
    for t in ts:   # measured on the model: rows x hidden, the batch over data = 2 on both meshes
        assert (t["dtype"], t["shape"]) == ("f32", [4, 8])
        assert t["src"]["spec"] == t["dst"]["spec"] == "S0 R"
    assert not c.untrainable and c.plan_json["train"]["trainable"]


def test_written_transfers_are_the_plans(tmp_path):
    """One written transfer: no chain is added (stage 2 of three then receives nothing: an error)."""
    text = plan_text(THREE_DATA, "  transfer only from stage 0 to stage 1", devices=6)
    c = compile_file(write(tmp_path, text), probe=True)
    assert [t["name"] for t in c.plan_json["transfers"]] == ["only"]
    assert any("stage 2 receives no activation" in d.message for d in c.untrainable)


def test_chain_transfers_is_pure(tmp_path):
    program = load(write(tmp_path, plan_text(TWO)))
    assert program.transfers == ()
    chained = chain_transfers(program)
    (t,) = chained.transfers
    assert (t.name, t.src_stage, t.dst_stage, t.dtype, t.shape, t.src_spec, t.dst_spec) == \
        ("s0_to_s1", 0, 1, None, None, None, None)
    assert t.span == program.stage(1).span   # an error about it points at the stage that receives it
    assert chain_transfers(chained) is chained
    one = load(write(tmp_path, plan_text(TWO.split("\n")[0].replace("0..2", "0..4"), devices=1)))
    assert chain_transfers(one) is one   # one stage: nothing to chain


def test_without_probe_the_chain_must_be_declared(tmp_path):
    with pytest.raises(PlanError) as e:
        compile_file(write(tmp_path, plan_text(TWO)), probe=False)
    text = e.value.render()
    assert "transfer 's0_to_s1' has no type and the model was not probed" in text
    assert "chain.plan:" in text


@pytest.mark.slow
def test_a_chain_without_transfer_lines_trains(tmp_path):
    """2 stages, 1 device each, no transfer line: launched on 2 gloo ranks, 2 SGD steps, the same losses
    and parameters as the whole model trained with plain torch."""
    src = write(tmp_path, plan_text(TWO))
    c = compile_file(src)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    plan = json.loads((out / "plan.json").read_text())
    assert [t["name"] for t in plan["transfers"]] == ["s0_to_s1"]
    r = run_direct(out, "--steps", "2", "--dump-params", str(tmp_path / "dump"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d+ loss ([-0-9.e+]+)", r.stdout)]

    def compare(ref_losses, ref_state, _record):   # SGD: the parameters see a gradient scale
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), r.stdout[-2000:]
        compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)

    # the reference infers the chain from the plan text (no transfer line), as the language says
    compare(*independent_reference(plan, out, 2, source=src), None)
    assert_controls_fail(compare, plan, out, 2, source=src, data_parts=1)
