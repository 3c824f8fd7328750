"""The compute-only bound's worker for ``python -m benchmarks bench iteration`` (launched inside the testbed).

``python benchmarks/bench/compute_only.py --compute-only --out OUT``: every rank runs its stage's part of
the plan's list without any transfer or reduction (standard library, torch and OUT's own runtime only).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

def compute_worker(argv) -> int:
    """Every rank runs its stage's part of the plan's list without any transfer or reduction."""
    import argparse

    p = argparse.ArgumentParser(prog="iteration.py --compute-only")
    p.add_argument("--compute-only", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    sys.path.insert(0, out)
    import importlib.util

    import torch
    import torch.distributed as dist
    from planc import plan as planfile
    from planc_runtime.dataflow import StageGraph, apply_layers, build_optimizer
    from planc_runtime.reshard import DTYPES

    plan = planfile.load(os.path.join(out, "plan.json"))
    ds_config = json.loads(Path(out, "ds_config.json").read_text())

    def load_function(ref):
        spec = importlib.util.spec_from_file_location("compute_user_" + Path(ref.file).stem,
                                                      os.path.join(out, ref.file))
        mod = sys.modules.get(spec.name)
        if mod is None:
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        return getattr(mod, ref.function)

    dist.init_process_group("gloo")   # the testbed's ranks are CPU processes
    rank = dist.get_rank()
    stage = plan.stage_of(rank)
    train = plan.train
    micro_batch, seed = train.micro_batch, train.seed
    samples = micro_batch * train.micro_batches
    work = None
    if stage is not None:
        graph = StageGraph(plan)
        model_args = dict(train.model.args)
        torch.manual_seed(seed)
        layers = load_function(train.model)(**model_args)
        lo, hi = stage.layers
        mine = torch.nn.ModuleList(layers[lo:hi])
        del layers
        loss_fn = load_function(train.loss)
        data = load_function(train.data)(micro_batch, seed, **model_args)
        a, b = stage.rows_of(rank)
        first, last = stage.index == 0, stage.index == graph.num_stages - 1
        incoming = [graph.by_name[n] for n in graph.incoming(stage.index)]
        outgoing = [graph.by_name[n] for n in graph.outgoing(stage.index)]
        taps = {graph.src_layer(t) for t in outgoing}
        params = [q for q in mine.parameters() if q.requires_grad]
        optimizer = build_optimizer(params, ds_config) if params else None
        work = (graph, mine, loss_fn, data, a, b, first, last, incoming, outgoing, taps, optimizer)

    def one_step():
        graph, mine, loss_fn, data, a, b, first, last, incoming, outgoing, taps, optimizer = work
        held = {}
        for op in plan.pipeline.per_stage[stage.index]:
            kind, m = op[0], int(op[1:])
            if kind == "F":
                x, y = next(data) if (first or last) else (None, None)
                if first:
                    inputs = [x[a:b]]
                else:
                    inputs = [torch.zeros([hi_ - lo_ for lo_, hi_ in t.forward.region("dst", rank)],
                                          dtype=DTYPES[t.dtype]).requires_grad_(True) for t in incoming]
                o, tapped = apply_layers(mine, stage.layers[0], inputs, taps)
                if last:
                    held[m] = [loss_fn(o, y[a:b]) * ((b - a) / micro_batch) / plan.pipeline.micro_batches], None
                else:
                    tensors = []
                    for t in outgoing:
                        z = tapped[graph.src_layer(t)]
                        if not any(z is u for u in tensors):
                            tensors.append(z)
                    held[m] = tensors, [torch.full_like(z, 1e-3) for z in tensors]
            else:
                tensors, grads = held.pop(m)
                torch.autograd.backward(tensors, grads)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()

    world = dist.get_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("PLANC_CPUS_PER_RANK"):   # each rank under its own CPU quota: no core is shared
        cores = world
    for step in range(args.steps):
        # one rank at a time, the others waiting in a barrier: each rank's work alone on the CPUs
        mine = 0.0
        for r in range(world):
            dist.barrier()
            if r == rank and work is not None:
                t0 = time.perf_counter()
                one_step()
                mine = time.perf_counter() - t0
        alone = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(alone, torch.tensor([mine], dtype=torch.float64))
        alone = [float(x) for x in alone]
        slowest, shared = max(alone), sum(alone) / min(cores, world)
        if rank == 0:
            t = max(slowest, shared)
            print(f"compute-only step {step}: slowest rank alone {slowest:.4f} s, all ranks {sum(alone):.4f} s "
                  f"on {min(cores, world)} cores {shared:.4f} s, per rank {[round(x, 4) for x in alone]}", flush=True)
            print(f"step {step} loss 0.0 time {t:.4f} s {samples / t:.1f} samples/s", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # leave without C++ static destructors: about 1 exit in 15, torch 2.13's (CPU, gloo) abort on a
    # joinable thread there, after every collective is done ("terminate called without an active
    # exception", SIGABRT, no Python frame), which fails the launch that measured fine
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)




if __name__ == "__main__":
    sys.exit(compute_worker(sys.argv[1:]))
