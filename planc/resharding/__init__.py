"""Cross-mesh resharding (AlpaComm): unit tasks, strategies, load balance and scheduling.

``plan_transfers(program, stages)`` turns every ``transfer`` statement into a
:class:`TransferPlan` whose ``to_json()`` is the plan.json ``transfers`` entry.
Transfers leaving the same source stage run in the same pipeline phase, so
they are scheduled together on one shared NIC timeline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planc import budget, ir, plan as planfile
from planc.ir import Cluster, SchedulerKind, StageLayout, Strategy, Transfer
from planc.resharding.bounds import lower_bound
from planc.resharding.schedulers import Job, Schedule
from planc.resharding.strategies import build_jobs, choose_strategy_jobs, run_scheduler
from planc.resharding.tiles import UnitTask, _dim_cells, device_region, device_regions, parts_per_dim, unit_tasks

__all__ = ["TaskPlan", "TransferPlan", "plan_transfers", "groups_used", "transfer_estimate",
           "unit_tasks", "UnitTask", "plan_routes", "parts_per_dim", "device_region", "transfer_records"]


@dataclass(frozen=True, slots=True)
class TaskPlan:
    slice: tuple[tuple[int, int], ...]
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    sender: int
    group: tuple[int, ...]       # sorted {sender} ∪ receivers: the ranks taking part
    start: float
    duration: float

    def __post_init__(self) -> None:
        if self.sender not in self.holders:
            raise ValueError("the sender of a task must be one of its holders")

    def to_json(self) -> dict:
        return {"slice": [list(r) for r in self.slice], "holders": list(self.holders),
                "receivers": list(self.receivers), "sender": self.sender, "group": list(self.group),
                "start": self.start, "duration": self.duration}


@dataclass(frozen=True, slots=True)
class TransferPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    src_stage: int
    src_spec: str
    dst_stage: int
    dst_spec: str
    strategy: Strategy
    chunks: int
    scheduler: SchedulerKind
    tasks: tuple[TaskPlan, ...]
    makespan: float
    lower_bound: float
    naive_makespan: float
    local: bool = False   # between two stages of one mesh, every device holding what it needs: no tasks

    def __post_init__(self) -> None:
        if self.strategy is Strategy.AUTO:
            raise ValueError("a planned transfer has a concrete strategy")
        if self.local and self.tasks:
            raise ValueError("a local transfer has no tasks")
        end = max((t.start + t.duration for t in self.tasks), default=0.0)
        if end != self.makespan:
            raise ValueError("makespan must be the end of the last task")

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "src": {"stage": self.src_stage, "spec": self.src_spec},
                "dst": {"stage": self.dst_stage, "spec": self.dst_spec},
                "strategy": str(self.strategy), "chunks": self.chunks, "scheduler": str(self.scheduler),
                **({"local": True} if self.local else {}),
                "tasks": [t.to_json() for t in self.tasks],
                "makespan": self.makespan, "lower_bound": self.lower_bound,
                "naive_makespan": self.naive_makespan}

    def route(self, src: StageLayout, src_spec: ir.ShardingSpec, dst: StageLayout, dst_spec: ir.ShardingSpec,
              cluster: Cluster, regions: dict | None = None) -> planfile.Route:
        """This direction as the plan file's ``Route``: its tasks (with the receiver sets that gather
        among themselves, allgather strategies) and every device's region on both meshes; the makespans
        in ``extra``. ``regions``: the caller's cache of those regions (a mesh is both ends of a transfer's
        two directions, and often of the next transfer's too)."""
        strategy = planfile.Strategy(str(self.strategy))
        tasks = tuple(planfile.Task(t.slice, t.holders, t.receivers, t.sender, t.group, t.start, t.duration,
                                    _parts(strategy, t.receivers, cluster)) for t in self.tasks)
        return planfile.Route(strategy, self.chunks, str(self.scheduler), tasks,
                              _regions(self.shape, src, src_spec, regions),
                              _regions(self.shape, dst, dst_spec, regions),
                              (("makespan", self.makespan), ("lower_bound", self.lower_bound),
                               ("naive_makespan", self.naive_makespan)), self.local)


def _parts(strategy: planfile.Strategy, receivers: tuple[int, ...], cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """Allgather strategies: the receiver sets that gather among themselves (global: all of them; local:
    those on each host, hosts in order); none for the others."""
    if strategy is planfile.Strategy.GLOBAL_ALLGATHER:
        return (tuple(sorted(receivers)),)
    if strategy is not planfile.Strategy.LOCAL_ALLGATHER:
        return ()
    by_host: dict[int, list[int]] = {}
    for r in receivers:
        by_host.setdefault(cluster.host_of(r), []).append(r)
    return tuple(tuple(sorted(v)) for _, v in sorted(by_host.items()))


def _regions(shape, layout: StageLayout, spec: ir.ShardingSpec, cache: dict | None = None) -> tuple:
    """Every device's region of the tensor on one mesh (half-open global ranges), devices in order;
    kept in ``cache`` (if given) by shape, mesh and spec."""
    key = (tuple(shape), layout, spec)
    if cache is not None and key in cache:
        return cache[key]
    found = tuple(device_regions(tuple(shape), layout, spec))
    if cache is not None:
        cache[key] = found
    return found


def transfer_records(program: ir.Program, stages: Sequence[StageLayout], forward: Sequence[TransferPlan],
                     backward: Sequence[TransferPlan] = ()) -> tuple[planfile.Transfer, ...]:
    """The transfers pass's plans as the plan file's entries, in program order: each transfer's forward
    route and, in training plans, its gradient's way back (the destination mesh and spec to the source's);
    ``src.layer`` is the layer whose output it sends (the source stage's last, unless the plan names one)."""
    out = []
    regions: dict = {}   # (shape, mesh, spec) -> every device's region: computed once per mesh and spec
    for i, (t, fwd) in enumerate(zip(program.transfers, forward)):
        src, dst = _stage(stages, t.src_stage), _stage(stages, t.dst_stage)
        src_layers = program.stage(t.src_stage).layers
        layer = t.src_layer if t.src_layer is not None else (src_layers[1] - 1 if src_layers is not None else None)
        back = backward[i].route(dst, t.dst_spec, src, t.src_spec, program.cluster, regions) if backward else None
        out.append(planfile.Transfer(fwd.name, fwd.dtype, tuple(fwd.shape), fwd.src_stage, layer, fwd.src_spec,
                                     fwd.dst_stage, fwd.dst_spec,
                                     fwd.route(src, t.src_spec, dst, t.dst_spec, program.cluster, regions), back))
    return tuple(out)


def _stage(stages: Sequence[StageLayout], index: int) -> StageLayout:
    for s in stages:
        if s.index == index:
            return s
    raise KeyError(f"no layout for stage {index}")


def transfer_estimate(transfer: Transfer, src: StageLayout, dst: StageLayout, cluster: Cluster) -> float:
    """A cheap, optimistic time for one transfer: its NIC lower bound (seconds)."""
    tasks = unit_tasks(transfer.shape, src, transfer.src_spec, dst, transfer.dst_spec)
    return lower_bound(tasks, ir.DTYPE_BYTES[transfer.dtype], cluster)


def plan_group(transfers: Sequence[Transfer], layouts: Sequence[tuple[StageLayout, StageLayout]],
               cluster: Cluster, config: ir.Resharding) -> tuple[TransferPlan, ...]:
    """Plan transfers that share one NIC timeline (same source stage)."""
    lays_of = list(layouts)
    all_tasks: list[UnitTask] = []
    all_jobs: list[Job] = []
    owner: list[int] = []
    strategies = []
    bounds = []
    counted = [0, 0]
    for i, (tr, (src, dst)) in enumerate(zip(transfers, layouts)):
        # bounded before any task is built (planc.budget 'tasks', 'task_devices')
        counted = [a + b for a, b in zip(counted, _task_count(tr, src, dst))]
        subject = f"transfer '{tr.name}' has" if not i else \
            f"the transfers leaving stage {tr.src_stage}, with '{tr.name}', have"
        budget.check("tasks", counted[0], subject, tr.span)
        budget.check("task_devices", counted[1], subject, tr.span)
        tasks = unit_tasks(tr.shape, src, tr.src_spec, dst, tr.dst_spec)
        itemsize = ir.DTYPE_BYTES[tr.dtype]
        strategy = config.strategy
        if not tasks:   # between two stages of one mesh, each device holding its region: nothing to move
            strategy, jobs = (Strategy.SEND_RECV if strategy is Strategy.AUTO else strategy), []
        elif strategy is Strategy.AUTO:
            strategy, jobs = choose_strategy_jobs(tasks, itemsize, cluster, config.chunks)
        else:
            jobs = build_jobs(tasks, itemsize, strategy, cluster, config.chunks)
        strategies.append(strategy)
        bounds.append(lower_bound(tasks, itemsize, cluster))
        all_tasks.extend(tasks)
        all_jobs.extend(jobs)
        owner.extend([i] * len(tasks))
    sched = run_scheduler(all_jobs, config)
    naive_sched = run_scheduler(all_jobs, ir.Resharding(scheduler=SchedulerKind.NAIVE))
    plans = []
    for i, tr in enumerate(transfers):
        mine = [j for j in range(len(all_jobs)) if owner[j] == i]
        task_plans = []
        for j in sorted(mine, key=lambda j: (sched.start[j], all_tasks[j].slice)):
            t, opt = all_tasks[j], all_jobs[j].options[sched.choice[j]]
            task_plans.append(TaskPlan(t.slice, t.holders, t.receivers, opt.sender,
                                       tuple(sorted({opt.sender, *t.receivers})),
                                       sched.start[j], opt.duration))
        plans.append(TransferPlan(
            tr.name, tr.dtype, tuple(tr.shape), tr.src_stage, str(tr.src_spec), tr.dst_stage, str(tr.dst_spec),
            strategies[i], config.chunks, config.scheduler, tuple(task_plans),
            max((t.start + t.duration for t in task_plans), default=0.0), bounds[i],
            _end(all_jobs, naive_sched, mine), not task_plans and lays_of[i][0].devices == lays_of[i][1].devices))
    return tuple(plans)


def _task_count(tr: Transfer, src: StageLayout, dst: StageLayout) -> tuple[int, int]:
    """How many unit tasks ``unit_tasks`` would build for ``tr`` (counted per dimension), and the
    devices they involve together (each task: its holders and its receivers)."""
    sp, dp = parts_per_dim(src.shape, tr.src_spec), parts_per_dim(dst.shape, tr.dst_spec)
    n = math.prod(len(_dim_cells(d, a, b)) for d, a, b in zip(tr.shape, sp, dp))
    return n, n * (len(src.devices) // max(1, math.prod(sp)) + len(dst.devices) // max(1, math.prod(dp)))


def _end(jobs: Sequence[Job], sched: Schedule, mine: Sequence[int]) -> float:
    return max((sched.start[j] + jobs[j].options[sched.choice[j]].duration for j in mine), default=0.0)


def plan_transfers(program: ir.Program, stages: tuple[StageLayout, ...]) -> tuple[TransferPlan, ...]:
    """One plan per transfer, in program order; transfers from one source stage share a NIC timeline."""
    by_src: dict[int, list[int]] = {}
    for i, tr in enumerate(program.transfers):
        by_src.setdefault(tr.src_stage, []).append(i)
    out: dict[int, TransferPlan] = {}
    for idxs in by_src.values():
        trs = [program.transfers[i] for i in idxs]
        lays = [(_stage(stages, t.src_stage), _stage(stages, t.dst_stage)) for t in trs]
        for i, p in zip(idxs, plan_group(trs, lays, program.cluster, program.resharding)):
            out[i] = p
    return tuple(out[i] for i in range(len(program.transfers)))


def _reverse(t: Transfer) -> Transfer:
    """The gradient's way back: from the destination mesh and spec to the source's."""
    return Transfer(t.name, t.dtype, t.shape, t.dst_stage, None, t.dst_spec, t.src_stage, t.src_spec, t.span)


def plan_routes(program: ir.Program, stages: tuple[StageLayout, ...], backward: bool
                ) -> tuple[tuple[TransferPlan, ...], tuple[TransferPlan, ...]]:
    """Every transfer's forward plan and, with ``backward``, its gradient's: planned like a
    transfer from the destination stage to the source stage (gradients leaving one stage share
    its NIC timeline, as activations do)."""
    forward = plan_transfers(program, stages)
    if not backward:
        return forward, ()
    reverse = tuple(_reverse(t) for t in program.transfers)
    by_src: dict[int, list[int]] = {}
    for i, tr in enumerate(reverse):
        by_src.setdefault(tr.src_stage, []).append(i)
    out: dict[int, TransferPlan] = {}
    for idxs in by_src.values():
        trs = [reverse[i] for i in idxs]
        lays = [(_stage(stages, t.src_stage), _stage(stages, t.dst_stage)) for t in trs]
        for i, p in zip(idxs, plan_group(trs, lays, program.cluster, program.resharding)):
            out[i] = p
    return forward, tuple(out[i] for i in range(len(reverse)))


def groups_used(plans: Sequence[TransferPlan], cluster: Cluster | None = None) -> tuple[tuple[int, ...], ...]:
    """Every process group the transfers need, members sorted, in first-use order.

    Each task's ``group`` ({sender} ∪ receivers; the broadcast group); for
    global allgather the receivers; for local allgather (given ``cluster``)
    the receivers on each host. One-member groups are left out.
    """
    seen: dict[tuple[int, ...], None] = {}

    def add(g: tuple[int, ...]) -> None:
        if len(g) > 1:
            seen.setdefault(g, None)

    for p in plans:
        for t in p.tasks:
            add(t.group)
            if p.strategy is Strategy.GLOBAL_ALLGATHER:
                add(t.receivers)
            elif p.strategy is Strategy.LOCAL_ALLGATHER and cluster is not None:
                per_host: dict[int, list[int]] = {}
                for r in t.receivers:
                    per_host.setdefault(cluster.host_of(r), []).append(r)
                for members in per_host.values():
                    add(tuple(sorted(members)))
    return tuple(seen)
