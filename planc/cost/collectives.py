"""Collective times on the tree-of-links network (DESIGN.md "Cost model").

Algorithms, over the members of a group in rank order ``m_0 < .. < m_{k-1}``:

* ring (allreduce, reduce_scatter, all_gather): edges ``m_i → m_{i+1 mod k}``;
  ``S`` = bytes each member holds before the step.
  allreduce: ``2(k-1)`` rounds of ``S/k`` per edge; reduce_scatter: ``k-1``
  rounds of ``S/k``; all_gather: ``k-1`` rounds of ``S`` (each member holds a
  piece of ``S`` and ends with ``k·S``).
* pipelined chain (broadcast, reduce): broadcast ``m_0 → m_1 → .. → m_{k-1}``,
  reduce the reverse chain into ``m_0``; every edge carries ``S`` once,
  pipelined in infinitely small chunks (no fill term beyond latency).

A lowered step runs all its groups at once. Its time is the fluid bandwidth
term over *all* edges of *all* groups together (the bottleneck link's total
bytes / capacity, so groups that share a link slow each other down) plus the
latency term of the slowest group: ``rounds × the largest hop latency`` of its
ring, or the sum of hop latencies along its chain.

Example: ring allreduce of S bytes over k devices of one level with bandwidth B
and latency α: ``2(k-1)/k·S/B + 2(k-1)·α``.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from planc import ir
from planc.cost.network import Network

Group = Sequence[int]
Step = tuple[ir.Collective, Sequence[Group]]

_RING = (ir.Collective.ALLREDUCE, ir.Collective.REDUCE_SCATTER, ir.Collective.ALL_GATHER)


def _edge_bytes_and_rounds(collective: ir.Collective, k: int, nbytes: float) -> tuple[float, int]:
    if collective is ir.Collective.ALLREDUCE:
        return 2 * (k - 1) / k * nbytes, 2 * (k - 1)
    if collective is ir.Collective.REDUCE_SCATTER:
        return (k - 1) / k * nbytes, k - 1
    if collective is ir.Collective.ALL_GATHER:
        return (k - 1) * nbytes, k - 1
    return float(nbytes), 1  # broadcast / reduce: each chain edge carries S once


def _edges(collective: ir.Collective, members: Sequence[int]) -> list[tuple[int, int]]:
    k = len(members)
    if collective in _RING:
        return [(members[i], members[(i + 1) % k]) for i in range(k)]
    if collective is ir.Collective.BROADCAST:
        return [(members[i], members[i + 1]) for i in range(k - 1)]
    return [(members[i + 1], members[i]) for i in range(k - 1)]  # reduce into members[0]


def ring_flows(collective: ir.Collective, members: Sequence[int], nbytes: float) -> list[tuple[int, int, float]]:
    """The ``(from, to, bytes)`` flows of one collective over ``members`` holding ``nbytes`` each, as
    this model runs it (rings for allreduce / reduce_scatter / all_gather, chains for broadcast / reduce):
    what an event simulation puts on the links."""
    per_edge, _ = _edge_bytes_and_rounds(collective, len(members), nbytes)
    return [(a, b, per_edge) for a, b in _edges(collective, members)]


def _step(net: Network, collective: ir.Collective, groups: Iterable[Group], nbytes: float
          ) -> tuple[float, float]:
    """``(bandwidth term, latency term)`` of one lowered step, by counting.

    Members sorted by rank fill every unit of a level as one consecutive run,
    so per group and linked level only the distinct units matter: a ring
    sends exactly one edge out of (and into) each unit it touches when it
    touches two or more; a chain sends one out of each unit but the last
    (broadcast) or the first (reduce). Each link thus gets at most one
    ``per_edge`` per group, added group by group — the same sums, in the same
    order, as walking every edge's path (:meth:`Network.bandwidth_time`).
    A ring's slowest hop crosses the outermost level its members span; a
    chain's hop latencies are summed edge by edge in chain order.
    """
    levels = net.linked_inner_first
    ups = [{} for _ in levels]
    downs = [{} for _ in levels]
    latency = 0.0
    ring = collective in _RING
    bcast = collective is ir.Collective.BROADCAST
    for g in groups:
        members = sorted(g)
        k = len(members)
        if k < 2:
            continue
        per_edge, rounds = _edge_bytes_and_rounds(collective, k, nbytes)
        load = per_edge > 0
        # distinct units per linked level, innermost first (until one unit is left)
        spans: list[tuple[int, list[int]]] = []
        units = None
        prev_stride = 1
        for idx, (l, stride) in enumerate(levels):
            if units is None:
                units = sorted(set(m // stride for m in members))
            else:
                q = stride // prev_stride
                units = sorted(set(u // q for u in units))
            prev_stride = stride
            if len(units) < 2:
                break
            spans.append((idx, units))
            if load:
                up, down = ups[idx], downs[idx]
                if ring:
                    senders = receivers = units
                elif bcast:
                    senders, receivers = units[:-1], units[1:]
                else:
                    senders, receivers = units[1:], units[:-1]
                for u in senders:
                    up[u] = up.get(u, 0.0) + per_edge
                for u in receivers:
                    down[u] = down.get(u, 0.0) + per_edge
        if ring:
            # level l holds an edge's outermost crossing iff it has more runs than the level above
            worst = 0.0
            for n, (idx, units) in enumerate(spans):
                outer_runs = len(spans[n + 1][1]) if n + 1 < len(spans) else 1
                if len(units) > outer_runs:
                    worst = max(worst, net.latency_from(levels[idx][0]))
            lat = rounds * worst
        else:
            hops = [0.0] * (k - 1)
            for idx, _ in spans:
                l, stride = levels[idx]
                cross = net.latency_from(l)
                u = [m // stride for m in members]
                hops = [cross if u[i] != u[i + 1] else h for i, h in enumerate(hops)]
            lat = sum(hops)
        if lat > latency:
            latency = lat
    bandwidth = 0.0
    for (l, _), up, down in zip(levels, ups, downs):
        bw = net.level_bandwidth(l)
        for loads in (up, down):
            if loads:
                bandwidth = max(bandwidth, max(loads.values()) / bw)
    return bandwidth, latency


def collective_time(net: Network, collective: ir.Collective | str, groups: Iterable[Group], nbytes: float) -> float:
    """Seconds for one lowered step: ``collective`` on every group at once.

    ``nbytes`` is the size each member holds before the step (for broadcast:
    the root's). Groups of fewer than two devices cost nothing.
    """
    bandwidth, latency = _step(net, ir.Collective(collective), groups, nbytes)
    return bandwidth + latency


def step_coefficients(net: Network, collective: ir.Collective | str, groups: Iterable[Group]
                      ) -> tuple[float, float]:
    """``(a, b)`` with ``collective_time(net, collective, groups, S) = a·S + b`` (one pass).

    Exactly ``(collective_time(.., 1) - collective_time(.., 0), collective_time(.., 0))``:
    every cost term is linear in ``S`` and the latency term does not depend on it.
    """
    bandwidth, latency = _step(net, ir.Collective(collective), groups, 1.0)
    return (bandwidth + latency) - latency, latency


def held_after(collective: ir.Collective | str, k: int, nbytes: float) -> float:
    """Size each (holding) member holds after the step: reduce_scatter ÷ k, all_gather × k."""
    collective = ir.Collective(collective)
    if collective is ir.Collective.REDUCE_SCATTER:
        return nbytes / k
    if collective is ir.Collective.ALL_GATHER:
        return nbytes * k
    return nbytes


def program_time(net: Network, steps: Iterable[Step], nbytes: float) -> float:
    """Seconds for a lowered program: steps run one after another.

    ``steps`` are ``(collective, groups)``; the held size starts at ``nbytes``
    and changes by :func:`held_after` with the size of the step's largest
    group (lowered steps have groups of one size).
    """
    total = 0.0
    held = float(nbytes)
    for collective, groups in steps:
        groups = [tuple(g) for g in groups]
        total += collective_time(net, collective, groups, held)
        k = max((len(g) for g in groups), default=1)
        held = held_after(collective, k, held)
    return total


def allreduce_lower_bound(net: Network, group: Group, nbytes: float) -> float:
    """``2(k-1)/k · S ÷ bottleneck bandwidth`` of the group (0 for k < 2)."""
    k = len(set(group))
    if k < 2:
        return 0.0
    bw = net.bottleneck_bandwidth(group)
    return 0.0 if math.isinf(bw) else 2 * (k - 1) / k * nbytes / bw
