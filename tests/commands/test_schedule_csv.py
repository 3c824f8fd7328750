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
