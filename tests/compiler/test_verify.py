"""``planc compile --verify``: every pass's output is checked independently, and a corrupt output is
reported naming the pass that produced it (each pass corrupted once, on a real compile)."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from planc.driver import compile as driver
from planc.driver.compile import compile_file
from planc.driver.verify import VerifyError

from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[2]
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


def _sender_not_a_holder(plan):
    """The first forward task sent by a device that holds none of its slice (the records alone,
    no JSON: the driver assembles records and never reads them back)."""
    t = plan.transfers[0]
    task = t.forward.tasks[0]
    outsider = next(d for s in plan.stages for d in s.devices if d not in task.holders)
    bad = dataclasses.replace(task, sender=outsider)
    route = dataclasses.replace(t.forward, tasks=(bad,) + t.forward.tasks[1:])
    return dataclasses.replace(plan, transfers=(dataclasses.replace(t, forward=route),) + plan.transfers[1:]), outsider


def test_the_assemble_verifier_reads_the_records_back_and_names_a_malformed_one():
    """The assembled plan's per-record checks (the validating reader's) run in the ``assemble``
    verifier: a task whose sender is not among its holders is named by its key."""
    from planc.driver.verify import verify

    plan = compile_file(UNET, probe=False, verify=True).plan
    verify("assemble", plan, None)   # the real one passes
    bad, outsider = _sender_not_a_holder(plan)
    bad.check()   # a cross-reference check alone does not see it: the record's own check does
    with pytest.raises(VerifyError) as e:
        verify("assemble", bad, None)
    msg = str(e.value)
    assert msg.startswith("--verify: the output of pass 'assemble' is invalid:")
    assert f"transfers[0].tasks[0].sender: {outsider} is not one of the holders" in msg


def test_a_compile_whose_assemble_makes_a_malformed_record_fails_verification(monkeypatch):
    real = driver.assemble
    monkeypatch.setattr(driver, "assemble", lambda value, ctx: _sender_not_a_holder(real(value, ctx))[0])
    with pytest.raises(VerifyError) as e:
        compile_file(UNET, probe=False, verify=True)
    assert "pass 'assemble'" in str(e.value) and "is not one of the holders" in str(e.value)


def test_assemble_checks_the_records_cross_references():
    """``Plan.check`` on records (what ``assemble`` runs, verification on or off): a reduction step's
    group that ``groups`` does not list is named."""
    from planc import plan as planfile

    plan = compile_file(UNET, probe=False, verify=True).plan
    r = next(r for r in plan.reductions if r.steps)
    i = plan.reductions.index(r)
    unlisted = dataclasses.replace(plan, groups=tuple(g for g in plan.groups if g != r.steps[0].groups[0]))
    with pytest.raises(planfile.PlanFileError, match=rf"reductions\[{i}\]\.program\.steps\[0\]: group .* is not "
                                                     "listed in groups"):
        unlisted.check()


# ---------------------------------------------------------------- ZeRO-1's pair of programs

def _zero_unet():
    """The bundled U-shaped plan with ``train { zero = 1 }`` set on the checked program."""
    from planc.lang import load

    program = load(UNET)
    return dataclasses.replace(program, train=dataclasses.replace(program.train, zero=1))


def _swap_owned(r):
    """The first group's first two members trade pieces: still a partition, no longer what the steps leave."""
    (a, b, *rest), *others = r.owned
    return _set(r, owned=((b, a, *rest),) + tuple(others))


def test_verify_checks_zero_pairs_after_the_reductions_pass(monkeypatch):
    compiled = driver.compile_program(_zero_unet(), None, verify=True)
    targets = [(r["name"], r.get("target")) for r in compiled.plan_json["reductions"]]
    assert targets == [("gradients", "reduce_scatter"), ("parameters", "all_gather")]
    real = driver.reductions_pass
    for i in (0, 1):   # the gradients' owned (not what its steps leave), the parameters' (another start)
        monkeypatch.setattr(driver, "reductions_pass", lambda value, ctx, i=i: tuple(
            _swap_owned(r) if j == i else r for j, r in enumerate(real(value, ctx))))
        with pytest.raises(VerifyError) as e:
            driver.compile_program(_zero_unet(), None, verify=True)
        msg = str(e.value)
        assert msg.startswith("--verify: the output of pass 'reductions' is invalid:")
        assert ("owned says" if i == 0 else "the all-gather starts device") in msg, msg


def test_the_assemble_verifier_replays_zero_pairs_from_the_records():
    from planc.driver.verify import verify

    plan = driver.compile_program(_zero_unet(), None, verify=True).plan
    verify("assemble", plan, None)
    ag = plan.reductions[1]
    bad = dataclasses.replace(plan, reductions=(plan.reductions[0], _swap_owned(ag)))
    with pytest.raises(VerifyError) as e:
        verify("assemble", bad, None)
    msg = str(e.value)
    assert "plan.json reduction 'parameters': step 1 (all_gather) on [0, 1]: pieces not consecutive" in msg
    assert ("plan.json reduction 'gradients' and reduction 'parameters': the all-gather starts device 0 from "
            "[1, 2) of 1/2, but the reduce-scatter leaves it [0, 1)") in msg
