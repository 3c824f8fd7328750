"""``planc compile --verify``: every pass's output is checked independently, and a corrupt output is
reported naming the pass that produced it (each pass corrupted once, on a real compile)."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from planc import compile as driver
from planc.compile import compile_file
from planc.verify import VerifyError

from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted((ROOT / "plans").glob("*.plan"))
UNET = spelled("unet-skip.plan")   # compiled with --no-probe here


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_every_bundled_plan_passes_verify(path):
    compile_file(spelled(path), probe=False, verify=True)


def _set(obj, **fields):
    """A copy of a frozen, slotted record with fields replaced, bypassing its own validation
    (which would refuse the corruption before the verifier could see it)."""
    out = copy.copy(obj)
    for k, v in fields.items():
        object.__setattr__(out, k, v)
    return out


def _corrupt_infer(program):
    t = program.transfers[0]
    return dataclasses.replace(program, transfers=(dataclasses.replace(t, dtype=None),) + program.transfers[1:])


def _corrupt_place(placement):
    a, b = placement.stages[0], placement.stages[1]
    b = dataclasses.replace(b, devices=(a.devices[0],) + b.devices[1:])
    return _set(placement, stages=(a, b) + placement.stages[2:])


def _corrupt_reductions(reductions):
    r = reductions[0]
    return (_set(r, steps=r.steps[:-1] + ((r.steps[-1][0], r.steps[-1][1][:-1]),)),) + reductions[1:]


def _corrupt_transfers(routes):
    forward, backward = routes
    t = forward[0]
    task = t.tasks[0]
    (a, b), rest = task.slice[0], task.slice[1:]
    bad = _set(task, slice=((a, b - 1),) + rest)    # one row of the first task's slice is never sent
    return (_set(t, tasks=(bad,) + t.tasks[1:]),) + forward[1:], backward


def _corrupt_pipeline(pipeline):
    first = pipeline.per_stage[0]
    return _set(pipeline, per_stage=(first[:-1],) + pipeline.per_stage[1:])


def _corrupt_assemble(plan):
    st = plan.stages[0]
    return _set(plan, stages=(_set(st, mesh_devices=st.mesh_devices[:-1]),) + plan.stages[1:])


CORRUPT = {"infer": ("infer_pass", _corrupt_infer), "place": ("place_pass", _corrupt_place),
           "reductions": ("reductions_pass", _corrupt_reductions),
           "transfers": ("transfers_pass", _corrupt_transfers),
           "pipeline": ("pipeline_pass", _corrupt_pipeline), "assemble": ("assemble", _corrupt_assemble)}


@pytest.mark.parametrize("pass_name", list(CORRUPT))
def test_verify_names_the_pass_whose_output_is_corrupt(pass_name, monkeypatch):
    attr, corrupt = CORRUPT[pass_name]
    real = getattr(driver, attr)
    monkeypatch.setattr(driver, attr, lambda value, ctx: corrupt(real(value, ctx)))
    with pytest.raises(VerifyError) as e:
        compile_file(UNET, probe=False, verify=True)
    assert str(e.value).startswith(f"--verify: the output of pass '{pass_name}' is invalid:")


def test_verify_on_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "planc", "compile", str(UNET), "--no-probe", "--verify",
                        "-o", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "plan.json").is_file()
