"""A rendezvous port for ranks started on this machine (``planc calibrate --on cluster``, the test
harness): one that is free now and that nothing takes by accident before rank 0's store binds it.

Binding port 0 and closing it (the usual way) hands out a port from the kernel's ephemeral range,
the range every outgoing connection and every gloo listener also draws from: on a busy machine
another process can be given the same port in the gap, and rank 0 then fails with EADDRINUSE while
the others wait on it. So the port here lies below that range, where the kernel assigns nothing by
itself; callers that run concurrently (pytest-xdist workers) take disjoint slices of it, and one
process walks its slice so that two launches of its own never share a port either."""

from __future__ import annotations

import itertools
import os
import socket

LOW = 10000                 # below: the ports services are configured on
DEFAULT_EPHEMERAL = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ``ip_local_port_range`` (Linux), else its default."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _slice(slot: int, slots: int) -> range:
    top = ephemeral_range()[0]
    if top - LOW < 64 * slots:          # an ephemeral range that starts low: use the ports above it
        lo, hi = ephemeral_range()[1] + 1, 65536
    else:
        lo, hi = LOW, top
    width = (hi - lo) // max(1, slots)
    return range(lo + slot * width, lo + (slot + 1) * width)


_walk: dict[tuple[int, int], itertools.count] = {}


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the store binds: TIME_WAIT is free
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(slot: int | None = None, slots: int | None = None) -> int:
    """A free TCP port in slice ``slot`` of ``slots`` below the ephemeral range. Default slice: the
    pytest-xdist worker's (``PYTEST_XDIST_WORKER`` gwN of ``PYTEST_XDIST_WORKER_COUNT``), else the
    whole range; each process starts its walk at a point of its own (its pid)."""
    if slot is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
        if worker.startswith("gw") and worker[2:].isdigit() and count.isdigit():
            slot, slots = int(worker[2:]), int(count)
        else:
            slot, slots = 0, 1
    ports = _slice(slot, slots or 1)
    walk = _walk.setdefault((slot, slots or 1), itertools.count(os.getpid() * 7))
    for _ in range(len(ports)):
        port = ports[next(walk) % len(ports)]
        if _bindable(port):
            return port
    raise OSError(f"no free TCP port in {ports.start}..{ports.stop - 1}")
