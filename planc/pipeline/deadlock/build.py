"""Every rank's thread programs for one mode and backend, as the runtime issues its communication
(``engine``, ``comm.RecvAhead``, ``TransferExecutor``, ``ReductionExecutor``, ``nicorder.NicOrder``,
``commcheck.comm_only``); ``planc.pipeline.deadlock``'s docstring has the model."""

from __future__ import annotations

from planc.pipeline.deadlock.events import (COLL, ISSUE, RECV, SEND, SIGNAL, WAIT, Event, Group, Op, Pair, Tagged,
                                            Thread, Turn)
from planc import plan as planfile
from planc.plan.gates import post_gates
from planc.plan import Direction, Strategy

_ALLGATHER = (Strategy.LOCAL_ALLGATHER, Strategy.GLOBAL_ALLGATHER)


def _lookups(plan: planfile.Plan) -> tuple:
    """What every Builder of ``plan`` looks up per rank, each a map built once (a scan per rank would be
    quadratic in the devices): transfer indices; per (transfer, direction) its ordered tasks and each
    rank's tasks as sender and as receiver, in schedule order; each rank's stage, host, tensor group and
    gradients reduction (with its group there); each transfer's destination ranks."""
    index_of = {t.name: i for i, t in enumerate(plan.transfers)}
    ordered, sending, receiving = {}, {}, {}
    for i, t in enumerate(plan.transfers):
        for d in Direction:
            route = t.forward if d is Direction.FORWARD else t.backward
            if route is not None:
                ordered[(i, d)] = tasks = route.ordered_tasks()
                by_sender, by_receiver = {}, {}
                for k, task in tasks:
                    by_sender.setdefault(task.sender, []).append((k, task))
                    for r in dict.fromkeys(task.receivers):
                        by_receiver.setdefault(r, []).append((k, task))
                sending[(i, d)], receiving[(i, d)] = by_sender, by_receiver
    stage_by_rank = {}
    for st in plan.stages:
        for dev in st.devices:
            stage_by_rank.setdefault(dev, st)
    host_by_rank = {dev: h for h, devs in enumerate(plan.cluster.hosts) for dev in devs}
    tp_by_rank: dict = {}
    for g in plan.tensor_groups:
        for dev in g:
            tp_by_rank.setdefault(dev, g)
    gradients_of: dict = {}   # (rank, stage) -> (its gradients reduction, its group there); stage None: any
    for red in plan.reductions:
        if red.name == "gradients":
            for g in red.groups:
                for dev in g:
                    gradients_of.setdefault((dev, red.stage), (red, g))
    destinations = [frozenset(dev for dev, _ in t.forward.dst_regions) for t in plan.transfers]
    return (index_of, ordered, sending, receiving, stage_by_rank, host_by_rank, tp_by_rank, gradients_of,
            destinations)


class Builder:
    """Every rank's thread programs for one mode and backend: lists of (code, event or op, where)."""

    def __init__(self, plan: planfile.Plan, backend: str, ahead: int, tensor_parallel: bool,
                 shared: dict | None = None):
        self.plan, self.backend, self.ahead, self.tp = plan, backend, ahead, tensor_parallel
        self.nccl = backend == "nccl"
        self.per_transfer = plan.runtime.p2p_per_transfer   # each transfer on communicators of its own
        self.comms: dict = {}
        self.invalid: list[tuple[int, str]] = []
        self._holding: dict = {}
        self._keep: list = []
        self._by_id: dict = {}
        # the host NIC order (plan.json pipeline.nic_order), as the runtime runs it: on gloo only
        self.nic = {h: keys for h, keys in (plan.pipeline.nic_order if plan.pipeline is not None else ())} \
            if backend == "gloo" else {}
        # per transfer: its route moves nothing (two stages of one mesh, each device holding its region)
        self.local = {(i, d): t.route(d).local for i, t in enumerate(plan.transfers) for d in Direction
                      if d is Direction.FORWARD or t.backward is not None}
        self.turns: dict = {}
        # the per-rank lookups read the plan alone (no backend, no mode, never written after): one set per
        # plan, kept in ``shared`` (planc.pipeline.deadlock.check_rendezvous's) for the next Builder
        hit = shared.get("builder lookups") if shared is not None else None
        if hit is None or hit[0] is not plan:
            hit = (plan, _lookups(plan))
            if shared is not None:
                shared["builder lookups"] = hit
        (self.index_of, self.ordered, self.sending, self.receiving, self.stage_by_rank, self.host_by_rank,
         self.tp_by_rank, self.gradients_of, self.destinations) = hit[1]

    # ---- communicators
    def _p2p(self, d: Direction, a: int, b: int, ti: int | None = None):
        """The point-to-point communicator of a pair of ranks in direction ``d`` (with
        ``runtime.p2p_per_transfer``: of transfer ``ti``'s direction ``d``)."""
        own = self.per_transfer and ti is not None
        label = f"p2p/{d}" + (f"/{self.plan.transfers[ti].name}" if own else "")
        if not self.nccl or a == b:
            key = ("tag", str(d)) + ((ti,) if own else ())
            if key not in self.comms:
                self.comms[key] = Tagged(label)
            return self.comms[key]
        lo, hi = min(a, b), max(a, b)
        key = ("p2p", str(d), lo, hi) + ((ti,) if own else ())
        c = self.comms.get(key)
        if c is None:
            c = self.comms[key] = Pair(label, lo, hi)
        return c

    def _group(self, key, members, label):
        c = self.comms.get(key)
        if c is None:
            c = self.comms[key] = Group(label, tuple(members))
        return c

    def _transfer_group(self, d: Direction, members, ti: int | None = None):
        members = tuple(sorted(members))
        own = (ti,) if self.per_transfer and ti is not None else ()
        return self._group(("transfer", str(d), members) + own, members, f"transfer/{d}/{list(members)}"
                           + (f"/{self.plan.transfers[ti].name}" if own else ""))

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
        return Op(rank, self._p2p(d, rank, peer, key[0]), SEND, key, peer, what)

    def recv(self, rank, d, peer, key, what):
        return Op(rank, self._p2p(d, peer, rank, key[0]), RECV, key, peer, what)

    def coll(self, rank, comm, key, what):
        if rank not in comm.q:
            self.invalid.append((rank, f"rank {rank} issues {Op(rank, comm, COLL, key, None, what).describe()}, "
                                       "a group it is not a member of"))
            return None
        return Op(rank, comm, COLL, key, None, what)

    # ---- one transfer direction, as TransferExecutor.send / .recv run it
    def emit_send(self, prog, rank, ti, d, m, where) -> list:
        """The sends ``TransferExecutor.send`` starts; returns them (the caller waits on them later)."""
        t = self.plan.transfers[ti]
        by_sender = self.sending.get((ti, d))
        if by_sender is None:
            return []
        strategy = t.route(d).strategy
        out = []
        for k, task in by_sender.get(rank, ()):
            key = (ti, d, m, k)
            if strategy is Strategy.BROADCAST:
                if self.nccl:
                    members = task.group or tuple(sorted({task.sender, *task.receivers}))
                    op = self.coll(rank, self._transfer_group(d, members, ti), ("bcast",) + key,
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
                prog.append((ISSUE, op, where))
            out += ops
        return out

    def emit_recv(self, prog, rank, ti, d, m, where) -> None:
        """``TransferExecutor.recv`` for one rank: posts, relays, gathers and waits, in the code's order."""
        t = self.plan.transfers[ti]
        by_receiver = self.receiving.get((ti, d))
        if by_receiver is None:
            return
        strategy = t.route(d).strategy
        mine = by_receiver.get(rank, ())
        name = t.name
        if self.nccl:
            pending = []
            for k, task in mine:
                key = (ti, d, m, k)
                if strategy is Strategy.BROADCAST:
                    members = task.group or tuple(sorted({task.sender, *task.receivers}))
                    op = self.coll(rank, self._transfer_group(d, members, ti), ("bcast",) + key,
                                   ("task", "broadcast", d, name, k, m))
                    if op is not None:
                        prog.append((ISSUE, op, where))
                        pending.append(op)
                    continue
                op = self.recv(rank, d, task.sender, key, ("task", "recv", d, name, k, m))
                prog.append((ISSUE, op, where))
                part = _part_of(task, rank) if strategy in _ALLGATHER else None
                if part is not None and len(part) > 1:
                    prog.append((WAIT, op, where))
                    self._gather(prog, rank, d, part, key, name, k, m, where)
                else:
                    pending.append(op)
            for op in pending:
                prog.append((WAIT, op, where))
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
            prog.append((ISSUE, op, where))
        for k, task in mine:
            key = (ti, d, m, k)
            if strategy is Strategy.BROADCAST:
                chain = _chain(task)
                pos = chain.index(rank)
                if pos + 1 < len(chain):
                    prog.append((WAIT, posted[k], where))
                    op = self.send(rank, d, chain[pos + 1], key, ("task", "relay", d, name, k, m))
                    prog.append((ISSUE, op, where))
                    relays.append(op)
            elif strategy in _ALLGATHER:
                part = _part_of(task, rank)
                if len(part) > 1:
                    prog.append((WAIT, posted[k], where))
                    self._gather(prog, rank, d, part, key, name, k, m, where)
        for k, _ in mine:
            prog.append((WAIT, posted[k], where))
        for op in relays:
            prog.append((WAIT, op, where))

    def _gather(self, prog, rank, d, part, key, name, k, m, where):
        op = self.coll(rank, self._transfer_group(d, part, key[0]), ("allgather",) + key,
                       ("task", "all_gather", d, name, k, m))
        if op is not None:
            prog.append((ISSUE, op, where))
            prog.append((WAIT, op, where))

    def emit_collective(self, prog, rank, comm, key, text, where) -> None:
        """A synchronous collective: issued, then waited for."""
        op = self.coll(rank, comm, key, ("text", text))
        if op is not None:
            prog.append((ISSUE, op, where))
            prog.append((WAIT, op, where))

    def group_holding(self, groups, rank):
        """The group of ``groups`` holding ``rank`` (None: none), from a map built once per groups list:
        scanning every group for every rank would be quadratic in the devices."""
        return self.holding(groups).get(rank)

    def holding(self, groups) -> dict:
        """``{rank: the group of groups holding it}`` (the last, should two), built once per groups list."""
        by_rank = self._holding.get(id(groups))
        if by_rank is None:
            by_rank = self._holding[id(groups)] = {d: g for g in groups for d in g}
            self._keep.append(groups)    # the id stays valid while the map is used
        return by_rank

    def emit_steps(self, prog, rank, red: planfile.Reduction, label: str, where, stage: int | None = None) -> None:
        """``ReductionExecutor.run`` (one bucket): each step's group holding the rank, if it has peers
        (``stage``: the REDUCE it runs for, where one reduction serves several stages of the rank)."""
        for i, step in enumerate(red.steps):
            g = self.group_holding(step.groups, rank)
            if g is not None and len(g) > 1:
                self.emit_collective(prog, rank, self._plan_group(g), ("reduce", red.name,
                                                                        red.stage if stage is None else stage, i),
                                     f"{label} step {i} ({step.collective})", where)

    def host_of(self, rank: int) -> int:
        h = self.host_by_rank.get(rank)
        return h if h is not None else self.plan.cluster.host_of(rank)   # its error: a device on no host

    def turn(self, rank, name, direction, m):
        key = (rank, name, str(direction), m)
        ev = self.turns.get(key)
        if ev is None:
            ev = self.turns[key] = Turn(rank, self.host_of(rank), f"send {name} {direction} m{m}")
        return ev

    def nic_thread(self, rank: int, submitted: dict) -> Thread | None:
        """``nicorder.NicOrder``'s thread: its rank's listed sends in the host's order, each after the
        compute thread handed it over and the host's previous send was sent."""
        host = self.host_of(rank)
        order = self.nic.get(host, ())
        prog = []
        for i, (r, name, direction, m) in enumerate(order):
            if r != rank:
                continue
            where = f"host {host}'s NIC order, turn {i} (send {name} {direction} m{m})"
            d = Direction(direction)
            prog.append((WAIT, submitted[(self.index_of[name], d, m)], where))
            if i > 0:
                prog.append((WAIT, self.turn(*order[i - 1]), where))
            for op in self.emit_send(prog, rank, self.index_of[name], d, m, where):
                prog.append((WAIT, op, where))
            prog.append((SIGNAL, self.turn(rank, name, direction, m), where))
        return Thread(rank, "nic", prog) if prog else None

    # ---- one rank, training step
    def train_threads(self, rank: int) -> list[Thread]:
        """The rank's threads for one training step: :meth:`train_pipeline`, then :meth:`train_tail` on the
        compute thread."""
        threads = self.train_pipeline(rank)
        self.train_tail(rank, threads[0].prog)
        return threads

    def train_pipeline(self, rank: int) -> list[Thread]:
        """The rank's threads up to the end of its pipeline part: the compute thread through the ops and the
        wait for its sends (the gradient reduction and the loss not yet), the receive and NIC threads.
        Communicators: transfers' (p2p, broadcast and all_gather groups), the tensor group, NIC turns."""
        plan = self.plan
        stage = self.stage_by_rank.get(rank)
        compute: list = []
        if stage is None:
            return [Thread(rank, "compute", compute)]
        s = stage.index
        cls = plan.pipeline.class_of(s)   # the rank runs its class's whole list (every stage of its mesh)
        turns = cls.turns()   # plan.json pipeline.actions: the one order
        several = len(cls.stages) > 1
        ops = [f"{t.compute.kind}{t.compute.stage}.{t.compute.micro_batch}" if several else
               f"{t.compute.kind}{t.compute.micro_batch}" for t in turns]
        number = {t.name: i for i, t in enumerate(plan.transfers)}
        tp = self.tp_by_rank.get(rank) if self.tp else None
        tp_comm = self._plan_group(tp) if tp is not None and len(tp) > 1 else None
        begun = [Event() for _ in ops]
        done = {}
        receive: list = []
        # a local transfer (two stages of this mesh, nothing to move) posts nothing and gates nothing
        gates = post_gates([(t.compute.kind, t.compute.stage, t.compute.micro_batch) for t in turns], self.ahead,
                           [any(not self.local.get((number[a.transfer], a.direction)) for a in t.recvs)
                            for t in turns])
        for j, (text, turn) in enumerate(zip(ops, turns)):
            where = f"receiving for stage {turn.compute.stage} op {j} ({text})"
            gate = gates[j]
            receive.append((WAIT, begun[gate], where))
            for a in turn.recvs:
                ti, d, m = number[a.transfer], a.direction, a.micro_batch
                if self.local.get((ti, d)):   # on this mesh: the compute thread's own SEND hands it over
                    done.setdefault((ti, d, m), Event())
                    continue
                self.emit_recv(receive, rank, ti, d, m, where)
                done[(ti, d, m)] = ev = Event()
                receive.append((SIGNAL, ev, where))
        sends = []
        host = self.host_of(rank)
        listed = {(self.index_of[n], Direction(d), m) for r, n, d, m in self.nic.get(host, ()) if r == rank}
        submitted = {k: Event() for k in listed}
        def send(a, where):
            nonlocal sends
            ti, d, m = number[a.transfer], a.direction, a.micro_batch
            if self.local.get((ti, d)):      # a local transfer: its RECV, later in this list, may go on
                compute.append((SIGNAL, done.setdefault((ti, d, m), Event()), where))
            elif (ti, d, m) in submitted:      # handed to the NIC thread: the compute thread goes on
                compute.append((SIGNAL, submitted[(ti, d, m)], where))
            else:
                sends += self.emit_send(compute, rank, ti, d, m, where)

        for j, (text, turn) in enumerate(zip(ops, turns)):   # the list in order, as the compute thread runs it
            where = f"stage {turn.compute.stage} op {j} ({text})"
            for k, a in enumerate(turn.before + (None,)):
                if k == turn.begin:
                    compute.append((SIGNAL, begun[j], where))
                if a is None:
                    break
                if a.kind == "RECV":
                    compute.append((WAIT, done[(number[a.transfer], a.direction, a.micro_batch)], where))
                else:
                    send(a, where)
            if tp_comm is not None:   # F, B and W alike: a tensor-parallel W all-gathers (docs/deadlock.md)
                self.emit_collective(compute, rank, tp_comm, ("tp", text), f"tensor-parallel all_reduce of {text}",
                                     where)
        for a in cls.tail():
            send(a, f"stage {s} after its last op")
        where = f"stage {s}, waiting for its sends before the gradient reduction"
        for op in sends:
            compute.append((WAIT, op, where))
        for ti, d, m in sorted(submitted, key=lambda k: (k[2], k[0], str(k[1]))):
            compute.append((WAIT, self.turn(rank, plan.transfers[ti].name, d, m), where))
        nic = self.nic_thread(rank, submitted)
        return [Thread(rank, "compute", compute), Thread(rank, "receive", receive)] + ([nic] if nic else [])

    def train_tail(self, rank: int, compute: list) -> None:
        """The rest of the rank's compute thread: its gradient reduction, then the world all_reduce of the
        loss. Communicators: the reduction's groups (or DeepSpeed's grid group), the world."""
        plan = self.plan
        world = self._world()
        stage = self.stage_by_rank.get(rank)
        if stage is None:
            self.emit_collective(compute, rank, world, ("loss",), "loss all_reduce", "after its step (idle rank)")
            return
        s = stage.index
        for k, red, g in self.reductions_of(rank):
            where = f"stage {s if k is None else k} gradient reduction"
            if red.mode is planfile.ReductionMode.ALLREDUCE:
                if len(g) > 1:   # DeepSpeed's data-parallel all-reduce on the grid group (the plan's if listed)
                    comm = self._plan_group(g) if g in plan.groups else self._group(("grid", g), g, f"grid {list(g)}")
                    self.emit_collective(compute, rank, comm, ("deepspeed", g, k), "DeepSpeed's data-parallel "
                                         "all_reduce", where)
            else:
                self.emit_steps(compute, rank, red, "gradient reduction", where, k)
        self.emit_collective(compute, rank, world, ("loss",), "loss all_reduce", f"stage {s}, after its step")

    def reductions_of(self, rank: int) -> list:
        """``(stage, reduction, its group holding rank)`` of the rank's gradient reductions, one per REDUCE of
        its class's list, in list order (a pipe-axis plan's one reduction serves every stage); ``stage`` is
        None for a class of one stage (its keys then name the reduction alone, so data replicas of
        different stages look alike to the tails' classes)."""
        stage = self.stage_by_rank.get(rank)
        if stage is None:
            return []
        pipe = self.plan.pipeline
        reduces = [a.stage for a in pipe.class_of(stage.index).reduces()] if pipe is not None else [stage.index]
        out = []
        for k in reduces:
            red, g = self.gradients_of.get((rank, k)) or self.gradients_of.get((rank, None)) or (None, None)
            if red is not None:
                out.append((k if len(reduces) > 1 else None, red, g))
        return out

    # ---- one rank, --comm-only step
    def comm_only_threads(self, rank: int) -> list[Thread]:
        prog: list = []
        self.comm_only_head(rank, prog)
        self.comm_only_transfers(rank, prog)
        self.comm_only_tail(rank, prog)
        return [Thread(rank, "main", prog)]

    def comm_only_head(self, rank: int, prog: list) -> None:
        """The world barrier that starts the step."""
        self.emit_collective(prog, rank, self._world(), ("barrier", 0), "barrier", "start of the step")

    def comm_only_transfers(self, rank: int, prog: list) -> None:
        """Per transfer, in declaration order: the forward sends, the receives, the wait for the sends."""
        d = Direction.FORWARD
        for ti, t in enumerate(self.plan.transfers):
            where = f"transfer {t.name!r}"
            works = self.emit_send(prog, rank, ti, d, 0, where)
            if rank in self.destinations[ti]:
                self.emit_recv(prog, rank, ti, d, 0, where)
            for op in works:
                prog.append((WAIT, op, where))

    def comm_only_tail(self, rank: int, prog: list) -> None:
        """Every reduction holding the rank, then the barrier and the all_gather_object that end the step."""
        world = self._world()
        for r in self.plan.reductions:
            if self.group_holding(r.groups, rank) is not None:
                self.emit_steps(prog, rank, r, f"reduction {r.name!r}", f"reduction {r.name!r}")
        self.emit_collective(prog, rank, world, ("barrier", 1), "barrier", "end of the step")
        self.emit_collective(prog, rank, world, ("gather",), "all_gather_object of the problems", "end of the step")


def _chain(task) -> tuple[int, ...]:
    return (task.sender,) + tuple(r for r in task.receivers if r != task.sender)


def _part_of(task, rank):
    return next(p for p in task.parts if rank in p)
