"""A split backward (B: input gradients, W: weight gradients; planc/runtime/bwsplit.py) run by the engine
from a plan.json action list, against the independent single-process reference (SGD, rtol 1e-4).

The lists are written here by hand from the compiled plan's: every ``W m`` right after ``B m+1`` (the
last one before the reduce), so each micro-batch's weight gradients wait one backward, as zero-bubble
schedules defer them. Whatever the order, the numbers must be 1f1b's."""
from __future__ import annotations

import json

import pytest

from e2e_util import (ROOT, assert_controls_fail, compare_dumps, data_degree, independent_reference, run_direct,
                      stage_ranks, step_lines)
from planc.driver.compile import compile_file
from planc.output.codegen import write_output

pytestmark = pytest.mark.xdist_group("split_backward")
STEPS = 2


def deferred_weights(actions: list) -> None:
    """In place: per class, W m inserted after B m+1 of the same stage (the last W before the REDUCEs)."""
    for c in actions:
        lst = c["list"]
        out, waiting = [], {}
        for a in lst:
            if a[0] == "REDUCE":
                for s in sorted(waiting):
                    out += [["W", s, m] for m in waiting.pop(s)]
            out.append(a)
            if a[0] == "B":
                prev = waiting.setdefault(a[1], [])
                out += [["W", a[1], m] for m in prev]
                prev[:] = [a[2]]
        c["list"] = out


@pytest.mark.parametrize("name", ["mlp-data2-to-data4.plan", "gpt-1-to-data2-tensor2.plan"])
def test_deferred_weight_gradients_train_the_reference(tmp_path, name):
    source = ROOT / "tests" / "plans" / name
    c = compile_file(source)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    plan = json.loads((out / "plan.json").read_text())
    assert c.program.train.optimizer.name == "sgd"
    deferred_weights(plan["pipeline"]["actions"])
    assert all(sum(a[0] == "W" for a in cl["list"]) == plan["pipeline"]["micro_batches"] * len(cl["stages"])
               for cl in plan["pipeline"]["actions"])
    (out / "plan.json").write_text(json.dumps(plan))
    r = run_direct(out, "--steps", str(STEPS), "--dump-params", str(tmp_path / "dump"), "--trace", str(tmp_path / "tr"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    lines = step_lines(r.stdout)
    losses = [lines[s]["loss"] for s in sorted(lines)]

    def compare(ref_losses, ref_state, _record):
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "losses"
        return compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)

    compare(*independent_reference(plan, out, STEPS, source=source), None)
    assert_controls_fail(compare, plan, out, STEPS, source=source, data_parts=data_degree(plan))
    # every stage rank ran its W passes, each after its B (the trace's compute spans, in time order)
    from planc.runtime.trace import load
    traces = load(str(tmp_path / "tr"))
    for rank in stage_ranks(plan):
        ev = sorted((e for e in traces[rank]["traceEvents"] if e.get("ph") == "X"
                     and e["name"] in ("BackwardPass", "WeightPass")), key=lambda e: e["ts"])
        ran = [(e["name"][0], e["args"]["micro_batch"]) for e in ev]
        assert sum(k == "W" for k, _ in ran) == STEPS * plan["pipeline"]["micro_batches"], rank
        for i, (k, m) in enumerate(ran):
            if k == "W":
                assert ("B", m) in ran[:i], (rank, ran)


@pytest.mark.parametrize("zero", [2, 3])
def test_deferred_weight_gradients_under_zero(tmp_path, zero):
    """ZeRO-2 reduce-scatters each micro-batch's gradients at the end of its W; ZeRO-3 gathers each layer for
    B (W of a linear reads no weight)."""
    from test_e2e_zero2 import run_and_compare, train_settings, variant
    src, out, plan = variant(tmp_path, "mlp-data2-to-data4.plan", train_settings(zero))
    deferred_weights(plan["pipeline"]["actions"])
    (out / "plan.json").write_text(json.dumps(plan))
    run_and_compare(tmp_path, src, out, plan, STEPS)
