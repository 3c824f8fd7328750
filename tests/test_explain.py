"""`planc explain`: per placement the matrix and why it won, per reduction the program against flat allreduce."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from planc.compile import compile_file
from planc.explain import explain

ROOT = Path(__file__).resolve().parents[1]


def test_explain_p2_plan_shows_matrix_reasons_and_programs():
    plan = compile_file(ROOT / "plans" / "p2-running-example.plan", probe=False).plan_json
    text = explain(plan)
    pl = plan["placement"]
    assert f"placement: {pl['candidates']} parallelism matrices fit" in text
    for axis, row in zip(pl["axes"], pl["matrix"]):
        assert re.search(rf"^\s+{axis['name']}\s+" + r"\s+".join(map(str, row)) + r"\s*$", text, re.M), axis
    assert "why: predicted communication per iteration" in text and "runner-up" in text
    for r in plan["reductions"]:
        assert f"reduce {r['name']} over {', '.join(r['axes'])}" in text
        assert f"  program: {r['program']['text']}" in text
        assert "flat allreduce" in text and f"{r['candidates']} valid program(s) found" in text
        for alt in r["alternatives"]:
            assert alt["text"] in text
    for ranked in pl["ranked"]:                       # each costed matrix with its breakdown
        assert str(ranked["matrix"]) in text
        assert all(k in text for k in ranked["breakdown"])


def test_explain_cli_shows_transfers_and_pipeline():
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(ROOT / "plans" / "unet-skip.plan"),
                        "--no-probe"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for name in ("down", "mid", "e2", "e1"):
        assert f"transfer {name}: " in r.stdout
    assert "scheduled on one NIC timeline with" in r.stdout
    assert "pipeline: eager_1f1b, 4 micro-batches" in r.stdout and "stage 2: F0 F1 B0 F2" in r.stdout
