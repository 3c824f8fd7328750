"""Lower bound of a transfer (PLAN_FORMAT.md): the NIC bound over hosts."""

from __future__ import annotations

from collections.abc import Sequence

from planc.cost.resharding import nic_seconds
from planc.ir import Cluster
from planc.resharding.tiles import UnitTask


def host_bytes(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster) -> dict[int, tuple[int, int]]:
    """Per host: (bytes its devices need that none of its devices holds,
    bytes held only on it that devices elsewhere need). Unit tasks are
    disjoint boxes, so each distinct byte is counted once."""
    out: dict[int, list[int]] = {}
    for t in tasks:
        nbytes = t.elements * itemsize
        holder_hosts = {cluster.host_of(d) for d in t.holders}
        receiver_hosts = {cluster.host_of(d) for d in t.receivers}
        for h in receiver_hosts - holder_hosts:
            out.setdefault(h, [0, 0])[0] += nbytes
        if len(holder_hosts) == 1:
            (h,) = holder_hosts
            if receiver_hosts - holder_hosts:
                out.setdefault(h, [0, 0])[1] += nbytes
    return {h: (v[0], v[1]) for h, v in sorted(out.items())}


def lower_bound(tasks: Sequence[UnitTask], itemsize: int, cluster: Cluster) -> float:
    """max over hosts of max(bytes in, bytes out) ÷ host-level bandwidth."""
    per_host = host_bytes(tasks, itemsize, cluster)
    worst = max((max(v) for v in per_host.values()), default=0)
    return nic_seconds(worst, cluster)

