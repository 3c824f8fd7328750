"""The model probe's subprocess overlaps the work that needs no probe (planc.driver.compile.compile_file).

- ``planc.placement.warm`` (ranking's reduction programs, synthesized while the probe runs) changes no
  result: a compile that warmed every program and one that warmed none write the same plan.json;
- it stops as soon as its ``stop()`` says so, and does nothing where no matrix is ranked;
- ``start_probe``: the answer is the one ``probe_model`` gives; a probe that fails raises its located
  error where the compiler takes the answer, not on the thread that ran it.
"""
from __future__ import annotations

import pytest

import planc.driver.compile as driver
from planc.driver.compile import compile_file, dump_plan
from planc.model.infer import chain_transfers
from planc.lang import load
from planc.lang.errors import PlanError
from planc.placement import warm
from planc.placement.mapping import program_costs
from planc.model.probe import probe_model, start_probe
from planc.model.probe_cache import ProbeCache
import importlib

from test_probe_cache import auto_plan

# the module (the package exports a function of the same name)
synth = importlib.import_module("planc.reduction.synthesize")


def _forget_programs():
    program_costs.cache_clear()
    synth._named.cache_clear()
    synth._synthesize.cache_clear()


def test_warming_changes_no_result(tmp_path, monkeypatch):
    path = auto_plan(tmp_path)
    cache = ProbeCache(tmp_path / "cache")
    warmed = []

    def warm_all(program, stop):   # every program, whatever the probe does
        warmed.append(warm(program, stop=lambda: False))
        return warmed[-1]

    _forget_programs()
    monkeypatch.setattr(driver, "warm", warm_all)
    a = dump_plan(compile_file(path, cache=cache).plan_json)
    assert warmed and warmed[0] > 0
    _forget_programs()
    monkeypatch.setattr(driver, "warm", lambda program, stop: 0)
    b = dump_plan(compile_file(path, cache=cache).plan_json)
    assert a == b


def test_warm_stops_when_told_and_skips_a_pinned_matrix(tmp_path):
    program = chain_transfers(load(auto_plan(tmp_path)))
    _forget_programs()
    assert warm(program, stop=lambda: True) == 0
    assert program_costs.cache_info().currsize == 0
    calls = []
    assert warm(program, stop=lambda: calls.append(1) or len(calls) > 2) == 2
    pinned = tmp_path / "pinned.plan"
    text = open(auto_plan(tmp_path)).read()
    pinned.write_text(text.replace("place = auto", "place = [[2, 1], [1, 2], [1, 2]]"))
    assert warm(chain_transfers(load(pinned)), stop=lambda: False) == 0


def test_a_started_probe_answers_as_probe_model_and_raises_where_taken(tmp_path):
    program = chain_transfers(load(auto_plan(tmp_path)))
    pending = start_probe(program)
    assert pending.result() == probe_model(program) and pending.done()
    broken = tmp_path / "broken.py"
    broken.write_text("def build(**kw):\n    raise RuntimeError('no model today')\n")
    bad = chain_transfers(load(auto_plan(tmp_path, model=str(broken))))
    pending = start_probe(bad)
    with pytest.raises(PlanError) as e:
        pending.result()
    assert "no model today" in str(e.value)
