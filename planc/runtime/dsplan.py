"""DeepSpeed's pipeline pieces answered from the plan: the schedule of a stage's per-stage list, the grid
and groups while DeepSpeed builds the engine, and the ds_config keys DeepSpeed must leave alone
(the engine itself, engine.py, runs them as plan.json says)."""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from deepspeed.runtime.pipe import module as ds_module
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule

from planc.plan import Plan

from .dataflow import EngineError
from .topology import PlanGrid

__all__ = ["BeginOp", "PlanSchedule", "deepspeed_on_plan", "check_ds_config", "DEEPSPEED_OWN"]


# ---------------------------------------------------------------- schedule

class BeginOp(ds_schedule.PipeInstruction):
    """Marks the start of operation ``index`` of the stage's list (lets receives run ahead of it)."""


class PlanSchedule(ds_schedule.PipeSchedule):
    """DeepSpeed instructions for one stage, from its plan.json ``per_stage`` list."""

    def __init__(self, ops, micro_batches, stages, stage_id, incoming, outgoing, loads_data):
        super().__init__(micro_batches, stages, stage_id)
        self.ops, self.incoming, self.outgoing, self.loads_data = list(ops), incoming, outgoing, loads_data

    def steps(self):
        for index, text in enumerate(self.ops):
            kind, m = text[0], int(text[1:])
            cmds = [BeginOp(index=index)]
            if kind == "F":
                if self.loads_data:
                    cmds.append(ds_schedule.LoadMicroBatch(buffer_id=m))
                cmds += [ds_schedule.RecvActivation(buffer_id=m, transfer=t) for t in self.incoming]
                cmds.append(ds_schedule.ForwardPass(buffer_id=m))
                cmds += [ds_schedule.SendActivation(buffer_id=m, transfer=t) for t in self.outgoing]
            else:
                cmds += [ds_schedule.RecvGrad(buffer_id=m, transfer=t) for t in self.outgoing]
                cmds.append(ds_schedule.BackwardPass(buffer_id=m))
                cmds += [ds_schedule.SendGrad(buffer_id=m, transfer=t) for t in self.incoming]
            yield cmds
        yield [ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]

    def num_pipe_buffers(self):
        return 1    # the engine keeps its own per-micro-batch buffers and frees each one early


@contextlib.contextmanager
def deepspeed_on_plan(plan: Plan, rank: int, groups: dict, timeout):
    """While DeepSpeed builds the module and engine: its grid is the plan's, its groups are the plan's.

    - ``PipelineParallelGrid`` (which would create a world-spanning pipe x data x
      model grid) is replaced by ``PlanGrid`` for this rank's stage;
    - ``dist.new_group`` returns the world group for the world and refuses any
      other group (all of the plan's were created up front, collectively, so idle
      ranks need not enter DeepSpeed);
    - the engine's start-up p2p handshake between neighbouring stages is skipped:
      planc's transfers are not neighbour-only and need no warm-up.
    """
    grid = PlanGrid(plan, rank, groups)
    world = tuple(range(dist.get_world_size()))
    saved = (ds_module.PipelineParallelGrid, dist.new_group, ds_p2p.send, ds_p2p.recv)

    def new_group(ranks=None, *args, **kwargs):
        if ranks is None or tuple(sorted(ranks)) == world:
            return dist.GroupMember.WORLD
        raise EngineError(f"DeepSpeed asked for a process group {sorted(ranks)} that the plan does not list")

    ds_module.PipelineParallelGrid = lambda process_group=None, topology=None: grid
    dist.new_group = new_group
    ds_p2p.send = ds_p2p.recv = lambda *a, **k: None
    try:
        yield grid
    finally:
        ds_module.PipelineParallelGrid, dist.new_group, ds_p2p.send, ds_p2p.recv = saved


DEEPSPEED_OWN = ("fp16", "bf16", "zero_optimization", "gradient_clipping")


def check_ds_config(cfg: dict) -> None:
    """ds_config.json must not switch on what the engine does itself as plan.json train says (precision,
    ZeRO, clipping): DeepSpeed's own would run a second, different regime."""
    on = [k for k in DEEPSPEED_OWN if (isinstance(cfg.get(k), dict) and (cfg[k].get("enabled") or cfg[k].get("stage")))
          or (k == "gradient_clipping" and cfg.get(k))]
    if on:
        raise EngineError(f"ds_config.json switches on DeepSpeed's {', '.join(on)}; planc's engine runs the "
                          f"precision, ZeRO and clipping plan.json train says (recompile the output)")
