"""The tails (gradient reduction or every reduction, then the world collectives) by classes of ranks:
the verdict of simulating every rank's tail, for the cost of one representative component per class.

docs/deadlock.md ("Classes of ranks", step 4) has the argument; in short: a tail is a sequence of
blocking collectives. Its world collectives are unconditional (``Builder.train_tail``: the loss
all_reduce last; ``comm_only_head`` / ``comm_only_tail``: a barrier first, a barrier and an
all_gather_object last), the same keys on every rank, and the world is a communicator no other tail
operation uses. So the world barrier that opens ``--comm-only`` completes; the reduction collectives
between (*phase A*) then run on their own communicators; and the closing world collectives complete
exactly when every rank's phase A does. Phase A splits into components (ranks joined by a reduction
communicator) that run alone, and components whose ranks issue the same (communicator, key) sequences
once ranks are renamed to their index in the component stop in the same state: one per class is
simulated. Anything else (a representative that cannot finish, world collectives not as above)
answers None, and the caller simulates every rank's tail, so hangs are reported exactly as before.
"""

from __future__ import annotations

from planc.pipeline.deadlock.build import Builder
from planc.pipeline.deadlock.events import ISSUE, Sim, Thread
from planc import plan as planfile


def _sequences(b: Builder, mode: str):
    """Per rank, phase A as the builder writes it: ``(communicator id, key)`` in issue order; and per
    communicator id its members as the builder's communicator holds them, and its kind."""
    plan = b.plan
    ids: dict = {}          # communicator key (as Builder.comms) -> id
    members: list = []      # id -> (kind, members)
    by_obj: dict = {}       # id(group tuple) -> (group, id): a group object costs one sort, not one per member

    def plan_group(g) -> int:
        hit = by_obj.get(id(g))
        if hit is not None and hit[0] is g:
            return hit[1]
        key = ("group", tuple(sorted(g)))
        cid = ids.get(key)
        if cid is None:
            cid = ids[key] = len(members)
            members.append(key)
        by_obj[id(g)] = (g, cid)
        return cid

    def grid(g) -> int:
        key = ("grid", tuple(g))
        cid = ids.get(key)
        if cid is None:
            cid = ids[key] = len(members)
            members.append(key)
        return cid

    def steps(red, ranks, stage=None) -> None:
        """``Builder.emit_steps`` for every rank of ``ranks`` (a map or set): each step's group holding it
        (``stage``: the REDUCE it runs for)."""
        for i, step in enumerate(red.steps):
            holding = b.holding(step.groups)
            key = ("reduce", red.name, red.stage if stage is None else stage, i)
            for g in step.groups:
                if len(g) > 1:
                    cid = plan_group(g)
                    for m in dict.fromkeys(g):
                        if holding[m] is g and m in ranks:
                            seqs[m].append((cid, key))

    seqs: list[list] = [[] for _ in range(plan.cluster.devices)]
    if mode == "train":     # Builder.train_tail, less the loss all_reduce: the staged ranks' gradient reduction
        listed = set(plan.groups)
        by_red: dict = {}
        for rank in range(plan.cluster.devices):   # one reduction per REDUCE of its class, in list order
            for k, red, g in b.reductions_of(rank):
                if red.mode is planfile.ReductionMode.ALLREDUCE:
                    if len(g) > 1:
                        seqs[rank].append((plan_group(g) if g in listed else grid(g), ("deepspeed", g, k)))
                else:   # a stage's reduction runs on its class's ranks only, so the order per rank holds
                    by_red.setdefault((id(red), k), (red, k, set()))[2].add(rank)
        for red, k, ranks in by_red.values():
            steps(red, ranks, k)
    else:                   # Builder.comm_only_tail, less the barrier and all_gather_object
        for red in plan.reductions:
            steps(red, b.holding(red.groups))
    return seqs, members


def _components(n: int, members: list) -> list[list[int]]:
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for _, ms in members:
        a = find(ms[0])
        for m in ms[1:]:
            c = find(m)
            if c != a:
                parent[c] = a
    out: dict[int, list[int]] = {}
    for r in range(n):
        out.setdefault(find(r), []).append(r)
    return sorted(out.values(), key=lambda c: c[0])


def tail_classes(b: Builder, mode: str) -> list[list[list[int]]]:
    """Phase A's components grouped by signature (each rank's (communicator, key) sequence, ranks renamed
    to their index in the component): each class a list of components, first the representative."""
    seqs, members = _sequences(b, mode)
    comps = _components(b.plan.cluster.devices, members)
    renamed: dict[int, tuple] = {}
    by_sig: dict[tuple, list[list[int]]] = {}
    for comp in comps:
        lam = {r: i for i, r in enumerate(comp)} if len(comp) > 1 else {comp[0]: 0}
        sig = []
        for r in comp:
            row = []
            for cid, key in seqs[r]:
                ren = renamed.get(cid)
                if ren is None:     # a communicator lies in one component: renamed once
                    kind, ms = members[cid]
                    ren = renamed[cid] = (kind, tuple(lam[m] for m in ms))
                if key[0] == "deepspeed":
                    key = ("deepspeed", tuple(lam[m] for m in key[1])) + key[2:]
                row.append((ren, key))
            sig.append(tuple(row))
        by_sig.setdefault(tuple(sig), []).append(comp)
    return list(by_sig.values())


def _tail_program(b: Builder, mode: str, rank: int) -> list:
    prog: list = []
    if mode == "train":
        b.train_tail(rank, prog)
    else:
        b.comm_only_head(rank, prog)
        b.comm_only_tail(rank, prog)
    return prog


def tails_finish(b: Builder, mode: str) -> bool:
    """True when every rank's tail is proven to finish by simulating one component per class; False when
    that is not shown (a representative stops, or the world collectives are not as the argument needs):
    the caller then simulates every rank's tail."""
    world = b._world()
    threads, closing = [], set()
    for cls in tail_classes(b, mode):
        for rank in cls[0]:
            prog = _tail_program(b, mode, rank)
            world_at = [ev.comm is world for _, ev, _ in prog]
            head = 2 if mode == "comm_only" else 0    # the opening barrier: its issue and its wait
            first = world_at.index(True, head) if True in world_at[head:] else len(prog)
            if not all(world_at[:head]) or not all(world_at[first:]):
                return False   # world collectives not only first and last: not the shape argued about
            keys = tuple(ev.key for code, ev, _ in prog if code == ISSUE and ev.comm is world)
            inner = prog[head:first]
            closing.add(keys)
            threads.append(Thread(rank, "compute" if mode == "train" else "main", inner))
    if b.invalid or len(closing) > 1:
        return False
    Sim(threads).run()
    return all(t.finished for t in threads)
