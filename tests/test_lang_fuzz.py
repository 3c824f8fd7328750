"""Random mutations of valid plans never raise anything but PlanError (and render cleanly)."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from planc import ir
from planc.lang import load_text
from planc.lang.errors import PlanError

ROOT = Path(__file__).resolve().parent.parent
SEEDS = [p.read_text() for d in ("plans", "examples") for p in sorted((ROOT / d).rglob("*.plan"))]
SEEDS += [p.read_text() for p in sorted((ROOT / "tests" / "golden" / "diagnostics").glob("*.plan"))][:12]
SEEDS.append("""cluster {
  level node x 2 : bandwidth 100 Gb/s, latency 20 us
  level gpu x 4 : bandwidth 150 GB/s
}
stage 0 : layers 0..2 on devices 0..4 as (data = 2, tensor = 2)
stage 1 : layers 2..4 on devices 4..8 as (2, 2)
model "m.py:f" { layers = 4 }
loss "m.py:l"
data "m.py:d"
transfer x : f32[8, 4] from stage 0 layer 1 as S(data,tensor) R to stage 1 as RS01
reduce gradients over data using reduce_scatter(slice=gpu, form=inside);
  allreduce(slice=gpu, form=parallel(root)); all_gather(slice=gpu, form=inside)
reduce w over m0 using allreduce : f32[16]
resharding { strategy = auto, chunks = 4, schedule = dfs(budget = 1 s) }
synthesis { max_size = 4, collectives = [allreduce, reduce_scatter] }
train { micro_batch = 4, schedule = 1f1b, optimizer = adam(lr = 1e-3), precision = bf16 }
deepspeed "ds.yaml"
""")

SEEDS.append("""cluster {
  level node x 2 : bandwidth 100 Gb/s, latency 20 us
  level gpu x 4 : bandwidth 150 GB/s
  flops = 312 TFLOP/s, memory = 80 GB
}
parallel { pipe = 2, data = 4 }
model "m.py:f" { layers = 4 }
loss "m.py:l"
data "m.py:d"
stages = auto(2)
transfer x from stage 0 layer 1 to stage 1
train { schedule = auto, timeout = 60 s, save_every = 5 }
""")
SEEDS.append("""cluster { level gpu x 8 : bandwidth 1 GB/s }
model "m.py:f" { layers = 4 }
loss "m.py:l"
data "m.py:d"
stage 0 : layers auto on devices 0..4 as (data = 4)
stage 1 : layers auto on devices 4..8 as (2, 2)
""")

TOKEN = re.compile(r'"[^"\n]*"|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|[A-Za-z_]\w*|\.\.|\n|[ \t]+|#[^\n]*|.', re.S)
NUMBERS = ["0", "1", "-1", "3", "7", "1024", "1e999", "2.5", "99999999999999999999999", "1" + "0" * 5000, "0.0"]
JUNK = ["{", "}", "(", ")", "[", "]", ",", ";", ":", "=", "..", "\n", '"', "@", "\x00", "é", "\t", "#",
        "stage", "layer", "on", "as", "S0", "S(", "R", "GB/s", "us", "plan", "cluster", "level", "x",
        "stages", "auto", "auto(", "flops", "memory", "TFLOP/s", "GiB", "-", "timeout", "save_every"]


@st.composite
def mutated(draw):
    toks = TOKEN.findall(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 4))):
        if not toks:
            break
        kind = draw(st.sampled_from(["delete", "duplicate", "number", "swap", "insert", "truncate"]))
        i = draw(st.integers(0, len(toks) - 1))
        if kind == "delete":
            del toks[i]
        elif kind == "duplicate":
            toks.insert(i, toks[i])
        elif kind == "number":
            nums = [k for k, t in enumerate(toks) if t[:1].isdigit()]
            if nums:
                toks[draw(st.sampled_from(nums))] = draw(st.sampled_from(NUMBERS))
        elif kind == "swap":
            j = draw(st.integers(0, len(toks) - 1))
            toks[i], toks[j] = toks[j], toks[i]
        elif kind == "insert":
            toks.insert(i, draw(st.sampled_from(JUNK)))
        else:
            toks = toks[:i]
    return "".join(toks)


def _check(text: str) -> None:
    try:
        p = load_text(text, "fuzz.plan")
    except PlanError as e:
        assert e.diagnostics
        out = e.render()
        assert "fuzz.plan" in out and "error:" in out
        for d in e.diagnostics:
            assert d.span.line >= 0 and d.span.col >= 0
    else:
        assert isinstance(p, ir.Program)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_raise_only_plan_errors(text):
    _check(text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(list('{}()[],;:=."#\n x') + ["..", "stage", "1", "S0", "level", "cluster"]),
                max_size=40))
def test_random_text_raises_only_plan_errors(parts):
    _check("".join(parts))


def test_known_nasty_inputs():
    for text in ["", "\n", "plan", "plan x {", "}", '"', "\x00", "\ufeffcluster { level a x 2 : bandwidth 1 GB/s }",
                 "cluster { level a x 1e999 }", "cluster { level a x " + "9" * 5000 + " }",
                 "cluster { level a x 1048577 : bandwidth 1 GB/s }",
                 "cluster { level a x 2 : bandwidth 1e999 GB/s }", "cluster { level a x 2 : bandwidth -1 GB/s }"]:
        _check(text)
