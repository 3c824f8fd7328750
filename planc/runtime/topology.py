"""Rank mapping from the plan, and creation of every planned process group.

Public API (stable):

    PlanTopology(plan)       deepspeed ProcessTopology whose rank mapping is the
                             plan's placement (axes = placement.axes, coords =
                             placement.coords); explicit stages without placement
                             use axes ("pipe", "m0", "m1", ...) = (stage, mesh index).
        .axes, .dims, .get_rank(**coord), .get_coord(rank), .get_axis_comm_lists(axis)
        .stage_of(rank), .mesh_position(rank)
    PlanGridTopology(plan)   the same rank mapping folded onto DeepSpeed's
                             (pipe, data, model) axes, for PipelineModule /
                             PipelineParallelGrid: pipe = stage, data = the stage
                             mesh axis named "data", model = the other mesh axes
                             (row-major). TopologyError when the plan is not a
                             rectangular grid (idle devices, stages of different
                             data or model sizes).
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

__all__ = ["PlanTopology", "PlanGridTopology", "TopologyError", "create_groups", "lookup_group", "GroupMissing"]


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


class TopologyError(PlanError):
    """The plan's placement is not a rectangular (pipe, data, model) grid."""


class PlanGridTopology(PlanTopology):
    """DeepSpeed's (pipe, data, model) grid with the plan's rank mapping.

    ``PipelineParallelGrid`` reads the axes ``pipe``, ``data`` and ``model`` and
    asserts that their product is the world size, so a training plan must put
    every device in a stage and give every stage the same data and model sizes.
    """

    AXES = ["pipe", "data", "model"]

    def __init__(self, plan: dict):
        self.plan = plan
        stages = sorted(plan["stages"], key=lambda s: s["index"])
        if [s["index"] for s in stages] != list(range(len(stages))):
            raise TopologyError(f"stage indices {[s['index'] for s in stages]} are not 0..{len(stages) - 1}")
        coords, sizes = {}, set()
        for st in stages:
            shape = mesh_shape(st["mesh"])
            axes = list(st.get("mesh_axes") or ())
            k = axes.index("data") if "data" in axes else None
            data = shape[k] if k is not None else 1
            model = 1
            for i, n in enumerate(shape):
                if i != k:
                    model *= n
            sizes.add((data, model))
            for d in mesh_devices(st["mesh"]):
                pos = mesh_position(st["mesh"], d)
                m = 0
                for i, n in enumerate(shape):
                    if i != k:
                        m = m * n + pos[i]
                coords[d] = (st["index"], pos[k] if k is not None else 0, m)
        if len(sizes) != 1:
            raise TopologyError(
                "DeepSpeed's pipeline grid needs every stage to have the same data and model sizes; "
                "the stages have (data, model) = " + ", ".join(
                    f"stage {s['index']}: {self._sizes(s)}" for s in stages))
        world = int(plan.get("cluster", {}).get("devices", len(coords)))
        idle = sorted(set(range(world)) - set(coords))
        if idle:
            raise TopologyError(f"devices {idle} are in no stage; DeepSpeed's pipeline grid needs every rank "
                                f"in a stage (pipe x data x model = world size) to train")
        data, model = sizes.pop()
        ProcessTopology.__init__(self, axes=list(self.AXES), dims=[len(stages), data, model])
        self.mapping = {self.ProcessCoord(*c): r for r, c in sorted(coords.items())}

    @staticmethod
    def _sizes(st):
        shape = mesh_shape(st["mesh"])
        axes = list(st.get("mesh_axes") or ())
        k = axes.index("data") if "data" in axes else None
        data = shape[k] if k is not None else 1
        total = 1
        for n in shape:
            total *= n
        return (data, total // data)
