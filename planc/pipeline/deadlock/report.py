"""Where the simulation stopped, explained: which rank waits in which operation for whom, and why;
the waits grouped into :class:`Hang`s (two ranks waiting on each other, a longer circle, or ranks
waiting for ones that will never act)."""

from __future__ import annotations

from dataclasses import dataclass

from planc.pipeline.deadlock.events import RECV, SEND, Group, Op, Pair, Thread, Turn


@dataclass(frozen=True, slots=True)
class Wait:
    """One rank blocked: in which thread and step, on which operation, for which ranks and why."""

    rank: int
    thread: str                  # "compute", "receive" or "main" (comm-only)
    where: str                   # e.g. "stage 1 op 0 (F1)"
    op: str                      # the operation it waits in
    waits_for: tuple[int, ...]   # the ranks that must act first
    why: str                     # what those ranks do instead

    def __str__(self) -> str:
        return f"rank {self.rank} waits in {self.op} ({self.thread} thread, {self.where}: {self.why})"


@dataclass(frozen=True, slots=True)
class Hang:
    """A set of ranks that can never finish the step.

    ``kind``: ``"cycle"`` (the ranks wait on each other in a circle; two ranks
    when that is possible), ``"stuck"`` (a rank waits for one that finished or
    that waits on others outside any cycle), ``"invalid"`` (a rank issues a
    collective on a group it is not in).
    """

    kind: str
    ranks: tuple[int, ...]
    waits: tuple[Wait, ...]
    backend: str
    mode: str

    def __str__(self) -> str:
        step = "training step" if self.mode == "train" else "--comm-only step"
        head = f"the plan hangs under {self.backend} in the {step}: "
        if self.kind == "invalid":
            return head + "; ".join(w.op for w in self.waits)
        if self.kind == "cycle" and len(self.waits) == 2:
            a, b = self.waits
            return head + f"{a}, while {b}"
        if self.kind == "cycle":
            return head + "ranks " + " -> ".join(map(str, self.ranks + self.ranks[:1])) + " wait in a circle: " + \
                "; ".join(map(str, self.waits))
        return head + "; ".join(map(str, self.waits))


# ---------------------------------------------------------------- explaining where it stopped

def _head(op: Op):
    c = op.comm
    if type(c) in (Pair, Group):
        q = c.q[op.rank]
        return q[0] if q else None
    return op


def _why(op: Op, finished: set, turns=None) -> tuple[tuple[int, ...], str]:
    """The ranks ``op`` (at the head of its rank's queue) waits for, and what they do instead
    (``turns``: the host NIC order's turns, to say when the missing send is one a NIC thread holds)."""
    c = op.comm

    def absent(p, what):
        text = f"rank {p} {'finished its step without issuing' if p in finished else 'has not issued'} {what}"
        w = op.what
        if op.kind == RECV and w[0] == "task" and turns:
            turn = turns.get((p, w[3], str(w[2]), w[5]))
            if turn is not None and not turn.done:
                text += (f": its NIC thread holds that send for its turn in host {turn.host}'s NIC order "
                         "(plan.json pipeline.nic_order)")
        return text

    if type(c) is Group:
        ranks, parts = [], []
        for m in c.members:
            q = c.q[m]
            if m == op.rank or (q and q[0].key == op.key):
                continue
            ranks.append(m)
            if not q:
                parts.append(absent(m, "it"))
            else:
                parts.append(f"rank {m} is first at {q[0].describe()} on that communicator: "
                             "the members reach their collectives in different orders")
        return tuple(ranks), "; ".join(parts)
    p = op.peer
    other = "receive" if op.kind == SEND else "send"
    if type(c) is Pair:
        q = c.q[p]
        if q:
            h = q[0]
            if h.kind != op.kind:
                return (p,), (f"rank {p}'s first unmatched operation with rank {op.rank} on that communicator is "
                              f"{h.describe()}: NCCL ignores tags and would pair them out of order")
            return (p,), f"rank {p}'s first unmatched operation with rank {op.rank} is also a {op.kind}: {h.describe()}"
    return (p,), absent(p, f"the matching {other}")


def _explain(th: Thread, finished: set, turns=None) -> Wait | None:
    code, ev, where = th.prog[th.pc]
    if isinstance(ev, Turn) and ev.rank != th.rank:   # its turn on the host's NIC, after another rank's send
        return Wait(th.rank, th.name, where, f"its turn on host {ev.host}'s NIC", (ev.rank,),
                    f"rank {ev.rank} has not finished its {ev.text}, the send before it in the host's order")
    if not isinstance(ev, Op):
        return None    # waits for its own other thread, which is blocked too and says why
    head = _head(ev)
    blocker = head if head is not None else ev
    ranks, why = _why(blocker, finished, turns)
    if blocker is not ev:
        why = f"it is queued behind its own {blocker.describe()}, for which {why}"
    return Wait(th.rank, th.name, where, ev.describe(), ranks, why)


def find_hangs(threads: list[Thread], backend: str, mode: str, limit: int, turns=None) -> list[Hang]:
    ranks = sorted({t.rank for t in threads})
    unfinished = {t.rank for t in threads if not t.finished}
    finished = {r for r in ranks if r not in unfinished}
    waits: dict[int, list[Wait]] = {}
    for th in threads:
        if not th.finished:
            w = _explain(th, finished, turns)
            if w is not None:
                waits.setdefault(th.rank, []).append(w)
    if not waits:
        return []
    edges = {r: [(p, w) for w in ws for p in w.waits_for] for r, ws in waits.items()}
    hangs, seen = [], set()
    for a in sorted(edges):                                   # two ranks waiting on each other
        for b, wa in edges[a]:
            if b <= a or (a, b) in seen:
                continue
            wb = next((w for p, w in edges.get(b, ()) if p == a), None)
            if wb is not None:
                seen.add((a, b))
                hangs.append(Hang("cycle", (a, b), (wa, wb), backend, mode))
    if not hangs:                                             # a longer circle
        cycle = _find_cycle(edges)
        if cycle:
            ws = tuple(next(w for p, w in edges[r] if p == cycle[(i + 1) % len(cycle)]) for i, r in enumerate(cycle))
            hangs.append(Hang("cycle", tuple(cycle), ws, backend, mode))
    if not hangs:                                             # waits for ranks that will never act
        for r in sorted(waits):
            for w in waits[r]:
                if not w.waits_for or all(p in finished or p not in edges for p in w.waits_for):
                    hangs.append(Hang("stuck", (r,), (w,), backend, mode))
    if not hangs:
        r = min(waits)
        hangs.append(Hang("stuck", (r,), tuple(waits[r]), backend, mode))
    return hangs[:limit]


def _find_cycle(edges: dict) -> list[int] | None:
    state: dict[int, int] = {}
    for start in sorted(edges):
        if start in state:
            continue
        path, stack = [], [(start, iter(sorted({p for p, _ in edges.get(start, ())})))]
        state[start] = 1
        path.append(start)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                stack.pop()
                path.pop()
                state[node] = 2
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):]
            if nxt not in state and nxt in edges:
                state[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted({p for p, _ in edges[nxt]}))))
    return None
