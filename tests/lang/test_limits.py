"""Resource bounds (planc.budget): each one hit with a located error naming it and how to raise
it, and each one raised with ``--budget`` / ``budget=`` so that the same plan goes through."""

from __future__ import annotations

import pytest

from planc import budget
from planc.commands.cli import main
from planc.driver.compile import compile_program
from planc.lang import load, load_text
from planc.lang.errors import PlanError

CLUSTER8 = "cluster { level gpu x 8 : bandwidth 100 GB/s }\n"


def _error(text: str, **kw) -> PlanError:
    with pytest.raises(PlanError) as ei:
        load_text(text, "limits.plan", **kw)
    return ei.value


def _one(e: PlanError, bound: str):
    ds = [d for d in e.diagnostics if f"bound '{bound}'" in d.message or f"--budget {bound}=" in (d.hint or "")]
    assert ds, e.render()
    d = ds[0]
    assert d.span.file == "limits.plan" and d.span.line >= 1, e.render()
    assert "docs/limits.md" in d.hint
    return d


def test_a_million_devices_stop_in_the_front_end():
    text = "cluster {\n  level node x 1024 : bandwidth 100 Gb/s\n  level gpu x 1024 : bandwidth 150 GB/s\n}\n"
    d = _one(_error(text), "devices")
    assert "1048576 devices, over the budget of 65536" in d.message
    assert d.hint.startswith("raise it with --budget devices=1048576")
    assert load_text(text, "limits.plan", budget="devices=1048576").cluster.devices == 1 << 20


def test_the_devices_default_is_65536():
    """65,536 devices pass the front end with the default budget; one more does not."""
    ok = "cluster {\n  level node x 8192 : bandwidth 100 Gb/s\n  level gpu x 8 : bandwidth 150 GB/s\n}\n"
    assert budget.DEFAULT["devices"] == 65536
    assert load_text(ok, "limits.plan").cluster.devices == 65536
    over = "cluster {\n  level node x 65537 : bandwidth 100 Gb/s\n}\n"
    assert "65537 devices, over the budget of 65536" in _one(_error(over), "devices").message


def test_hundreds_of_levels():
    text = "cluster {\n" + "".join(f"  level l{i} x 1\n" for i in range(300)) + "  level gpu x 2 : bandwidth 1 GB/s\n}\n"
    d = _one(_error(text), "levels")
    assert "301 levels, over the budget of 64" in d.message and d.span.line == 66   # the 65th level
    assert len(load_text(text, "limits.plan", budget=budget.parse("levels=301")).cluster.levels) == 301


def test_yaml_cluster_levels_are_bounded_at_the_yaml_line(tmp_path):
    (tmp_path / "c.yaml").write_text("levels:\n" + "".join(f"  - {{name: l{i}, fanout: 1}}\n" for i in range(70)))
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\n')
    with pytest.raises(PlanError) as ei:
        load(tmp_path / "p.plan")
    (d,) = ei.value.diagnostics
    assert d.span.file.endswith("c.yaml") and d.span.line == 66 and "bound 'levels'" in d.message
    assert len(load(tmp_path / "p.plan", budget="levels=70").cluster.levels) == 70


def test_micro_batches_and_pipeline_ops():
    base = (CLUSTER8 + "parallel { pipe = 4, data = 2 }\n" + 'model "m.py:f" { layers = 4 }\nloss "m.py:l"\n'
            'data "m.py:d"\nstages = auto(4)\n')
    d = _one(_error(base + "train { micro_batches = 20000 }\n"), "micro_batches")
    assert "micro_batches 20000 is too many (at most 10000" in d.message and d.span.line == 7
    d = _one(_error(base + "train { micro_batches = 9000 }\n", budget="pipeline_ops=1000"), "pipeline_ops")
    assert "4 stages x 9000 micro-batches make 72000 pipeline ops, over the budget of 1000" in d.message
    p = load_text(base + "train { micro_batches = 20000 }\n", "limits.plan", budget="micro_batches=20000")
    assert p.train.micro_batches == 20000


def test_synthesis_size():
    text = CLUSTER8 + "parallel { data = 8 }\nreduce g over data : f32[16]\nsynthesis { max_size = 12 }\n"
    d = _one(_error(text), "synthesis_size")
    assert d.message.startswith("max_size 12 is too large (at most 8") and d.span.line == 4
    assert load_text(text, "limits.plan", budget="synthesis_size=12").synthesis.max_size == 12
    # a lower bound also lowers the default (no synthesis block): the plan still checks
    small = load_text(CLUSTER8 + "parallel { data = 8 }\n", "limits.plan", budget="synthesis_size=3")
    assert small.synthesis.max_size == 3


def test_trials_and_dfs_seconds():
    text = CLUSTER8 + "resharding { schedule = randomized_greedy(trials = 5000) }\n"
    _one(_error(text), "trials")
    assert load_text(text, "limits.plan", budget="trials=5000").resharding.trials == 5000
    text = CLUSTER8 + "resharding { schedule = dfs(budget = 1200 s) }\n"
    _one(_error(text), "dfs_seconds")
    assert load_text(text, "limits.plan", budget="dfs_seconds=1200").resharding.dfs_budget_s == 1200.0


def _transfer_plan(src: int, dst: int, shape: str) -> str:
    nodes = (src + dst + 7) // 8
    return (f"cluster {{\n  level node x {nodes} : bandwidth 100 Gb/s\n  level gpu x 8 : bandwidth 100 GB/s\n}}\n"
            f"stage 0 on devices 0..{src} as ({src})\nstage 1 on devices {src}..{src + dst} as ({dst})\n"
            f"transfer x : f32[{shape}] from stage 0 as S0 R to stage 1 as R S0\n")


def test_a_transfer_of_100000_unit_tasks_stops_before_building_them():
    program = load_text(_transfer_plan(512, 256, "512, 256"), "limits.plan")   # 512 x 256 = 131072 tasks
    with pytest.raises(PlanError) as ei:
        compile_program(program)
    d = _one(ei.value, "tasks")
    assert "transfer 'x' has 131072 unit tasks, over the budget of 10000" in d.message and d.span.line == 7


def test_tasks_bound_lowered_and_raised():
    program = load_text(_transfer_plan(16, 8, "16, 8"), "limits.plan")        # 128 unit tasks
    with pytest.raises(PlanError) as ei:
        compile_program(program, budget="tasks=100")
    assert "has 128 unit tasks, over the budget of 100" in _one(ei.value, "tasks").message
    compiled = compile_program(program, budget="tasks=128")
    assert len(compiled.plan_json["transfers"][0]["tasks"]) == 128


def test_task_devices():
    # 1024 tasks, each sent to the 256 devices holding its replica: 263168 endpoints
    text = _transfer_plan(512, 512, "512, 256").replace("as (512)\ntransfer", "as (2, 256)\ntransfer")
    program = load_text(text, "limits.plan")
    with pytest.raises(PlanError) as ei:
        compile_program(program)
    d = _one(ei.value, "task_devices")
    assert "263168 task endpoints" in d.message and "--budget task_devices=263168" in d.hint


def test_budget_parsing():
    b = budget.parse("devices=20000, tasks=1_000")
    assert b["devices"] == 20000 and b["tasks"] == 1000 and b["levels"] == budget.DEFAULT["levels"]
    assert budget.parse("dfs_seconds=0.5")["dfs_seconds"] == 0.5 and budget.parse("devices=2e6")["devices"] == 2_000_000
    for bad, msg in [("devics=3", "unknown budget bound 'devics'"), ("devices", "is not NAME=NUMBER"),
                     ("devices=0", "must be positive"), ("devices=x", "must be a whole number"),
                     ("devices=2.5", "must be a whole number"), ("dfs_seconds=inf", "positive and finite")]:
        with pytest.raises(budget.BudgetSyntaxError, match=msg):
            budget.parse(bad)
    with budget.using("devices=7"):
        assert budget.current()["devices"] == 7
    assert budget.current() == budget.DEFAULT


def test_cli_budget_option(tmp_path, capsys):
    plan = tmp_path / "big.plan"
    plan.write_text("cluster {\n  level node x 100 : bandwidth 1 GB/s\n  level gpu x 700 : bandwidth 10 GB/s\n}\n")
    assert main(["check", str(plan)]) == 2
    err = capsys.readouterr().err
    assert "70000 devices, over the budget of 65536 (bound 'devices')" in err and "--budget devices=70000" in err
    assert main(["check", "--budget", "devices=70000", str(plan)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        main(["compile", "--budget", "widgets=3", str(plan)])
    assert ei.value.code == 2 and "unknown budget bound 'widgets'" in capsys.readouterr().err
    assert main(["explain", "--no-probe", str(plan)]) == 2 and "bound 'devices'" in capsys.readouterr().err
    # compile stops at the same bound before any pass runs
    assert main(["compile", "--no-probe", "-o", str(tmp_path / "out"), str(plan)]) == 2
    assert "bound 'devices'" in capsys.readouterr().err and not (tmp_path / "out").exists()
