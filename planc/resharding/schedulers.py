"""Host-level load balancing and scheduling of unit tasks (AlpaComm §3.2).

Each host has one NIC. A *job* is a unit task ready to schedule: one
:class:`Option` per holder host (the sender device it would use, the NICs it
would occupy, its duration). A schedule picks one option per job and a start
time; two jobs sharing a NIC never overlap. Every scheduler here produces a
*list schedule*: jobs are taken in some order and each starts at the earliest
time all the NICs it occupies are free. Ordering an optimal schedule's jobs by
start time and list-scheduling them reproduces it or better, so searching
over orders and sender choices (``dfs``) is exact given enough budget.
Jobs that occupy no NIC (all receivers on the sender's host) start at 0.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

DFS_NODES_PER_SECOND = 10_000  # fixed rate: a seconds budget becomes a node count, so output is deterministic
# randomized_greedy: a round runs at most min(trials, GREEDY_WORK // (jobs x jobs left)) trials (at least
# one), so all rounds together look at about GREEDY_WORK jobs (or jobs² when one trial a round already
# passes it) -- without it, 600 unit tasks took 9 s at the default 64 trials and 10^18 trials never ended.
GREEDY_WORK = 1_000_000


@dataclass(frozen=True, slots=True)
class Option:
    host: int                 # sender host
    sender: int               # sender device (lowest holder on that host)
    nics: tuple[int, ...]     # hosts whose NIC the job occupies, sorted
    duration: float


@dataclass(frozen=True, slots=True)
class Job:
    options: tuple[Option, ...]   # by sender device, ascending: options[0] is the first holder's host

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError("a job needs at least one sender option")


@dataclass(frozen=True, slots=True)
class Schedule:
    choice: tuple[int, ...]       # option index per job
    start: tuple[float, ...]      # start time per job


def list_schedule(jobs: Sequence[Job], order: Sequence[int], choice: Sequence[int]) -> Schedule:
    free: dict[int, float] = {}
    start = [0.0] * len(jobs)
    for j in order:
        opt = jobs[j].options[choice[j]]
        if not opt.nics:
            continue
        s = max(free.get(h, 0.0) for h in opt.nics)
        start[j] = s
        end = s + opt.duration
        for h in opt.nics:
            free[h] = end
    return Schedule(tuple(choice), tuple(start))


def makespan(jobs: Sequence[Job], sched: Schedule) -> float:
    return max((s + jobs[j].options[sched.choice[j]].duration for j, s in enumerate(sched.start)), default=0.0)


def naive(jobs: Sequence[Job]) -> Schedule:
    """First holder, jobs in the given order."""
    return list_schedule(jobs, range(len(jobs)), [0] * len(jobs))


def _lpt_order(jobs: Sequence[Job]) -> list[int]:
    return sorted(range(len(jobs)), key=lambda j: (-min(o.duration for o in jobs[j].options), j))


def load_balance(jobs: Sequence[Job]) -> Schedule:
    """LPT: longest job first, to the least-loaded holder host; NIC loads include receiving."""
    order = _lpt_order(jobs)
    load: dict[int, float] = {}
    choice = [0] * len(jobs)
    for j in order:
        opts = jobs[j].options
        k = min(range(len(opts)), key=lambda i: (load.get(opts[i].host, 0.0), opts[i].duration, i))
        choice[j] = k
        for h in opts[k].nics:
            load[h] = load.get(h, 0.0) + opts[k].duration
    return list_schedule(jobs, order, choice)


def randomized_greedy(jobs: Sequence[Job], trials: int, seed: int) -> Schedule:
    """Rounds of the largest set of non-conflicting jobs found over ``trials`` random orders.

    Half of the orders are purely random; the other half put first the jobs
    whose mandatory NICs (receiver hosts no holder shares) carry the most
    remaining work, ties broken at random: covering the busiest NICs every
    round is what keeps the number of rounds near the busiest NIC's load.
    Within a round a job takes, among the sender hosts whose NICs are still
    unused in that round, the one that would finish first given the load so
    far, among equally early ones the one on the NICs the fewest remaining jobs
    could use (then, in odd trials, at random); sets covering more NICs win,
    then shorter ones. Rounds, concatenated
    (each longest first), give the list order; a round that uses every NIC
    still wanted ends the trials early. Rounds over many jobs run fewer trials
    (:data:`GREEDY_WORK`), so the run time stays bounded. The result is the better of that
    order list-scheduled with the round's sender choices and with each job's
    sender re-chosen at list time (earliest finish).
    """
    rng = random.Random(seed)
    choice = [0] * len(jobs)
    order: list[int] = [j for j in range(len(jobs)) if not any(o.nics for o in jobs[j].options)]
    remaining = [j for j in range(len(jobs)) if any(o.nics for o in jobs[j].options)]
    mandatory = {j: _mandatory_nics(jobs[j]) for j in remaining}
    min_dur = {j: min(o.duration for o in jobs[j].options) for j in remaining}
    load: dict[int, float] = {}
    trials = max(1, trials)
    while remaining:
        pending: dict[int, float] = {}
        # how many remaining jobs could use each NIC: among equally early options, the one on the NICs
        # fewest others want leaves the most room in the round (two jobs that can both take NICs {0, 1},
        # or one {1, 3} and the other {0, 2}, fit together only if the first does not take {0, 1})
        demand: dict[int, int] = {}
        for j in remaining:
            for h in mandatory[j]:
                pending[h] = pending.get(h, 0.0) + min_dur[j]
            for h in set().union(*(o.nics for o in jobs[j].options)):
                demand[h] = demand.get(h, 0) + 1
        wanted = set(demand)
        prio = {j: sum(pending[h] for h in mandatory[j]) for j in remaining}
        best: tuple[tuple[int, float], list[tuple[int, int]]] | None = None
        # once every wanted NIC is used, only a job with a NIC-free option could still fit
        local = any(not o.nics for j in remaining for o in jobs[j].options)
        round_trials = min(trials, max(1, GREEDY_WORK // (len(jobs) * len(remaining))))
        for trial in range(round_trials):
            perm = remaining[:]
            rng.shuffle(perm)
            if trial % 2 == 0:
                perm.sort(key=lambda j: -prio[j])
            used: set[int] = set()
            picked: list[tuple[int, int]] = []
            for j in perm:
                if not local and len(used) == len(wanted):
                    break
                opts = jobs[j].options
                fits = [i for i, o in enumerate(opts) if not used.intersection(o.nics)]
                if not fits:
                    continue
                ties = {i: rng.random() if trial % 2 else i for i in fits}   # odd trials: ties at random
                k = min(fits, key=lambda i: (_finish(load, opts[i]), sum(demand[h] for h in opts[i].nics), ties[i]))
                used.update(opts[k].nics)
                picked.append((j, k))
            score = (len(used), -sum(jobs[j].options[k].duration for j, k in picked))
            if best is None or score > best[0]:
                best = (score, picked)
            if len(used) == len(wanted):
                break
        assert best is not None
        picked = sorted(best[1], key=lambda jk: (-jobs[jk[0]].options[jk[1]].duration, jk[0]))
        for j, k in picked:
            choice[j] = k
            order.append(j)
            for h in jobs[j].options[k].nics:
                load[h] = load.get(h, 0.0) + jobs[j].options[k].duration
        taken = {j for j, _ in picked}
        remaining = [j for j in remaining if j not in taken]
    rounds = list_schedule(jobs, order, choice)
    rechosen = _earliest_finish(jobs, order)
    return min((rounds, rechosen), key=lambda sc: makespan(jobs, sc))


def _finish(load: dict[int, float], opt: Option) -> float:
    return max((load.get(h, 0.0) for h in opt.nics), default=0.0) + opt.duration


def _earliest_finish(jobs: Sequence[Job], order: Sequence[int]) -> Schedule:
    """List-schedule ``order``, giving each job the sender host that lets it finish first."""
    free: dict[int, float] = {}
    choice = [0] * len(jobs)
    for j in order:
        opts = jobs[j].options
        k = min(range(len(opts)), key=lambda i: (_finish(free, opts[i]), i))
        choice[j] = k
        end = _finish(free, opts[k])
        for h in opts[k].nics:
            free[h] = end
    return list_schedule(jobs, order, choice)


def _mandatory_nics(job: Job) -> tuple[int, ...]:
    """NICs every option of the job occupies."""
    common = set(job.options[0].nics)
    for o in job.options[1:]:
        common &= set(o.nics)
    return tuple(sorted(common))


def dfs(jobs: Sequence[Job], budget_s: float) -> Schedule:
    """Depth-first search over (next job, sender host) with lower-bound pruning.

    The budget is a node count (``budget_s`` × :data:`DFS_NODES_PER_SECOND`),
    not wall time, so the result is the same on every run. The incumbent
    starts as the better of ``naive`` and ``load_balance``. Jobs with equal
    options are interchangeable, so only the first of them is branched on.
    """
    n = len(jobs)
    budget = max(1, int(budget_s * DFS_NODES_PER_SECOND))
    best = min((naive(jobs), load_balance(jobs)), key=lambda s: makespan(jobs, s))
    best_ms = makespan(jobs, best)
    active = [j for j in range(n) if any(o.nics for o in jobs[j].options)]
    if not active:
        return best
    sig = {j: tuple((o.nics, o.duration) for o in jobs[j].options) for j in active}
    min_dur = {j: min(o.duration for o in jobs[j].options) for j in active}
    mandatory = {j: _mandatory_nics(jobs[j]) for j in active}
    state = {"best": best, "best_ms": best_ms}
    path: list[tuple[int, int, float]] = [(0, 0, 0.0)] * len(active)

    def bound(free: dict[int, float], remaining: list[int], current: float) -> float:
        extra: dict[int, float] = {}
        lb = current
        for j in remaining:
            d = min_dur[j]
            for h in mandatory[j]:
                extra[h] = extra.get(h, 0.0) + d
            if not mandatory[j]:
                lb = max(lb, d)
        for h, e in extra.items():
            lb = max(lb, free.get(h, 0.0) + e)
        return lb

    def children(free: dict[int, float], remaining: list[int]) -> list[tuple[float, float, int, int]]:
        out, seen = [], set()
        for j in remaining:
            if sig[j] in seen:
                continue
            seen.add(sig[j])
            for k, o in enumerate(jobs[j].options):
                s = max(free.get(h, 0.0) for h in o.nics) if o.nics else 0.0
                out.append((s + o.duration, s, j, k))
        out.sort()
        return out

    idle = [j for j in range(n) if j not in sig]
    root_current = max((jobs[j].options[0].duration for j in idle), default=0.0)
    # explicit stack (a node per placed job can be thousands deep): (free, remaining, current, children, next)
    stack = [({}, active, root_current, children({}, active), 0)]
    nodes = 0
    while stack and nodes < budget:
        free, remaining, current, kids, i = stack[-1]
        if i >= len(kids):
            stack.pop()
            continue
        stack[-1] = (free, remaining, current, kids, i + 1)
        end, s, j, k = kids[i]
        nodes += 1
        new_current = max(current, end)
        if new_current >= state["best_ms"]:
            stack[-1] = (free, remaining, current, kids, len(kids))  # children are sorted by end time
            continue
        o = jobs[j].options[k]
        new_free = dict(free)
        for h in o.nics:
            new_free[h] = end
        rest = [r for r in remaining if r != j]
        if bound(new_free, rest, new_current) >= state["best_ms"]:
            continue
        depth = len(active) - len(rest) - 1
        path[depth] = (j, k, s)
        if not rest:
            state["best_ms"] = new_current
            choice, start = [0] * n, [0.0] * n
            for jj, kk, ss in path:
                choice[jj], start[jj] = kk, ss
            state["best"] = Schedule(tuple(choice), tuple(start))
            continue
        stack.append((new_free, rest, new_current, children(new_free, rest), 0))
    return state["best"]
