"""End-to-end: a plan with a host NIC order (plan.json pipeline.nic_order) trained by its ranks
started directly (``e2e_util.run_direct``, 4 CPU ranks on gloo, 2 plan hosts of 2), with SGD, against
``independent_reference`` (plain torch, no planc code); its --trace shows every host's cross-host
sends taking their turns exactly in the plan's order, step after step."""

from __future__ import annotations

import json
import re

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

from e2e_util import (ROOT, assert_controls_fail, compare_dumps, data_degree, independent_reference,
                      run_direct, stage_ranks)
from test_nic_order import SLOW

STEPS = 2


@pytest.mark.slow
def test_nic_ordered_training_matches_the_reference_and_runs_the_order(tmp_path):
    text = (ROOT / "plans" / "gpt-bench-2x2.plan").read_text()
    start = text.index("  cluster {")
    text = text[:start] + SLOW + text[text.index("  }", start) + 3:]
    text, n = re.subn(r"schedule = eager_1f1b", "schedule = 1f1b", text)
    text, k = re.subn(r"optimizer = adam\(lr = [^)]*\)", "optimizer = sgd(lr = 0.05)", text)
    assert n == 1 and k == 1
    src = tmp_path / "gpt-nic.plan"
    src.write_text(text.replace('"../examples/', f'"{ROOT}/examples/'))
    c = compile_file(src)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    plan = json.loads((out / "plan.json").read_text())
    order = {e["host"]: [tuple(s) for s in e["sends"]] for e in plan["pipeline"].get("nic_order", ())}
    assert order, "the compiler kept no NIC order for a 25 Mbit/s host link"

    r = run_direct(out, "--steps", str(STEPS), "--dump-params", str(tmp_path / "dump"),
                  "--trace", str(tmp_path / "trace"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "host NIC order:" in r.stdout
    # the hold's rate is the compiled host link's, said at start-up (a faster link would be held back)
    rate = min(lv["bandwidth"] for lv in plan["cluster"]["levels"][:1 + next(
        i for i, lv in enumerate(plan["cluster"]["levels"]) if lv["name"] == plan["cluster"]["host_level"])]
        if lv["fanout"] > 1)
    assert f"each turn held for its bytes at {rate / 1e6:g} MB/s, the host link the plan was compiled for" in r.stdout
    losses = [float(x) for x in re.findall(r"step \d+ loss ([-0-9.e+]+)", r.stdout)]


    def compare(ref_losses, ref_state, _record):   # SGD: the parameters see a gradient scale
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "losses"
        compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)

    compare(*independent_reference(plan, out, STEPS, source=src), None)
    assert_controls_fail(compare, plan, out, STEPS, source=src, data_parts=data_degree(plan))

    from planc.runtime.trace import load
    traces = load(str(tmp_path / "trace"))
    for h, sends in order.items():
        turns = []
        for rank in plan["cluster"]["hosts"][h]:
            for e in traces[rank]["traceEvents"]:
                if e.get("ph") == "X" and e.get("tid") == "nic":
                    name, direction, m = e["name"].split()[1:]
                    turns.append((e["args"]["turn"], e["ts"], (rank, name, direction, int(m[1:]))))
        turns.sort()
        assert [t for t, _, _ in turns] == list(range(STEPS * len(sends)))      # every turn, once
        assert [key for _, _, key in turns] == sends * STEPS                     # in the plan's order
        starts = [ts for _, ts, _ in turns]
        assert starts == sorted(starts), "a turn began before the one before it"
