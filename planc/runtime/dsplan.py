"""DeepSpeed's pipeline pieces answered from the plan: the schedule of a stage's per-stage list, the grid
and groups while DeepSpeed builds the engine, and the ds_config keys DeepSpeed must leave alone
(the engine itself, engine.py, runs them as plan.json says)."""
from __future__ import annotations

import contextlib

import torch.distributed as dist
from deepspeed.runtime.pipe import module as ds_module
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule

from planc.plan import Direction, Plan

from .dataflow import EngineError
from .topology import PlanGrid

__all__ = ["BeginOp", "PlanSchedule", "deepspeed_on_plan", "check_ds_config", "DEEPSPEED_OWN"]


# ---------------------------------------------------------------- schedule

class BeginOp(ds_schedule.PipeInstruction):
    """Marks the start of operation ``index`` of the stage's list (lets receives run ahead of it)."""


class WeightPass(ds_schedule.BufferOpInstruction):
    """A split backward's weight gradients of micro-batch ``buffer_id`` (``W``; bwsplit.py)."""


class PlanSchedule(ds_schedule.PipeSchedule):
    """DeepSpeed instructions for one stage, from its rank class's plan.json ``pipeline.actions`` list, in
    its order: per turn (``planc.plan.RankClass.turns``) its receives (a wait) and sends (issued) as listed,
    ``BeginOp`` where the turn begins, the compute (``W``: ``WeightPass``); the sends after the last compute, then the reduce and
    the optimizer step."""

    _RECV = {Direction.FORWARD: ds_schedule.RecvActivation, Direction.BACKWARD: ds_schedule.RecvGrad}
    _SEND = {Direction.FORWARD: ds_schedule.SendActivation, Direction.BACKWARD: ds_schedule.SendGrad}

    def __init__(self, rank_class, micro_batches, stages, stage_id, loads):
        """``loads``: the stages whose forwards load their micro-batch (the first and the last stage)."""
        super().__init__(micro_batches, stages, stage_id)
        self.rank_class, self.loads = rank_class, set(loads)

    @staticmethod
    def _tag(cmd, stage: int):
        cmd.planc_stage = stage   # which stage's engine runs it (classrun.py: a rank of several stages)
        return cmd

    def _move(self, a):
        table = self._RECV if a.kind == "RECV" else self._SEND
        return self._tag(table[a.direction](buffer_id=a.micro_batch, transfer=a.transfer), a.stage)

    def steps(self):
        for index, turn in enumerate(self.rank_class.turns()):
            a = turn.compute
            cmds = [self._move(x) for x in turn.before]
            cmds.insert(turn.begin, BeginOp(index=index))
            if a.kind == "F" and a.stage in self.loads:
                cmds.append(self._tag(ds_schedule.LoadMicroBatch(buffer_id=a.micro_batch), a.stage))
            cmds.append(self._tag({"F": ds_schedule.ForwardPass, "B": ds_schedule.BackwardPass,
                                   "W": WeightPass}[a.kind](buffer_id=a.micro_batch), a.stage))
            yield cmds
        yield [self._move(x) for x in self.rank_class.tail()] + [
            self._tag(cmd, r.stage) for r in self.rank_class.reduces()
            for cmd in (ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep())]

    def num_pipe_buffers(self):
        return 1    # the engine keeps its own per-micro-batch buffers and frees each one early


@contextlib.contextmanager
def deepspeed_on_plan(plan: Plan, rank: int, groups: dict, timeout, stage=None):
    """While DeepSpeed builds the module and engine: its grid is the plan's, its groups are the plan's.

    - ``PipelineParallelGrid`` (which would create a world-spanning pipe x data x
      model grid) is replaced by ``PlanGrid`` for this rank's stage;
    - ``dist.new_group`` returns the world group for the world and refuses any
      other group (all of the plan's were created up front, collectively, so idle
      ranks need not enter DeepSpeed);
    - the engine's start-up p2p handshake between neighbouring stages is skipped:
      planc's transfers are not neighbour-only and need no warm-up.
    """
    grid = PlanGrid(plan, rank, groups, stage)
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


def named_instruction(instruction: str, fn):
    """An instruction whose communication failure (a dead or hung peer, the collective timeout)
    is reported naming this rank, its stage, the instruction and what it was waiting for."""
    import functools

    @functools.wraps(fn)
    def run(self, **kwargs):
        try:
            if self.tracer is None or instruction == "BeginOp":
                return fn(self, **kwargs)
            with self.tracer.span(instruction, "compute", micro_batch=kwargs.get("buffer_id"),
                                  transfer=kwargs.get("transfer")):
                return fn(self, **kwargs)
        except (RuntimeError, EngineError) as e:
            if getattr(e, "planc_named", False):
                raise
            what = ", ".join(f"{'micro-batch' if k == 'buffer_id' else k} {v!r}" for k, v in kwargs.items())
            peers = self._peers(instruction, kwargs.get("transfer"))
            err = EngineError(f"rank {self.rank} (stage {self.stage_id}) failed in {instruction}"
                              f"{f' ({what})' if what else ''}"
                              f"{f' with ranks {peers}' if peers else ''}: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
            err.planc_named = True
            raise err from e
    return run
