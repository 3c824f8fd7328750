"""Golden tests of the front end's diagnostics: the exact text a user sees.

Each ``tests/golden/diagnostics/NAME.plan`` must fail to check; its rendered
diagnostics (as printed by ``planc check``, file shown as ``NAME.plan``) are
compared with ``NAME.txt``. To regenerate after an intended change::

    PLANC_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/lang/test_lang_diagnostics.py

then review every changed ``.txt`` by eye (``git diff tests/golden``): each must
be what a user should see.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from planc.lang import load_text
from planc.lang.errors import PlanError

GOLDEN = Path(__file__).parents[1] / "golden" / "diagnostics"
CASES = sorted(p.stem for p in GOLDEN.glob("*.plan"))
UPDATE = os.environ.get("PLANC_UPDATE_GOLDEN") == "1"


def render(name: str) -> str:
    text = (GOLDEN / f"{name}.plan").read_text()
    with pytest.raises(PlanError) as ei:
        load_text(text, f"{name}.plan")
    return ei.value.render() + "\n"


def test_there_are_goldens():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", CASES)
def test_golden(name):
    got = render(name)
    want_path = GOLDEN / f"{name}.txt"
    if UPDATE:
        want_path.write_text(got)
    assert want_path.exists(), f"no golden {want_path.name}; run with PLANC_UPDATE_GOLDEN=1 and review it"
    assert got == want_path.read_text()


@pytest.mark.parametrize("name", CASES)
def test_golden_shape(name):
    """Every diagnostic names file:line:col, shows the line and a caret run under the culprit."""
    got = render(name)
    heads = [l for l in got.splitlines() if re.match(rf"{re.escape(name)}\.plan:\d+:\d+: error: ", l)]
    assert heads, got
    assert "Traceback" not in got
    lines = got.splitlines()
    for i, l in enumerate(lines):
        if l in heads:
            assert re.match(r"\s*\d+ \| ", lines[i + 1]), got
            assert re.fullmatch(r" +\^+", lines[i + 2]), got


def _positions(err: PlanError):
    return [(d.span.line, d.span.col) for d in err.diagnostics]


def test_multiple_errors_reported_together_sorted_by_position():
    text = (GOLDEN / "multiple_errors.plan").read_text()
    with pytest.raises(PlanError) as ei:
        load_text(text, "m.plan")
    pos = _positions(ei.value)
    assert len(pos) >= 4 and pos == sorted(pos)


def test_errors_at_the_same_place_keep_their_order():
    with pytest.raises(PlanError) as ei:
        load_text((GOLDEN / "matrix_column.plan").read_text(), "m.plan")
    msgs = [d.message for d in ei.value.diagnostics]
    assert [m.split("'")[1] for m in msgs] == ["node", "gpu"]  # level order, not alphabetical


def test_did_you_mean_hints():
    for name, hint in [("reduce_unknown_axis", "did you mean 'data'?"), ("host_level", "did you mean 'node'?"),
                       ("spec_named_axis", "did you mean 'data'?")]:
        assert f"hint: {hint}" in render(name)


def test_unclosed_bracket_ignores_strings_and_comments():
    text = 'cluster { level a x 2 : bandwidth 1 GB/s }\nmodel "a{b.py:f" { x = [1, "}"  # }\n'
    with pytest.raises(PlanError) as ei:
        load_text(text, "u.plan")
    (d,) = ei.value.diagnostics
    assert d.message == "unexpected end of file: this '[' is never closed (add ']')"
    assert (d.span.line, d.span.col) == (2, 24)


def test_unreadable_files(tmp_path):
    from planc.lang import load

    with pytest.raises(PlanError, match="cannot read plan file"):
        load(tmp_path / "missing.plan")
    (tmp_path / "bin.plan").write_bytes(b"cluster \xff")
    with pytest.raises(PlanError, match=r"not UTF-8 text \(byte 8\)"):
        load(tmp_path / "bin.plan")


def test_huge_numbers_are_plan_errors():
    for text, msg in [("cluster { level a x 1e999 }", "must be a whole number, got 1e999"),
                      ("cluster { level a x " + "9" * 30 + " }", "is too large (30 digits)"),
                      ("cluster { level a x 2048 : bandwidth 1 GB/s\n level b x 1024 : bandwidth 1 GB/s }",
                       "the cluster has 2097152 devices, over the budget of 65536 (bound 'devices')"),
                      ("cluster { level a x 2 : bandwidth 1e999 GB/s }", "1e999 GB/s is too large")]:
        with pytest.raises(PlanError, match=re.escape(msg)):
            load_text(text)


def test_a_misspelt_unit_is_named_with_the_units_of_its_key():
    """'1 GB/z' stops the lexer at '/': the error names the whole unit and what the key takes."""
    plan = ("cluster {\n  level node x 2 : bandwidth 1 GB/z, latency 5 us\n  level gpu x 2 : bandwidth 9 GB/s\n"
            "  memory = 80 Gigs\n}\nparallel { data = 4 }\nreduce g over data : f32[8]\n")
    with pytest.raises(PlanError) as ei:
        load_text(plan, "u.plan")
    d = ei.value.diagnostics[0]
    assert d.message == ("unknown unit 'GB/z'; did you mean 'GB/s'? a bandwidth takes "
                         "B/s, KB/s, MB/s, GB/s, TB/s, Mb/s, Gb/s")
    assert (d.span.line, d.span.col, d.span.end_col) == (2, 32, 36)
    with pytest.raises(PlanError) as ei:
        load_text(plan.replace("GB/z", "GB/s"), "u.plan")
    assert ei.value.diagnostics[0].message.endswith("a size takes B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")


@pytest.mark.parametrize("wrong, right", [("tranfer", "transfer"), ("reduse", "reduce"), ("trian", "train"),
                                          ("clustr", "cluster"), ("resharing", "resharding")])
def test_a_misspelt_keyword_or_block_name_gets_did_you_mean(wrong, right):
    """Misspelt keywords are parse errors at the word, with the keyword the parser accepts there as the
    hint (not only misspelt names)."""
    body = {"transfer": "x : f32[4] from stage 0 as R to stage 1 as R", "reduce": "g over data : f32[4]",
            "train": "{ steps = 2 }", "cluster": "{ level node x 2 : bandwidth 1 GB/s }",
            "resharding": "{ chunks = 4 }"}[right]
    plan = ("plan m {\n  cluster {\n    level node x 2 : bandwidth 1 GB/s, latency 5 us\n  }\n"
            "  parallel { data = 2 }\n"
            f"  {wrong} {body}\n}}\n")
    with pytest.raises(PlanError) as ei:
        load_text(plan, "m.plan")
    d = ei.value.diagnostics[0]
    assert d.message.startswith(f"unexpected '{wrong}'") and (d.span.line, d.span.col) == (6, 3)
    assert d.hint == f"did you mean '{right}'?"


SCHEDULES = "gpipe, 1f1b, eager_1f1b, interleaved_1f1b(virtual = V), zb_h1, zbv or auto"


@pytest.mark.parametrize("setting, message, hint", [
    ("schedule = 1F1B", f"'1F1B' is not a schedule: schedule must be one of {SCHEDULES}",
     "did you mean '1f1b'? (spellings are lower case)"),
    ("precision = FP32", "precision must be one of fp32, fp16, bf16", "did you mean 'fp32'? (spellings are lower case)"),
    ("schedule = GPIPE", f"schedule must be one of {SCHEDULES}",
     "did you mean 'gpipe'? (spellings are lower case)"),
    ("schedule = 2f1b", f"'2f1b' is not a schedule: schedule must be one of {SCHEDULES}",
     "did you mean '1f1b'?"),
])
def test_a_closed_settings_value_in_another_case_is_answered_with_its_spellings(setting, message, hint):
    """Even a value the lexer cannot read as a name (a digit first: '1F1B') is an error at the value that
    names the setting's accepted spellings."""
    plan = ("plan m {\n  cluster {\n    level node x 2 : bandwidth 1 GB/s, latency 5 us\n  }\n"
            f"  train {{ {setting} }}\n}}\n")
    with pytest.raises(PlanError) as ei:
        load_text(plan, "m.plan")
    d = ei.value.diagnostics[0]
    value = setting.split(" = ")[1]
    assert (d.message, d.hint) == (message, hint)
    assert (d.span.line, d.span.col, d.span.end_col) == (5, 11 + setting.index(value), 11 + len(setting))
