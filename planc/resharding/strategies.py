"""Strategies (AlpaComm §3.1) turn unit tasks into schedulable jobs; ``auto`` picks one per transfer.

The time of a job comes from ``planc.cost.resharding``; this module only
decides which NICs a job occupies: its sender host's NIC if any receiver is
on another host, and the NIC of every receiver host other than the sender's.
"""

from __future__ import annotations

from collections.abc import Sequence

from planc import ir
from planc.cost.resharding import CONCRETE, task_time
from planc.ir import Cluster, SchedulerKind, Strategy
from planc.resharding import schedulers
from planc.resharding.schedulers import Job, Option, Schedule
from planc.resharding.tiles import UnitTask


def build_jobs(tasks: Sequence[UnitTask], itemsize: int, strategy: Strategy,
               cluster: Cluster, chunks: int) -> tuple[Job, ...]:
    jobs = []
    for t in tasks:
        nbytes = t.elements * itemsize
        recv_hosts = [cluster.host_of(r) for r in t.receivers]
        first_on_host: dict[int, int] = {}
        for d in t.holders:  # sorted, so the first seen is the lowest
            first_on_host.setdefault(cluster.host_of(d), d)
        options = []
        for host, sender in sorted(first_on_host.items(), key=lambda hs: hs[1]):
            remote = set(recv_hosts) - {host}
            nics = tuple(sorted(remote | {host})) if remote else ()
            options.append(Option(host, sender, nics, task_time(strategy, nbytes, host, recv_hosts, cluster, chunks)))
        jobs.append(Job(tuple(options)))
    return tuple(jobs)


def choose_strategy(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster, chunks: int) -> Strategy:
    """``auto``: the strategy whose load-balanced makespan is least (ties: the simpler strategy)."""
    return choose_strategy_jobs(tasks, itemsize, cluster, chunks)[0]


def choose_strategy_jobs(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster, chunks: int
                         ) -> tuple[Strategy, tuple[Job, ...]]:
    """:func:`choose_strategy` and the chosen strategy's jobs (built once, not again by the caller)."""
    best = None
    for s in CONCRETE:
        jobs = build_jobs(tasks, itemsize, s, cluster, chunks)
        ms = schedulers.makespan(jobs, schedulers.load_balance(jobs))
        if best is None or ms < best[0]:
            best = (ms, s, jobs)
    assert best is not None
    return best[1], best[2]


def run_scheduler(jobs: Sequence[Job], config: ir.Resharding) -> Schedule:
    kind = config.scheduler
    if kind is SchedulerKind.NAIVE:
        return schedulers.naive(jobs)
    if kind is SchedulerKind.LOAD_BALANCE:
        return schedulers.load_balance(jobs)
    if kind is SchedulerKind.DFS:
        return schedulers.dfs(jobs, config.dfs_budget_s)
    if kind is SchedulerKind.RANDOMIZED_GREEDY:
        return schedulers.randomized_greedy(jobs, config.trials, config.seed)
    raise ValueError(f"unknown scheduler {kind}")
