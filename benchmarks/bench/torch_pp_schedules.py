"""torch's own multi-stage pipelining on a compiled plan's model: `python -m benchmarks bench schedules`' baseline.

Standalone (torch and the standard library; ``stock_deepspeed``'s plan readers), launched like the
compiled program, one process per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT), ``torch_pp_schedules.py
--out OUT --schedule interleaved|zbv [--steps N]``. It reads the compiled output OUT only for what the
plan says about the model and training (builder, loss and data and their arguments, seed, micro-batch
rows and count, the layer cut, the optimizer of ds_config.json) and then does what a torch user does:

- two ``PipelineStage`` s per rank over the default group, each the plan's layers of that stage as one
  ``nn.Sequential``: rank r holds stages r and r + P (``interleaved``: ``ScheduleInterleaved1F1B``,
  Megatron's placement) or r and 2P − 1 − r (``zbv``: ``ScheduleZBVZeroBubble``, the V, its backward
  split into input and weight passes). The plan must have 2P stages of one device each, placed that
  way (planc's own placement for ``interleaved_1f1b(virtual = 2)`` and ``zbv``), else exit 2;
- ``scale_grads=True``: the schedule divides the gradients by the micro-batch count, so they are those
  of the mean loss over the micro-batches, as planc's (an SGD test holds it to the reference).

Rank 0 prints ``step N loss X time T s S samples/s`` (the loss: the mean over micro-batches, from the
rank of the last stage; ``torch_fsdp_pp.timed_steps``, the loop both torch baselines run).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench.stock_deepspeed import _load_function, _optimizer, read_output  # noqa: E402
from benchmarks.bench.torch_fsdp_pp import refuses, timed_steps  # noqa: E402

SCHEDULES = {"interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}


def rank_of_stage(schedule: str, stage: int, ranks: int) -> int:
    """The rank torch's schedule puts ``stage`` on (of 2 x ``ranks`` stages): looped or V."""
    if stage < ranks:
        return stage
    return stage - ranks if schedule == "interleaved" else 2 * ranks - 1 - stage


def layout_error(plan: dict, schedule: str) -> str | None:
    """Why torch's ``schedule`` cannot run ``plan``'s stages where planc runs them, or None: 2P stages
    of one device each, stage i on device ``rank_of_stage(schedule, i, P)``."""
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    P = int(plan["cluster"]["devices"])
    if len(stages) != 2 * P:
        return f"{len(stages)} stages on {P} devices: the baseline runs two stages a rank ({2 * P})"
    for s in stages:
        want = [rank_of_stage(schedule, s["index"], P)]
        if sorted(s["devices"]) != want:
            return (f"stage {s['index']} runs on devices {sorted(s['devices'])}: {SCHEDULES[schedule]} puts it "
                    f"on {want}")
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torch_pp_schedules.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a planc-compiled output folder (its plan.json, model file)")
    p.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args(argv)

    out, plan, ds_config, train, steps, seed, micro_batch, micro_batches = read_output(args.out, args.steps)
    if refuses(layout_error(plan, args.schedule), "torch_pp_schedules"):
        return 2

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    S = 2 * P
    mine = [i for i in range(S) if rank_of_stage(args.schedule, i, P) == rank]
    model_args = dict(train["model"].get("args", {}))
    torch.manual_seed(seed)   # every rank builds all layers from the same seed, as planc's runtime does
    layers = _load_function(out, train["model"])(**model_args)
    cut = {s["index"]: s["layers"] for s in plan["stages"]}
    modules = [nn.Sequential(*layers[cut[i][0]:cut[i][1]]) for i in mine]
    del layers
    stages = [pipelining.PipelineStage(m, i, S, torch.device("cpu")) for m, i in zip(modules, mine)]
    kind = getattr(pipelining, SCHEDULES[args.schedule])
    loss_fn = _load_function(out, train["loss"])
    schedule = kind(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
    optimizer = _optimizer([q for m in modules for q in m.parameters() if q.requires_grad], ds_config)
    batches = _load_function(out, train["data"])(micro_batch, seed, **model_args)
    if rank == 0:
        print(f"torch pipelining: {kind.__name__}, {P} ranks x stages {mine} (rank 0)", flush=True)
    timed_steps(schedule, optimizer, batches, steps=steps, micro_batches=micro_batches,
                samples=micro_batch * micro_batches, first=0 in mine, last=S - 1 in mine)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
