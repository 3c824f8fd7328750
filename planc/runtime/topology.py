"""Rank mapping from the plan, and creation of every planned process group.

Public API (stable):

    PlanTopology(plan)       deepspeed ProcessTopology whose rank mapping is the
                             plan's placement (axes = placement.axes, coords =
                             placement.coords); explicit stages without placement
                             use axes ("pipe", "m0", "m1", ...) = (stage, mesh index).
        .axes, .dims, .get_rank(**coord), .get_coord(rank), .get_axis_comm_lists(axis)
        .stage_of(rank), .mesh_position(rank)
    create_groups(plan, timeout=None) -> dict[tuple[int, ...], ProcessGroup | None]
        creates plan["groups"] in order on every rank (dist.new_group is
        collective); the value is None on ranks outside the group.
    lookup_group(groups, members) -> ProcessGroup | None
        the group of exactly `members`; GroupMissing if the plan did not list it
"""
from __future__ import annotations

from deepspeed.runtime.pipe.topology import ProcessTopology

from .dist_util import GroupMissing, create_groups, lookup_group
from .plan import PlanError, mesh_devices, mesh_position, mesh_shape, stage_of

__all__ = ["PlanTopology", "create_groups", "lookup_group", "GroupMissing"]


class PlanTopology(ProcessTopology):
    """ProcessTopology with the plan's coordinates instead of row-major ranks."""

    def __init__(self, plan: dict):
        self.plan = plan
        placement = plan.get("placement")
        if placement:
            axes = [a["name"] for a in placement["axes"]]
            dims = [int(a["size"]) for a in placement["axes"]]
            coords = {r: tuple(c) for r, c in enumerate(placement["coords"])}
        else:
            stages = plan["stages"]
            nd = max(len(mesh_shape(s["mesh"])) for s in stages)
            axes = ["pipe"] + [f"m{i}" for i in range(nd)]
            dims = [len(stages)] + [max((mesh_shape(s["mesh"]) + (1,) * nd)[i] for s in stages)
                                    for i in range(nd)]
            coords = {}
            for s in stages:
                for d in mesh_devices(s["mesh"]):
                    pos = mesh_position(s["mesh"], d)
                    coords[d] = (s["index"],) + pos + (0,) * (nd - len(pos))
        super().__init__(axes=axes, dims=dims)
        self.mapping = {}
        for r, c in sorted(coords.items()):
            if len(c) != len(axes):
                raise PlanError(f"placement.coords[{r}] = {list(c)} has {len(c)} entries for axes {axes}")
            key = self.ProcessCoord(*c)
            if key in self.mapping:
                raise PlanError(f"ranks {self.mapping[key]} and {r} share coordinates {list(c)}")
            self.mapping[key] = r

    def get_axis_comm_lists(self, axis):
        """As ProcessTopology's, skipping coordinates no device has (uneven explicit meshes)."""
        if axis not in self.axes:
            return []
        k = self.axes.index(axis)
        lists: dict[tuple, list[int]] = {}
        for coord, r in self.mapping.items():
            rest = tuple(v for i, v in enumerate(coord) if i != k)
            lists.setdefault(rest, []).append((coord[k], r))
        return [[r for _, r in sorted(v)] for _, v in sorted(lists.items())]

    def stage_of(self, rank: int):
        return stage_of(self.plan, rank)

    def mesh_position(self, rank: int):
        s = stage_of(self.plan, rank)
        if s is None:
            return None
        st = next(x for x in self.plan["stages"] if x["index"] == s)
        return mesh_position(st["mesh"], rank)
