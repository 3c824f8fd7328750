"""The rendezvous check over equivalence classes of ranks: the same verdict as simulating every rank,
for the cost of one representative per class of pipeline replicas plus a collectives-only pass.

docs/deadlock.md ("Classes of ranks") has the argument; in short:

1. **Two phases on disjoint communicators.** Every rank's step is a *pipeline part* (the receive and
   NIC threads, and the compute thread up to and including the wait for its sends: transfers' p2p and
   transfer groups, the tensor group, NIC turns; in ``--comm-only`` the transfers) followed, on the
   compute (main) thread only, by a *tail* (the gradient reduction or the reductions, the world
   collectives). When no communicator is used by both parts (a tensor group that is also a reduction
   group would be; then :func:`check_mode` answers None and the caller simulates every rank), no tail
   operation can match a pipeline one, so the pipeline parts can be run first, alone: if one cannot
   finish, that rank never reaches its tail and the step hangs; if all finish, the tails start from an
   empty state and decide alone. (``--comm-only``'s first world barrier is every rank's first
   operation on a communicator nothing else uses before it: it completes, and is run with the tail.)
2. **Components.** Ranks that share a pipeline-part communicator (a task's sender, receivers, group
   and parts; a tensor group; consecutive turns of a host's NIC order) are joined; the pipeline parts
   of different components never match each other's operations or events, so each component runs alone.
3. **Classes.** A component's *signature* is every fact :class:`~planc.pipeline.deadlock.build.Builder`
   reads to write its ranks' pipeline parts (stage, tensor group, destination flags, the tasks of each
   transfer direction in schedule order, NIC turns and the turn before each), with each rank renamed
   to its index in the component's sorted ranks. Components with equal signatures get the same
   programs up to that renaming (ranks, task keys, communicators), so they stop in the same state up
   to it: one representative per class is simulated. Data replicas of a plan are such components.

The event loop is confluent (docs/deadlock.md), which is what lets each part and component be run on
its own. Tails are simulated for every rank: collectives only, a few per rank.
"""

from __future__ import annotations

from planc.pipeline.deadlock.build import Builder
from planc.pipeline.deadlock.events import Sim, Thread
from planc.pipeline.deadlock.report import Hang, Wait, find_hangs
from planc.pipeline.deadlock.tails import tails_finish
from planc import plan as planfile


def components(b: Builder, mode: str) -> list[list[int]]:
    """The ranks joined by the pipeline part's communicators, each component sorted, by smallest rank."""
    n = b.plan.cluster.devices
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(members) -> None:
        it = iter(members)
        first = next(it, None)
        if first is None:
            return
        a = find(first)
        for m in it:
            c = find(m)
            if c != a:
                parent[c] = a

    for ordered in b.ordered.values():
        for _, task in ordered:
            join((task.sender, *task.receivers, *(task.group or ()), *(r for p in task.parts for r in p)))
    if mode == "train":
        if b.tp:
            for g in b.plan.tensor_groups:
                join(g)
        for order in b.nic.values():
            join(r for r, _, _, _ in order)
    out: dict[int, list[int]] = {}
    for r in range(n):
        out.setdefault(find(r), []).append(r)
    return sorted(out.values(), key=lambda c: c[0])


def signatures(b: Builder, mode: str, comps: list[list[int]]) -> list[tuple]:
    """Per component, everything the builder reads to write its pipeline parts, ranks renamed to their
    index in the component (``planc.pipeline.deadlock.build``: train_pipeline, comm_only_transfers)."""
    comp_of = {}
    for i, c in enumerate(comps):
        for r in c:
            comp_of[r] = i
    lam = {r: i for c in comps for i, r in enumerate(c)}

    def rename(xs):
        return None if xs is None else tuple(lam[x] for x in xs)

    tasks = [[] for _ in comps]
    for key, ordered in b.ordered.items():
        if mode == "comm_only" and key[1] is not planfile.Direction.FORWARD:
            continue
        for _, t in ordered:
            tasks[comp_of[t.sender]].append((key[0], str(key[1]), lam[t.sender], rename(t.receivers),
                                             rename(t.group), tuple(rename(p) for p in t.parts)))
    nic = [[] for _ in comps]
    if mode == "train":
        for order in b.nic.values():
            for i, (r, name, direction, m) in enumerate(order):
                prev = order[i - 1] if i else None
                nic[comp_of[r]].append((lam[r], name, str(direction), m,
                                        None if prev is None else (lam[prev[0]],) + tuple(prev[1:])))
    out = []
    for i, c in enumerate(comps):
        ranks = []
        for r in c:
            st = b.stage_by_rank.get(r)
            if mode == "train":   # the stages of its rank class (the list it runs)
                tp = b.tp_by_rank.get(r) if b.tp and st is not None else None
                ranks.append((None if st is None else b.plan.pipeline.class_of(st.index).stages, rename(tp)))
            else:
                ranks.append(tuple(r in dst for dst in b.destinations))
        out.append((tuple(ranks), tuple(tasks[i]), tuple(nic[i])))
    return out


def classes(b: Builder, mode: str) -> list[list[list[int]]]:
    """The components grouped by signature: each class a list of components, first the representative."""
    comps = components(b, mode)
    by_sig: dict[tuple, list[list[int]]] = {}
    for c, sig in zip(comps, signatures(b, mode, comps)):
        by_sig.setdefault(sig, []).append(c)
    return list(by_sig.values())


def separable(b: Builder, mode: str) -> bool:
    """Whether no communicator serves both the pipeline part and the tail (step 1 of the argument): the
    only plan groups of the pipeline part are tensor groups, and the tail's are reduction groups."""
    if mode != "train" or not b.tp:
        return True
    tensor = {tuple(sorted(g)) for g in b.plan.tensor_groups if len(g) > 1}
    for red in b.plan.reductions:
        for g in red.groups:
            if tuple(sorted(g)) in tensor:
                return False
        for step in red.steps:
            for g in step.groups:
                if tuple(sorted(g)) in tensor:
                    return False
    return True


def _invalid(b: Builder, mode: str, backend: str, limit: int) -> list[Hang]:
    thread = "compute" if mode == "train" else "main"
    return [Hang("invalid", (rank,), (Wait(rank, thread, mode, text, (), "torch refuses it"),), backend, mode)
            for rank, text in b.invalid[:limit]]


def _pipeline_parts(b: Builder, mode: str, comps) -> list[Thread]:
    threads: list[Thread] = []
    for comp in comps:
        for rank in comp:
            if mode == "train":
                threads += [t for t in b.train_pipeline(rank) if t.prog]
            else:
                prog: list = []
                b.comm_only_transfers(rank, prog)
                if prog:
                    threads.append(Thread(rank, "main", prog))
    return threads


def check_mode(plan: planfile.Plan, mode: str, backend: str, ahead: int, tensor_parallel: bool,
               limit: int, shared: dict | None = None) -> list[Hang] | None:
    """The hangs of one mode found by classes (the same verdict as simulating every rank), or None when
    the two parts share a communicator and the classes cannot be formed."""
    b = Builder(plan, backend, ahead, tensor_parallel, shared)
    if not separable(b, mode):
        return None
    found = classes(b, mode)
    threads = _pipeline_parts(b, mode, [cls[0] for cls in found])
    if b.invalid:
        return _invalid(b, mode, backend, limit)
    Sim(threads).run()
    stuck = {t.rank for t in threads if not t.finished}
    if stuck:
        # a class whose representative cannot finish: every component of it hangs alike; simulate them
        # all, so that the hangs name every rank that would (as the whole simulation does)
        b = Builder(plan, backend, ahead, tensor_parallel, shared)
        threads = _pipeline_parts(b, mode, [c for cls in found if any(r in stuck for r in cls[0]) for c in cls])
        Sim(threads).run()
        return find_hangs(threads, backend, mode, limit, b.turns)
    # every rank's tail by classes of reduction components (planc.pipeline.deadlock.tails); the verdict
    # does not depend on the backend (collectives only), so ``shared`` keeps it for the other backend's check
    if shared is not None and shared.get(("tails finish", mode)):
        return []
    if tails_finish(b, mode):
        if shared is not None:
            shared[("tails finish", mode)] = True
        return []
    b = Builder(plan, backend, ahead, tensor_parallel, shared)   # not shown: every rank's tail, from empty queues
    tails: list[Thread] = []
    for rank in range(plan.cluster.devices):
        prog = []
        if mode == "train":
            b.train_tail(rank, prog)
            tails.append(Thread(rank, "compute", prog))
        else:
            b.comm_only_head(rank, prog)
            b.comm_only_tail(rank, prog)
            tails.append(Thread(rank, "main", prog))
    if b.invalid:
        return _invalid(b, mode, backend, limit)
    Sim(tails).run()
    return find_hangs(tails, backend, mode, limit, b.turns)
