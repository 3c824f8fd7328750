"""Strategies (AlpaComm §3.1) turn unit tasks into schedulable jobs; ``auto`` picks one per transfer.

The time of a job comes from ``planc.cost.resharding``; this module only
decides which NICs a job occupies: its sender host's NIC if any receiver is
on another host, and the NIC of every receiver host other than the sender's.
"""

from __future__ import annotations

from collections.abc import Sequence

from planc import ir
from planc.cost.resharding import CONCRETE, shape_time, task_shape
from planc.ir import Cluster, SchedulerKind, Strategy
from planc.resharding import schedulers
from planc.resharding.schedulers import Job, Option, Schedule
from planc.resharding.tiles import UnitTask


def build_jobs(tasks: Sequence[UnitTask], itemsize: int, strategy: Strategy,
               cluster: Cluster, chunks: int, layout=None) -> tuple[Job, ...]:
    """One job per unit task: an option per host that holds its slice (sent by that host's lowest
    holder), each with the NICs it occupies and its time under ``strategy``. ``layout``: the tasks'
    :func:`task_options`, when the caller has them (they do not depend on the strategy)."""
    times: dict[tuple, float] = {}   # (bytes, task shape) -> seconds: most tasks of a transfer share both
    jobs = []
    for t, opts in zip(tasks, layout if layout is not None else task_options(tasks, cluster)):
        nbytes = t.elements * itemsize
        options = []
        for host, sender, nics, shape in opts:
            key = (nbytes, shape)
            seconds = times.get(key)
            if seconds is None:
                seconds = times[key] = shape_time(strategy, nbytes, shape, cluster, chunks)
            options.append(Option(host, sender, nics, seconds))
        jobs.append(Job(tuple(options)))
    return tuple(jobs)


def task_options(tasks: Sequence[UnitTask], cluster: Cluster) -> list[list[tuple]]:
    """Per task, per host holding its slice: ``(host, sender, NICs occupied, task_shape)``, from the tasks'
    :func:`task_hosts`; none of it depends on the strategy."""
    out = []
    for recv_hosts, senders in task_hosts(tasks, cluster):
        opts = []
        for host, sender in senders:
            remote = set(recv_hosts) - {host}
            nics = tuple(sorted(remote | {host})) if remote else ()
            opts.append((host, sender, nics, task_shape(host, recv_hosts)))
        out.append(opts)
    return out


def task_hosts(tasks: Sequence[UnitTask], cluster: Cluster) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per task, its receivers' hosts (with repeats) and ``(host, first holder on it)`` in holder order."""
    per_host = cluster.devices_per_host   # Cluster.host_of(d) is d // devices_per_host: computed once here
    out = []
    for t in tasks:
        first_on_host: dict[int, int] = {}
        for d in t.holders:  # sorted, so the first seen is the lowest
            first_on_host.setdefault(d // per_host, d)
        out.append(([r // per_host for r in t.receivers], sorted(first_on_host.items(), key=lambda hs: hs[1])))
    return out


def choose_strategy(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster, chunks: int) -> Strategy:
    """``auto``: the strategy whose load-balanced makespan is least (ties: the simpler strategy)."""
    return choose_strategy_jobs(tasks, itemsize, cluster, chunks)[0]


def choose_strategy_jobs(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster, chunks: int
                         ) -> tuple[Strategy, tuple[Job, ...]]:
    """:func:`choose_strategy` and the chosen strategy's jobs (built once, not again by the caller)."""
    best = None
    layout = task_options(tasks, cluster)
    for s in CONCRETE:
        jobs = build_jobs(tasks, itemsize, s, cluster, chunks, layout)
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
