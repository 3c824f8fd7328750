"""End-to-end: ``zero = 3`` (LANGUAGE.md ``zero``; docs/training.md "ZeRO-3") against ``independent_reference``
(plain torch, one process, no planc code) at rtol 1e-4, with its negative controls (gradients x2, a data
rank's rows missing) failing the same comparison:

- data 2 -> data 4 (hierarchical programs), SGD with the defaults (prefetch, freed after every use):
  ``--memory-stats`` shows each layer gathered twice a micro-batch and never the whole stage held;
- the same, AdamW + clip, ``zero_keep_gathered = true`` and stage 1 recomputing: one gather per layer a step;
- a (data 2, tensor 2) stage, AdamW + clip, ``zero_prefetch = false`` (gathers in the compute thread),
  stage 1 recomputing;
- a Linear tied across stages (stays whole), AdamW; and bf16 + clip with the tie (bf16's tolerance);
- checkpoints across degrees: test_e2e_zero3_ckpt.py.

Slow: launches of 3-9 ranks (forked from one interpreter, ~10-20 s each).
"""
from __future__ import annotations

import json
import re

import pytest

from e2e_util import (assert_controls_fail, compare_dumps, independent_reference, stage_ranks,
                      start_ranks, step_lines)
from test_e2e_zero2 import ADAMW_CLIP, run_and_compare, targets, train_settings, variant

STAGE1 = r"(stage 1 : layers 2\.\.4 on devices 4\.\.8 as \(data = 4\))"


def memory(path) -> dict:
    return {int(m[1]): json.loads(f.read_text()) for f in path.iterdir() if (m := re.match(r"rank(\d+)\.json$", f.name))}


def check_gathers(mem: dict, ranks, per_layer: int, layers) -> None:
    """Every rank gathered each of its layers ``per_layer`` times, held some gathered parameters at its peak
    and none after the step (tests/runtime/test_zero3.py shows the storage freed between layers)."""
    for rank in ranks:
        got = mem[rank]
        want = {str(k): per_layer[k] if isinstance(per_layer, dict) else per_layer for k in layers[rank]}
        assert got["zero3_gathers"] == want, (rank, got["zero3_gathers"])
        assert got["zero3_gathered_bytes_now"] == 0, rank          # freed after the step
        assert 0 < got["zero3_peak_gathered_bytes"] <= got["zero3_sharded_parameter_bytes"], rank


@pytest.mark.slow
def test_zero3_on_unequal_meshes_sgd_matches_the_reference(tmp_path):
    src, out, plan = variant(tmp_path, "mlp-data2-to-data4.plan", train_settings(3))
    assert plan["train"]["zero"] == 3 and plan["train"]["zero3"] == {"prefetch": True, "keep_gathered": False}
    assert targets(plan) == {("gradients", 0): "reduce_scatter", ("parameters", 0): "all_gather",
                             ("gradients", 1): "reduce_scatter", ("parameters", 1): "all_gather"}
    r, _ = run_and_compare(tmp_path, src, out, plan, 3, "--memory-stats", str(tmp_path / "mem"),
                           "--trace", str(tmp_path / "trace"))
    assert "ZeRO-3" in r.stderr and "freed between uses" in r.stderr, r.stderr[-3000:]
    # the trace's gather events (thread "gather"): one per layer unit gathered, the same count as --memory-stats
    from planc.runtime.trace import summarise
    events = json.loads((tmp_path / "trace" / "trace-rank4.json").read_text())["traceEvents"]
    gathers = [e["name"].split()[2] for e in events if e.get("tid") == "gather"]
    assert {k: gathers.count(k) for k in set(gathers)} == {"2": 24, "3": 24}
    assert summarise(str(tmp_path / "trace"))
    mem = memory(tmp_path / "mem")
    layers = {0: (0, 1), 1: (0, 1), 4: (2, 3), 5: (2, 3), 6: (2, 3), 7: (2, 3)}
    micro_batches, steps = plan["pipeline"]["micro_batches"], 3
    check_gathers(mem, layers, 2 * micro_batches * steps, layers)   # forward and backward, each micro-batch
    for rank in layers:   # what the rank reports holding: the gathered peak, nothing of the stage kept whole
        assert mem[rank]["parameter_bytes"] == mem[rank]["zero3_peak_gathered_bytes"]


@pytest.mark.slow
def test_zero3_keep_gathered_with_recompute_adamw_clip(tmp_path):
    edits = train_settings(3, ADAMW_CLIP) + [(r"(micro_batch = \d+)", r"zero_keep_gathered = true, \1"),
                                             (STAGE1, r"\1 recompute")]
    src, out, plan = variant(tmp_path, "mlp-data2-to-data4.plan", edits)
    assert plan["train"]["zero3"] == {"prefetch": True, "keep_gathered": True}
    assert plan["train"]["recompute"] == [False, True]
    r, record = run_and_compare(tmp_path, src, out, plan, 3, "--memory-stats", str(tmp_path / "mem"))
    assert max(record["grad_norm"]) > 0.05   # clipped
    layers = {0: (0, 1), 1: (0, 1), 4: (2, 3), 5: (2, 3), 6: (2, 3), 7: (2, 3)}
    check_gathers(memory(tmp_path / "mem"), layers, 3, layers)   # one a step


@pytest.mark.slow
def test_zero3_with_tensor_parallelism_no_prefetch_and_recompute(tmp_path):
    """Stage 1 on (data 2, tensor 2), GPT's block 2 sharded over tensor and its parameters over data;
    gathers in the compute thread (zero_prefetch = false); stage 1 recomputes; AdamW + clip."""
    edits = [(r"optimizer = sgd\(lr = 0\.5\)", ADAMW_CLIP),
             (r"(micro_batch = \d+)", r"zero = 3, zero_prefetch = false, \1"),
             (r"(stage 1 : layers 2\.\.4 on devices 1\.\.5 as \(data = 2, tensor = 2\))", r"\1 recompute")]
    src, out, plan = variant(tmp_path, "gpt-1-to-data2-tensor2.plan", edits)
    assert targets(plan)[("gradients", 1)] == "reduce_scatter"
    assert plan["train"]["zero3"] == {"prefetch": False, "keep_gathered": False}
    r, record = run_and_compare(tmp_path, src, out, plan, 3, "--memory-stats", str(tmp_path / "mem"))
    assert "ZeRO-3" in r.stderr and "prefetch off" in r.stderr, r.stderr[-3000:]
    assert max(record["grad_norm"]) > 0.05
    info = json.loads((tmp_path / "dump" / "rank2.shards.json").read_text())
    assert {int(k.split(".")[1]) for k in info} >= {2}   # block 2 really is sharded over tensor
    layers = {r: (2, 3) for r in (1, 2, 3, 4)}
    m = plan["pipeline"]["micro_batches"] * 3   # micro-batches of the 3 steps
    # recompute: forward, recompute, backward; the last layer's backward starts the recompute (gathered already)
    check_gathers(memory(tmp_path / "mem"), layers, {2: 3 * m, 3: 2 * m}, layers)


# ---------------------------------------------------------------- a Linear tied across two zero-3 stages

def _tied_plan(tmp_path, train: str, **edits):
    from test_tied import _compile, _plan, _tied
    _, out = _compile(tmp_path, _plan(4, "on devices 0..2 as (data = 2)", "on devices 2..4 as (data = 2)", train))
    from e2e_util import edit_plan
    plan = edit_plan(out, **edits)
    assert plan["train"]["zero"] == 3
    (t, _b) = _tied(plan)
    assert t["groups"] == [[0, 1, 2, 3]]
    return out, plan


@pytest.mark.slow
def test_zero3_with_a_linear_tied_across_stages_adamw_clip(tmp_path):
    """Both stages data 2 and zero 3, AdamW + clip; the Linear shared by layers 0 and 3 stays whole (a replicated fp32
    master, a whole gradient summed by the tie's program), the MLP layers between are sharded and gathered."""
    from planc import plan as P
    from test_tied import STEPS, _copies_identical
    out, plan = _tied_plan(tmp_path, "zero = 3, clip = 0.05", optimizer=P.Optimizer.make("adamw", 1e-2))
    rc, rank0, every = start_ranks(out, 4, "--steps", STEPS, "--dump-params", out / "dump",
                                   "--memory-stats", out / "mem")
    assert rc == 0 and "Traceback" not in every, every[-4000:]
    got = step_lines(rank0)

    def compare(ref_losses, ref_state, record):
        assert [got[s]["loss"] for s in range(STEPS)] == pytest.approx(ref_losses, rel=1e-4, abs=1e-6)
        assert [got[s]["grad_norm"] for s in range(STEPS)] == pytest.approx(record["grad_norm"], rel=1e-4)
        compare_dumps(out / "dump", stage_ranks(plan), ref_state, rtol=1e-4, atol=1e-6)

    record: dict = {}
    losses, state = independent_reference(plan, out, STEPS, record=record)
    assert losses[-1] != losses[0] and max(record["grad_norm"]) > 0.05
    compare(losses, state, record)
    _copies_identical(out / "dump", plan)
    assert_controls_fail(compare, plan, out, STEPS, source=None, data_parts=2)
    mem = memory(out / "mem")
    m = plan["pipeline"]["micro_batches"]
    for rank, layer in ((0, 1), (1, 1), (2, 2), (3, 2)):   # the tied layers 0 and 3 hold nothing sharded
        assert mem[rank]["zero3_gathers"] == {str(layer): 2 * m * STEPS}, mem[rank]["zero3_gathers"]
        assert mem[rank]["parameter_bytes"] == mem[rank]["zero3_peak_gathered_bytes"] + 4 * (8 * 8 + 8)


@pytest.mark.slow
def test_zero3_bf16_with_a_tie_and_clip(tmp_path):
    """bf16 + clip under zero 3: parameters gathered in bf16 from fp32 masters; the update is the fp32
    reference's within bf16's tolerance (a 5 % rate error is not)."""
    from test_tied import run_bf16
    out, plan = _tied_plan(tmp_path, "zero = 3, clip = 0.05", transfer_dtype="bf16", precision="bf16")
    run_bf16(out, plan, 4)
