"""Cross-mesh resharding executor (AlpaComm §3.1) for one transfer, one direction.

The compiler plans; this module executes plan.json's ``transfers[i]`` (forward:
activations, source stage → destination stage) or ``transfers[i].backward``
(gradients, the other way), read through ``planfile.Transfer``. A unit task
moves one global slice from its ``sender`` (one of the holders) to its
``receivers``; every rank's own region on each mesh is read from the route's
``regions``, never computed from a spec.

    TransferExecutor(transfer, direction, rank, groups, tags, index, device=None, backend=None)
        .my_src / .my_dst           this rank's region on the sending / receiving mesh (None: not there)
        .send(local_shard, micro_batch) -> list[Work]   async; keep the shard until they complete
        .recv(micro_batch, out=None) -> Tensor          this rank's assembled region (static shape)
        .post(micro_batch) -> handle; .finish(handle) -> Tensor   the same, in two halves: post the
                                                        receives early, complete them where consumed

Tasks run in schedule order (planned ``start``, then index) on every rank, so
collective and p2p calls are issued in the same order everywhere.

Strategies and how each backend runs them:
  broadcast        slice cut in K = ``chunks`` pieces. gloo: pipelined chain by
                   isend/irecv, sender → receivers in rank order (gloo's own
                   broadcast does not pipeline; DESIGN.md testbed: 352 vs 1051 ms).
                   nccl: dist.broadcast per chunk on the task's group.
  send_recv        the sender isends the whole slice to every receiver.
  local_allgather, global_allgather
                   the task's ``parts`` (receivers per host, or all receivers):
                   the sender sends 1/n of the slice to each of a part's n
                   receivers, which all_gather on the group of exactly that part.
Slices whose element count does not divide n are zero-padded for the allgather.

Tags (``planfile.TagLayout``): transfer | direction | micro-batch | task, each
field as wide as the plan needs, so none wraps; chunks of one task share the
tag and rely on per-(peer, tag) FIFO order, which gloo and NCCL both keep.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from .dist_util import all_gather_flat, direction_groups, lookup_group
from planc.plan import Direction, PlanFileError, Strategy, TagLayout, Task, Transfer
from .regions import to_local

__all__ = ["TransferExecutor", "DTYPES", "STRATEGIES"]

DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16,
          "bf16": torch.bfloat16, "i64": torch.int64, "i32": torch.int32,
          "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool}
STRATEGIES = tuple(str(s) for s in Strategy)


class _Task:
    """One task of a route, as this rank runs it: slice, chunking, groups."""

    __slots__ = ("index", "slice", "numel", "sender", "receivers", "group", "chunks", "strategy", "parts")

    def __init__(self, index: int, task: Task, strategy: Strategy, chunks: int):
        self.index = index
        self.slice = task.slice
        self.numel = task.numel
        self.sender = task.sender
        self.receivers = task.receivers
        self.group = task.group or tuple(sorted({task.sender, *task.receivers}))
        self.strategy = strategy
        self.chunks = max(1, min(int(chunks), self.numel))
        if strategy in (Strategy.LOCAL_ALLGATHER, Strategy.GLOBAL_ALLGATHER):
            if not task.parts:
                raise PlanFileError(f"task {index}: an allgather strategy needs the task's receiver parts")
            self.parts = task.parts
        else:
            self.parts = None


def _transfer_groups(groups: dict, direction: Direction, name: str | None = None) -> dict:
    """The groups as one direction's transfers see them: the transfer's own communicators first, where the
    plan gives each transfer its own (``("transfer", direction, name, *members)``, plan.json
    ``runtime.p2p_per_transfer``), then the direction's (``("transfer", direction, *members)``), then the
    plan's."""
    view = direction_groups(groups, str(direction))
    prefix = ("transfer", str(direction))
    view.update({k[2:]: v for k, v in groups.items() if k[:2] == prefix and len(k) > 2 and isinstance(k[2], int)})
    view.update({k[3:]: v for k, v in groups.items() if k[:3] == prefix + (name,)})
    return view


class TransferExecutor:
    """Executes one direction of one transfer for one rank, exactly as plan.json lists it."""

    def __init__(self, transfer: Transfer, direction: Direction, rank: int, groups: dict, tags: TagLayout,
                 index: int, device=None, backend: str | None = None, signal: bool = False):
        self.transfer = transfer
        self.name = transfer.name
        self.direction = Direction(direction)
        self.rank = int(rank)
        self.groups = _transfer_groups(groups, self.direction, self.name)
        # its own point-to-point communicator where the plan gives each transfer one, else the direction's
        # (None: the default group)
        self.p2p = groups.get(("p2p", str(self.direction), self.name), groups.get(("p2p", str(self.direction))))
        self.index = int(index)
        self.tags = tags
        self.dtype = DTYPES[transfer.dtype]
        self.shape = transfer.shape
        route = transfer.route(self.direction)
        self.route = route
        self.tasks = [_Task(i, t, route.strategy, route.chunks) for i, t in route.ordered_tasks()]
        self.strategy = route.strategy
        self.backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        # signal (plan.json runtime.signal_transfers): AlpaComm's "signal send/recv" bound; every task moves
        # one element from its sender to each receiver (same schedule, same order, same dependencies) and
        # the receiver's region is zeros: the iteration without the cost of moving the data
        self.signal = bool(signal)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.my_src = route.region("src", self.rank)
        self.my_dst = route.region("dst", self.rank)
        self.is_sender = any(t.sender == self.rank for t in self.tasks)
        self.is_receiver = self.my_dst is not None
        for t in self.tasks:   # resolve groups now: a missing one is a plan error, found before any traffic
            for p in t.parts or ():
                if len(p) > 1 and self.rank in p:
                    lookup_group(self.groups, p)
            if self.backend != "gloo" and t.strategy is Strategy.BROADCAST and (
                    self.rank == t.sender or self.rank in t.receivers):
                lookup_group(self.groups, t.group)

    def peers(self) -> list[int]:
        """The ranks this rank exchanges data with in this direction (for naming a failed peer)."""
        out = set()
        for t in self.tasks:
            if self.rank == t.sender:
                out.update(t.receivers)
            elif self.rank in t.receivers:
                out.add(t.sender)
                out.update(m for p in (t.parts or ()) if self.rank in p for m in p)
                if t.strategy is Strategy.BROADCAST:
                    chain = self._chain(t)
                    i = chain.index(self.rank)
                    out.update(chain[max(0, i - 1):i + 2])
        out.discard(self.rank)
        return sorted(out)

    # ------------------------------------------------------------------ helpers
    def _tag(self, mb, t):
        return self.tags.tag(self.index, self.direction, mb, t.index)

    @staticmethod
    def _chunk_bounds(n, k):
        q, r = divmod(n, k)
        out, a = [], 0
        for i in range(k):
            b = a + q + (1 if i < r else 0)
            out.append((a, b))
            a = b
        return out

    def _chain(self, t):
        return (t.sender,) + tuple(r for r in t.receivers if r != t.sender)

    @staticmethod
    def _part_bounds(n, k):
        per = -(-n // k)
        return per, per * k

    def wire_bytes(self, host_of) -> float:
        """Bytes this rank sends to other hosts per micro-batch (``host_of``: rank -> host)."""
        item = torch.tensor([], dtype=self.dtype).element_size()
        me, total = host_of(self.rank), 0
        for t in self.tasks:
            if t.sender != self.rank:
                continue
            if self.signal:
                total += item * sum(host_of(r) != me for r in t.receivers if r != self.rank)
            elif t.strategy is Strategy.BROADCAST:
                total += item * t.numel * (host_of(self._chain(t)[1]) != me)
            elif t.strategy is Strategy.SEND_RECV:
                total += item * t.numel * sum(host_of(r) != me for r in t.receivers)
            else:
                for part in t.parts:
                    per = t.numel if len(part) == 1 else self._part_bounds(t.numel, len(part))[0]
                    total += item * per * sum(host_of(r) != me for r in part)
        return float(total)

    # -------------------------------------------------------------------- send
    def send(self, local_shard: torch.Tensor, micro_batch: int = 0) -> list:
        """Start every task this rank sends; returns the work handles to wait on."""
        if self.my_src is None:
            raise PlanFileError(f"rank {self.rank} holds nothing of transfer {self.name!r} ({self.direction})")
        want = tuple(b - a for a, b in self.my_src)
        if tuple(local_shard.shape) != want:
            raise ValueError(f"transfer {self.name!r} ({self.direction}): rank {self.rank} sends a shard of "
                             f"shape {tuple(local_shard.shape)}, the plan says {want}")
        if local_shard.dtype != self.dtype:  # the wire carries the plan's dtype
            local_shard = local_shard.to(self.dtype)
        works = []
        if self.signal:
            one = torch.zeros(1, dtype=self.dtype, device=self.device)
            return [dist.isend(one, dst=r, tag=self._tag(micro_batch, t), group=self.p2p)
                    for t in self.tasks if t.sender == self.rank for r in t.receivers if r != self.rank]
        for t in self.tasks:
            if t.sender != self.rank:
                continue
            flat = local_shard[to_local(t.slice, self.my_src)].contiguous().view(-1)
            tag = self._tag(micro_batch, t)
            if t.strategy is Strategy.BROADCAST:
                if self.backend == "gloo":
                    nxt = self._chain(t)[1]
                    for a, b in self._chunk_bounds(t.numel, t.chunks):
                        works.append(dist.isend(flat[a:b], dst=nxt, tag=tag, group=self.p2p))
                else:
                    pg = lookup_group(self.groups, t.group or (t.sender,) + t.receivers)
                    for a, b in self._chunk_bounds(t.numel, t.chunks):
                        works.append(dist.broadcast(flat[a:b], src=t.sender, group=pg, async_op=True))
            elif t.strategy is Strategy.SEND_RECV:
                for r in t.receivers:
                    works.append(dist.isend(flat, dst=r, tag=tag, group=self.p2p))
            else:
                for part in t.parts:
                    if len(part) == 1:
                        works.append(dist.isend(flat, dst=part[0], tag=tag, group=self.p2p))
                        continue
                    per, padded = self._part_bounds(t.numel, len(part))
                    if padded != t.numel:
                        buf = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
                        buf[:t.numel] = flat
                    else:
                        buf = flat
                    for i, r in enumerate(part):
                        works.append(dist.isend(buf[i * per:(i + 1) * per], dst=r, tag=tag, group=self.p2p))
        # the work objects keep the contiguous copies alive until the caller waits
        return [w for w in works if w is not None]

    # -------------------------------------------------------------------- recv
    def recv(self, micro_batch: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Receive (and forward, gather) everything; return this rank's assembled shard."""
        return self.finish(self.post(micro_batch, out))

    def post(self, micro_batch: int = 0, out: torch.Tensor | None = None) -> "_Posted":
        """Post this rank's receives of one micro-batch and return at once (``finish`` completes them).

        On gloo every p2p receive is posted here, into buffers of the plan's static shapes: gloo
        sends nothing until the receiver has posted (the receiver notifies the sender), so a
        receive posted only when the previous one completed costs one trip of that notice per
        message, behind whatever queues on the reverse link. On NCCL nothing is issued here:
        its broadcasts are collectives and keep the issue order ``finish`` gives them.
        """
        if self.my_dst is None:
            raise PlanFileError(f"rank {self.rank} receives nothing of transfer {self.name!r} ({self.direction})")
        shape = tuple(b - a for a, b in self.my_dst)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        h = _Posted(micro_batch, out, [t for t in self.tasks if self.rank in t.receivers])
        if self.signal:
            for t in h.mine:
                if t.sender != self.rank:
                    h.bufs[t.index] = torch.empty(1, dtype=self.dtype, device=self.device)
                    h.pending[t.index] = [dist.irecv(h.bufs[t.index], src=t.sender, tag=self._tag(micro_batch, t),
                                                     group=self.p2p)]
            return h
        if self.backend == "gloo":
            for t in h.mine:
                self._post_task(h, t)
        return h

    def _post_task(self, h: "_Posted", t: _Task) -> None:
        """Post the receives of task t for this rank (non-blocking)."""
        tag = self._tag(h.micro_batch, t)
        if t.strategy is Strategy.BROADCAST:
            buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
            h.bufs[t.index] = buf
            if self.backend == "gloo":
                chain = self._chain(t)
                prev = chain[chain.index(self.rank) - 1]
                h.pending[t.index] = [dist.irecv(buf[a:b], src=prev, tag=tag, group=self.p2p)
                                      for a, b in self._chunk_bounds(t.numel, t.chunks)]
            else:
                pg = lookup_group(self.groups, t.group or (t.sender,) + t.receivers)
                h.pending[t.index] = [dist.broadcast(buf[a:b], src=t.sender, group=pg, async_op=True)
                                      for a, b in self._chunk_bounds(t.numel, t.chunks)]
        elif t.strategy is Strategy.SEND_RECV:
            buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
            h.bufs[t.index] = buf
            h.pending[t.index] = [dist.irecv(buf, src=t.sender, tag=tag, group=self.p2p)]
        else:
            part = next(p for p in t.parts if self.rank in p)
            if len(part) == 1:
                buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
                h.bufs[t.index] = buf
                h.pending[t.index] = [dist.irecv(buf, src=t.sender, tag=tag, group=self.p2p)]
            else:
                per, padded = self._part_bounds(t.numel, len(part))
                buf = torch.empty(padded, dtype=self.dtype, device=self.device)
                h.bufs[t.index] = buf
                i = part.index(self.rank)
                h.pending[t.index] = [dist.irecv(buf[i * per:(i + 1) * per], src=t.sender, tag=tag, group=self.p2p)]

    def finish(self, h: "_Posted") -> torch.Tensor:
        """Wait for, relay and gather what ``post`` posted; return this rank's assembled shard."""
        if self.signal:
            for works in h.pending.values():
                for w in works:
                    w.wait()
            return h.out.zero_()
        gloo = self.backend == "gloo"
        sends = []
        for t in h.mine:
            if not gloo:
                self._post_task(h, t)
            if t.strategy is Strategy.BROADCAST and gloo:
                chain = self._chain(t)
                pos = chain.index(self.rank)
                if pos + 1 < len(chain):  # forward each chunk as soon as it lands
                    nxt, tag, buf = chain[pos + 1], self._tag(h.micro_batch, t), h.bufs[t.index]
                    for w, (a, b) in zip(h.pending[t.index], self._chunk_bounds(t.numel, t.chunks)):
                        w.wait()
                        sends.append(dist.isend(buf[a:b], dst=nxt, tag=tag, group=self.p2p))
                    h.pending[t.index] = []
            elif t.parts is not None:
                part = next(p for p in t.parts if self.rank in p)
                if len(part) > 1:
                    for w in h.pending[t.index]:
                        w.wait()
                    h.pending[t.index] = []
                    pg = lookup_group(self.groups, part)
                    per, padded = self._part_bounds(t.numel, len(part))
                    i = part.index(self.rank)
                    full = h.bufs[t.index]
                    all_gather_flat(full, full[i * per:(i + 1) * per].clone(), group=pg)
        out = h.out
        for t in h.mine:
            for w in h.pending.get(t.index, ()):
                w.wait()
            out[to_local(t.slice, self.my_dst)] = h.bufs[t.index][:t.numel].view(
                tuple(b - a for a, b in t.slice))
        for w in sends:
            w.wait()
        return out


class _Posted:
    """One micro-batch's receives of one transfer direction, posted and not yet finished."""

    __slots__ = ("micro_batch", "out", "mine", "bufs", "pending")

    def __init__(self, micro_batch: int, out: torch.Tensor, mine: list):
        self.micro_batch, self.out, self.mine = micro_batch, out, mine
        self.bufs: dict[int, torch.Tensor] = {}
        self.pending: dict[int, list] = {}
