"""Can the compiled plan hang? Every rank's communication, simulated under rendezvous semantics.

``check_rendezvous(plan, ahead=4, backend="nccl")`` replays one training step
(and the ``--comm-only`` step) of every rank exactly in the order the runtime
issues it, with the strict semantics of NCCL, and returns the hangs it finds
(empty: the plan cannot hang). Pure and torch-free; docs/deadlock.md has the
model and how each rule maps to the runtime's code.

The model, per rank:

- the **compute thread** (``engine.PlanEngine``) runs the stage's
  ``pipeline.per_stage`` list: ``F m`` waits for every incoming transfer's
  forward receive (``RecvAhead.take``), computes (a tensor-parallel all_reduce
  when the rank has a tensor group), then issues every outgoing transfer's
  forward sends (``TransferExecutor.send``, non-blocking); ``B m`` likewise
  with the outgoing transfers' backward receives and the incoming transfers'
  backward sends. Then it waits for all its sends (``SendReaper.drain``), runs
  its gradient reduction program, and the world all_reduce of the loss.
  Ranks in no stage only do the all_reduce;
- the **receive thread** (``comm.RecvAhead``) runs, one after the other, the
  receive jobs of the list (per op, the transfers it consumes, in declaration
  order), job ``j`` only once the compute thread has begun the op
  ``comm.post_gates`` names (``j - ahead``, or for ``B m`` this stage's ``F m``
  when earlier; ``advance``), each job being ``TransferExecutor.recv``: per task of the
  route in schedule order, the receive, broadcast or all_gather it posts and
  the waits in the order the code has them;
- the **NIC thread** (``nicorder.NicOrder``; gloo, when plan.json has a host
  NIC order for the rank's host): the rank's listed sends in the host's
  order, each once the compute thread handed it over (it signals instead of
  issuing) and the host's previous listed send was sent; the compute thread
  waits for those turns with its other sends;
- ``--comm-only`` (``main.comm_only``): one thread; a barrier, then per
  transfer the forward sends, the receives and a wait on the sends, then
  every reduction the rank is in, then a barrier.

Communicators: an operation completes when its partners are at the head of
their own queue on the same communicator. NCCL: a single send/recv runs on
the two-rank communicator of its peer pair (torch ``ProcessGroupNCCL``), so
p2p is FIFO per (direction, pair) and tags are not looked at: the k-th send of
a pair meets the k-th receive; a broadcast is a collective on the task's group
(``("transfer", direction, *members)``). gloo: p2p matches by (pair, tag) in
any order and a broadcast is the relay chain sender → receivers. Allgather
parts, reduction steps, tensor groups and the world are collectives (FIFO per
communicator) on both. Sends never block the thread that issues them.

The state it stops in does not depend on the order in which the simulation
runs threads: operations only ever enable others, and matching at queue heads
is deterministic. A rank that uses one communicator from both of its threads
(impossible for a compiled plan: transfers go from earlier to later stages)
gets the simulation's interleaving.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from planc.runtime import planfile
from planc.runtime.planfile import Direction, Strategy
from planc.runtime.comm import DEFAULT_AHEAD, post_gates

__all__ = ["check_rendezvous", "Hang", "Wait", "BACKENDS", "MODES"]

BACKENDS = ("nccl", "gloo")
MODES = ("train", "comm_only")

_ISSUE, _WAIT, _SIGNAL = 0, 1, 2
_SEND, _RECV, _COLL = "send", "recv", "coll"
_ALLGATHER = (Strategy.LOCAL_ALLGATHER, Strategy.GLOBAL_ALLGATHER)


# ---------------------------------------------------------------- the report

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


# ---------------------------------------------------------------- events and operations

class _Event:
    __slots__ = ("done", "waiters")

    def __init__(self):
        self.done = False
        self.waiters = []


class _Op(_Event):
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
        if self.kind == _SEND:
            text += f" to rank {self.peer}"
        elif self.kind == _RECV:
            text += f" from rank {self.peer}"
        return f"{text} on communicator {self.comm.label}"


class _Turn(_Event):
    """A turn of a host NIC order (gloo): done when that rank's NIC thread has sent it."""

    __slots__ = ("rank", "host", "text")

    def __init__(self, rank, host, text):
        super().__init__()
        self.rank, self.host, self.text = rank, host, text


class _Pair:
    """NCCL p2p: one two-rank communicator per peer pair and direction, FIFO on both ends."""

    __slots__ = ("label", "q", "ranks")

    def __init__(self, label, a, b):
        self.label, self.ranks = label, (a, b)
        self.q = {a: deque(), b: deque()}


class _Tagged:
    """gloo p2p (and a rank's messages to itself): a send meets the receive of the same tag, in any order."""

    __slots__ = ("label", "sends", "recvs")

    def __init__(self, label):
        self.label = label
        self.sends: dict = {}
        self.recvs: dict = {}


class _Group:
    """A collective communicator: a member's operation completes when every member's head is the same one."""

    __slots__ = ("label", "members", "q", "filled")

    def __init__(self, label, members):
        self.label, self.members = label, members
        self.q = {m: deque() for m in members}
        self.filled = 0            # members whose queue is not empty: match only when all are


class _Thread:
    __slots__ = ("rank", "name", "prog", "pc")

    def __init__(self, rank, name, prog):
        self.rank, self.name, self.prog, self.pc = rank, name, prog, 0

    @property
    def finished(self) -> bool:
        return self.pc >= len(self.prog)


# ---------------------------------------------------------------- building every rank's programs

class _Builder:
    """Every rank's thread programs for one mode and backend: lists of (code, event or op, where)."""

    def __init__(self, plan: planfile.Plan, backend: str, ahead: int, tensor_parallel: bool):
        self.plan, self.backend, self.ahead, self.tp = plan, backend, ahead, tensor_parallel
        self.nccl = backend == "nccl"
        self.comms: dict = {}
        self.invalid: list[tuple[int, str]] = []
        self._holding: dict = {}
        self._keep: list = []
        self._by_id: dict = {}
        self.ordered = {}
        # the host NIC order (plan.json pipeline.nic_order), as the runtime runs it: on gloo only
        self.nic = {h: keys for h, keys in (plan.pipeline.nic_order if plan.pipeline is not None else ())} \
            if backend == "gloo" else {}
        self.turns: dict = {}
        self.index_of = {t.name: i for i, t in enumerate(plan.transfers)}
        for i, t in enumerate(plan.transfers):
            for d in Direction:
                route = t.forward if d is Direction.FORWARD else t.backward
                if route is not None:
                    self.ordered[(i, d)] = route.ordered_tasks()

    # ---- communicators
    def _p2p(self, d: Direction, a: int, b: int):
        label = f"p2p/{d}"
        if not self.nccl or a == b:
            key = ("tag", str(d))
            if key not in self.comms:
                self.comms[key] = _Tagged(label)
            return self.comms[key]
        lo, hi = min(a, b), max(a, b)
        key = ("p2p", str(d), lo, hi)
        c = self.comms.get(key)
        if c is None:
            c = self.comms[key] = _Pair(label, lo, hi)
        return c

    def _group(self, key, members, label):
        c = self.comms.get(key)
        if c is None:
            c = self.comms[key] = _Group(label, tuple(members))
        return c

    def _transfer_group(self, d: Direction, members):
        members = tuple(sorted(members))
        return self._group(("transfer", str(d), members), members, f"transfer/{d}/{list(members)}")

    def _plan_group(self, members):
        # the same group object comes back once per member: look it up by identity first, so a
        # group of N devices costs O(N) once, not sorting and hashing N members N times
        hit = self._by_id.get(id(members))
        if hit is not None and hit[0] is members:
            return hit[1]
        key = tuple(sorted(members))
        c = self._group(("group", key), key, f"group {list(key)}")
        self._by_id[id(members)] = (members, c)
        return c

    def _world(self):
        c = self.comms.get(("world",))
        if c is None:
            n = self.plan.cluster.devices
            c = self._group(("world",), tuple(range(n)), "world")
        return c

    # ---- operations
    def send(self, rank, d, peer, key, what):
        return _Op(rank, self._p2p(d, rank, peer), _SEND, key, peer, what)

    def recv(self, rank, d, peer, key, what):
        return _Op(rank, self._p2p(d, peer, rank), _RECV, key, peer, what)

    def coll(self, rank, comm, key, what):
        if rank not in comm.q:
            self.invalid.append((rank, f"rank {rank} issues {_Op(rank, comm, _COLL, key, None, what).describe()}, "
                                       "a group it is not a member of"))
            return None
        return _Op(rank, comm, _COLL, key, None, what)

    # ---- one transfer direction, as TransferExecutor.send / .recv run it
    def emit_send(self, prog, rank, ti, d, m, where) -> list:
        """The sends ``TransferExecutor.send`` starts; returns them (the caller waits on them later)."""
        t = self.plan.transfers[ti]
        ordered = self.ordered.get((ti, d))
        if ordered is None:
            return []
        strategy = t.route(d).strategy
        out = []
        for k, task in ordered:
            if task.sender != rank:
                continue
            key = (ti, d, m, k)
            if strategy is Strategy.BROADCAST:
                if self.nccl:
                    members = task.group or tuple(sorted({task.sender, *task.receivers}))
                    op = self.coll(rank, self._transfer_group(d, members), ("bcast",) + key,
                                   ("task", "broadcast", d, t.name, k, m))
                    ops = [op] if op is not None else []
                else:
                    chain = _chain(task)
                    ops = [self.send(rank, d, chain[1], key, ("task", "send", d, t.name, k, m))] if len(chain) > 1 else []
            elif strategy is Strategy.SEND_RECV:
                ops = [self.send(rank, d, r, key, ("task", "send", d, t.name, k, m)) for r in task.receivers]
            else:
                ops = [self.send(rank, d, r, key, ("task", "send", d, t.name, k, m)) for part in task.parts for r in part]
            for op in ops:
                prog.append((_ISSUE, op, where))
            out += ops
        return out

    def emit_recv(self, prog, rank, ti, d, m, where) -> None:
        """``TransferExecutor.recv`` for one rank: posts, relays, gathers and waits, in the code's order."""
        t = self.plan.transfers[ti]
        ordered = self.ordered.get((ti, d))
        if ordered is None:
            return
        strategy = t.route(d).strategy
        mine = [(k, task) for k, task in ordered if rank in task.receivers]
        name = t.name
        if self.nccl:
            pending = []
            for k, task in mine:
                key = (ti, d, m, k)
                if strategy is Strategy.BROADCAST:
                    members = task.group or tuple(sorted({task.sender, *task.receivers}))
                    op = self.coll(rank, self._transfer_group(d, members), ("bcast",) + key,
                                   ("task", "broadcast", d, name, k, m))
                    if op is not None:
                        prog.append((_ISSUE, op, where))
                        pending.append(op)
                    continue
                op = self.recv(rank, d, task.sender, key, ("task", "recv", d, name, k, m))
                prog.append((_ISSUE, op, where))
                part = _part_of(task, rank) if strategy in _ALLGATHER else None
                if part is not None and len(part) > 1:
                    prog.append((_WAIT, op, where))
                    self._gather(prog, rank, d, part, key, name, k, m, where)
                else:
                    pending.append(op)
            for op in pending:
                prog.append((_WAIT, op, where))
            return
        # gloo: every receive posted up front, then relays and gathers task by task
        posted, relays = {}, []
        for k, task in mine:
            key = (ti, d, m, k)
            src = task.sender
            if strategy is Strategy.BROADCAST:
                chain = _chain(task)
                src = chain[chain.index(rank) - 1]
            posted[k] = op = self.recv(rank, d, src, key, ("task", "recv", d, name, k, m))
            prog.append((_ISSUE, op, where))
        for k, task in mine:
            key = (ti, d, m, k)
            if strategy is Strategy.BROADCAST:
                chain = _chain(task)
                pos = chain.index(rank)
                if pos + 1 < len(chain):
                    prog.append((_WAIT, posted[k], where))
                    op = self.send(rank, d, chain[pos + 1], key, ("task", "relay", d, name, k, m))
                    prog.append((_ISSUE, op, where))
                    relays.append(op)
            elif strategy in _ALLGATHER:
                part = _part_of(task, rank)
                if len(part) > 1:
                    prog.append((_WAIT, posted[k], where))
                    self._gather(prog, rank, d, part, key, name, k, m, where)
        for k, _ in mine:
            prog.append((_WAIT, posted[k], where))
        for op in relays:
            prog.append((_WAIT, op, where))

    def _gather(self, prog, rank, d, part, key, name, k, m, where):
        op = self.coll(rank, self._transfer_group(d, part), ("allgather",) + key, ("task", "all_gather", d, name, k, m))
        if op is not None:
            prog.append((_ISSUE, op, where))
            prog.append((_WAIT, op, where))

    def emit_collective(self, prog, rank, comm, key, text, where) -> None:
        """A synchronous collective: issued, then waited for."""
        op = self.coll(rank, comm, key, ("text", text))
        if op is not None:
            prog.append((_ISSUE, op, where))
            prog.append((_WAIT, op, where))

    def group_holding(self, groups, rank):
        """The group of ``groups`` holding ``rank`` (None: none), from a map built once per groups list:
        scanning every group for every rank would be quadratic in the devices."""
        by_rank = self._holding.get(id(groups))
        if by_rank is None:
            by_rank = self._holding[id(groups)] = {d: g for g in groups for d in g}
            self._keep.append(groups)    # the id stays valid while the map is used
        return by_rank.get(rank)

    def emit_steps(self, prog, rank, red: planfile.Reduction, label: str, where) -> None:
        """``ReductionExecutor.run`` (one bucket): each step's group holding the rank, if it has peers."""
        for i, step in enumerate(red.steps):
            g = self.group_holding(step.groups, rank)
            if g is not None and len(g) > 1:
                self.emit_collective(prog, rank, self._plan_group(g), ("reduce", red.name, red.stage, i),
                                     f"{label} step {i} ({step.collective})", where)

    def turn(self, rank, name, direction, m):
        key = (rank, name, str(direction), m)
        ev = self.turns.get(key)
        if ev is None:
            ev = self.turns[key] = _Turn(rank, self.plan.cluster.host_of(rank), f"send {name} {direction} m{m}")
        return ev

    def nic_thread(self, rank: int, submitted: dict) -> _Thread | None:
        """``nicorder.NicOrder``'s thread: its rank's listed sends in the host's order, each after the
        compute thread handed it over and the host's previous send was sent."""
        host = self.plan.cluster.host_of(rank)
        order = self.nic.get(host, ())
        prog = []
        for i, (r, name, direction, m) in enumerate(order):
            if r != rank:
                continue
            where = f"host {host}'s NIC order, turn {i} (send {name} {direction} m{m})"
            d = Direction(direction)
            prog.append((_WAIT, submitted[(self.index_of[name], d, m)], where))
            if i > 0:
                prog.append((_WAIT, self.turn(*order[i - 1]), where))
            for op in self.emit_send(prog, rank, self.index_of[name], d, m, where):
                prog.append((_WAIT, op, where))
            prog.append((_SIGNAL, self.turn(rank, name, direction, m), where))
        return _Thread(rank, "nic", prog) if prog else None

    # ---- one rank, training step
    def train_threads(self, rank: int) -> list[_Thread]:
        plan = self.plan
        world = self._world()
        stage = plan.stage_of(rank)
        compute: list = []
        if stage is None:
            self.emit_collective(compute, rank, world, ("loss",), "loss all_reduce", "after its step (idle rank)")
            return [_Thread(rank, "compute", compute)]
        s = stage.index
        ops = plan.pipeline.per_stage[s]
        incoming = [i for i, t in enumerate(plan.transfers) if t.dst_stage == s]
        outgoing = [i for i, t in enumerate(plan.transfers) if t.src_stage == s]
        tp = next((g for g in plan.tensor_groups if rank in g), None) if self.tp else None
        tp_comm = self._plan_group(tp) if tp is not None and len(tp) > 1 else None
        begun = [_Event() for _ in ops]
        done = {}
        receive: list = []
        gates = post_gates(ops, self.ahead, [bool(incoming if text[0] == "F" else outgoing) for text in ops])
        for j, text in enumerate(ops):
            where = f"receiving for stage {s} op {j} ({text})"
            gate = gates[j]
            receive.append((_WAIT, begun[gate], where))
            m = int(text[1:])
            d = Direction.FORWARD if text[0] == "F" else Direction.BACKWARD
            for ti in (incoming if d is Direction.FORWARD else outgoing):
                self.emit_recv(receive, rank, ti, d, m, where)
                done[(ti, d, m)] = ev = _Event()
                receive.append((_SIGNAL, ev, where))
        sends = []
        host = plan.cluster.host_of(rank)
        listed = {(self.index_of[n], Direction(d), m) for r, n, d, m in self.nic.get(host, ()) if r == rank}
        submitted = {k: _Event() for k in listed}
        for j, text in enumerate(ops):
            where = f"stage {s} op {j} ({text})"
            compute.append((_SIGNAL, begun[j], where))
            m = int(text[1:])
            forward = text[0] == "F"
            d = Direction.FORWARD if forward else Direction.BACKWARD
            for ti in (incoming if forward else outgoing):
                compute.append((_WAIT, done[(ti, d, m)], where))
            if tp_comm is not None:
                self.emit_collective(compute, rank, tp_comm, ("tp", text), f"tensor-parallel all_reduce of {text}",
                                     where)
            for ti in (outgoing if forward else incoming):
                if (ti, d, m) in submitted:      # handed to the NIC thread: the compute thread goes on
                    compute.append((_SIGNAL, submitted[(ti, d, m)], where))
                else:
                    sends += self.emit_send(compute, rank, ti, d, m, where)
        where = f"stage {s}, waiting for its sends before the gradient reduction"
        for op in sends:
            compute.append((_WAIT, op, where))
        for ti, d, m in sorted(submitted, key=lambda k: (k[2], k[0], str(k[1]))):
            compute.append((_WAIT, self.turn(rank, plan.transfers[ti].name, d, m), where))
        red = plan.gradient_reduction(rank)
        where = f"stage {s} gradient reduction"
        if red is not None and red.mode is planfile.ReductionMode.ALLREDUCE:
            g = red.group_of(rank)
            if len(g) > 1:   # DeepSpeed's data-parallel all-reduce on the grid group (the plan's if listed)
                comm = self._plan_group(g) if g in plan.groups else self._group(("grid", g), g, f"grid {list(g)}")
                self.emit_collective(compute, rank, comm, ("deepspeed", g), "DeepSpeed's data-parallel all_reduce",
                                     where)
        elif red is not None:
            self.emit_steps(compute, rank, red, "gradient reduction", where)
        self.emit_collective(compute, rank, world, ("loss",), "loss all_reduce", f"stage {s}, after its step")
        nic = self.nic_thread(rank, submitted)
        return [_Thread(rank, "compute", compute), _Thread(rank, "receive", receive)] + ([nic] if nic else [])

    # ---- one rank, --comm-only step
    def comm_only_threads(self, rank: int) -> list[_Thread]:
        plan = self.plan
        world = self._world()
        prog: list = []
        self.emit_collective(prog, rank, world, ("barrier", 0), "barrier", "start of the step")
        d = Direction.FORWARD
        for ti, t in enumerate(plan.transfers):
            where = f"transfer {t.name!r}"
            works = self.emit_send(prog, rank, ti, d, 0, where)
            if t.forward.region("dst", rank) is not None:
                self.emit_recv(prog, rank, ti, d, 0, where)
            for op in works:
                prog.append((_WAIT, op, where))
        for r in plan.reductions:
            if self.group_holding(r.groups, rank) is not None:
                self.emit_steps(prog, rank, r, f"reduction {r.name!r}", f"reduction {r.name!r}")
        self.emit_collective(prog, rank, world, ("barrier", 1), "barrier", "end of the step")
        self.emit_collective(prog, rank, world, ("gather",), "all_gather_object of the problems", "end of the step")
        return [_Thread(rank, "main", prog)]


def _chain(task) -> tuple[int, ...]:
    return (task.sender,) + tuple(r for r in task.receivers if r != task.sender)


def _part_of(task, rank):
    return next(p for p in task.parts if rank in p)


# ---------------------------------------------------------------- the event loop

class _Sim:
    def __init__(self, threads: list[_Thread]):
        self.threads = threads
        self.ready = deque(threads)

    def _complete(self, op: _Event) -> None:
        op.done = True
        if op.waiters:
            self.ready.extend(op.waiters)
            op.waiters = []

    def _issue(self, op: _Op) -> None:
        c = op.comm
        if type(c) is _Pair:
            q = c.q[op.rank]
            q.append(op)
            if len(q) == 1:
                self._match_pair(c)
        elif type(c) is _Group:
            q = c.q[op.rank]
            q.append(op)
            if len(q) == 1:
                c.filled += 1
                if c.filled == len(c.members):
                    self._match_group(c)
        else:
            if op.kind == _SEND:
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

    def _match_pair(self, c: _Pair) -> None:
        qa, qb = c.q[c.ranks[0]], c.q[c.ranks[1]]
        while qa and qb:
            a, b = qa[0], qb[0]
            if a.key != b.key or a.kind == b.kind:
                return
            qa.popleft()
            qb.popleft()
            self._complete(a)
            self._complete(b)

    def _match_group(self, c: _Group) -> None:
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
                if code == _WAIT:
                    if not ev.done:
                        ev.waiters.append(th)
                        break
                elif code == _ISSUE:
                    self._issue(ev)
                else:
                    self._complete(ev)
                pc += 1
            th.pc = pc


# ---------------------------------------------------------------- explaining where it stopped

def _head(op: _Op):
    c = op.comm
    if type(c) in (_Pair, _Group):
        q = c.q[op.rank]
        return q[0] if q else None
    return op


def _why(op: _Op, finished: set, turns=None) -> tuple[tuple[int, ...], str]:
    """The ranks ``op`` (at the head of its rank's queue) waits for, and what they do instead
    (``turns``: the host NIC order's turns, to say when the missing send is one a NIC thread holds)."""
    c = op.comm

    def absent(p, what):
        text = f"rank {p} {'finished its step without issuing' if p in finished else 'has not issued'} {what}"
        w = op.what
        if op.kind == _RECV and w[0] == "task" and turns:
            turn = turns.get((p, w[3], str(w[2]), w[5]))
            if turn is not None and not turn.done:
                text += (f": its NIC thread holds that send for its turn in host {turn.host}'s NIC order "
                         "(plan.json pipeline.nic_order)")
        return text

    if type(c) is _Group:
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
    other = "receive" if op.kind == _SEND else "send"
    if type(c) is _Pair:
        q = c.q[p]
        if q:
            h = q[0]
            if h.kind != op.kind:
                return (p,), (f"rank {p}'s first unmatched operation with rank {op.rank} on that communicator is "
                              f"{h.describe()}: NCCL ignores tags and would pair them out of order")
            return (p,), f"rank {p}'s first unmatched operation with rank {op.rank} is also a {op.kind}: {h.describe()}"
    return (p,), absent(p, f"the matching {other}")


def _explain(th: _Thread, finished: set, turns=None) -> Wait | None:
    code, ev, where = th.prog[th.pc]
    if isinstance(ev, _Turn) and ev.rank != th.rank:   # its turn on the host's NIC, after another rank's send
        return Wait(th.rank, th.name, where, f"its turn on host {ev.host}'s NIC", (ev.rank,),
                    f"rank {ev.rank} has not finished its {ev.text}, the send before it in the host's order")
    if not isinstance(ev, _Op):
        return None    # waits for its own other thread, which is blocked too and says why
    head = _head(ev)
    blocker = head if head is not None else ev
    ranks, why = _why(blocker, finished, turns)
    if blocker is not ev:
        why = f"it is queued behind its own {blocker.describe()}, for which {why}"
    return Wait(th.rank, th.name, where, ev.describe(), ranks, why)


def _report(threads: list[_Thread], backend: str, mode: str, limit: int, turns=None) -> list[Hang]:
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


# ---------------------------------------------------------------- the check

def check_rendezvous(plan: planfile.Plan, ahead: int = DEFAULT_AHEAD, backend: str = "nccl", mode: str = "auto",
                     tensor_parallel: bool = True, limit: int = 8) -> list[Hang]:
    """The hangs of ``plan`` under rendezvous semantics (empty: it cannot hang).

    ``ahead``: how many operations the receive thread runs ahead (``PLANC_RECV_AHEAD``,
    default ``comm.DEFAULT_AHEAD`` = 4, the runtime's). ``backend``: ``"nccl"`` (strict: p2p FIFO per
    peer pair, broadcast as a collective) or ``"gloo"`` (p2p matched by tag, broadcast
    as a relay chain). ``mode``: ``"train"`` (one training step; needs a pipeline),
    ``"comm_only"`` (one ``--comm-only`` step) or ``"auto"``: ``comm_only``, and
    ``train`` too when the plan trains. ``tensor_parallel``: model a tensor-parallel
    all_reduce in every F and B of ranks with a tensor group. At most ``limit`` hangs
    per mode are returned.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    if mode == "auto":
        trains = plan.pipeline is not None and plan.train is not None and plan.train.trainable
        modes = ("train", "comm_only") if trains else ("comm_only",)
    elif mode in MODES:
        if mode == "train" and plan.pipeline is None:
            raise ValueError("mode 'train' needs a plan with a pipeline")
        modes = (mode,)
    else:
        raise ValueError(f"mode must be 'auto' or one of {list(MODES)}, got {mode!r}")
    out: list[Hang] = []
    for m in modes:
        b = _Builder(plan, backend, ahead, tensor_parallel)
        threads = []
        for rank in range(plan.cluster.devices):
            threads += b.train_threads(rank) if m == "train" else b.comm_only_threads(rank)
        if b.invalid:
            for rank, text in b.invalid[:limit]:
                out.append(Hang("invalid", (rank,), (Wait(rank, "compute" if m == "train" else "main", m, text, (),
                                                          "torch refuses it"),), backend, m))
            continue
        sim = _Sim(threads)
        sim.run()
        out += _report(threads, backend, m, limit, b.turns)
    return out
