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


def _small_plan() -> dict:
    """A hand-written plan.json: 2 hosts x 2 devices, stage 0 on host 0, stage 1 on host 1."""
    def transfer(name, **extra):
        t = {"name": name, "dtype": "f32", "shape": [4, 8],
             "src": {"stage": 0, "spec": "S0 R"}, "dst": {"stage": 1, "spec": "R S0"},
             "strategy": "send_recv", "chunks": 1, "scheduler": "naive",
             "tasks": [{"slice": [[0, 2], [0, 4]]}, {"slice": [[0, 2], [4, 8]]},
                       {"slice": [[2, 4], [0, 4]]}, {"slice": [[2, 4], [4, 8]]}],
             "makespan": 0.002, "lower_bound": 0.001, "naive_makespan": 0.002}
        t.update(extra)
        return t
    fwd = {"src": {"0": [[0, 2], [0, 8]], "1": [[2, 4], [0, 8]]},
           "dst": {"2": [[0, 4], [0, 4]], "3": [[0, 4], [4, 8]]}}
    back = {"src": fwd["dst"], "dst": fwd["src"]}
    return {
        "name": "tiny",
        "cluster": {"levels": [{"name": "node", "fanout": 2}, {"name": "gpu", "fanout": 2}],
                    "host_level": "node", "devices": 4, "hosts": [[0, 1], [2, 3]]},
        "stages": [{"index": 0, "layers": None, "mesh": [0, 1], "mesh_axes": ["data"]},
                   {"index": 1, "layers": None, "mesh": [2, 3], "mesh_axes": ["data"]}],
        "reductions": [
            {"name": "gradients", "stage": 0, "axes": ["data"], "bytes": 1024, "groups": [[0, 1]],
             "program": {"text": "allreduce(slice=root, form=inside)",
                         "steps": [{"collective": "allreduce", "groups": [[0, 1]]}], "predicted": 1e-5},
             "allreduce_predicted": 1e-5, "candidates": 3, "alternatives": []},
        ],
        "transfers": [
            transfer("hidden", regions=fwd, backward={"makespan": 0.002, "regions": back}),
            transfer("old"),                                      # plan.json from before regions
            transfer("odd", regions={"src": {"0": [[0, 4], [0, 8]]}, "dst": {"2": [[0, 4], [0, 8]], "x": "?"}},
                     backward={"regions": {"src": {"3": [[0, 4], [0, 8]]}, "dst": {"1": [[0, 4], [0, 8]]}}}),
        ],
    }


def test_explain_prints_each_devices_region_on_both_meshes():
    text = explain(_small_plan())
    block = text[text.index("transfer hidden:"):text.index("\n\ntransfer old:")]
    assert block == """\
transfer hidden: f32[4, 8] stage 0 (S0 R) -> stage 1 (R S0)
  4 unit task(s), strategy send_recv, scheduled by naive
  makespan 2.000 ms; lower bound 1.000 ms (2.00x; the bound counts NIC bytes, not latency); naive schedule 2.000 ms
  scheduled on one NIC timeline with old, odd (same source stage): times are where this transfer ends on it
  regions (global ranges a:b per dim; src = stage 0's mesh, dst = stage 1's):
    dev 0 (host 0)  src [0:2, 0:8]
    dev 1 (host 0)  src [2:4, 0:8]
    dev 2 (host 1)  dst [0:4, 0:4]
    dev 3 (host 1)  dst [0:4, 4:8]
  backward (gradients, stage 1 -> stage 0): the same regions, reversed"""
    assert "reduce gradients over data (stage 0): 1.0 KiB per group, 1 group(s) of 2" in text


def test_explain_without_regions_or_with_odd_ones_does_not_crash():
    text = explain(_small_plan())
    old = text[text.index("transfer old:"):text.index("\n\ntransfer odd:")]
    assert "regions" not in old
    odd = text[text.index("transfer odd:"):]
    assert "    dev x (host ?)  dst ?" in odd
    assert "  backward regions (src = stage 1's mesh, sending gradients; dst = stage 0's):" in odd
    assert "    dev 1 (host 0)  dst [0:4, 0:8]" in odd and "    dev 3 (host 1)  src [0:4, 0:8]" in odd
