"""`planc check` end to end in a subprocess: exit codes 0 and 2, no traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOOD = ROOT / "plans" / "gpt-2x4.plan"


def planc(*args, cwd=ROOT):
    r = subprocess.run([sys.executable, "-m", "planc.commands.cli", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stdout + r.stderr
    return r


def test_check_ok():
    r = planc("check", GOOD, ROOT / "plans" / "alpacomm-2x4.plan")
    assert r.returncode == 0, r.stderr
    assert "gpt_2x4: ok" in r.stdout and "alpacomm_2x4: ok" in r.stdout
    # piped: summary()'s lines as an 80-column table without escapes, every fact kept
    assert "\x1b[" not in r.stdout and all(len(line) <= 80 for line in r.stdout.splitlines())
    assert re.search(r"^axes\s+pipe 2, data 2, tensor 2 \(place = auto\)$", r.stdout, re.M)
    assert re.search(r"^reduce\s+gradients over data \(synthesized\)$", r.stdout, re.M)
    assert re.search(r"^transfer\s+fanout f32\[1024, 1024, 512\]: stage 2 \(R R R\) -> stage 1 \(S0 S1 R\)$",
                     r.stdout, re.M)
    assert "  (communication-only plan: no model)" in r.stdout


def test_check_json():
    r = planc("check", "--json", GOOD)
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["name"] == "gpt_2x4" and data["parallel"]["axes"][0]["name"] == "pipe"


def test_check_user_errors_exit_2(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("cluster {\n  level gpu x 4 : bandwidth 1 GB/s\n}\nparallel { data = 3 }\n")
    r = planc("check", bad, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith(f"{bad}:4:1: error: axis sizes multiply to 3")
    assert "   4 | parallel { data = 3 }\n" in r.stderr and "1 error in 1 file" in r.stderr


@pytest.mark.parametrize("content", [b"plan {", b"\xff\xfe\x00junk", b"cluster { level a x 1e999 }", b""])
def test_malformed_input_exit_2(tmp_path, content):
    f = tmp_path / "x.plan"
    f.write_bytes(content)
    r = planc("check", f)
    assert r.returncode == 2 and "error:" in r.stderr


def test_missing_file_exit_2(tmp_path):
    r = planc("check", tmp_path / "nope.plan")
    assert r.returncode == 2 and "cannot read plan file" in r.stderr


def test_good_and_bad_together(tmp_path):
    bad = tmp_path / "bad.plan"
    bad.write_text("cluster { level a x 2 }\n")
    r = planc("check", GOOD, bad)
    assert r.returncode == 2 and "gpt_2x4: ok" in r.stdout and "needs a bandwidth" in r.stderr


def test_cluster_file_that_is_not_utf8_is_a_located_error(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"levels:\n  - name: node\xff\n")
    (tmp_path / "y.plan").write_text('plan y {\n  cluster "c.yaml"\n}\n')
    r = subprocess.run([sys.executable, "-m", "planc", "check", str(tmp_path / "y.plan")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "y.plan:2:11: error: cluster file 'c.yaml' is not UTF-8 text (byte 22)" in r.stderr
