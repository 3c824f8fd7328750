"""`planc explain`: per placement the matrix and why it won, per reduction the program against flat allreduce,
per transfer its schedule and regions; in plain (piped) mode, 80 columns; --json and --draw."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from planc.driver.compile import compile_file
from planc.commands.draw import draw
from planc.commands.explain import explain, explain_data

from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[2]
UNET = spelled("unet-skip.plan")   # the bundled plan with its transfer types written out: no probe needed


def _flat(text: str) -> str:
    """Whitespace runs as one space: long lines wrap at 80 columns with a hanging indent."""
    return " ".join(text.split())


def test_explain_p2_plan_shows_matrix_reasons_and_programs():
    compiled = compile_file(ROOT / "plans" / "p2-running-example.plan", probe=False)
    plan = compiled.plan_json
    text = explain(compiled.plan)              # the typed plan, as the CLI gives it
    assert explain(plan) == text               # plan.json, read once with the plan file's reader
    flat = _flat(text)
    pl = plan["placement"]
    assert f"placement: {pl['candidates']} parallelism matrices fit" in text
    for axis, row in zip(pl["axes"], pl["matrix"]):      # one table row per axis: name, then its factors
        assert re.search(rf"^\s*{axis['name']}\s+" + r"\s+".join(map(str, row)) + r"\s*$", text, re.M), axis
    assert "why: predicted communication per iteration" in flat and "runner-up" in flat
    for r in plan["reductions"]:
        assert f"reduce {r['name']} over {', '.join(r['axes'])}" in text
        assert f"program: {r['program']['text']}" in flat
        assert "flat allreduce" in flat and f"{r['candidates']} valid program(s) found" in flat
        for alt in r["alternatives"]:                   # one instruction per line of the alternatives table
            for instruction in alt["text"].split(";"):
                assert instruction.strip() in text
    host_of = {d: h for h, devs in enumerate(plan["cluster"]["hosts"]) for d in devs}
    for r, shown in zip(plan["reductions"], explain_data(plan)["reductions"]):   # in host or across hosts
        assert [s["in_host"] for s in shown["steps"]] == [
            all(len({host_of[d] for d in g}) == 1 for g in s["groups"]) for s in r["program"]["steps"]]
    assert {s["in_host"] for r in explain_data(plan)["reductions"] for s in r["steps"]} == {True, False}
    for ranked in pl["ranked"]:                       # each costed matrix with its breakdown
        assert str(ranked["matrix"]) in text
        assert all(k in text for k in ranked["breakdown"])
    assert all(len(line) <= 80 for line in text.splitlines()), max(text.splitlines(), key=len)


def test_explain_cli_shows_transfers_and_pipeline():
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(UNET),
                        "--no-probe"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout                    # piped: no ANSI escapes
    for name in ("down", "mid", "e2", "e1"):
        assert f"transfer {name}: " in r.stdout
        assert re.search(rf"^{name}\s+\d -> \d\s+\w+", r.stdout, re.M), name   # the transfers table
    assert "scheduled on one NIC timeline with" in r.stdout
    assert "pipeline: eager_1f1b, 4 micro-batches" in r.stdout
    classes = compile_file(UNET, probe=False).plan_json["pipeline"]["actions"]
    text = " ".join(r.stdout.split())   # the table wraps each class's long list
    for c in classes:                  # each class's row of the schedule table: its actions, in order
        words = [f"{a[0]}{a[1]}.{a[2]}" if a[0] in "FBW" else f"reduce({a[1]})" if a[0] == "REDUCE" else
                 f"{a[0].lower()}({a[3]},{dict(forward='fwd', backward='bwd')[a[4]]},{a[2]})" for a in c["list"]]
        assert " ".join(words) in text, c["stages"]
    assert all(len(line) <= 80 for line in r.stdout.splitlines())


def test_explain_json_is_the_same_content():
    plan = compile_file(UNET, probe=False).plan_json
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(UNET),
                        "--no-probe", "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data == json.loads(json.dumps(explain_data(plan)))
    assert list(data) == ["plan", "cluster", "placement", "stages", "tensor_groups", "reductions", "transfers", "pipeline", "choices"]
    assert data["placement"]["matrix"] == plan["placement"]["matrix"]
    assert [t["name"] for t in data["transfers"]] == [t["name"] for t in plan["transfers"]]
    for t, src in zip(data["transfers"], plan["transfers"]):
        assert t["strategy"] == src["strategy"] and t["tasks"] == len(src["tasks"])
        assert t["makespan"] == src["makespan"] and t["lower_bound"] == src["lower_bound"]
    assert [c["stages"] for c in data["pipeline"]["actions"]] == [c["stages"] for c in plan["pipeline"]["actions"]]
    assert [len(c["list"]) for c in data["pipeline"]["actions"]] == [len(c["list"]) for c in plan["pipeline"]["actions"]]
    assert data["reductions"][0]["program"] == plan["reductions"][0]["program"]["text"]


def test_explain_draw_svg_has_one_node_per_device(tmp_path):
    svg = tmp_path / "tree.svg"
    plan = compile_file(UNET, probe=False).plan_json
    assert draw(plan, svg) == plan["cluster"]["devices"]
    text = svg.read_text()
    ids = re.findall(r'id="device-(\d+)"', text)
    assert sorted(map(int, ids)) == list(range(plan["cluster"]["devices"]))
    groups = re.findall(r'id="group-(\d+)-(\d+)"', text)
    assert len(groups) == sum(len(r["groups"]) for r in plan["reductions"] if any(len(g) > 1 for g in r["groups"]))
    sends = {(int(t), int(k)) for t, k in re.findall(r'id="transfer-(\d+)-(\d+)"', text)}
    assert {t for t, _ in sends} == set(range(len(plan["transfers"])))   # a row of arrows per transfer
    png = tmp_path / "tree.png"
    draw(plan, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_explain_draw_bad_suffix_or_no_matplotlib_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(UNET),
                        "--no-probe", "--draw", str(tmp_path / "tree.pdf")], capture_output=True, text=True)
    assert r.returncode == 2 and "must end in .png or .svg, not '.pdf'" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "matplotlib").mkdir()            # a matplotlib that cannot be imported shadows the real one
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
                        "from planc.commands.cli import main; raise SystemExit(main(sys.argv[1:]))",
                        "explain", str(UNET), "--no-probe",
                        "--draw", str(tmp_path / "t.svg")], capture_output=True, text=True)
    assert r.returncode == 2 and "matplotlib is not installed" in r.stderr, r.stderr
    assert not (tmp_path / "t.svg").exists()


def _small_plan() -> dict:
    """A hand-written plan.json: 2 hosts x 2 devices, stage 0 on host 0, stage 1 on host 1. ``hidden`` and
    ``again`` go S0 R -> R S0, their gradients back the same way reversed; ``odd`` goes S0 R -> R R and its
    gradients come back replicated (R R -> R R), regions that are not the forward ones reversed."""
    def task(piece, sender, receivers):
        return {"slice": piece, "holders": [sender], "receivers": receivers, "sender": sender}

    def route(regions, tasks, **extra):
        return {"strategy": "send_recv", "chunks": 1, "scheduler": "naive", "tasks": tasks, **extra,
                "regions": regions}

    def transfer(name, regions, tasks, backward):
        return {"name": name, "dtype": "f32", "shape": [4, 8],
                "src": {"stage": 0, "spec": "S0 R"}, "dst": {"stage": 1, "spec": "R S0" if name != "odd" else "R R"},
                **route(regions, tasks, makespan=0.002, lower_bound=0.001, naive_makespan=0.002),
                "backward": backward}
    fwd = {"src": {"0": [[0, 2], [0, 8]], "1": [[2, 4], [0, 8]]},
           "dst": {"2": [[0, 4], [0, 4]], "3": [[0, 4], [4, 8]]}}
    pieces = [([[a, a + 2], [b, b + 4]], a // 2, 2 + b // 4) for a in (0, 2) for b in (0, 4)]
    tasks = [task(p, s, [r]) for p, s, r in pieces]
    back = route({"src": fwd["dst"], "dst": fwd["src"]}, [task(p, r, [s]) for p, s, r in pieces], makespan=0.002)
    whole = [[0, 4], [0, 8]]
    odd = {"src": fwd["src"], "dst": {"2": whole, "3": whole}}
    odd_tasks = [task([[0, 2], [0, 8]], 0, [2, 3]), task([[2, 4], [0, 8]], 1, [2, 3])]
    odd_back = route({"src": {"2": whole, "3": whole}, "dst": {"0": whole, "1": whole}},
                     [task(whole, 2, [0]), task(whole, 3, [1])])
    return {
        "format": "planc/1", "name": "tiny",
        "cluster": {"levels": [{"name": "node", "fanout": 2, "bandwidth": None, "latency": 0.0},
                               {"name": "gpu", "fanout": 2, "bandwidth": None, "latency": 0.0}],
                    "host_level": "node", "devices": 4, "hosts": [[0, 1], [2, 3]]},
        "groups": [[0, 1]], "stage_mode": "pipe_axis",
        "stages": [{"index": 0, "layers": None, "devices": [0, 1], "mesh": [0, 1], "mesh_axes": ["data"],
                    "mesh_shape": [2], "mesh_devices": [0, 1]},
                   {"index": 1, "layers": None, "devices": [2, 3], "mesh": [2, 3], "mesh_axes": ["data"],
                    "mesh_shape": [2], "mesh_devices": [2, 3]}],
        "reductions": [
            {"name": "gradients", "stage": 0, "axes": ["data"], "bytes": 1024, "groups": [[0, 1]],
             "program": {"text": "allreduce(slice=root, form=inside)", "unit": 1,
                         "steps": [{"collective": "allreduce", "groups": [[0, 1]], "regions": [[0, 1]]}],
                         "predicted": 1e-5},
             "allreduce_predicted": 1e-5, "candidates": 3, "alternatives": []},
        ],
        "transfers": [transfer("hidden", fwd, tasks, back), transfer("again", fwd, tasks, back),
                      transfer("odd", odd, odd_tasks, odd_back)],
    }


def _rows(block: str) -> list[list[str]]:
    """The rows of the region table in a block of explain's text: device, host, then region cells."""
    return [line.split(None, 2) for line in block.splitlines() if re.match(r"^\s+(\d+|x)\s+(\d+|\?)\s", line)]


def test_explain_prints_each_devices_region_on_both_meshes():
    text = explain(_small_plan())
    block = text[text.index("transfer hidden:"):text.index("\n\ntransfer again:")]
    assert block.startswith("""\
transfer hidden: f32[4, 8] stage 0 (S0 R) -> stage 1 (R S0)
  4 unit task(s), strategy send_recv, scheduled by naive
  makespan 2.000 ms; lower bound 1.000 ms (2.00x; the bound counts NIC bytes,
      not latency); naive schedule 2.000 ms
  scheduled on one NIC timeline with again, odd (same source stage): times are
      where this transfer ends on it
  regions (global ranges a:b per dim; src = stage 0's mesh, dst = stage 1's):
""")
    # columns: device, host, src region, dst region (a device is on one mesh here)
    assert re.search(r"^device\s+host\s+src region\s+dst region$", block, re.M)
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"^\s+(\d)\s+(\d)\s+(\[.*\])$", block, re.M)}
    assert sorted(lines) == [0, 1, 2, 3]
    src_col = block.splitlines()[[i for i, l in enumerate(block.splitlines()) if l.startswith("device")][0]].index("src")
    dst_col = block.splitlines()[[i for i, l in enumerate(block.splitlines()) if l.startswith("device")][0]].index("dst")
    for d, host, region, col in ((0, 0, "[0:2, 0:8]", src_col), (1, 0, "[2:4, 0:8]", src_col),
                                 (2, 1, "[0:4, 0:4]", dst_col), (3, 1, "[0:4, 4:8]", dst_col)):
        line = lines[d]
        assert line.split()[1] == str(host) and line.index(region) == col, line
    assert block.rstrip().endswith("  backward (gradients, stage 1 -> stage 0): the same regions, reversed")
    assert "reduce gradients over data (stage 0): 1.0 KiB per group, 1 group(s) of 2" in text


def test_explain_shows_backward_regions_that_are_not_the_forward_ones_reversed():
    text = explain(_small_plan())
    odd = text[text.index("transfer odd:"):]
    assert "  backward regions (src = stage 1's mesh, sending gradients; dst = stage 0's):" in odd
    back = odd[odd.index("backward regions"):]
    assert re.search(r"^\s+0\s+0\s+\[0:4, 0:8\]$", back, re.M)          # dev 0 on host 0: dst only
    assert re.search(r"^\s+3\s+1\s+\[0:4, 0:8\]\s*$", back, re.M)      # dev 3 on host 1: src only
    hdr = next(l for l in back.splitlines() if l.startswith("device"))
    zero = next(l for l in back.splitlines() if re.match(r"^\s+0\s", l))
    three = next(l for l in back.splitlines() if re.match(r"^\s+3\s", l))
    assert zero.index("[") == hdr.index("dst") and three.index("[") == hdr.index("src")


def test_explain_reads_plan_json_with_the_plan_files_reader():
    """explain takes the typed plan; a plan.json document is read once, validated: a transfer without its
    regions, or a malformed note of the compiler's, is named by its key."""
    import pytest
    from planc.plan import PlanFileError
    doc = _small_plan()
    del doc["transfers"][1]["regions"]
    with pytest.raises(PlanFileError, match=r"^plan.json: transfers\[1\].regions: missing$"):
        explain(doc)
    doc = _small_plan()
    doc["reductions"][0]["candidates"] = "3"
    with pytest.raises(PlanFileError, match=r"^plan.json: reductions\[0\].candidates: expected an integer"):
        explain(doc)


TP = ROOT / "tests" / "plans" / "gpt-1-to-data2-tensor2.plan"


def test_explain_lists_the_tensor_groups_of_an_explicit_mesh():
    plan = compile_file(TP, probe=False).plan_json
    assert explain_data(plan)["tensor_groups"] == [{"stage": 1, "tensor": 2, "groups": [[1, 2], [3, 4]]}]
    flat = _flat(explain(plan))
    assert ("tensor groups (each splits its stage's layers; their all-reduces stay inside it): "
            "stage 1: 2 group(s) of 2: [1, 2], [3, 4]") in flat


def test_explain_says_nothing_to_reduce_once_for_the_stages_that_have_nothing(tmp_path):
    """Every stage of data = 1 under one `reduce` line: one line naming them all, not a block per stage."""
    text = TP.read_text().replace("../../examples", str(ROOT / "examples")).replace(
        "level gpu  x 3", "level gpu  x 4").replace(
        "stage 1 : layers 2..4 on devices 1..5 as (data = 2, tensor = 2)   # block 2, head",
        "stage 1 : layers 2..3 on devices 1..2 as (data = 1)\n"
        "  stage 2 : layers 3..4 on devices 2..6 as (data = 2, tensor = 2)\n"
        "  transfer h2 : f32[8, 8, 16] from stage 1 as R R R to stage 2 as S0 R R").replace(
        "to stage 1 as S0 R R", "to stage 1 as R R R", 1)
    (tmp_path / "p.plan").write_text(text)
    flat = _flat(explain(compile_file(tmp_path / "p.plan", probe=False).plan_json))
    assert ("reduce gradients over data (stages 0, 1): nothing to reduce: stages 0, 1 each have data = 1 (one "
            "device holds each gradient; no communication)") in flat
    assert flat.count("nothing to reduce") == 1
    assert "reduce gradients over data (stage 2): " in flat and "0 group(s) of 0" not in flat


def test_draw_leaves_out_the_rows_with_nothing_and_shows_tensor_groups_and_sends(tmp_path):
    """Stage 0 (data = 1) has nothing to reduce: no row for it; stage 1's tensor groups and transfer h's
    sends (device 0 to each device of stage 1) have theirs."""
    plan = compile_file(TP, probe=False).plan_json
    assert [r["groups"] for r in plan["reductions"]] == [[], [[1, 3], [2, 4]]]
    text = (tmp_path / "t.svg").read_text() if draw(plan, tmp_path / "t.svg") else ""
    assert sorted(re.findall(r'id="group-(\d+)-\d+"', text)) == ["1", "1"]
    assert "reduce gradients (stage 0)" not in text and "reduce gradients (stage 1)" in text
    assert sorted(re.findall(r'id="tensor-(\d+)"', text)) == ["0", "1"] and "tensor groups" in text
    assert len(re.findall(r'id="transfer-0-\d+"', text)) == 4 and "transfer h (0 -&gt; 1)" in text


def test_a_large_mesh_is_cut_to_its_corners_in_the_compile_summary():
    """``planc compile``'s table names a stage's mesh whole up to 64 devices; a larger one by its shape,
    size and each level's first two and last entries (a 16,384-device plan printed 2,257 lines)."""
    from planc.commands.summaries import mesh_text
    small = [[r * 8 + c for c in range(8)] for r in range(8)]
    assert mesh_text(small) == str(small)
    big = [[r * 64 + c * 8 for c in range(8)] for r in range(256)]
    assert mesh_text(big) == ("256 x 8 of 2048 devices [[0, 8, …, 56], [64, 72, …, 120], …, "
                              "[16320, 16328, …, 16376]]")
    assert mesh_text(list(range(100))) == "100 of 100 devices [0, 1, …, 99]"
