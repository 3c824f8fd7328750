"""Cost of one unit task of a cross-mesh resharding under each strategy (AlpaComm §3.1).

Symbols (DESIGN.md): a unit task sends a slice of ``S`` bytes from one sender
device to its receivers. ``t = latency_h + S / bandwidth_h`` is the time to push
one copy through a host's NIC (host-level link); ``A`` is the number of
receiver hosts other than the sender's host; ``B`` the most receivers on one
such host; ``K`` the broadcast chunk count. Receivers on the sender's own host
are reached over the faster in-host links, ``t_loc = latency_l + S /
bandwidth_l`` (the slowest level below the host).

- send/recv:                  A·B·t  (+ one t_loc per receiver on the sender's host)
- send/recv + local allgather: A·t   (+ t_loc for the in-host allgather)
- global allgather:           2t, the all-gather crossing hosts; with every receiver on one other
                              host (A = 1, none local) the all-gather stays inside that host and the
                              task is local allgather's program exactly (same parts): A·t + t_loc
- broadcast (K chunks, chain): t + A·t/K

A task with no receiver off the sender's host uses only in-host links: the
same formulas with ``t_loc`` for ``t`` and the receivers for ``A``.

This is AlpaComm's host-level model (one NIC per host is the bottleneck), so it
reads two links of the tree: the host level's and the slowest one below it.
Collectives use the full tree-of-links model in ``planc.cost.network``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from planc.ir import Cluster, Strategy

CONCRETE = (Strategy.SEND_RECV, Strategy.LOCAL_ALLGATHER, Strategy.GLOBAL_ALLGATHER, Strategy.BROADCAST)


def host_link(cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) of the host-level link; infinite bandwidth when there is one host."""
    level = cluster.levels[cluster.host_index]
    if level.bandwidth is None or cluster.num_hosts == 1:
        return math.inf, 0.0
    return float(level.bandwidth), float(level.latency)


def local_link(cluster: Cluster) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest link below the host level."""
    inner = [l for l in cluster.levels[cluster.host_index + 1:] if l.bandwidth is not None and l.fanout > 1]
    if not inner:
        bw, lat = host_link(cluster)
        return (bw if bw != math.inf else 1e12), lat
    slow = min(inner, key=lambda l: l.bandwidth)
    return float(slow.bandwidth), max(l.latency for l in inner)


def task_time(strategy: Strategy, nbytes: int, sender_host: int, receiver_hosts: Iterable[int],
              cluster: Cluster, chunks: int) -> float:
    """Seconds one unit task takes under ``strategy`` (one of :data:`CONCRETE`).

    ``receiver_hosts`` lists the host of every receiver device (with repeats).
    """
    return shape_time(strategy, nbytes, task_shape(sender_host, receiver_hosts), cluster, chunks)


def task_shape(sender_host: int, receiver_hosts: Iterable[int]) -> tuple[int, int, int]:
    """What a task's time depends on besides its bytes: ``(local, A, B)``, the receivers on the sender's
    host, the receiver hosts other than the sender's, and the most receivers on one of them."""
    per_host = Counter(receiver_hosts)
    local = per_host.pop(sender_host, 0)
    return local, len(per_host), max(per_host.values(), default=0)


def shape_time(strategy: Strategy, nbytes: int, shape: tuple[int, int, int], cluster: Cluster,
               chunks: int) -> float:
    """:func:`task_time` of a task of this :func:`task_shape` (tasks of one shape and size cost the same:
    a caller with many of them computes it once)."""
    local, a, b = shape
    lbw, llat = local_link(cluster)
    t_loc = llat + nbytes / lbw
    if a == 0:
        extra = t_loc if strategy is Strategy.LOCAL_ALLGATHER and local > 1 else 0.0
        return _remote_time(strategy, t_loc, 1, local, chunks) + extra
    bw, lat = host_link(cluster)
    t = lat + nbytes / bw
    if strategy is Strategy.GLOBAL_ALLGATHER and a == 1 and not local:
        strategy = Strategy.LOCAL_ALLGATHER      # one part, gathered in-host: the same program (docs/cost-model.md)
    extra = 0.0
    if strategy is Strategy.SEND_RECV:
        extra = local * t_loc
    elif strategy is Strategy.LOCAL_ALLGATHER and (b > 1 or local):
        extra = t_loc
    return _remote_time(strategy, t, a, b, chunks) + extra


def _remote_time(strategy: Strategy, t: float, a: int, b: int, chunks: int) -> float:
    if strategy is Strategy.SEND_RECV:
        return a * b * t
    if strategy is Strategy.LOCAL_ALLGATHER:
        return a * t
    if strategy is Strategy.GLOBAL_ALLGATHER:
        return 2 * t if a * b > 1 else t
    if strategy is Strategy.BROADCAST:
        return t + a * t / max(chunks, 1)
    raise ValueError(f"no cost for strategy {strategy}")


def nic_seconds(nbytes: float, cluster: Cluster) -> float:
    """Seconds the host NIC needs to move ``nbytes`` (no latency): the unit of the lower bound."""
    bw, _ = host_link(cluster)
    return nbytes / bw
