"""The rendezvous semantics: every rank's threads as programs of events, its communicators, and the
event loop that runs them until nothing can move (``planc.pipeline.deadlock``'s model).

A thread's program is a list of ``(code, event, where)``: ``ISSUE`` an operation on its communicator,
``WAIT`` for an event, ``SIGNAL`` one (to another thread of the rank). An operation completes when
its partners are at the head of their own queue on the same communicator (NCCL p2p: FIFO per peer
pair; gloo p2p: matched by tag in any order; collectives: FIFO per communicator).
"""

from __future__ import annotations

from collections import deque

ISSUE, WAIT, SIGNAL = 0, 1, 2
SEND, RECV, COLL = "send", "recv", "coll"


class Event:
    __slots__ = ("done", "waiters")

    def __init__(self):
        self.done = False
        self.waiters = []


class Op(Event):
    """One communication operation of one rank: a send, a receive, or its part in a collective."""

    __slots__ = ("rank", "comm", "kind", "key", "peer", "what")

    def __init__(self, rank, comm, kind, key, peer, what):
        super().__init__()
        self.rank, self.comm, self.kind, self.key, self.peer, self.what = rank, comm, kind, key, peer, what

    def describe(self) -> str:
        w = self.what
        if w[0] == "task":        # ("task", verb, direction, transfer, task, micro-batch)
            _, verb, d, name, k, m = w
            text = f"{d} {verb} of transfer {name!r} task {k} (micro-batch {m})"
        else:                     # ("text", description)
            text = w[1]
        if self.kind == SEND:
            text += f" to rank {self.peer}"
        elif self.kind == RECV:
            text += f" from rank {self.peer}"
        return f"{text} on communicator {self.comm.label}"


class Turn(Event):
    """A turn of a host NIC order (gloo): done when that rank's NIC thread has sent it."""

    __slots__ = ("rank", "host", "text")

    def __init__(self, rank, host, text):
        super().__init__()
        self.rank, self.host, self.text = rank, host, text


class Pair:
    """NCCL p2p: one two-rank communicator per peer pair and direction, FIFO on both ends."""

    __slots__ = ("label", "q", "ranks")

    def __init__(self, label, a, b):
        self.label, self.ranks = label, (a, b)
        self.q = {a: deque(), b: deque()}


class Tagged:
    """gloo p2p (and a rank's messages to itself): a send meets the receive of the same tag, in any order."""

    __slots__ = ("label", "sends", "recvs")

    def __init__(self, label):
        self.label = label
        self.sends: dict = {}
        self.recvs: dict = {}


class Group:
    """A collective communicator: a member's operation completes when every member's head is the same one."""

    __slots__ = ("label", "members", "q", "filled")

    def __init__(self, label, members):
        self.label, self.members = label, members
        self.q = {m: deque() for m in members}
        self.filled = 0            # members whose queue is not empty: match only when all are


class Thread:
    __slots__ = ("rank", "name", "prog", "pc")

    def __init__(self, rank, name, prog):
        self.rank, self.name, self.prog, self.pc = rank, name, prog, 0

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.prog)


# ---------------------------------------------------------------- the event loop

class Sim:
    def __init__(self, threads: list[Thread]):
        self.threads = threads
        self.ready = deque(threads)

    def _complete(self, op: Event) -> None:
        op.done = True
        if op.waiters:
            self.ready.extend(op.waiters)
            op.waiters = []

    def _issue(self, op: Op) -> None:
        c = op.comm
        if type(c) is Pair:
            q = c.q[op.rank]
            q.append(op)
            if len(q) == 1:
                self._match_pair(c)
        elif type(c) is Group:
            q = c.q[op.rank]
            q.append(op)
            if len(q) == 1:
                c.filled += 1
                if c.filled == len(c.members):
                    self._match_group(c)
        else:
            if op.kind == SEND:
                k = (op.rank, op.peer, op.key)
                mine, other = c.sends, c.recvs
            else:
                k = (op.peer, op.rank, op.key)
                mine, other = c.recvs, c.sends
            waiting = other.get(k)
            if waiting:
                self._complete(waiting.popleft())
                self._complete(op)
            else:
                mine.setdefault(k, deque()).append(op)

    def _match_pair(self, c: Pair) -> None:
        qa, qb = c.q[c.ranks[0]], c.q[c.ranks[1]]
        while qa and qb:
            a, b = qa[0], qb[0]
            if a.key != b.key or a.kind == b.kind:
                return
            qa.popleft()
            qb.popleft()
            self._complete(a)
            self._complete(b)

    def _match_group(self, c: Group) -> None:
        """Complete the heads while every member has one and they are the same operation
        (O(members) per completed collective: a member's issue only counts queues)."""
        qs, n = c.q, len(c.members)
        while c.filled == n:
            key = qs[c.members[0]][0].key
            if any(qs[m][0].key != key for m in c.members):
                return
            for m in c.members:
                q = qs[m]
                self._complete(q.popleft())
                if not q:
                    c.filled -= 1

    def run(self) -> None:
        ready = self.ready
        while ready:
            th = ready.popleft()
            prog, pc, n = th.prog, th.pc, len(th.prog)
            while pc < n:
                code, ev, _ = prog[pc]
                if code == WAIT:
                    if not ev.done:
                        ev.waiters.append(th)
                        break
                elif code == ISSUE:
                    self._issue(ev)
                else:
                    self._complete(ev)
                pc += 1
            th.pc = pc
