"""`python -m benchmarks bench resharding`: AlpaComm-style resharding cases, makespan ÷ lower bound per scheduler and strategy.

Pure planning (no network): every figure is the cost model's prediction.
Scheduler run times are wall-clock and vary from machine to machine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planc.commands import ui
from planc.ir import Cluster, Level, Resharding, SchedulerKind, ShardingSpec, StageLayout, Strategy, Transfer
from planc.resharding import plan_group
from planc.resharding.check import check_plan

SHAPE = (1024, 1024, 512)
STRATEGIES = (Strategy.SEND_RECV, Strategy.LOCAL_ALLGATHER, Strategy.GLOBAL_ALLGATHER, Strategy.BROADCAST)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    cluster: Cluster
    src: StageLayout
    dst: StageLayout
    src_spec: str
    dst_spec: str


def _cluster(hosts: int, per_host: int) -> Cluster:
    return Cluster((Level("node", hosts, 1.25e10, 2e-5), Level("gpu", per_host, 1.5e11, 2e-6)), "node")


def _mesh(index: int, shape: tuple[int, ...], first: int) -> StageLayout:
    n = 1
    for s in shape:
        n *= s
    return StageLayout(index, None, shape, tuple(f"m{i}" for i in range(len(shape))), tuple(range(first, first + n)))


def cases(large: bool = True) -> list[Case]:
    """1-to-m broadcasts, n-to-m between (2,4) meshes, and (with ``large``) (8,8) and (32,8) meshes."""
    out = []
    for a, b in ((1, 2), (1, 4), (2, 2), (2, 4), (4, 2)):
        # the sender alone on host 0; the destination mesh fills hosts 1..a
        out.append(Case(f"1 -> ({a},{b})  R R R", _cluster(a + 1, b), _mesh(0, (), 0), _mesh(1, (a, b), b),
                        "R R R", "R R R"))
    for s_spec in ("S0 R R", "R R R", "R S0 R", "S1 R R"):
        out.append(Case(f"(2,4) -> (2,4)  {s_spec} -> S0 R R", _cluster(4, 4), _mesh(0, (2, 4), 0),
                        _mesh(1, (2, 4), 8), s_spec, "S0 R R"))
    for hosts in (8, 32) if large else ():
        for s_spec, d_spec in (("S0 R R", "S0 R R"), ("R S0 R", "S0 R R"), ("S0 S1 R", "S1 S0 R"),
                               ("S1 R R", "S0 R R")):
            out.append(Case(f"({hosts},8) -> ({hosts},8)  {s_spec} -> {d_spec}", _cluster(2 * hosts, 8),
                            _mesh(0, (hosts, 8), 0), _mesh(1, (hosts, 8), hosts * 8), s_spec, d_spec))
    return out


def _plan(case: Case, config: Resharding):
    tr = Transfer("x", "f32", SHAPE, 0, None, ShardingSpec.parse(case.src_spec), 1, ShardingSpec.parse(case.dst_spec))
    t0 = time.perf_counter()
    plan = plan_group([tr], [(case.src, case.dst)], case.cluster, config)[0]
    return plan, time.perf_counter() - t0


def _plan_dict(case: Case, plan) -> dict:
    c = case.cluster
    return {"cluster": {"levels": [{"name": l.name, "bandwidth": l.bandwidth} for l in c.levels],
                        "host_level": c.host_level, "hosts": [list(h) for h in c.hosts()]},
            "stages": [{"index": s.index, "devices": list(s.devices), "mesh": s.mesh() if s.shape else list(s.devices)}
                       for s in (case.src, case.dst)],
            "transfers": [plan.to_json()]}


def run(check: bool = True, large: bool = True) -> str:
    """The markdown table; with ``check`` every plan is re-checked by ``planc.resharding.check``.

    Columns: the lower bound; makespan ÷ lower bound per scheduler (strategy
    ``auto``) and per strategy (scheduler ``randomized_greedy``); each
    scheduler's planning time in seconds (wall clock, machine-dependent).
    """
    sched_cols = [SchedulerKind.NAIVE, SchedulerKind.LOAD_BALANCE, SchedulerKind.DFS, SchedulerKind.RANDOMIZED_GREEDY]
    head = (["case", "tasks", "lower bound (ms)", "auto ="]
            + [f"{s} ÷ LB" for s in sched_cols]
            + [f"{s} ÷ LB (greedy)" for s in STRATEGIES]
            + [f"{s} s" for s in sched_cols])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    # a bar on a terminal (stderr) only: piped, the table is all there is
    for case in ui.progress(cases(large), "benchmarks bench resharding", piped="silent", describe=lambda c: c.name):
        ratios, times, strat_ratios = [], [], []
        auto = None
        for s in sched_cols:
            plan, secs = _plan(case, Resharding(scheduler=s, dfs_budget_s=1.0))
            _verify(case, plan, check)
            ratios.append(_ratio(plan))
            times.append(secs)
            auto = plan
        for strat in STRATEGIES:
            plan, _ = _plan(case, Resharding(strategy=strat))
            _verify(case, plan, check)
            strat_ratios.append(_ratio(plan))
        assert auto is not None
        cells = ([case.name, str(len(auto.tasks)), f"{auto.lower_bound * 1e3:.2f}", str(auto.strategy)]
                 + [f"{r:.3f}" for r in ratios] + [f"{r:.3f}" for r in strat_ratios] + [f"{t:.3f}" for t in times])
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _ratio(plan) -> float:
    return plan.makespan / plan.lower_bound if plan.lower_bound > 0 else float("nan")


def _verify(case: Case, plan, check: bool) -> None:
    if check:
        errors = check_plan(_plan_dict(case, plan))
        if errors:
            raise AssertionError(f"{case.name}: {errors[:3]}")
