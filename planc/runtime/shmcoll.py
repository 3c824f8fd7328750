"""In-host collectives through the host's shared memory (gloo only).

On gloo, ranks of one host otherwise talk over TCP on the loopback: every byte of an in-host
reduce_scatter or all_gather is copied through the kernel twice, by processes that compete with
each other for the host's cores. A reduction program's in-host steps (``form=inside`` of DESIGN.md,
the ``reduce_scatter`` and ``all_gather`` around a cross-host ``allreduce``) are instead run here,
through one file of ``/dev/shm`` that the group's ranks map: each member copies its data in once,
the members sum disjoint pieces, each copies the result out once. Only the synchronisation goes
over the group's gloo communicator (a barrier per phase), so a dead sibling is still an error after
the collective timeout, never a hang.

    HostSegment.open(pg, members, rank, slot_bytes=None, want=True) -> (HostSegment | None, why)
                                            # slot_bytes: plan.json runtime.shm_slot_bytes (default 8 MiB),
                                            # rounded up to a multiple of 64
                                            # collective on pg: every member of the group calls it
        .allreduce(buf, x, y)               SUM of buf[x:y] over the members, on every member
        .reduce_scatter(buf, x, y, p, q)    SUM of buf[x:y]; this member keeps its piece buf[p:q]
        .reduce(buf, x, y)                  SUM of buf[x:y] on the first member
        .all_gather(buf, x, y, p, q)        members' pieces buf[p:q] concatenated into buf[x:y]
        .broadcast(buf, x, y)               the first member's buf[x:y] on every member

The sum of an element is always formed by one member, adding the members' values in member
order, so every member ends with the same bits. Regions larger than a slot go window by window.

Who may use it: only a group the plan places on one host (the caller checks that; on the
emulated testbed every "host" shares this machine's /dev/shm, so the plan is the only judge).
``open`` then checks that the members really share the file (the leader writes a random nonce,
the others must read it back) and reserves the memory with ``posix_fallocate``, so a full or
private /dev/shm means gloo as before, never a SIGBUS or a wrong sum; so does a member built with
``want=False`` (plan.json ``runtime.in_host = backend``; the members vote first). The file exists only between that vote and the
moment every member has mapped it (unlinked also when the set-up fails); after that nothing is
left to clean up, even by a rank that is killed.
"""
from __future__ import annotations

import mmap
import os
import struct

import torch
import torch.distributed as dist

from planc.plan import DEFAULT_SHM_SLOT_BYTES

__all__ = ["HostSegment", "DEFAULT_SLOT_BYTES", "slot_size"]

DEFAULT_SLOT_BYTES = DEFAULT_SHM_SLOT_BYTES   # per member (plan.json runtime.shm_slot_bytes); larger regions go in windows
HEADER = 64                      # bytes before the slots: the nonce, then padding (keeps slots aligned)


def _shm_dir() -> str:
    return os.environ.get("PLANC_SHM_DIR", "/dev/shm")


def slot_size(slot_bytes: int | None = None) -> int:
    """The slot a segment gives each member: ``slot_bytes`` (plan.json ``runtime.shm_slot_bytes``, which its
    reader keeps at least 1; None: the default) rounded up to a multiple of 64 bytes, so slots stay aligned."""
    n = DEFAULT_SLOT_BYTES if slot_bytes is None else int(slot_bytes)
    if n <= 0:
        raise ValueError(f"a shared-memory slot must be at least 1 byte (plan.json runtime.shm_slot_bytes), not {n}")
    return -(-n // 64) * 64


class HostSegment:
    def __init__(self, pg, members, rank, mm, slot_bytes):
        self.pg = pg
        self.members = tuple(members)
        self.k = len(self.members)
        self.me = self.members.index(rank)
        self.slot_bytes = slot_bytes
        self._mm = mm                                   # kept alive: the tensor below maps it
        self._base = torch.frombuffer(mm, dtype=torch.uint8)

    # ------------------------------------------------------------ set-up
    @classmethod
    def open(cls, pg, members, rank, slot_bytes=None, want=True):
        """Map one segment for the group (collective over ``pg``, every member calls it).

        Returns ``(segment, "")``, or ``(None, why)`` when the group keeps gloo: a member does not
        ``want`` it (its ``enabled()``), the first member cannot create and reserve the file, or a
        member cannot map it or read the nonce back. Every member returns the same answer."""
        members = tuple(members)
        slot_bytes = slot_size(slot_bytes)
        size = HEADER + len(members) * slot_bytes
        leader = members[0]
        # first a vote, which is also a barrier: the file exists only while every member is here
        vote = torch.tensor([int(bool(want))], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=pg)
        if not int(vote[0]):
            return None, "turned off (plan.json runtime.in_host = backend) on a member"
        info = torch.zeros(3, dtype=torch.int64)        # [ok, token, nonce]
        mm, created = None, None
        if rank == leader:
            token, nonce = (int.from_bytes(os.urandom(7), "little") for _ in range(2))
            path = os.path.join(_shm_dir(), f"planc-red-{token:014x}")
            try:
                mm = _map(path, size, create=True)
                created = path
                mm[:8] = struct.pack("<q", nonce)
                info = torch.tensor([1, token, nonce], dtype=torch.int64)
            except Exception:                           # noqa: BLE001 - any failure means gloo, never a crash
                mm = None                               # _map removed what it had created
        try:
            dist.broadcast(info, src=leader, group=pg)
            ok, token, nonce = (int(v) for v in info)
            if not ok:
                return None, f"the first member could not create and reserve {size} bytes in {_shm_dir()}"
            if rank != leader:
                try:
                    mm = _map(os.path.join(_shm_dir(), f"planc-red-{token:014x}"), size, create=False)
                    ok = int(struct.unpack("<q", mm[:8])[0] == nonce)
                except Exception:                       # noqa: BLE001
                    ok = 0
            flag = torch.tensor([ok], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=pg)   # every member has mapped it, or failed
        finally:
            if created is not None:
                _unlink(created)
        if not int(flag[0]):
            return None, f"a member could not map the first member's file in {_shm_dir()} (no shared memory)"
        return cls(pg, members, rank, mm, slot_bytes), ""

    # ------------------------------------------------------------ helpers
    def _slot(self, j, dtype, n):
        es = torch.empty((), dtype=dtype).element_size()
        a = HEADER + j * self.slot_bytes
        return self._base[a:a + n * es].view(dtype)

    def _window(self, buf) -> int:
        return max(1, self.slot_bytes // buf.element_size())

    def _sync(self):
        dist.barrier(group=self.pg)

    def _sum_into(self, out, w0, a, b, own):
        """out[:] = sum over members, in member order, of their [a, b) (a window starting at w0):
        the others' from their slots, this member's from ``own`` (``out`` may be ``own``)."""
        if b <= a:
            return
        if self.me >= 2 and out.data_ptr() == own.data_ptr():
            own = own.clone()              # the first add below would overwrite it before it is added
        parts = [own if j == self.me else self._slot(j, out.dtype, b - w0)[a - w0:] for j in range(self.k)]
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)

    def _publish(self, buf, w0, w1, a, b):
        """Copy buf[w0:w1] into this member's slot, except [a, b) (which it keeps to itself)."""
        mine = self._slot(self.me, buf.dtype, w1 - w0)
        a, b = min(max(a, w0), w1), max(min(b, w1), w0)
        if b <= a:
            mine.copy_(buf[w0:w1])
            return
        mine[:a - w0].copy_(buf[w0:a])
        mine[b - w0:].copy_(buf[b:w1])

    # ------------------------------------------------------------ collectives
    def allreduce(self, buf, x, y):
        step = self._window(buf)
        for w0 in range(x, y, step):
            w1 = min(y, w0 + step)
            n = w1 - w0
            cut = [w0 + n * j // self.k for j in range(self.k + 1)]
            a, b = cut[self.me], cut[self.me + 1]
            # member r sums part r of the window; the others need only its other parts
            self._publish(buf, w0, w1, a, b)
            self._sync()
            if b > a:
                self._sum_into(buf[a:b], w0, a, b, buf[a:b])
                self._slot(self.me, buf.dtype, b - w0)[a - w0:].copy_(buf[a:b])
            self._sync()
            for j in range(self.k):
                if j != self.me and cut[j + 1] > cut[j]:
                    buf[cut[j]:cut[j + 1]].copy_(self._slot(j, buf.dtype, cut[j + 1] - w0)[cut[j] - w0:])
            self._sync()

    def reduce_scatter(self, buf, x, y, p, q):
        step = self._window(buf)
        for w0 in range(x, y, step):
            w1 = min(y, w0 + step)
            a, b = max(p, w0), min(q, w1)
            self._publish(buf, w0, w1, a, b)
            self._sync()
            self._sum_into(buf[a:b], w0, a, b, buf[a:b])
            self._sync()

    def reduce(self, buf, x, y):
        step = self._window(buf)
        for w0 in range(x, y, step):
            w1 = min(y, w0 + step)
            if self.me != 0:
                self._slot(self.me, buf.dtype, w1 - w0).copy_(buf[w0:w1])
            self._sync()
            if self.me == 0:
                self._sum_into(buf[w0:w1], w0, w0, w1, buf[w0:w1])
            self._sync()

    def all_gather(self, buf, x, y, p, q):
        step = self._window(buf)
        for w0 in range(x, y, step):
            w1 = min(y, w0 + step)
            shared = self._slot(0, buf.dtype, w1 - w0)
            a, b = max(p, w0), min(q, w1)
            if b > a:
                shared[a - w0:b - w0].copy_(buf[a:b])
            self._sync()
            if a < b:                                   # the rest of the window: around this member's piece
                buf[w0:a].copy_(shared[:a - w0])
                buf[b:w1].copy_(shared[b - w0:])
            else:
                buf[w0:w1].copy_(shared)
            self._sync()

    def broadcast(self, buf, x, y):
        step = self._window(buf)
        for w0 in range(x, y, step):
            w1 = min(y, w0 + step)
            shared = self._slot(0, buf.dtype, w1 - w0)
            if self.me == 0:
                shared.copy_(buf[w0:w1])
            self._sync()
            if self.me != 0:
                buf[w0:w1].copy_(shared)
            self._sync()


def _map(path, size, create):
    """Map ``path`` (``create``: a new file of ``size`` bytes, its pages reserved now, so a full
    /dev/shm fails here and not as a SIGBUS later; removed again if any of that fails)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size != size:
            raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    except BaseException:
        if create:
            _unlink(path)
        raise
    finally:
        os.close(fd)


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
