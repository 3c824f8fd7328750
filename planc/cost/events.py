"""Discrete-event simulation of a task graph whose communication shares the links of the cost model.

A :class:`Graph` holds nodes; each node starts when every node it depends on
has finished, and then either

* runs for a fixed ``duration`` (computation, a zero-length marker), or
* moves ``flows`` — ``(src, dst, nbytes)`` device pairs — over the tree of
  links of :class:`planc.cost.network.Network`, and finishes ``latency``
  seconds after its last byte arrived.

Compute may share a pool of cores (``Graph.pools``: an emulated cluster on
one machine, CPU ranks sharing a host): a node with ``pool = p`` does
``duration`` seconds of one core's work, and the nodes computing in pool ``p``
at an instant share its ``cores`` equally, each at most one core (processor
sharing, capped: with no more nodes than cores every node runs at full speed).
Nodes without a pool run for their ``duration``, whatever else runs.

Serial streams (a device's compute stream, its receive thread, its reduction
thread) are expressed as dependencies: each node of a stream depends on the
one before it. So the graph fixes the *order* of work; the simulation decides
the *times*.

Contention is fluid, and fairer than :meth:`Network.flows_time`'s
all-start-together estimate: at every instant the active flows share each
link's capacity by max-min fairness (progressive filling: the most loaded link
fixes the rate of its flows, which are then taken off every other link); a
flow's rate changes only when a flow starts or ends, so the simulation jumps
from one such event to the next. A set of equal flows through one bottleneck
link therefore finishes at ``bytes on the link / capacity``, the cost model's
bandwidth term. While both directions of a link carry flows, each direction's
capacity is the level's ``both_ways`` figure (``Network.link_capacity``). Flows between the same two devices go one after another, in
the order they were issued (one connection per pair: gloo's TCP pair, NCCL's
per-peer stream); flows between a device and itself are free.

:func:`run` returns each node's start and finish and, per flow, its start,
finish and links, for timelines (``planc.pipeline.gantt``).
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, field

from planc.cost.network import LinkId, Network

__all__ = ["Graph", "Node", "Trace", "run", "EPS"]

EPS = 1e-18   # seconds: a flow due this close to now has arrived (floating-point residue)


@dataclass(slots=True)
class Node:
    deps: list[int]
    duration: float = 0.0
    flows: tuple[tuple[int, int, float], ...] = ()
    latency: float = 0.0
    tag: tuple = ()          # what the node is, for the caller (stage, kind, micro-batch, ...)
    pool: int | None = None  # the core pool its ``duration`` of work runs on (None: its own core)


@dataclass(slots=True)
class Graph:
    nodes: list[Node] = field(default_factory=list)
    pools: list[float] = field(default_factory=list)   # cores of each pool

    def add_pool(self, cores: float) -> int:
        """A pool of ``cores`` (> 0) shared by the nodes added with its index as ``pool``."""
        if not (cores > 0 and math.isfinite(cores)):
            raise ValueError(f"a core pool needs a positive number of cores, got {cores!r}")
        self.pools.append(float(cores))
        return len(self.pools) - 1

    def add(self, deps=(), duration: float = 0.0, flows=(), latency: float = 0.0, tag: tuple = (),
            pool: int | None = None) -> int:
        deps = [d for d in deps if d is not None]   # more may be appended later: g.nodes[i].deps
        if duration < 0 or latency < 0 or not math.isfinite(duration) or not math.isfinite(latency):
            raise ValueError(f"node {len(self.nodes)}: duration and latency must be finite and non-negative")
        if pool is not None and not 0 <= pool < len(self.pools):
            raise ValueError(f"node {len(self.nodes)}: unknown core pool {pool}")
        if pool is not None and flows:
            raise ValueError(f"node {len(self.nodes)}: a node on a core pool moves no bytes")
        self.nodes.append(Node(deps, float(duration), tuple(flows), float(latency), tag, pool))
        return len(self.nodes) - 1


@dataclass(frozen=True, slots=True)
class Trace:
    start: tuple[float, ...]
    finish: tuple[float, ...]
    flows: tuple[tuple[int, float, float, tuple[LinkId, ...], float], ...]   # (node, start, end, links, bytes)

    @property
    def makespan(self) -> float:
        return max(self.finish, default=0.0)


def _rates(active: dict, net: Network) -> None:
    """Max-min fair rates of the active flows (progressive filling), written into ``active[f][1]``."""
    users: dict[LinkId, list[int]] = {}
    for f, rec in active.items():
        for link in rec[2]:
            users.setdefault(link, []).append(f)
    # a direction whose opposite (same level and unit) also carries flows has the level's both-ways capacity
    cap = {link: net.link_capacity(link, (link[0], link[1], 1 - link[2]) in users) for link in users}
    unfixed = {link: len(fs) for link, fs in users.items()}
    fixed: set[int] = set()
    while len(fixed) < len(active):
        best, share = None, math.inf
        for link, n in unfixed.items():
            if n > 0:
                s = cap[link] / n
                if s < share:
                    best, share = link, s
        if best is None:        # flows on no finite link (cannot happen for src != dst)
            for f in active:
                if f not in fixed:
                    active[f][1] = math.inf
            return
        for f in users[best]:
            if f in fixed:
                continue
            fixed.add(f)
            active[f][1] = share
            for link in active[f][2]:
                cap[link] -= share
                unfixed[link] -= 1
        unfixed[best] = 0


def run(graph: Graph, net: Network | None) -> Trace:
    """Simulate ``graph`` (nodes with flows need ``net``); a cycle is a ``ValueError``."""
    nodes = graph.nodes
    n = len(nodes)
    waiting = [len(nd.deps) for nd in nodes]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, nd in enumerate(nodes):
        for d in nd.deps:
            if not 0 <= d < n or d == i:
                raise ValueError(f"node {i} ({nd.tag}) depends on unknown node {d}")
            children[d].append(i)
    start = [math.nan] * n
    finish = [math.nan] * n
    heap: list[tuple[float, int, int]] = []    # (time, order, node): a node's end (after its flows)
    order = 0
    active: dict[int, list] = {}   # flow id -> [remaining bytes, rate, links, node, start, bytes, eta, pair]
    pending: dict[int, list] = {}  # flows queued behind an earlier one between the same two devices
    pairs: dict[tuple[int, int], collections.deque] = {}
    left = [0] * n                             # flows of a node still moving
    flow_log = []
    next_flow = 0
    now = 0.0
    dirty = False
    computing: dict[int, float] = {}           # node on a core pool -> seconds of one core's work left
    in_pool = [0] * len(graph.pools)

    def begin(i: int, t: float) -> None:
        nonlocal order, next_flow, dirty
        nd = nodes[i]
        start[i] = t
        if nd.pool is not None and nd.duration > 0:
            computing[i] = nd.duration
            in_pool[nd.pool] += 1
            return
        moving = [(a, b, x) for a, b, x in nd.flows if a != b and x > 0]
        if not moving:
            order += 1
            heapq.heappush(heap, (t + nd.duration + nd.latency, order, i))
            return
        if net is None:
            raise ValueError("a node moves bytes but no network was given")
        left[i] = len(moving)
        for a, b, x in moving:
            rec = [float(x), 0.0, net.path_links(a, b), i, t, float(x), math.inf, (a, b)]
            queue = pairs.setdefault((a, b), collections.deque())
            queue.append(next_flow)
            if len(queue) == 1:     # the pair's connection is free: on the wire now
                active[next_flow] = rec
            else:
                pending[next_flow] = rec
            next_flow += 1
        dirty = True

    for i in range(n):
        if waiting[i] == 0:
            begin(i, 0.0)
    done = 0
    while done < n:
        if dirty:
            _rates(active, net)
            dirty = False
        t_flow = math.inf
        for rec in active.values():
            if rec[1] > 0:
                rec[6] = now + rec[0] / rec[1]
                t_flow = min(t_flow, rec[6])
        speed = [min(1.0, cores / k) if k else 0.0 for cores, k in zip(graph.pools, in_pool)]
        t_comp = min((now + w / speed[nodes[i].pool] for i, w in computing.items()), default=math.inf)
        t_node = heap[0][0] if heap else math.inf
        t_node = min(t_node, t_comp)
        if t_flow == math.inf and t_node == math.inf:
            stuck = [i for i in range(n) if math.isnan(finish[i])]
            raise ValueError(f"the task graph cannot finish: {len(stuck)} node(s) wait on each other "
                             f"(first: {nodes[stuck[0]].tag})")
        t = min(t_flow, t_node)
        dt = t - now
        now = t
        if active:
            ended = [f for f, rec in active.items() if rec[1] > 0 and rec[6] <= now * (1 + 1e-12) + EPS]
            for f, rec in active.items():
                rec[0] -= rec[1] * dt
            for f in ended:
                rec = active.pop(f)
                flow_log.append((rec[3], rec[4], now, rec[2], rec[5]))
                queue = pairs[rec[7]]
                queue.popleft()
                if queue:               # the next message between the same pair goes on the wire
                    nxt = pending.pop(queue[0])
                    nxt[4] = now
                    active[queue[0]] = nxt
                i = rec[3]
                left[i] -= 1
                if left[i] == 0:
                    order += 1
                    heapq.heappush(heap, (now + nodes[i].duration + nodes[i].latency, order, i))
            if ended:
                dirty = True
        if computing:
            done_work = []
            for i in computing:
                v = speed[nodes[i].pool]
                computing[i] -= v * dt
                if now + computing[i] / v <= now * (1 + 1e-12) + EPS:   # due now (floating-point residue)
                    done_work.append(i)
            for i in done_work:   # its work is done: it ends after its latency, as any node
                del computing[i]
                in_pool[nodes[i].pool] -= 1
                order += 1
                heapq.heappush(heap, (now + nodes[i].latency, order, i))
        while heap and heap[0][0] <= now:
            _, _, i = heapq.heappop(heap)
            finish[i] = now
            done += 1
            for c in children[i]:
                waiting[c] -= 1
                if waiting[c] == 0:
                    begin(c, now)
    return Trace(tuple(start), tuple(finish), tuple(flow_log))
