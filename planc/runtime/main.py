"""Program entry of a compiled output: ``deepspeed OUT/train.py [--comm-only] [--steps N]``.

Reads OUT/plan.json (the compiler's decisions), OUT/run.json (model, loss,
data and train settings) and OUT/ds_config.json (optimizer), initializes the
process group, runs the start-up checks, builds the DeepSpeed pipeline engine
(``PlanEngine``, a ``PipelineEngine`` subclass) from the copied model file and
trains; rank 0 prints ``step N loss X``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from .dist_util import init_distributed, startup_checks
from .engine import (EngineError, PlanEngine, _executor_classes, _ProgramReduction, _RegionTransfer,
                     check_stage_shapes, data_slice, plan_problems)
from .plan import load_plan, plan_digest, stage_of
from .topology import create_groups


def load_function(out_dir: str, ref: dict):
    path = os.path.join(out_dir, ref["file"])
    name = "planc_user_" + os.path.splitext(os.path.basename(path))[0]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return getattr(mod, ref["function"])


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train.py", description="Run a planc-compiled training plan.")
    p.add_argument("--comm-only", action="store_true",
                   help="run only the plan's transfers and reductions on random data, and time them")
    p.add_argument("--steps", type=int, default=None, help="override train.steps")
    p.add_argument("--dump-params", default=None, metavar="DIR",
                   help="after training, save each rank's stage parameters to DIR/rank<R>.pt")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _fail_together(problems: list[str]) -> None:
    """All ranks learn every rank's problems and stop with the same message."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    every = [p for ps in gathered for p in ps]
    if every:
        raise EngineError("the plan cannot train:\n  " + "\n  ".join(dict.fromkeys(every)))


def comm_only(plan: dict, groups: dict, rank: int, steps: int) -> None:
    """Run every transfer forward and every reduction once per step; rank 0 prints the times."""
    TE, RE = _executor_classes()
    for step in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        for i, t in enumerate(plan.get("transfers", ())):
            ex = TE(t, plan, groups, rank, "forward") if TE else _RegionTransfer(t, plan, rank, "forward", 2 * i)
            works = []
            if stage_of(plan, rank) == t["src"]["stage"]:
                held = getattr(ex, "my_src", None) or getattr(ex, "mine_src", None)
                works = ex.send(torch.randn(tuple(b - a for a, b in held)), micro_batch=step)
            if stage_of(plan, rank) == t["dst"]["stage"]:
                ex.recv(micro_batch=step)
            for w in works or ():
                (w[0] if isinstance(w, tuple) else w).wait()
        for r in plan.get("reductions", ()):
            if any(rank in g for g in r["groups"]):
                n = max(1, int(r.get("bytes", 4)) // 4)
                (RE(r, groups, rank) if RE else _ProgramReduction(r, groups, rank)).run(torch.ones(n))
        dist.barrier()
        if rank == 0:
            print(f"step {step} comm {time.perf_counter() - t0:.6f} s", flush=True)


def main(argv=None, out_dir: str | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = out_dir or os.path.dirname(os.path.abspath(sys.argv[0]))
    plan = load_plan(os.path.join(out_dir, "plan.json"))
    with open(os.path.join(out_dir, "run.json")) as f:
        run = json.load(f)
    with open(os.path.join(out_dir, "ds_config.json")) as f:
        ds_config = json.load(f)
    train = run.get("train", {})
    steps = args.steps if args.steps is not None else int(train.get("steps", 1))

    init_distributed()
    startup_checks(plan, plan_digest(plan))
    rank = dist.get_rank()
    groups = create_groups(plan)

    if args.comm_only or not run.get("model"):
        comm_only(plan, groups, rank, steps)
        dist.barrier()
        dist.destroy_process_group()
        return 0

    if train.get("precision", "fp32") != "fp32":
        raise EngineError(f"precision {train['precision']} is not supported by the planc engine yet (fp32 only)")
    model_args = dict(run["model"].get("args", {}))
    seed = int(train.get("seed", 0))
    micro_batch = int(train["micro_batch"])
    torch.manual_seed(seed)   # every rank builds all layers alike, then keeps its stage's
    layers = load_function(out_dir, run["model"])(**model_args)
    loss_fn = load_function(out_dir, run["loss"])
    batches = load_function(out_dir, run["data"])
    stage = stage_of(plan, rank)

    # everything that can stop the plan is checked before DeepSpeed builds its groups (collective),
    # and gathered so that all ranks stop together with one message
    problems = plan_problems(plan, ds_config)   # pure: the same on every rank
    if not problems:
        try:
            lo, hi = (int(v) for v in next(s for s in plan["stages"] if s["index"] == stage)["layers"])
            x, _ = next(batches(micro_batch, seed, **model_args))
            a, b, _ = data_slice(plan, stage, rank, micro_batch)
            problems = check_stage_shapes(plan, rank, layers[lo:hi], x[a:b])
        except (EngineError, ValueError, KeyError) as e:
            problems = [f"rank {rank}: {e}"]
    _fail_together(problems)

    engine = PlanEngine.build(plan, groups, layers, loss_fn, batches(micro_batch, seed, **model_args), ds_config)
    for step in range(steps):
        loss = engine.train_batch()
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)

    if args.dump_params:
        os.makedirs(args.dump_params, exist_ok=True)
        torch.save(dict(engine.plan_named_parameters()), os.path.join(args.dump_params, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0
