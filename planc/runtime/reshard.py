"""Cross-mesh resharding executor (AlpaComm §3.1) for one transfer, one direction.

The compiler plans; this module only executes plan.json's `transfers[i].tasks`
(or `transfers[i].backward.tasks` for gradients). A task moves one global slice
from its `sender` (one of the holders) to its `receivers`. Tasks run in schedule
order (`start`, then index) on every rank, so collective and p2p calls are
issued in the same order everywhere (no deadlock, also on NCCL).

Public API (stable; used by engine.py):

    TransferExecutor(transfer, plan, groups, rank, direction="forward",
                     index=None, device=None, backend=None)
        .is_sender / .is_receiver       this rank's role in this direction
        .send(local_shard, micro_batch=0) -> list[Work]
            async; wait on every handle before reusing local_shard (a shard of
            another dtype is cast to the transfer's dtype first)
        .recv(micro_batch=0, out=None) -> Tensor
            this rank's shard under the destination spec (shape and dtype
            static from the plan; no metadata exchange)
        .src_layout / .dst_layout       regions.Layout of the sending/receiving side
    build_tasks(src_layout, dst_layout, hosts, strategy="send_recv") -> list[dict]
        a simple, valid task list (unit tiles, round-robin senders); the
        fallback when a transfer has no `backward` record.
    tag_for(transfer_index, direction, micro_batch, task_index) -> int

Direction: "forward" sends src stage -> dst stage with `tasks`; "backward"
sends gradients dst stage -> src stage with `transfer["backward"]["tasks"]`
(planned by the compiler in the reverse direction). The code is the same with
the two layouts swapped.

Strategies and how each backend runs them:
  broadcast        slice cut in K=`chunks` pieces. gloo: pipelined chain by
                   isend/irecv, sender -> receivers in rank order (gloo's own
                   broadcast does not pipeline; DESIGN.md testbed: 352 vs 1051 ms).
                   nccl: dist.broadcast per chunk on the task's group.
  send_recv        sender isends the whole slice to every receiver.
  local_allgather  per host of receivers: sender sends 1/n of the slice to each of
                   the n receivers there, which all_gather on the group of exactly
                   those receivers (must be listed in plan["groups"]).
  global_allgather as local_allgather with n = all receivers of the task.
Slices whose element count does not divide n are zero-padded for the allgather.

Tags: p2p tags never collide between transfers, directions, micro-batches and
tasks (bit fields, see tag_for); chunks of one task share the tag and rely on
per-(peer, tag) FIFO order, which gloo and NCCL both keep.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .plan import PlanError, host_of, stage_layout
from .regions import Layout, intersect, numel, to_local
from .dist_util import all_gather_flat, direction_groups, lookup_group

__all__ = ["TransferExecutor", "build_tasks", "tag_for", "DTYPES", "STRATEGIES"]

DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16,
          "bf16": torch.bfloat16, "i64": torch.int64, "i32": torch.int32,
          "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "bool": torch.bool}
STRATEGIES = ("broadcast", "send_recv", "local_allgather", "global_allgather")


def tag_for(transfer_index: int, direction: str, micro_batch: int, task_index: int) -> int:
    """31-bit tag: transfer (7 bits) | direction (1) | micro-batch (10) | task (13).

    Fields wrap modulo their width; a wrapped tag can only meet another one of the
    same pair of ranks, which are issued in the same order on both sides.
    """
    d = 1 if direction == "backward" else 0
    return (((transfer_index & 0x7F) << 24) | (d << 23) | ((micro_batch & 0x3FF) << 13)
            | (task_index & 0x1FFF))


def _layout(plan, side):
    st = stage_layout(plan, side["stage"])
    return st, side["spec"]


class _Task:
    """One task, resolved for this rank: its slice, chunking, groups, role."""

    __slots__ = ("index", "slice", "numel", "sender", "receivers", "group", "chunks",
                 "strategy", "parts")

    def __init__(self, index, rec, strategy, chunks, hosts_of):
        self.index = index
        self.slice = tuple((int(a), int(b)) for a, b in rec["slice"])
        self.numel = numel(self.slice)
        self.sender = int(rec["sender"])
        self.receivers = tuple(sorted(int(r) for r in rec["receivers"]))
        self.group = tuple(sorted(int(g) for g in rec["group"])) if rec.get("group") else None
        self.strategy = rec.get("strategy", strategy)
        if self.strategy not in STRATEGIES:
            raise PlanError(f"task {index}: unknown strategy {self.strategy!r} (one of {STRATEGIES})")
        self.chunks = max(1, min(int(chunks), self.numel))
        # allgather strategies: receiver sets that gather among themselves
        if self.strategy == "local_allgather":
            if rec.get("groups"):
                self.parts = [tuple(sorted(int(x) for x in g)) for g in rec["groups"]]
            else:
                by_host: dict[int, list[int]] = {}
                for r in self.receivers:
                    by_host.setdefault(hosts_of(r), []).append(r)
                self.parts = [tuple(v) for _, v in sorted(by_host.items())]
        elif self.strategy == "global_allgather":
            self.parts = [self.receivers]
        else:
            self.parts = None


class TransferExecutor:
    def __init__(self, transfer: dict, plan: dict, groups: dict, rank: int,
                 direction: str = "forward", index: int | None = None, device=None,
                 backend: str | None = None):
        if direction not in ("forward", "backward"):
            raise ValueError(f"direction must be 'forward' or 'backward', not {direction!r}")
        self.transfer = transfer
        self.name = transfer.get("name", "?")
        self.direction = direction
        self.rank = int(rank)
        self.groups = direction_groups(groups, direction)
        if index is None:
            names = [t.get("name") for t in plan.get("transfers", ())]
            index = names.index(transfer.get("name")) if transfer.get("name") in names else 0
        self.index = int(index)
        self.dtype = DTYPES[transfer.get("dtype", "f32")]
        self.shape = tuple(int(s) for s in transfer["shape"])
        layouts = {}
        for side in ("src", "dst"):
            st = stage_layout(plan, transfer[side]["stage"])
            layouts[side] = Layout(self.shape, st["mesh"], transfer[side]["spec"], st.get("mesh_axes"))
        hosts_of = (lambda r: host_of(plan, r))
        if direction == "forward":
            self.src_layout, self.dst_layout = layouts["src"], layouts["dst"]
            rec = transfer
        else:
            self.src_layout, self.dst_layout = layouts["dst"], layouts["src"]
            rec = transfer.get("backward")
            if rec is None:
                hosts = plan["cluster"]["hosts"]
                rec = {"strategy": "send_recv",
                       "tasks": build_tasks(self.src_layout, self.dst_layout, hosts, "send_recv")}
        strategy = rec.get("strategy", transfer.get("strategy", "send_recv"))
        chunks = rec.get("chunks", transfer.get("chunks", 1))
        order = sorted(range(len(rec["tasks"])), key=lambda i: (float(rec["tasks"][i].get("start", 0.0)), i))
        self.tasks = [_Task(i, rec["tasks"][i], strategy, chunks, hosts_of) for i in order]
        self.strategy = strategy
        self.backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.my_src = self.src_layout.region(self.rank)
        self.my_dst = self.dst_layout.region(self.rank)
        self.is_sender = any(t.sender == self.rank for t in self.tasks)
        self.is_receiver = self.my_dst is not None
        for t in self.tasks:
            if t.sender == self.rank and (self.my_src is None or intersect(t.slice, self.my_src) != t.slice):
                raise PlanError(f"transfer {self.name!r} ({direction}) task {t.index}: sender {t.sender} "
                                f"does not hold slice {t.slice} (holds {self.my_src})")
            if self.rank in t.receivers and (self.my_dst is None or intersect(t.slice, self.my_dst) != t.slice):
                raise PlanError(f"transfer {self.name!r} ({direction}) task {t.index}: slice {t.slice} "
                                f"is outside receiver {self.rank}'s region {self.my_dst}")
            # resolve groups now: a missing group is a plan error, found before any traffic
            if t.parts is not None:
                for p in t.parts:
                    if len(p) > 1 and self.rank in p:
                        lookup_group(groups, p)
            if self.backend != "gloo" and t.strategy == "broadcast" and (self.rank == t.sender or self.rank in t.receivers):
                lookup_group(groups, t.group or (t.sender,) + t.receivers)

    # ------------------------------------------------------------------ helpers
    def _tag(self, mb, t):
        return tag_for(self.index, self.direction, mb, t.index)

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

    # -------------------------------------------------------------------- send
    def send(self, local_shard: torch.Tensor, micro_batch: int = 0) -> list:
        """Start every task this rank sends; returns the work handles to wait on."""
        if self.my_src is None:
            raise PlanError(f"rank {self.rank} holds nothing of transfer {self.name!r} ({self.direction})")
        want = tuple(b - a for a, b in self.my_src)
        if tuple(local_shard.shape) != want:
            raise ValueError(f"transfer {self.name!r} ({self.direction}): rank {self.rank} sends a shard of "
                             f"shape {tuple(local_shard.shape)}, the plan says {want}")
        if local_shard.dtype != self.dtype:  # the wire carries the plan's dtype
            local_shard = local_shard.to(self.dtype)
        works = []
        for t in self.tasks:
            if t.sender != self.rank:
                continue
            flat = local_shard[to_local(t.slice, self.my_src)].contiguous().view(-1)
            tag = self._tag(micro_batch, t)
            if t.strategy == "broadcast":
                if self.backend == "gloo":
                    nxt = self._chain(t)[1]
                    for a, b in self._chunk_bounds(t.numel, t.chunks):
                        works.append(dist.isend(flat[a:b], dst=nxt, tag=tag))
                else:
                    pg = lookup_group(self.groups, t.group or (t.sender,) + t.receivers)
                    for a, b in self._chunk_bounds(t.numel, t.chunks):
                        works.append(dist.broadcast(flat[a:b], src=t.sender, group=pg, async_op=True))
            elif t.strategy == "send_recv":
                for r in t.receivers:
                    works.append(dist.isend(flat, dst=r, tag=tag))
            else:
                for part in t.parts:
                    if len(part) == 1:
                        works.append(dist.isend(flat, dst=part[0], tag=tag))
                        continue
                    per, padded = self._part_bounds(t.numel, len(part))
                    if padded != t.numel:
                        buf = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
                        buf[:t.numel] = flat
                    else:
                        buf = flat
                    for i, r in enumerate(part):
                        works.append(dist.isend(buf[i * per:(i + 1) * per], dst=r, tag=tag))
        # the work objects keep the contiguous copies alive until the caller waits
        return [w for w in works if w is not None]

    # -------------------------------------------------------------------- recv
    def recv(self, micro_batch: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Receive (and forward, gather) everything; return this rank's assembled shard."""
        if self.my_dst is None:
            raise PlanError(f"rank {self.rank} receives nothing of transfer {self.name!r} ({self.direction})")
        shape = tuple(b - a for a, b in self.my_dst)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        mine = [t for t in self.tasks if self.rank in t.receivers]
        gloo = self.backend == "gloo"
        bufs, pending, sends = {}, {}, []

        def post(t):
            """Post the receives of task t for this rank (non-blocking)."""
            tag = self._tag(micro_batch, t)
            if t.strategy == "broadcast":
                buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
                bufs[t.index] = buf
                if gloo:
                    chain = self._chain(t)
                    prev = chain[chain.index(self.rank) - 1]
                    pending[t.index] = [dist.irecv(buf[a:b], src=prev, tag=tag)
                                        for a, b in self._chunk_bounds(t.numel, t.chunks)]
                else:
                    pg = lookup_group(self.groups, t.group or (t.sender,) + t.receivers)
                    pending[t.index] = [dist.broadcast(buf[a:b], src=t.sender, group=pg, async_op=True)
                                        for a, b in self._chunk_bounds(t.numel, t.chunks)]
            elif t.strategy == "send_recv":
                buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
                bufs[t.index] = buf
                pending[t.index] = [dist.irecv(buf, src=t.sender, tag=tag)]
            else:
                part = next(p for p in t.parts if self.rank in p)
                if len(part) == 1:
                    buf = torch.empty(t.numel, dtype=self.dtype, device=self.device)
                    bufs[t.index] = buf
                    pending[t.index] = [dist.irecv(buf, src=t.sender, tag=tag)]
                else:
                    per, padded = self._part_bounds(t.numel, len(part))
                    buf = torch.empty(padded, dtype=self.dtype, device=self.device)
                    bufs[t.index] = buf
                    i = part.index(self.rank)
                    pending[t.index] = [dist.irecv(buf[i * per:(i + 1) * per], src=t.sender, tag=tag)]

        if gloo:  # gloo p2p is truly asynchronous: post every receive up front
            for t in mine:
                post(t)
        for t in mine:
            if not gloo:
                post(t)
            if t.strategy == "broadcast" and gloo:
                chain = self._chain(t)
                pos = chain.index(self.rank)
                if pos + 1 < len(chain):  # forward each chunk as soon as it lands
                    nxt, tag, buf = chain[pos + 1], self._tag(micro_batch, t), bufs[t.index]
                    for w, (a, b) in zip(pending[t.index], self._chunk_bounds(t.numel, t.chunks)):
                        w.wait()
                        sends.append(dist.isend(buf[a:b], dst=nxt, tag=tag))
                    pending[t.index] = []
            elif t.parts is not None:
                part = next(p for p in t.parts if self.rank in p)
                if len(part) > 1:
                    for w in pending[t.index]:
                        w.wait()
                    pending[t.index] = []
                    pg = lookup_group(self.groups, part)
                    per, padded = self._part_bounds(t.numel, len(part))
                    i = part.index(self.rank)
                    full = bufs[t.index]
                    all_gather_flat(full, full[i * per:(i + 1) * per].clone(), group=pg)
        for t in mine:
            for w in pending.get(t.index, ()):
                w.wait()
            out[to_local(t.slice, self.my_dst)] = bufs[t.index][:t.numel].view(
                tuple(b - a for a, b in t.slice))
        for w in sends:
            w.wait()
        return out


def build_tasks(src_layout: Layout, dst_layout: Layout, hosts, strategy: str = "send_recv") -> list[dict]:
    """Unit tasks: tiles on the union of both layouts' region boundaries.

    Each tile goes to every destination device whose region holds it, from a
    holder picked round-robin (preferring one on a receiver's host). Not a
    load-balanced schedule; a correct fallback and a test fixture.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}")
    host = {d: h for h, ds in enumerate(hosts) for d in ds}
    cuts = []
    for dim, size in enumerate(src_layout.shape):
        pts = {0, size}
        for lay in (src_layout, dst_layout):
            for d in lay.devices:
                a, b = lay.region(d)[dim]
                pts.update((a, b))
        cuts.append(sorted(pts))
    tiles = [()]
    for c in cuts:
        tiles = [t + ((a, b),) for t in tiles for a, b in zip(c, c[1:])]
    tasks = []
    for n, tile in enumerate(tiles):
        holders = [d for d in src_layout.devices if intersect(tile, src_layout.region(d)) == tile]
        receivers = [d for d in dst_layout.devices if intersect(tile, dst_layout.region(d)) == tile]
        if not receivers:
            continue
        rh = {host.get(r) for r in receivers}
        near = [h for h in holders if host.get(h) in rh] or holders
        sender = near[n % len(near)]
        task = {"slice": [list(r) for r in tile], "holders": holders, "receivers": receivers,
                "sender": sender, "start": 0.0, "duration": 0.0}
        if strategy == "broadcast":
            task["group"] = sorted({sender, *receivers})
        tasks.append(task)
    return tasks
