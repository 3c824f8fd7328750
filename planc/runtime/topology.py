"""Process groups from the plan, and DeepSpeed's pipeline grid answered from the plan.

Public API (stable):

    create_groups(plan, timeout=None) -> dict[tuple[int, ...], ProcessGroup | None]
        every group of plan.json ``groups``, then ``backward_groups`` (keyed
        ``("backward", *members)``), then each stage's DeepSpeed grid groups
        (``stages[].data_groups`` / ``model_groups``, one-member groups included,
        keyed ``("grid", *members)``), then the gradient programs' own communicators
        (``("reduce", *members)``), then (zero = 3 only) the zero-3 stages' ``parameters``
        programs' own communicators (``("gather", *members)``, zero3.py's gathers only), then the transfers' own communicators (per
        direction, a p2p one over the world, keyed ``("p2p", direction)``, and one
        per broadcast group or allgather part, keyed ``("transfer", direction, *members)``),
        in that order on every rank (creation is collective). The value is None on
        ranks outside the group.
    lookup_group(groups, members) -> ProcessGroup | None   (GroupMissing if the plan did not list it)
    StageTopology(plan)  a deepspeed ``ProcessTopology`` with axes (pipe, data, model) holding
        exactly the plan's stage devices: pipe = stage, data = position along the stage's
        ``data`` mesh dimension, model = row-major position over its other mesh dimensions.
        Stages may differ in size; coordinates no device has are simply absent.
    PlanGrid(plan, rank, groups)  what ``PipelineParallelGrid`` answers, for one rank of a
        stage, from its stage alone (its data and model groups, its stage id, the number of
        stages). DeepSpeed's own grid needs pipe x data x model = world; the plan's does not.
"""
from __future__ import annotations

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology

from .dist_util import BACKWARD, GroupMissing, collective_timeout, lookup_group
from planc.plan import Direction, Plan, PlanFileError, Strategy

__all__ = ["create_groups", "lookup_group", "GroupMissing", "StageTopology", "PlanGrid", "reduce_groups", "GRID",
           "BACKWARD", "gather_groups"]

GRID, P2P, TRANSFER, REDUCE, GATHER = "grid", "p2p", "transfer", "reduce", "gather"


def create_groups(plan: Plan, timeout=None) -> dict:
    """Create every communicator the plan uses, in the plan's order, on every rank."""
    timeout = timeout or collective_timeout(plan)
    me = dist.get_rank()
    out: dict = {}
    world = tuple(range(dist.get_world_size()))
    families = [((), plan.groups), ((BACKWARD,), plan.backward_groups),
                ((GRID,), [g for s in plan.stages for g in (*s.data_groups, *s.model_groups)])]
    # the gradient programs' own communicators, used by the reduction thread only (see grads.py)
    families.append(((REDUCE,), [g for r in plan.reductions if r.name == "gradients" for s in r.steps
                                 for g in s.groups]))
    if plan.train is not None and plan.train.zero3 is not None:   # zero 3's per-layer gathers (zero3.py)
        families.append(((GATHER,), [g for r in plan.reductions if r.name == "parameters" and (r.stage is None
                                     or plan.zero_of(r.stage) == 3) for s in r.steps for g in s.groups]))
    # a mesh that runs several stages: each stage's reduction thread (and zero 3's gather thread) on
    # communicators of its own, so the stages' threads never share one (their orders would interleave)
    for stages in [c.stages for c in plan.pipeline.actions if len(c.stages) > 1] if plan.pipeline else ():
        for s in stages:
            mine = set(plan.stages[s].devices)
            for name, family in (("gradients", REDUCE), ("parameters", GATHER)):
                families.append(((family, "stage", s), [g for r in plan.reductions if r.name == name
                                                        and r.stage in (None, s) for st in r.steps
                                                        for g in st.groups if set(g) <= mine]))
    if plan.transfers:   # the transfers' own communicators, used by nothing else (see comm.py)
        for d in Direction:
            families.append(((P2P, str(d)), [world]))
            families.append(((TRANSFER, str(d)), route_groups(plan, d)))
        if plan.runtime.p2p_per_transfer:   # each direction of each transfer on its own
            for t in plan.transfers:
                for d in Direction:
                    families.append(((P2P, str(d), t.name), [world]))
                    families.append(((TRANSFER, str(d), t.name), route_groups(plan, d, (t,))))
    for prefix, lists in families:
        for members in lists:
            key = prefix + tuple(members)
            if key in out:
                continue
            if prefix == (GRID,) and tuple(members) in out:   # reuse the plan's own communicator
                out[key] = out[tuple(members)]
                continue
            pg = dist.new_group(ranks=list(members), timeout=timeout)
            out[key] = pg if me in members else None
    return out


def _own(groups: dict, family: str, stage: int | None) -> dict:
    out = {k[1:]: v for k, v in groups.items() if k and k[0] == family and (len(k) < 2 or k[1] != "stage")}
    if stage is not None:   # a stage of a mesh that runs several: its own
        out.update({k[3:]: v for k, v in groups.items() if k[:3] == (family, "stage", stage)})
    return out


def reduce_groups(groups: dict, stage: int | None = None) -> dict:
    """The groups as the gradient reduction thread sees them: its own communicators by members (``stage``:
    that stage's own, where its mesh runs several stages)."""
    return _own(groups, REDUCE, stage)


def gather_groups(groups: dict, stage: int | None = None) -> dict:
    """The groups as zero 3's parameter gathers see them (compute thread or gather thread, never both at
    once): their own communicators by members (``stage``: as ``reduce_groups``)."""
    return _own(groups, GATHER, stage)


def route_groups(plan: Plan, direction: Direction, transfers=None) -> list[tuple[int, ...]]:
    """The member sets one direction's tasks run collectives on, in first-use order: broadcast
    groups ({sender} ∪ receivers) and allgather parts; one-member sets left out. ``transfers``: of these
    only (default: the plan's)."""
    seen: dict[tuple[int, ...], None] = {}
    for t in plan.transfers if transfers is None else transfers:
        route = t.forward if direction is Direction.FORWARD else t.backward
        if route is None:
            continue
        for task in route.tasks:
            for g in ((task.group,) if route.strategy is Strategy.BROADCAST else task.parts):
                if len(g) > 1:
                    seen.setdefault(tuple(g), None)
    return list(seen)


class StageTopology(ProcessTopology):
    """(pipe, data, model) coordinates of the plan's stage devices; stages may differ in size."""

    AXES = ("pipe", "data", "model")

    def __init__(self, plan: Plan, stage=None):
        """``stage``: the stage this process builds an engine for, where its device runs several (stages
        that share a mesh: a device's coordinate is that stage's; else the first stage holding it)."""
        coords = {}
        dims = [len(plan.stages), 1, 1]
        # the given stage first: its devices take its coordinates
        for st in sorted(plan.stages, key=lambda st: stage is not None and st.index != stage.index):
            k = st.mesh_axes.index("data") if "data" in st.mesh_axes else None
            for d in st.mesh_devices:
                pos = st.position(d)
                m = 0
                for i, n in enumerate(st.mesh_shape):
                    if i != k:
                        m = m * n + pos[i]
                c = (st.index, pos[k] if k is not None else 0, m)
                coords.setdefault(d, c)
                dims[1], dims[2] = max(dims[1], c[1] + 1), max(dims[2], c[2] + 1)
        super().__init__(axes=list(self.AXES), dims=dims)
        self.mapping = {self.ProcessCoord(*c): r for r, c in sorted(coords.items())}

    def get_axis_comm_lists(self, axis):
        """As ProcessTopology's, skipping coordinates no device has."""
        if axis not in self.axes:
            return []
        k = self.axes.index(axis)
        lists: dict[tuple, list[tuple[int, int]]] = {}
        for coord, r in self.mapping.items():
            rest = tuple(v for i, v in enumerate(coord) if i != k)
            lists.setdefault(rest, []).append((coord[k], r))
        return [[r for _, r in sorted(v)] for _, v in sorted(lists.items())]


class PlanGrid(PipelineParallelGrid):
    """``PipelineParallelGrid`` for one rank, answered from its stage in the plan.

    ``PipelineParallelGrid.__init__`` is not called: it would create DeepSpeed's
    groups for a pipe x data x model grid spanning the world. The attributes it
    sets are set here from the plan, and every group is one ``create_groups``
    made. The pipe group is this rank alone: planc moves activations and the
    loss itself, DeepSpeed's pipe-wide collectives are not used.
    """

    def __init__(self, plan: Plan, rank: int, groups: dict, stage=None):
        st = stage if stage is not None else plan.stage_of(rank)
        if st is None:
            raise PlanFileError(f"rank {rank} is in no stage; an idle rank builds no engine")
        self._topo = StageTopology(plan, stage)
        self.global_rank = rank
        self.world_size = dist.get_world_size()
        self.stage = st
        self.dp_group = list(st.group_of("data", rank))
        self.mp_group = list(st.group_of("model", rank))
        self.dp_proc_group = _grid_group(groups, self.dp_group)
        self.ds_model_proc_group = self.slice_proc_group = _grid_group(groups, self.mp_group)
        self.pp_group = [rank]
        self.pp_proc_group = self.dp_proc_group   # a valid group holding this rank; never used for traffic
        self.data_parallel_size = len(self.dp_group)
        self.model_parallel_size = self.slice_parallel_size = len(self.mp_group)
        self.pipe_parallel_size = len(plan.stages)
        self.ds_model_world_size = self.model_parallel_size
        self.ds_model_rank = self.mp_group.index(rank)
        self.slice_group = self.mp_group
        self.stage_id = st.index
        self.data_parallel_id = self.dp_group.index(rank)
        self.is_first_stage = st.index == 0
        self.is_last_stage = st.index == len(plan.stages) - 1
        self.p2p_groups = []

    def get_stage_id(self):
        return self.stage_id

    def get_data_parallel_id(self):
        return self.data_parallel_id

    def stage_to_global(self, stage_id, **kwargs):
        raise PlanFileError("planc stages are not a rectangular grid: ask the plan, not stage_to_global")

    def get_pipe_parallel_rank(self):
        return self.stage_id

    def get_pipe_parallel_world_size(self):
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    def get_data_parallel_rank(self):
        return self.data_parallel_id

    def get_data_parallel_world_size(self):
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self):
        return list(self.dp_group)

    def get_model_parallel_rank(self):
        return self.ds_model_rank

    def get_model_parallel_world_size(self):
        return self.model_parallel_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self):
        return self.ds_model_rank

    def get_slice_parallel_world_size(self):
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group


def _grid_group(groups: dict, members):
    key = (GRID, *members)
    if key not in groups:
        raise GroupMissing(f"process group {list(members)} is not among the plan's stage grid groups")
    return groups[key]
