"""A stage rank's ``Regime`` (regime.py) built from the plan: its ZeRO sharding, the ``parameters`` all-gather
executor (zero = 3: on that program's own communicators, ``topology.gather_groups``), the norm group and
the rank's tensor and data positions. Moved out of engine.py (its ``PlanEngine._regime``).

Imports only torch, the standard library, the contract and the runtime's own modules.
"""
from __future__ import annotations

from planc.plan import Plan, Precision

from .dataflow import EngineError
from .reduce import ReductionExecutor
from .regime import Regime, zero_sharding
from .topology import gather_groups, lookup_group

__all__ = ["build_regime"]


def build_regime(engine, plan: Plan, groups: dict, red, initial) -> Regime:
    """The optimizer step as plan.json train says (regime.py), on ``engine``'s buckets and groups."""
    rank, stage = engine.rank, engine.stage
    zero = plan.zero_of(engine.stage_id)
    try:
        owned = zero_sharding(plan, engine.stage_id, red, engine.reduction, engine.grads)
    except (ValueError, AttributeError) as e:
        raise EngineError(f"rank {rank}: {e}") from None
    gather = None
    if owned is not None:
        params = next((r for r in plan.reductions if r.name == "parameters" and r.group_of(rank) is not None),
                      None)
        if params is None or params.group_of(rank) != red.group_of(rank):
            raise EngineError(f"rank {rank}: zero = {zero} but plan.json has no parameters "
                              f"all-gather over its gradient group {list(red.group_of(rank))}")
        gather = ReductionExecutor.for_plan(plan, params, gather_groups(groups, engine.stage_id) if zero == 3 else groups, rank)
        engine.reduce_description += (f"; ZeRO-{zero}: fp32 master weights and optimizer "
                                      f"state sharded over the data group, parameters all-gathered by {params.text}")
        if zero == 3:
            z3 = plan.train.zero3
            engine.reduce_description += (f" per layer before its forward and its backward (prefetch "
                                          f"{'on' if z3.prefetch else 'off'}, keep_gathered "
                                          f"{'on' if z3.keep_gathered else 'off'}), freed between uses")
    members = plan.train.norm_group
    norm_group = lookup_group(groups, members) if len(members) > 1 and rank in members else None
    if plan.train.clip is not None or plan.train.precision is Precision.FP16:
        if rank not in members:
            raise EngineError(f"rank {rank}: plan.json train.norm_group {list(members)} does not hold it")
    tensor_index = stage.position(rank)[stage.mesh_axes.index("tensor")] if "tensor" in stage.mesh_axes else 0
    group = red.group_of(rank) if red is not None else (rank,)
    return Regime(plan.train, engine.grads, engine.device, initial=initial, owned=owned, gather=gather,
                  tied=engine.tied, norm_group=norm_group, tensor_index=tensor_index,
                  share=(group.index(rank), len(group)))
