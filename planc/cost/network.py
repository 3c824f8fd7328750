"""The tree-of-links network model (DESIGN.md "Cost model", v1).

Levels ``0..n`` (outermost first). Every unit of level ``j`` (a rack, a node, a
GPU, ...) has one full-duplex link to its parent with capacity ``bandwidth_j``
bytes/s per direction. A transfer between devices whose level coordinates first
differ at level ``j`` leaves the sender through its up-links of levels
``n, n-1, .., j`` and enters the receiver through the down-links of levels
``j, .., n``. Levels of fanout 1 have no physical link (the unit *is* its
parent) and are skipped; their bandwidth may be ``None``.

Latency: a level's ``latency_j`` is the one-way latency of a hop between two
siblings at that level; a transfer crossing levels ``j..n`` pays the sum of
``latency_l`` over the crossed levels ``l = j..n`` (counted once per level, not
once per side), so a ring step between GPUs of one node costs ``latency_gpu``.

A level may also give ``both_ways``: a direction's capacity while the opposite direction of the
same unit's link carries data too (over TCP each direction's acknowledgements queue behind the
other's data; `planc calibrate` measures it). :meth:`Network.link_capacity` takes whether the
opposite direction is busy; the event simulation (``planc.cost.events``) asks it at every instant.
The closed forms below use the one-way ``bandwidth``.

Contention (:meth:`Network.flows_time`): concurrent flows are treated as fluid
and share every link's capacity; the time of a set of concurrent flows is the
bottleneck link's ``bytes on link / capacity`` plus the largest latency of any
flow. This is exact for flows that all start together and are limited by one
link, and an optimistic estimate otherwise.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

from planc import ir

UP = 0
DOWN = 1

# A link id: (level index, unit index at that level (row-major over the level
# coordinates c_0..c_level), direction UP or DOWN).
LinkId = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Network:
    """Tree-of-links model of one cluster; pure and hashable (by its cluster)."""

    cluster: ir.Cluster
    _strides: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _linked: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _bw: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _both: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _lat_from: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _inner_first: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        levels = self.cluster.levels
        fan = self.cluster.fanouts
        strides = tuple(math.prod(fan[j + 1:]) for j in range(len(fan)))
        linked = tuple(j for j, l in enumerate(levels) if l.fanout > 1)
        for j in linked:
            bw = levels[j].bandwidth
            if bw is None or bw <= 0:
                raise ValueError(f"level {levels[j].name!r} has fanout {levels[j].fanout} but no positive bandwidth")
        bws = tuple(float(l.bandwidth) if l.bandwidth else math.inf for l in levels)
        # _lat_from[j] = sum of latencies of linked levels j..n
        lat = [0.0] * (len(levels) + 1)
        for j in range(len(levels) - 1, -1, -1):
            lat[j] = lat[j + 1] + (levels[j].latency if levels[j].fanout > 1 else 0.0)
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_linked", linked)
        object.__setattr__(self, "_bw", bws)
        object.__setattr__(self, "_both", tuple(float(l.loaded_both_ways) if l.bandwidth else math.inf
                                                for l in levels))
        object.__setattr__(self, "_lat_from", tuple(lat))
        # (level, stride) of the linked levels, innermost first: a transfer that
        # stays inside a unit of level l stays inside every unit above it too.
        object.__setattr__(self, "_inner_first", tuple((l, strides[l]) for l in reversed(linked)))

    # ------------------------------------------------------------ geometry

    @property
    def devices(self) -> int:
        return self.cluster.devices

    def unit(self, device: int, level: int) -> int:
        """Row-major index of the unit of ``level`` that contains ``device``."""
        return device // self._strides[level]

    def crossing_level(self, a: int, b: int) -> int:
        """First level at which the coordinates of ``a`` and ``b`` differ (``len(levels)`` if a == b)."""
        for j, s in enumerate(self._strides):
            if a // s != b // s:
                return j
        return len(self._strides)

    def path_links(self, a: int, b: int) -> tuple[LinkId, ...]:
        """Links a transfer a → b uses: a's up-links (innermost first), then b's down-links (outermost first)."""
        j = self.crossing_level(a, b)
        levels = [l for l in self._linked if l >= j]
        ups = tuple((l, a // self._strides[l], UP) for l in reversed(levels))
        downs = tuple((l, b // self._strides[l], DOWN) for l in levels)
        return ups + downs

    @property
    def linked_inner_first(self) -> tuple[tuple[int, int], ...]:
        """``(level, stride)`` of the levels with links, innermost first (unit of d = d // stride)."""
        return self._inner_first

    def latency_from(self, level: int) -> float:
        """Latency of a transfer whose coordinates first differ at ``level``."""
        return self._lat_from[level]

    def level_bandwidth(self, level: int) -> float:
        return self._bw[level]

    def link_capacity(self, link: LinkId, both_ways: bool = False) -> float:
        """Bytes/s of ``link``; ``both_ways``: while the opposite direction of the same link is busy."""
        return self._both[link[0]] if both_ways else self._bw[link[0]]

    def latency(self, a: int, b: int) -> float:
        """One-way latency a → b: sum of the crossed levels' latencies (0 for a == b)."""
        # The crossing level is always a linked level (coordinates of a
        # fanout-1 level are always 0): the outermost linked level whose
        # units differ, found walking up from the innermost.
        lat = 0.0
        for l, s in self._inner_first:
            if a // s == b // s:
                break
            lat = self._lat_from[l]
        return lat

    # ------------------------------------------------------------ contention

    def link_loads(self, flows: Iterable[tuple[int, int, float]]) -> dict[LinkId, float]:
        """Bytes each link carries for the given flows (src, dst, nbytes)."""
        loads: dict[LinkId, float] = {}
        for (l, _), (up, down) in zip(self._inner_first, self._level_loads(flows)):
            loads.update(((l, u, UP), b) for u, b in up.items())
            loads.update(((l, u, DOWN), b) for u, b in down.items())
        return loads

    def _level_loads(self, flows: Iterable[tuple[int, int, float]]
                     ) -> list[tuple[dict[int, float], dict[int, float]]]:
        """Per linked level (innermost first): bytes on each unit's up-link and down-link.

        A flow is walked up from the innermost level and stops at the first
        level whose unit holds both ends (no link above it is crossed either).
        Each link's bytes are summed in flow order.
        """
        levels = self._inner_first
        out = [(defaultdict(float), defaultdict(float)) for _ in levels]
        strides = [s for _, s in levels]
        for src, dst, nbytes in flows:
            if src == dst or nbytes <= 0:
                continue
            for (up, down), s in zip(out, strides):
                us, ud = src // s, dst // s
                if us == ud:
                    break
                up[us] += nbytes
                down[ud] += nbytes
        return out

    def bandwidth_time(self, flows: Iterable[tuple[int, int, float]]) -> float:
        """Max over links of bytes on the link / its capacity (the fluid bandwidth term)."""
        best = 0.0
        for (l, _), (up, down) in zip(self._inner_first, self._level_loads(flows)):
            bw = self._bw[l]
            for loads in (up, down):
                if loads:
                    # x / bw is monotone in x, so this is the max of the quotients
                    best = max(best, max(loads.values()) / bw)
        return best

    def flows_time(self, flows: Iterable[tuple[int, int, float]]) -> float:
        """Time for concurrent flows: bottleneck link load / capacity + the largest flow latency."""
        flows = [f for f in flows if f[0] != f[1] and f[2] > 0]
        lat = max((self.latency(s, d) for s, d, _ in flows), default=0.0)
        return self.bandwidth_time(flows) + lat

    def bottleneck_bandwidth(self, group: Iterable[int]) -> float:
        """Smallest capacity among the levels a transfer inside ``group`` may cross (inf for < 2 devices).

        These are the linked levels at or below the outermost level at which the
        members' coordinates differ.
        """
        members = sorted(set(group))
        if len(members) < 2:
            return math.inf
        j = min(self.crossing_level(members[0], m) for m in members[1:])
        return min((self._bw[l] for l in self._linked if l >= j), default=math.inf)
