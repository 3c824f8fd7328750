"""Stock DeepSpeed pipeline training of a planc-compiled plan's model: the `python -m benchmarks bench iteration` baseline.

Standalone: imports torch, DeepSpeed and the standard library only, and is
launched exactly like the compiled program (``deepspeed ... stock_deepspeed.py
--out OUT --steps N``, one launcher per host). It reads the compiled output
OUT only for what the plan says about the model and training:

- ``plan.json``'s ``train``: the model builder, loss and data functions (the copied model
  file in OUT) and their arguments, the seed;
- ``plan.json``: the number of stages and the layer cut (checked against what
  DeepSpeed's partitioner gives), micro-batch rows and micro-batch count;
- ``ds_config.json``: batch sizes and the optimizer (built as a torch optimizer
  the way planc's runtime builds it, so both use ``torch.optim``).

and then does what a DeepSpeed user does: ``PipelineModule(layers,
num_stages=S, loss_fn=..., partition_method=M)`` with DeepSpeed's default
topology (``PipeDataParallelTopology``: rank = stage × data + data position),
``deepspeed.initialize``, and ``engine.train_batch(data_iter)`` per step: its
own schedule (``TrainSchedule``, 1F1B), its own p2p between neighbouring
stages and its own data-parallel gradient all-reduce. ``M`` is ``--partition``
(``uniform`` or ``parameters``, chosen by the bench as the method that
reproduces the plan's cut); the script stops with exit 2 if DeepSpeed's
``module.parts`` differ from the plan's layer boundaries.

Each data-parallel rank trains on its rows of the same seeded micro-batches
the planc program uses (rows ``[d·b, (d+1)·b)`` of every micro-batch, ``b`` =
micro_batch ÷ data), so both programs train the same model on the same data.
Rank 0 prints ``step N loss X time T s S samples/s`` like the compiled program.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time


def _load_function(out_dir: str, ref: dict):
    path = os.path.join(out_dir, ref["file"])
    name = "stock_user_" + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, ref["function"])


def _optimizer(params, ds_config: dict):
    import torch

    opt = ds_config.get("optimizer") or {"type": "Adam", "params": {"lr": 1e-3}}
    kw = dict(opt.get("params", {}))
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    table = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    return table[str(opt.get("type", "Adam")).lower()](params, **kw)


def _regime(train: dict) -> dict:
    """The plan's precision, ZeRO stage and clipping as a DeepSpeed user writes them in the config (planc's
    own ds_config.json leaves them out: planc's engine does them itself)."""
    cfg = {}
    if train.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif train.get("precision") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 1}
    if train.get("zero"):
        cfg["zero_optimization"] = {"stage": int(train["zero"])}
    if train.get("clip"):
        cfg["gradient_clipping"] = float(train["clip"])
    return cfg


def read_output(out_dir: str, steps: int | None):
    """What a baseline reads of a compiled output: ``(out, plan, ds_config, train, steps, seed, micro_batch,
    micro_batches)``, ``steps`` the argument's, else ``train.steps``."""
    out = os.path.abspath(out_dir)
    with open(os.path.join(out, "plan.json")) as f:
        plan = json.load(f)
    with open(os.path.join(out, "ds_config.json")) as f:
        ds_config = json.load(f)
    train = plan["train"]     # the model, loss and data references and the train settings
    steps = steps if steps is not None else int(train.get("steps", 1))
    return (out, plan, ds_config, train, steps, int(train.get("seed", 0)), int(train["micro_batch"]),
            int(train["micro_batches"]))


def print_step(step: int, loss: float, elapsed: float, samples: int) -> None:
    """Rank 0's step line, as the compiled program prints it."""
    print(f"step {step} loss {loss:.6f} time {elapsed:.4f} s {samples / elapsed:.1f} samples/s", flush=True)


def print_total(steps: int, total: float, samples: int) -> None:
    if steps:
        print(f"trained {steps} step(s) in {total:.3f} s: {steps * samples / total:.1f} samples/s", flush=True)


def _rows(batches, lo: int, hi: int):
    for x, y in batches:
        yield x[lo:hi].contiguous(), y[lo:hi].contiguous()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="stock_deepspeed.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="a planc-compiled output folder (its plan.json, model file)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--partition", default="uniform", help="PipelineModule partition_method (uniform, parameters)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    import deepspeed
    from deepspeed.pipe import PipelineModule

    out, plan, ds_config, train, steps, seed, micro_batch, micro_batches = read_output(args.out, args.steps)
    num_stages = len(plan["stages"])
    bounds = [s["layers"][0] for s in plan["stages"]] + [plan["stages"][-1]["layers"][1]]

    deepspeed.init_distributed(dist_backend="gloo")   # the testbed's ranks are CPU processes
    rank, world = dist.get_rank(), dist.get_world_size()
    data = world // num_stages
    model_args = dict(train["model"].get("args", {}))
    torch.manual_seed(seed)   # as planc's runtime: every rank builds all layers from the same seed
    layers = _load_function(out, train["model"])(**model_args)
    loss_fn = _load_function(out, train["loss"])
    batches = _load_function(out, train["data"])

    module = PipelineModule(layers=layers, num_stages=num_stages, loss_fn=loss_fn,
                            partition_method=args.partition)
    del layers
    if list(module.parts) != bounds:
        print(f"stock_deepspeed: rank {rank}: partition_method={args.partition!r} cut the layers at "
              f"{list(module.parts)}, the plan at {bounds}", file=sys.stderr, flush=True)
        return 2
    if rank == 0:
        print(f"stock DeepSpeed: PipelineModule(num_stages={num_stages}, partition_method={args.partition!r}) "
              f"parts={list(module.parts)}, topology pipe {num_stages} x data {data}", flush=True)
    cfg = {k: v for k, v in ds_config.items() if k != "optimizer"}
    cfg.update(_regime(train))
    cfg.update(train_micro_batch_size_per_gpu=micro_batch // data, gradient_accumulation_steps=micro_batches,
               train_batch_size=micro_batch * micro_batches, steps_per_print=10 ** 9)
    optimizer = _optimizer([q for q in module.parameters() if q.requires_grad], ds_config)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
    d = engine.grid.get_data_parallel_rank()
    rows = micro_batch // data
    it = _rows(batches(micro_batch, seed, **model_args), d * rows, (d + 1) * rows)
    samples = micro_batch * micro_batches
    total = 0.0
    for step in range(steps):
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=it)
        elapsed = time.perf_counter() - t0
        total += elapsed
        if rank == 0:
            print_step(step, float(loss), elapsed, samples)
    if rank == 0:
        print_total(steps, total, samples)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
