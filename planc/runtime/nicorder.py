"""The host NIC order: a host's cross-host sends one at a time, in the plan's order.

plan.json ``pipeline.nic_order`` lists, per host, the sends that leave it (one per sender rank,
transfer, direction and micro-batch) in the order the compiler's simulation found best
(docs/simulator.md, "The host NIC order"). Every rank of the host follows one counter, an 8-byte
integer in a file of ``/dev/shm`` that the host's ranks map: send ``k`` of step ``s`` (position
``s * L + k`` of the host's order of length ``L``) is issued when the counter equals that position,
by its rank's NIC thread, which waits for every piece of it to complete and then advances the
counter. Only the rank whose turn it is writes, so a plain aligned store is enough; the others
poll. Sends that stay in the host (and hosts without an order) go as they come.

    NicOrder(rank, host, order, counter, timeout)
        .gated(transfer, direction, m) -> bool
        .submit(transfer, direction, m, issue) -> handle      # issue() -> work handles; handle.wait()
        .begin_step()                                         # before the step's first send
    open_counters(plan, rank) -> memoryview | None            # collective: every rank calls it

The order cannot hang the step under the rules the simulator runs (the compiler keeps it only
when its simulation completes); a counter that does not move for ``timeout`` seconds (a dead or
hung sibling) is an error naming the send the host waits for and its rank.
"""
from __future__ import annotations

import mmap
import os
import threading
import time

__all__ = ["NicOrder", "NicOrderError", "open_counters"]

POLL_S = 0.0002          # how often a waiting NIC thread reads the counter
SIOCOUTQNSD = 0x894B     # linux/sockios.h: bytes of a TCP socket's send queue not yet sent


class NicOrderError(RuntimeError):
    pass


def host_bandwidth(plan) -> float | None:
    """Bytes/s of the link a cross-host send leaves by: the slowest level at or above the host level
    (one way: the least a turn is held; the wait for the rank's send queues to empty adds what the
    link loses to traffic both ways, as it happens: :class:`CrossHostSockets`)."""
    levels = plan.cluster.levels
    k = next((i for i, lv in enumerate(levels) if lv.name == plan.cluster.host_level), None)
    rates = [lv.bandwidth for lv in levels[:k + 1] if lv.fanout > 1 and lv.bandwidth] if k is not None else []
    return min(rates) if rates else None


def open_counters(plan, rank: int):
    """This rank's host counter (a memoryview of one int64), or None when its host has no order.

    Collective over the world: rank 0 draws the job's name for the files and broadcasts it; every
    rank of a host with an order creates or opens ``/dev/shm/planc-nic-<job>-h<host>``; after a
    barrier every rank unlinks it again (the mappings stay), so nothing is left behind, even
    by a rank that is killed later."""
    import torch.distributed as dist

    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    host = plan.cluster.host_of(rank)
    view, path = None, None
    if plan.pipeline is not None and plan.pipeline.nic_order_of(host) and os.path.isdir("/dev/shm"):
        path = f"/dev/shm/planc-nic-{token[0]}-h{host}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8:
                os.ftruncate(fd, 8)      # zero-filled; the same size again from a sibling changes nothing
            view = memoryview(mmap.mmap(fd, 8)).cast("q")
        finally:
            os.close(fd)
    dist.barrier()
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:        # a sibling removed it first
            pass
    return view


class CrossHostSockets:
    """This process's established TCP connections to other hosts, and the bytes they have not sent yet.

    gloo's send completes when the kernel has taken the bytes, not when they left: a turn handed on
    then lets the next sender's bytes into the host's queue beside ours, and the two connections
    share the link in whatever order TCP gives (over a shaped link whose other direction is busy,
    ACKs queue behind the other way's data, so the bytes can sit there for long). Waiting until the
    rank's connections to other hosts have sent everything (``SIOCOUTQNSD``; the queue in front of the
    link is first in, first out) keeps the wire in the planned order. Found from ``/proc/self/fd``
    and ``/proc/self/net/tcp{,6}`` (a connection to another host: its remote address is not its
    local one); where those are missing (not Linux) there are none and nothing is waited for."""

    def __init__(self):
        self.fds: tuple[int, ...] = ()

    def refresh(self) -> None:
        inodes: dict[str, int] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            names = []
        for name in names:
            try:
                link = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes[link[8:-1]] = int(name)
        fds = []
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            try:
                with open(table) as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                col = row.split()
                if len(col) < 10 or col[3] != "01":          # 01: ESTABLISHED
                    continue
                local, remote = col[1].rsplit(":", 1)[0], col[2].rsplit(":", 1)[0]
                if local != remote and col[9] in inodes:
                    fds.append(inodes[col[9]])
        self.fds = tuple(sorted(fds))

    def unsent(self) -> int:
        import fcntl
        import struct

        total = 0
        for fd in self.fds:
            try:
                total += struct.unpack("i", fcntl.ioctl(fd, SIOCOUTQNSD, b"\0\0\0\0"))[0]
            except OSError:      # closed since (or not a TCP socket any more): nothing of ours queued
                pass
        return total


class _Sent:
    """What ``submit`` returns: ``wait()`` returns when the send completed, or raises its error."""

    __slots__ = ("done", "error", "timeout", "what")

    def __init__(self, timeout: float, what: str):
        self.done, self.error, self.timeout, self.what = threading.Event(), None, timeout, what

    def wait(self):
        if not self.done.wait(self.timeout):
            raise NicOrderError(f"{self.what}: not sent within {self.timeout:g} s")
        if self.error is not None:
            raise self.error


class NicOrder:
    """One rank's part of its host's NIC order (a daemon thread issuing its gated sends in turn)."""

    def __init__(self, rank: int, host: int, order, counter, timeout: float, bandwidth: float | None = None,
                 tracer=None, drain: bool = True):
        self.rank, self.host, self.timeout, self.tracer = rank, host, float(timeout), tracer
        # the host link's bytes/s (plan.json cluster): a send holds the NIC until its bytes can have left
        self.bandwidth = bandwidth if bandwidth and bandwidth > 0 else None
        self.order = tuple(order)
        self.length = len(self.order)
        self.counter = counter
        self.mine = [(i, key[1:]) for i, key in enumerate(self.order) if key[0] == rank]
        self.position = {key: i for i, key in self.mine}
        self._lock = threading.Condition()
        self._submitted: dict[tuple, tuple] = {}     # (step, key) -> (issue, handle, bytes to other hosts)
        self._step = -1                              # the step being submitted
        self._failed: BaseException | None = None    # the NIC thread's error: every send after it fails too
        self.sockets = CrossHostSockets() if drain else None   # plan.json runtime.nic_drain
        self._thread = threading.Thread(target=self._run, name="planc-nic-order", daemon=True)
        if self.mine:
            self._thread.start()

    def gated(self, transfer: str, direction: str, m: int) -> bool:
        return (transfer, direction, m) in self.position

    def begin_step(self) -> None:
        with self._lock:
            self._step += 1

    def submit(self, transfer: str, direction: str, m: int, issue, nbytes: float = 0.0):
        key = (transfer, direction, m)
        what = (f"rank {self.rank}: send {transfer} {direction} m{m} (position {self.position[key]} of host "
                f"{self.host}'s NIC order)")
        # its turn may come after every earlier send of the host: allow it a timeout per send before it,
        # one for its own send and one for its bytes to leave (the drain)
        handle = _Sent(self.timeout * (self.position[key] + 2), what)
        with self._lock:
            if self._failed is not None:
                handle.error = self._failed
                handle.done.set()
                return handle
            self._submitted[(max(self._step, 0), key)] = (issue, handle, nbytes)
            self._lock.notify_all()
        return handle

    # ---------------------------------------------------------------- the NIC thread
    def _run(self) -> None:
        step = 0
        while True:
            for i, key in self.mine:
                with self._lock:
                    while (step, key) not in self._submitted:
                        self._lock.wait()
                    issue, handle, nbytes = self._submitted.pop((step, key))
                turn = step * self.length + i
                try:
                    self._wait_turn(turn, key)
                    t0 = time.monotonic()
                    for w in issue():
                        w.wait()
                    # a completed gloo send is one the kernel has taken (its socket buffer), not one on
                    # the wire: hold the turn for the bytes' time at the link's rate
                    if self.bandwidth is not None:
                        left = t0 + nbytes / self.bandwidth - time.monotonic()
                        if left > 0:
                            time.sleep(left)
                    if self.sockets is not None:             # and until the bytes have left this rank
                        if i == self.mine[0][0]:
                            self.sockets.refresh()           # once a step (gloo connects at group creation)
                        self._drain(t0, key)
                    if self.tracer is not None:          # the turn, from issue to handing it on
                        now = self.tracer.now()
                        self.tracer.complete(f"nic {key[0]} {key[1]} m{key[2]}", now - (time.monotonic() - t0) * 1e6,
                                             now, "nic", micro_batch=key[2], turn=turn, host=self.host)
                    self.counter[0] = turn + 1           # the next send of the host may go
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the handles
                    with self._lock:
                        self._failed = e
                        for h in [handle] + [v[1] for v in self._submitted.values()]:
                            h.error = e
                            h.done.set()
                        self._submitted.clear()
                    return
                del issue
                handle.done.set()
            step += 1

    def _drain(self, t0: float, key) -> None:
        """Wait until this rank's connections to other hosts have sent every byte (at most ``timeout``)."""
        while self.sockets.unsent() > 0:
            if time.monotonic() - t0 > self.timeout:
                raise NicOrderError(f"rank {self.rank}: send {key[0]} {key[1]} m{key[2]}: its bytes have not "
                                    f"left this rank's TCP send queues within {self.timeout:g} s")
            time.sleep(POLL_S)

    def _wait_turn(self, turn: int, key) -> None:
        last, since = int(self.counter[0]), time.monotonic()
        while True:
            now = int(self.counter[0])
            if now == turn:
                return
            if now > turn:
                raise NicOrderError(f"rank {self.rank}: host {self.host}'s NIC counter is at {now}, past this "
                                    f"rank's turn {turn}: the host's ranks disagree on the order")
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                holder = self.order[now % self.length]
                raise NicOrderError(
                    f"rank {self.rank}: waited {self.timeout:g} s for its turn on host {self.host}'s NIC "
                    f"(send {key[0]} {key[1]} m{key[2]}); the host is waiting for rank {holder[0]}'s send "
                    f"{holder[1]} {holder[2]} m{holder[3]} (step {now // self.length})")
            time.sleep(POLL_S)
