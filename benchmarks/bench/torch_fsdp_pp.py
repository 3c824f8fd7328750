"""torch's own FSDP2 + pipelining on a planc-compiled plan's model: the baseline of ``python -m benchmarks bench zero3``.

Standalone (torch and the standard library; ``stock_deepspeed``'s plan readers), launched like the
compiled program, one process per rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT), ``torch_fsdp_pp.py --out
OUT --steps N``. It reads the compiled output OUT only for what the plan says about the model and
training (builder, loss, data and their arguments, seed, micro-batch rows and count, the layer cut,
the optimizer of ds_config.json) and then does what a torch user does:

- a 2-d ``DeviceMesh`` ``(pp, dp)`` (rank = stage x D + data position, as the plan's uniform
  placement with its data axis inside the host): the plan must be uniform, each stage on D devices
  ``[s·D, (s+1)·D)``, else exit 2;
- the stage's layers as one ``nn.Sequential``; every layer ``fully_shard`` over ``dp`` (FSDP2: each
  layer's parameters all-gathered before its forward and its backward, freed after,
  ``reshard_after_forward=True``), and the stage module too: pipelining then keeps the stage gathered
  across the step's micro-batches and reduce-scatters the gradients once, after the last (its
  ``stage.py``: ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)`` before
  the last backward), the mode of planc's ``zero_keep_gathered = true``; with ``--per-micro-batch``
  the stage module is left plain, so every layer keeps FSDP2's defaults (gathered before each forward
  and backward, freed after, gradients reduce-scattered every micro-batch), the mode of planc's
  default;
- ``PipelineStage`` + ``Schedule1F1B`` (or ``ScheduleGPipe`` for a gpipe plan) over ``pp``, its
  ``scale_grads`` dividing the gradients by the micro-batch count and FSDP2 averaging over ``dp``, so
  gradients are those of the global mean loss, as planc's (an SGD test holds it to the reference).

Each data position trains on its rows of the same seeded micro-batches planc's program uses. Rank 0
prints ``step N loss X time T s S samples/s`` (the loss: the mean over micro-batches, on the last
stage, sent to rank 0).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench.stock_deepspeed import (_load_function, _optimizer, print_step, print_total,  # noqa: E402
                                               read_output)


def layout_error(plan: dict) -> str | None:
    """Why the baseline cannot lay ``plan`` out as its ``(pp, dp)`` mesh (rank = stage x D + data position),
    or None: every stage must hold D devices, stage s the devices ``[s·D, (s+1)·D)``."""
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    D = int(plan["cluster"]["devices"]) // len(stages)
    for s in stages:
        if sorted(s["devices"]) != list(range(s["index"] * D, (s["index"] + 1) * D)):
            return (f"stage {s['index']} runs on devices {sorted(s['devices'])}: the baseline needs a uniform plan "
                    f"with stage s on [s·{D}, (s+1)·{D})")
    return None


def refuses(why: str | None, prog: str) -> bool:
    """Whether a baseline refuses its plan (``why``: a layout error, or None), said once, by rank 0,
    before any process group is formed."""
    if why and os.environ.get("RANK", "0") == "0":
        print(f"{prog}: {why}", file=sys.stderr, flush=True)
    return why is not None


def timed_steps(schedule, optimizer, batches, *, steps: int, micro_batches: int, samples: int, first: bool,
                last: bool, rows: slice = slice(None), holders: int = 1) -> None:
    """The torch baselines' training loop: per step ``micro_batches`` micro-batches drawn (``rows`` of
    each: this rank's data position), then, timed together, the schedule's step on what this rank's
    stages take (the input where it holds the first stage, the target and the losses where it holds the
    last) and the optimizer's step; rank 0 prints the step's loss (the mean over the micro-batches,
    summed over the ranks, ÷ ``holders``: the ranks of the last stage), time and ``samples`` a second as
    planc's program does."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    total = 0.0
    for step in range(steps):
        xs, ys = zip(*((x[rows], y[rows]) for x, y in (next(batches) for _ in range(micro_batches))))
        x, y = torch.cat(xs), torch.cat(ys)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        losses: list = []
        schedule.step(*((x,) if first else ()), **(dict(target=y, losses=losses) if last else {}))
        optimizer.step()
        elapsed = time.perf_counter() - t0
        total += elapsed
        mine = torch.tensor([float(sum(v.detach() for v in losses)) / micro_batches if losses else 0.0],
                            dtype=torch.float64)
        dist.all_reduce(mine)
        if rank == 0:
            print_step(step, mine.item() / holders, elapsed, samples)
    if rank == 0:
        print_total(steps, total, samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torch_fsdp_pp.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a planc-compiled output folder (its plan.json, model file)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--per-micro-batch", action="store_true",
                   help="gather and reduce-scatter every micro-batch (the stage module itself not fully_shard)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    out, plan, ds_config, train, steps, seed, micro_batch, micro_batches = read_output(args.out, args.steps)
    stages = sorted(plan["stages"], key=lambda s: s["index"])
    S = len(stages)

    if refuses(layout_error(plan), "torch_fsdp_pp"):
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    D = world // S
    mesh = init_device_mesh("cpu", (S, D), mesh_dim_names=("pp", "dp"))
    s, d = rank // D, rank % D
    model_args = dict(train["model"].get("args", {}))
    torch.manual_seed(seed)   # every rank builds all layers from the same seed, as planc's runtime and stock do
    layers = _load_function(out, train["model"])(**model_args)
    a, b = stages[s]["layers"]
    module = nn.Sequential(*layers[a:b])
    del layers
    for layer in module:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh["dp"])
    if not args.per_micro_batch:   # pipelining keeps an FSDP stage module gathered through the step
        fully_shard(module, mesh=mesh["dp"])
    loss_fn = _load_function(out, train["loss"])   # the schedule divides the gradients by the micro-batches

    stage = PipelineStage(module, s, S, torch.device("cpu"), group=mesh["pp"].get_group())
    kind = ScheduleGPipe if train.get("schedule") == "gpipe" else Schedule1F1B
    schedule = kind(stage, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
    optimizer = _optimizer([q for q in module.parameters() if q.requires_grad], ds_config)
    rows = micro_batch // D
    batches = _load_function(out, train["data"])(micro_batch, seed, **model_args)
    if rank == 0:
        print(f"torch FSDP2 + pipelining: {kind.__name__}, pp {S} x dp {D}, every layer fully_shard over dp, "
              + ("gathered and reduce-scattered every micro-batch" if args.per_micro_batch
                 else "kept gathered through the step, gradients reduce-scattered after the last micro-batch"),
              flush=True)
    # each data position its rows of every micro-batch; the loss averaged over the D ranks of the last stage
    timed_steps(schedule, optimizer, batches, steps=steps, micro_batches=micro_batches,
                samples=micro_batch * micro_batches, first=s == 0, last=s == S - 1,
                rows=slice(d * rows, (d + 1) * rows), holders=D)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
