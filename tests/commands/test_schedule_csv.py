"""`planc explain --schedule-csv`: the plan's order as torch pipelining's compute-only CSV, read and
dry-run by torch's own code (its action parser, schedule validation, send/receive lowering and
deadlock simulation), and refused, with the reason, for plans torch's schedules cannot express."""
from __future__ import annotations

import csv

import pytest

from e2e_util import ROOT, spelled
from planc.commands.cli import main
from planc.driver.compile import compile_file

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")


def _compute_orders(plan_json) -> dict[int, list[str]]:
    """Per stage its compute actions from plan.json, read here: torch's cell text for each."""
    out = {}
    for c in plan_json["pipeline"]["actions"]:
        for a in c["list"]:
            if a[0] in ("F", "B", "W"):
                out.setdefault(a[1], []).append(f"{a[1]}{a[0]}{a[2]}")
    return out


def test_a_uniform_plan_is_torchs_schedule(tmp_path, capsys):
    plan = spelled("gpt-bench-2x2.plan")
    out = tmp_path / "order.csv"
    assert main(["explain", "--no-probe", "--schedule-csv", str(out), str(plan)]) == 0
    assert f"wrote {out} (2 pipeline ranks" in capsys.readouterr().err
    rows = list(csv.reader(out.open(newline="")))
    pj = compile_file(plan, probe=False).plan_json
    assert rows == [_compute_orders(pj)[0], _compute_orders(pj)[1]]
    micro = pj["pipeline"]["micro_batches"]
    actions = {r: [pipelining._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    stage_to_rank = pipelining._validate_schedule(actions, 2, 2, micro)
    assert stage_to_rank == {0: 0, 1: 1}
    with_comms = pipelining._add_send_recv(actions, stage_to_rank.__getitem__, 2)
    pipelining._simulate_comms_compute(with_comms, stage_to_rank.__getitem__, 2)   # raises on a deadlock


def test_plans_torch_cannot_express_are_refused(tmp_path, capsys):
    skip = spelled("unet-skip.plan")
    assert main(["explain", "--no-probe", "--schedule-csv", str(tmp_path / "a.csv"), str(skip)]) == 2
    err = capsys.readouterr().err
    assert err == (f"planc explain --schedule-csv: {skip}: transfer 'e2' goes from stage 0 to stage 2; torch's "
                   "schedules only pass stage i's output to stage i + 1\n")
    unequal = ROOT / "plans" / "llama-unequal.plan"
    assert main(["explain", "--schedule-csv", str(tmp_path / "b.csv"), str(unequal)]) == 2
    assert "torch's schedules run every stage on equal meshes; this plan's stages have" in capsys.readouterr().err
    assert not (tmp_path / "a.csv").exists() and not (tmp_path / "b.csv").exists()


@pytest.mark.parametrize("name, stage_to_rank", [
    ("gpt-interleaved-2x2.plan", {0: 0, 1: 1, 2: 0, 3: 1}),   # interleaved_1f1b(virtual = 2): p, p + 2
    ("gpt-zbv-2.plan", {0: 0, 1: 1, 2: 1, 3: 0}),              # zbv: the V
    ("mlp-interleaved-meshes.plan", {0: 0, 1: 1, 2: 0, 3: 1}),  # interleaved on explicit shared meshes
])
def test_plans_of_several_stages_per_rank_are_torchs_schedules(tmp_path, capsys, name, stage_to_rank):
    """Each rank class is one row holding all its stages (zbv: its B is torch's I, beside W); torch's parser,
    validation (which stage each rank runs), send/receive lowering and deadlock simulation accept them."""
    plan = ROOT / "tests" / "plans" / name
    out = tmp_path / "order.csv"
    assert main(["explain", "--no-probe", "--schedule-csv", str(out), str(plan)]) == 0
    capsys.readouterr()
    rows = list(csv.reader(out.open(newline="")))
    pj = compile_file(plan, probe=False).plan_json
    orders = _compute_orders(pj)
    split = "zbv" in name
    for rank, row in enumerate(rows):
        stages = sorted(s for s, r in stage_to_rank.items() if r == rank)
        assert sorted({int(c[0]) for c in row}) == stages
        assert [c for c in row if c[0] == str(stages[0])] == [
            c.replace("B", "I") if split else c for c in orders[stages[0]]]
    micro = pj["pipeline"]["micro_batches"]
    actions = {r: [pipelining._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    assert pipelining._validate_schedule(actions, len(rows), len(stage_to_rank), micro) == stage_to_rank
    with_comms = pipelining._add_send_recv(actions, stage_to_rank.__getitem__, len(stage_to_rank))
    pipelining._simulate_comms_compute(with_comms, stage_to_rank.__getitem__, len(stage_to_rank))


def test_rank_classes_of_different_sizes_are_refused():
    from planc import plan as planfile
    from planc.commands.schedule_csv import ScheduleCsvError, schedule_csv
    import dataclasses
    p = planfile.Plan.from_json(compile_file(ROOT / "tests" / "plans" / "gpt-zbv-2.plan", probe=False).plan_json)
    a, b = p.pipeline.actions
    uneven = dataclasses.replace(p, pipeline=dataclasses.replace(p.pipeline, actions=(a, b, dataclasses.replace(
        b, stages=(9,)))))
    with pytest.raises(ScheduleCsvError, match="as many stages on every rank"):
        schedule_csv(uneven)
