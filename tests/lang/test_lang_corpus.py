"""Every bundled plan checks OK, and IR -> canonical text -> IR round-trips."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planc import ir
from planc.lang import load, load_text
from planc.lang.format import summary, to_json, to_text

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted(p for d in ("plans", "examples") for p in (ROOT / d).rglob("*.plan"))

CLUSTER = """cluster {
  level node x 2 : bandwidth 100 Gb/s, latency 20 us
  level gpu  x 4 : bandwidth 150 GB/s,  latency 2.5 us
}
"""
MODEL = 'model "m.py:build" { layers = 4, ratio = 0.5, name = "x y", flag = false, dims = [1, 2] }\nloss "m.py:loss"\ndata "m.py:batches"\n'
SAMPLES = {
    "derived": CLUSTER + "parallel { pipe = 2, data = 2, tensor = 2, place = [[2, 1], [1, 2], [1, 2]] }\n" + MODEL
    + "stage 0 : layers 0..3\nstage 1 : layers 3..6\n"
    + "transfer h : f32[8, 32, 64] from stage 0 layer 1 as S0 R S1 to stage 1 as S01 R R\n"
    + "reduce gradients over data using allreduce\n"
    + "train { schedule = 1f1b, optimizer = sgd(lr = 0.05, momentum = 0.9), precision = fp16, micro_batch = 4 }\n"
    + 'deepspeed "ds.yaml"\n',
    "explicit": CLUSTER + "stage 0 on devices 0..4 as (data = 2, tensor = 2)\nstage 1 on devices 4..6 as (2)\n"
    + "transfer x : bf16[8, 8] from stage 0 as S(data, tensor) R to stage 1 as R S0\n"
    + "reduce w over data, m0 using reduce_scatter(slice=gpu, form=inside);\n  all_gather(slice=gpu, form=inside) : i8[4096]\n"
    + "resharding { strategy = broadcast, chunks = 3, schedule = dfs(budget = 1.5 ms) }\n"
    + "synthesis { max_size = 3, collectives = [reduce, broadcast] }\n",
    "comm_only": CLUSTER + "parallel { data = 4, param = 2 }\nreduce a over param : f64[7]\n"
    + "reduce b over data, param using allreduce(slice=root, form=inside) : f32[1, 2, 3]\n"
    + "resharding { schedule = load_balance }\n",
    "naive": "cluster {\n level rack x 1\n level gpu x 2 : bandwidth 1 TB/s\n}\nparallel { data = 2 }\n"
    + "resharding { schedule = naive, strategy = local_allgather }\n",
}


def test_corpus_is_not_empty():
    assert len(CORPUS) >= 3


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_corpus_plan_checks(path):
    p = load(path)
    assert isinstance(p, ir.Program)
    assert summary(p).startswith(f"{p.name}: ok")
    assert to_json(p)


def _strip(p: ir.Program) -> ir.Program:
    return dataclasses.replace(p, source_path="", source_sha256="", source_dir="")


def _roundtrip(p: ir.Program) -> None:
    text = to_text(p)
    q = load_text(text, "canonical.plan")
    assert _strip(q) == _strip(p), text
    assert to_text(q) == text  # canonical text is a fixed point


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_corpus_roundtrip(path):
    _roundtrip(load(path))


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_sample_roundtrip(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # the samples' files (a DeepSpeed overrides file) beside them
    (tmp_path / "ds.yaml").write_text("steps_per_print: 10\n")
    _roundtrip(load_text(SAMPLES[name], f"{name}.plan"))
