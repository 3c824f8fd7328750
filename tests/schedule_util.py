"""Tests that reorder a compiled plan's compute: plan.json ``pipeline.actions`` read as per-stage compute
orders, and compute orders written back as actions by the schedules' generator
(``planc.pipeline.schedules.actions_of``: each transfer's receives before the action that consumes them,
its sends after the one that produced them)."""
from __future__ import annotations

from typing import NamedTuple

from planc.pipeline.schedules import actions_of


class T(NamedTuple):   # what actions_of reads of a transfer
    name: str
    src_stage: int
    dst_stage: int


def compute_lists(d: dict) -> list[list[str]]:
    """Per stage its forwards and backwards in list order (``"F0"``, ``"B3"``), from plan.json's actions."""
    out = {}
    for c in d["pipeline"]["actions"]:
        for a in c["list"]:
            if a[0] in ("F", "B", "W"):
                out.setdefault(a[1], []).append(f"{a[0]}{a[2]}")
    return [out[s] for s in sorted(out)]


def set_compute_lists(d: dict, lists) -> None:
    """Write ``lists`` (per stage, ``"F0"``-style) into plan.json ``d`` as its actions, in place."""
    transfers = [T(t["name"], t["src"]["stage"], t["dst"]["stage"]) for t in d.get("transfers", ())]
    ops = [[(op[0], int(op[1:])) for op in ops] for ops in lists]
    d["pipeline"]["actions"] = [c.to_json() for c in actions_of(ops, transfers)]
