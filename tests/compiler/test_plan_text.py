"""plan.json's text: written once, verified as bytes, the same whichever way it is written.

- the compiler's text (``CompiledPlan.text``, serialized at assemble) is what the plan file's one writer
  gives for ``plan_json``, and ``write_output`` writes the same bytes with it or without it;
- the layout: valid JSON that reads back as the document, one top-level key a line, one element of a
  list of objects a line, deterministic;
- the ``assemble`` verifier reads the bytes the plan holds: bytes of another plan are caught; a record
  changed with ``dataclasses.replace`` holds no bytes (they would be stale) and is serialized anew.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from planc import plan as planfile
from planc.output.codegen import write_output
from planc.driver.compile import compile_file
from planc.plan.file import encode, written
from planc.driver.verify import VerifyError, verify

ROOT = Path(__file__).resolve().parents[2]
PLANS = [ROOT / "tests" / "plans" / "gpt-2x4-spelled.plan", ROOT / "tests" / "plans" / "unet-skip-spelled.plan",
         ROOT / "plans" / "p2-running-example.plan"]


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.name)
def test_the_compilers_text_is_the_writers_and_is_written(path, tmp_path):
    c = compile_file(path, probe=False)
    assert c.text is not None
    assert c.text == planfile.dumps(planfile.Plan.from_json(c.plan_json)) == encode(c.plan_json)
    a = write_output(c.plan_json, c.program, tmp_path / "a", text=c.text)
    b = write_output(c.plan_json, c.program, tmp_path / "b")
    assert (a / "plan.json").read_bytes() == (b / "plan.json").read_bytes() == c.text.encode()
    assert planfile.digest(planfile.load(a / "plan.json")) == planfile.digest(c.plan)


def test_the_layout():
    c = compile_file(PLANS[0], probe=False)
    text = c.text
    assert json.loads(text) == c.plan_json and text == encode(c.plan_json) and text.endswith("}\n")
    lines = text.splitlines()
    assert lines[0] == "{" and lines[-1] == "}"
    top = [ln for ln in lines if ln.startswith('  "')]
    assert [json.loads("{" + ln.rstrip(",").split(":", 1)[0] + ":0}").popitem()[0] for ln in top] == list(c.plan_json)
    stages = lines.index('  "stages": [')
    assert [json.loads(ln.strip().rstrip(",")) for ln in lines[stages + 1:stages + 1 + len(c.plan_json["stages"])]] \
        == c.plan_json["stages"]
    element = lines[stages + 1].strip().rstrip(",")   # compact inside an element (strings may hold spaces)
    assert element == json.dumps(json.loads(element), separators=(",", ":"), ensure_ascii=False)


def test_verify_reads_the_bytes_the_plan_holds():
    plan = compile_file(PLANS[0], probe=False).plan
    verify("assemble", plan, None)
    other = compile_file(PLANS[1], probe=False).plan
    object.__setattr__(plan, "raw", other.raw)   # bytes that are not these records
    with pytest.raises(VerifyError) as e:
        verify("assemble", plan, None)
    assert "do not read back as the assembled records" in str(e.value)
    object.__setattr__(plan, "raw", b"{not json")
    with pytest.raises(VerifyError) as e:
        verify("assemble", plan, None)
    assert "not valid JSON" in str(e.value)


def test_replace_drops_the_bytes():
    plan = written(compile_file(PLANS[0], probe=False).plan)
    assert plan.raw is not None
    renamed = dataclasses.replace(plan, name="renamed")
    assert renamed.raw is None
    verify("assemble", renamed, None)   # serialized anew: its own bytes
    assert json.loads(planfile.dumps(renamed))["name"] == "renamed"
