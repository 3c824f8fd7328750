"""``planc.plan.Route.region`` (found by bisection over the device-sorted regions plan.json reads)
against a scan: sorted and unsorted routes, present and absent devices, both sides."""

from __future__ import annotations

import random

from planc.plan.transfers import Route
from planc.plan.vocab import Strategy


def _route(src, dst) -> Route:
    return Route(Strategy.BROADCAST, 1, "naive", (), tuple(src), tuple(dst))


def _scan(regions, device):
    return next((r for d, r in regions if d == device), None)


def test_region_equals_a_scan_on_sorted_and_unsorted_routes():
    rng = random.Random(3)
    for trial in range(200):
        devices = rng.sample(range(60), rng.randint(0, 20))
        src = [(d, ((d, d + 1), (0, 4))) for d in devices]
        dst = [(d + 100, ((0, d + 1),)) for d in devices]
        if trial % 2:
            src.sort()
            dst.sort()
        route = _route(src, dst)
        for probe in range(-1, 170):
            assert route.region("src", probe) == _scan(src, probe)
            assert route.region("dst", probe) == _scan(dst, probe)
