"""The model probe runs once per compile and is cached across compiles (planc/model/probe_cache.py).

- ``stages = auto(N)``: the cut's probe is derived from the chain probe, equal to probing the cut
  program again (transfers, tensor traffic per stage); a cut that is not a chain is probed again;
- a cache hit gives a byte-identical plan.json and runs no subprocess; a corrupt entry (not JSON,
  another key, an answer that does not match its digest) is ignored and rewritten, never trusted;
- the key follows the model file, a file beside it that it imports, the arguments and the micro-batch;
- ``planc compile --no-cache`` probes; ``--profile`` prints a table of the passes.
"""
from __future__ import annotations

import json

import pytest

from planc.model import probe as probe_mod
from planc.commands.cli import main
from planc.driver.compile import compile_file, dump_plan
from planc.model.infer import chain_transfers
from planc.lang.errors import PlanError
from planc.lang import load
from planc.pipeline.cut import apply_auto_stages
from planc.model.probe import probe_for_cut, probe_model, probe_request
from planc.model.probe_cache import ProbeCache, imported_beside, request_key

from e2e_util import ROOT

GPT = ROOT / "examples" / "gpt.py"


def auto_plan(tmp_path, transfers: str = "", model: str = str(GPT), args: str = "layers = 4") -> str:
    path = tmp_path / "auto.plan"
    path.write_text(f"""plan auto_tp {{
  cluster {{ level node x 2 : bandwidth 1 GB/s
            level gpu x 4 : bandwidth 10 GB/s
            host = node
            flops = 1 TFLOP/s }}
  parallel {{ pipe = 2, data = 2, tensor = 2, place = auto }}
  model "{model}:build" {{ {args}, hidden = 16, heads = 2, seq = 8, vocab = 32 }}
  loss  "{GPT}:loss"
  data  "{GPT}:batches"
  stages = auto(2)
{transfers}
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 2, steps = 1, schedule = 1f1b, optimizer = sgd(lr = 0.1), seed = 3 }}
}}
""")
    return str(path)


def counting(monkeypatch) -> list:
    runs = []
    real = probe_mod._run_probe

    def run(program, req):
        runs.append(req)
        return real(program, req)
    monkeypatch.setattr(probe_mod, "_run_probe", run)
    return runs


def test_the_cut_is_probed_once_and_equals_a_second_probe(tmp_path, monkeypatch):
    program = chain_transfers(load(auto_plan(tmp_path)))
    runs = counting(monkeypatch)
    chain = probe_model(program)
    cut, _ = apply_auto_stages(program, chain)
    derived = probe_for_cut(chain, cut)
    assert derived is not None and len(runs) == 1
    assert derived.tensor_traffic and all(t.ops for t in derived.tensor_traffic)   # tensor 2: measured
    assert derived == probe_model(cut)                                            # what probing again gives
    runs.clear()
    compile_file(auto_plan(tmp_path))
    assert len(runs) == 1


def test_a_cut_that_is_not_a_chain_is_probed_again(tmp_path, monkeypatch):
    path = auto_plan(tmp_path, "  transfer h from stage 0 to stage 1\n  transfer skip from stage 0 layer 0 to stage 1")
    program = load(path)
    chain = probe_model(program)
    cut, _ = apply_auto_stages(program, chain)
    assert probe_for_cut(chain, cut) is None
    runs = counting(monkeypatch)
    try:
        compile_file(path)
    except PlanError:   # (what the second probe finds of a skip into a GPT block is not the point here)
        pass
    assert len(runs) == 2


def test_a_cache_hit_gives_the_same_plan_json_without_a_probe(tmp_path, monkeypatch):
    path = auto_plan(tmp_path)
    cache = ProbeCache(tmp_path / "cache")
    first = dump_plan(compile_file(path, cache=cache).plan_json)
    assert cache.misses == 1 and cache.hits == 0 and len(list((tmp_path / "cache").glob("*.json"))) == 1
    runs = counting(monkeypatch)
    again = dump_plan(compile_file(path, cache=cache).plan_json)
    assert runs == [] and cache.hits == 1
    assert again == first
    assert dump_plan(compile_file(path).plan_json) == first   # and as without any cache


def test_the_users_code_failing_is_kept_and_replayed_but_a_crash_is_not(tmp_path, monkeypatch):
    """The probe's own report of the user's model failing (exit 2, ``probe[PART]:``) is as much the
    request's as an answer: ``planc check`` then ``planc compile`` probe once, the second giving the very
    same located error. A probe that fails otherwise (here: killed) is never kept."""
    import subprocess
    model = tmp_path / "broken.py"
    model.write_text(GPT.read_text().replace("def build(", "def build(*_, **__):\n    raise ValueError('no such width')\n\n\ndef _build("))
    path = auto_plan(tmp_path, model=str(model))
    cache = ProbeCache(tmp_path / "cache")
    with pytest.raises(PlanError) as first:
        compile_file(path, cache=cache)
    assert "no such width" in str(first.value) and str(first.value).startswith(f"{path}:")
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    runs = counting(monkeypatch)
    with pytest.raises(PlanError) as again:
        compile_file(path, cache=cache)
    assert runs == [] and cache.hits == 1 and str(again.value) == str(first.value)

    killed = ProbeCache(tmp_path / "killed")
    real = subprocess.run
    monkeypatch.setattr(probe_mod.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -9, "", ""))
    with pytest.raises(PlanError):
        compile_file(path, cache=killed)
    monkeypatch.setattr(probe_mod.subprocess, "run", real)
    assert not list((tmp_path / "killed").glob("*.json"))


def test_a_corrupt_entry_is_recomputed(tmp_path, monkeypatch):
    """Each corruption (not JSON, not an object, another key, an answer its digest does not match) is
    ignored: the probe runs again and the entry is rewritten. The model runs once, for the good entry;
    the recomputations answer with what it measured (what is under test is the cache, not the probe)."""
    path = auto_plan(tmp_path)
    cache = ProbeCache(tmp_path / "cache")
    answers = []
    real = probe_mod._run_probe

    def first(program, req):
        answers.append(json.dumps(real(program, req)))
        return json.loads(answers[-1])
    monkeypatch.setattr(probe_mod, "_run_probe", first)
    good = dump_plan(compile_file(path, cache=cache).plan_json)
    (entry,) = (tmp_path / "cache").glob("*.json")
    written = entry.read_text()
    runs = []

    def again(program, req):
        runs.append(req)
        return json.loads(answers[0])
    monkeypatch.setattr(probe_mod, "_run_probe", again)
    for corrupt in ("not json {", "[]", "key", "answer"):
        doc = json.loads(written)
        if corrupt == "key":
            doc["key"] = "0" * 64
            entry.write_text(json.dumps(doc))
        elif corrupt == "answer":     # a measurement changed behind the digest's back: not trusted
            doc["answer"]["layer_params"][0] += 1
            entry.write_text(json.dumps(doc))
        else:
            entry.write_text(corrupt)
        runs.clear()
        assert dump_plan(compile_file(path, cache=cache).plan_json) == good, corrupt
        assert len(runs) == 1, corrupt                                        # recomputed ...
        assert json.loads(entry.read_text())["key"] == entry.stem, corrupt   # ... and rewritten
        runs.clear()
        compile_file(path, cache=cache)
        assert runs == [], corrupt


def test_the_key_follows_what_the_probe_reads(tmp_path):
    model = tmp_path / "net.py"
    helper = tmp_path / "blocks.py"
    helper.write_text("WIDTH = 1\n")
    model.write_text((GPT.read_text()).replace("import torch\n", "import torch\nimport blocks\n", 1))
    assert imported_beside(model) == [helper]
    program = chain_transfers(load(auto_plan(tmp_path, model=str(model))))
    req = probe_request(program)
    key = request_key(req)
    assert request_key(json.loads(json.dumps(req))) == key
    helper.write_text("WIDTH = 2\n")
    assert request_key(req) != key                      # a file it imports beside it changed
    key = request_key(req)
    model.write_text(model.read_text() + "\n# edited\n")
    assert request_key(req) != key                      # the model file changed
    assert request_key(dict(req, micro_batch=8)) != request_key(req)
    assert request_key(dict(req, args={**req["args"], "layers": 5})) != request_key(req)


def test_cli_no_cache_and_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))   # the default folder, under a fresh home
    path = auto_plan(tmp_path)
    assert main(["compile", path, "-o", str(tmp_path / "a"), "--profile"]) == 0
    out = capsys.readouterr().out
    for name in ("load", "probe", "cut", "place", "launch check", "write output", "total"):
        assert f"\n{name} " in out, out
    assert "peak MB" in out and "child" in out
    assert len(list((tmp_path / "home" / ".cache" / "planc" / "probe").glob("*.json"))) == 1
    runs = counting(monkeypatch)
    assert main(["compile", path, "-o", str(tmp_path / "b")]) == 0
    assert runs == []
    assert main(["compile", path, "-o", str(tmp_path / "c"), "--no-cache"]) == 0
    assert len(runs) == 1
    a, b, c = ((tmp_path / x / "plan.json").read_bytes() for x in "abc")
    assert a == b == c
