"""The torch side of ``planc calibrate``: microbenchmarks run by every rank of a job.

Run as a script by each rank (``python microbench.py --spec JSON``) under a
launcher that sets RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT (the testbed's direct launcher, or the ranks ``planc calibrate
--on cluster`` spawns). Ranks are numbered host by host: rank r is on host
``r // LOCAL_WORLD_SIZE``. Standard library and torch only (no planc import):
the compiler that starts it stays torch-free.

Phases, each ended on rank 0 by a line ``step I comm T s (verified: PHASE)``
(the testbed's step-line format, so the caller can follow progress) and the
whole result printed by rank 0 as one line ``PLANC_MICROBENCH {json}``:

* ``matmul``: each rank multiplies two ``n x n`` f32 matrices (on its GPU under
  NCCL) for each ``n`` of the spec; seconds per product;
* ``block``: each rank runs the forward and backward of a transformer encoder
  layer (``torch.nn.TransformerEncoderLayer``, hidden ``h``, ``h // 64`` heads,
  4 h feed-forward, for each ``[h, seq, batch]`` of the spec), FLOPs counted by
  ``torch.utils.flop_counter`` as the model probe counts them; seconds per step.
  This is the device's training throughput, what the compute model divides the
  probe's FLOPs by (a bare matmul is its peak, which a training step on CPU
  does not reach: docs/calibrate.md).

  On GPUs every rank measures at once (each has its own device). On CPUs the
  ranks take turns, one at a time between barriers: ranks that share a
  machine's cores would otherwise measure their share of it, and the
  simulator models that sharing itself (``cluster { cores = ... }``).
* ``p2p inner`` / ``p2p outer``: ping-pong between rank 0 and rank 1 (same host)
  and between rank 0 and the first rank of host 1; one-way time = round trip / 2;
* ``exchange outer``: rank 0 and the first rank of host 1 send to each other at once (one
  message each way, both posted before either is waited on); seconds until both arrived. A
  direction of a link that carries data both ways can move less than one that carries it one
  way (over TCP, each direction's acknowledgements queue behind the other's data), and a
  pipeline's traffic goes both ways;
* ``allreduce inner`` / ``allreduce outer``: ``all_reduce`` (SUM) over host 0's
  ranks and over the first rank of every host.

Every payload is checked after it arrives (p2p: the sender's pattern; all-reduce:
the sum of the members' values); a wrong byte is an error, not a timing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

MARK = "PLANC_MICROBENCH "
STREAM = 8                             # messages each way per exchange: a pipeline's traffic is a stream
BLOCK = [[256, 64, 8], [512, 64, 4]]   # [hidden, seq, batch] of the training-throughput block


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, repeats: int, device, alone: bool, min_s: float = 0.0) -> float:
    """Median seconds of ``fn()`` on this rank; ``alone``: the ranks take turns (one at a time);
    ``min_s``: each sample calls ``fn`` often enough to last that long (a rank under a CPU quota runs a
    call shorter than its period at full speed, on the quota it saved while waiting)."""
    fn()   # warm-up (allocations, kernels)
    _sync(device)
    calls = 1
    if min_s > 0:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        calls = max(1, round(min_s / max(time.perf_counter() - t0, 1e-6)))
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    for turn in range(world if alone else 1):
        dist.barrier()
        if alone and turn != rank:
            continue
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            _sync(device)
            times.append((time.perf_counter() - t0) / calls)
    dist.barrier()
    return statistics.median(times)


def _matmul(ns, repeats: int, device, alone: bool, min_s: float = 0.0) -> list[dict]:
    out = []
    for n in ns:
        a = torch.rand(n, n, device=device)
        b = torch.rand(n, n, device=device)
        out.append({"n": n, "flop": 2.0 * n ** 3, "seconds": _timed(lambda: torch.matmul(a, b), repeats, device,
                                                                    alone, min_s)})
    return out


def _block(shapes, repeats: int, device, alone: bool, min_s: float = 0.0) -> list[dict]:
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    torch.manual_seed(0)
    for h, seq, batch in shapes:
        layer = torch.nn.TransformerEncoderLayer(h, max(1, h // 64), 4 * h, dropout=0.0, batch_first=True,
                                                 device=device)
        x = torch.rand(batch, seq, h, device=device, requires_grad=True)

        def step():
            layer(x).sum().backward()

        with FlopCounterMode(display=False) as counter:
            step()
        out.append({"h": h, "seq": seq, "batch": batch, "flop": float(counter.get_total_flops()),
                    "seconds": _timed(step, repeats, device, alone, min_s)})
    return out


def _pingpong(me: int, a: int, b: int, sizes, repeats: int, device) -> list[list]:
    """[[bytes, [one-way seconds per repeat]]] measured by ``a`` (empty on the other ranks)."""
    samples = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        times = []
        for rep in range(repeats + 1):                       # the first round trip warms the connection
            value = float(rep + 1)
            if me == a:
                buf = torch.full((n,), value, device=device)
                back = torch.empty(n, device=device)
                _sync(device)
                t0 = time.perf_counter()
                dist.send(buf, b)
                dist.recv(back, b)
                _sync(device)
                dt = time.perf_counter() - t0
                if not torch.equal(back, buf):
                    raise RuntimeError(f"p2p {a}<->{b}: {nbytes} B came back altered")
                if rep:
                    times.append(dt / 2)
            elif me == b:
                buf = torch.empty(n, device=device)
                dist.recv(buf, a)
                if not bool((buf == value).all()):
                    raise RuntimeError(f"p2p {a}->{b}: {nbytes} B arrived altered")
                dist.send(buf, a)
        if me == a:
            samples.append([n * 4, times])
    return samples


def _exchange(me: int, a: int, b: int, sizes, repeats: int, device) -> list[list]:
    """[[bytes, [seconds per repeat]]] measured by ``a``: ``a`` and ``b`` send ``bytes`` to each other at
    once; the time from a barrier until both messages arrived (empty on the other ranks)."""
    samples = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        times = []
        for rep in range(repeats + 1):                       # the first exchange warms the connection
            if me in (a, b):
                peer = b if me == a else a
                out = torch.full((STREAM, n), float(me + 1 + rep), device=device)
                got = torch.empty(STREAM, n, device=device)
            dist.barrier()
            if me not in (a, b):
                continue
            _sync(device)
            t0 = time.perf_counter()
            works = []
            for k in range(STREAM):
                works += [dist.isend(out[k], peer), dist.irecv(got[k], peer)]
            for w in works:
                w.wait()
            _sync(device)
            dt = time.perf_counter() - t0
            if not bool((got == float(peer + 1 + rep)).all()):
                raise RuntimeError(f"exchange {a}<->{b}: {nbytes} B arrived altered")
            if rep:
                times.append(dt)
        if me == a:
            samples.append([STREAM * n * 4, times])
    return samples


def _allreduce(me: int, members: list[int], group, sizes, repeats: int, device) -> list[list]:
    """[[bytes, [seconds per repeat]]] measured by ``members[0]`` (empty elsewhere)."""
    samples = []
    if me not in members:
        return samples
    want = float(sum(m + 1 for m in members))
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        times = []
        for rep in range(repeats + 1):
            buf = torch.full((n,), float(me + 1), device=device)
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _sync(device)
            dt = time.perf_counter() - t0
            if not bool((buf == want).all()):
                raise RuntimeError(f"allreduce over {members}: wrong sum for {nbytes} B")
            if rep:
                times.append(dt)
        if me == members[0]:
            samples.append([n * 4, times])
    return samples


def run(spec: dict) -> dict | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE") or spec.get("per_host") or world)
    if world % per_host:
        raise RuntimeError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {per_host}")
    hosts = world // per_host
    backend = spec.get("backend", "auto")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= per_host else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", rank % per_host)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=float(spec.get("timeout", 120))))
    repeats = int(spec.get("repeats", 3))
    step = 0

    def done(phase: str, t0: float) -> None:
        nonlocal step
        dist.barrier()
        if rank == 0:
            print(f"step {step} comm {time.perf_counter() - t0:.6f} s (verified: {phase})", flush=True)
        step += 1

    alone = device.type == "cpu"
    t0 = time.perf_counter()
    min_s = float(spec.get("min_sample_s", 0.0))   # the lab's calibration under CPU quotas sets it
    mm = _matmul(spec.get("matmul", [256, 512]), repeats, device, alone, min_s)
    done("matmul", t0)
    t0 = time.perf_counter()
    blocks = _block(spec.get("block", BLOCK), repeats, device, alone, min_s)
    done("block", t0)
    inner_group = [dist.new_group(list(range(h * per_host, (h + 1) * per_host))) for h in range(hosts)]
    leaders = list(range(0, world, per_host))
    outer_group = dist.new_group(leaders)
    result = {"world": world, "hosts": hosts, "per_host": per_host, "backend": backend, "device": str(device),
              "threads": torch.get_num_threads(), "p2p": {}, "allreduce": {}}
    if per_host > 1:
        t0 = time.perf_counter()
        result["p2p"]["inner"] = _pingpong(rank, 0, 1, spec["sizes_inner"], repeats, device)
        done("p2p inner", t0)
        t0 = time.perf_counter()
        members = list(range(per_host))
        result["allreduce"]["inner"] = {"k": per_host, "samples": _allreduce(
            rank, members, inner_group[0], spec["sizes_inner"], repeats, device)}
        done("allreduce inner", t0)
    if hosts > 1:
        t0 = time.perf_counter()
        result["p2p"]["outer"] = _pingpong(rank, 0, per_host, spec["sizes_outer"], repeats, device)
        done("p2p outer", t0)
        t0 = time.perf_counter()
        result["exchange"] = {"outer": _exchange(rank, 0, per_host, spec["sizes_outer"], repeats, device)}
        done("exchange outer", t0)
        t0 = time.perf_counter()
        result["allreduce"]["outer"] = {"k": hosts, "samples": _allreduce(
            rank, leaders, outer_group, spec["sizes_outer"], repeats, device)}
        done("allreduce outer", t0)
    gathered = [None] * world
    dist.all_gather_object(gathered, mm)
    result["matmul"] = gathered
    gathered = [None] * world
    dist.all_gather_object(gathered, blocks)
    result["block"] = gathered
    result["alone"] = alone
    dist.barrier()
    dist.destroy_process_group()
    return result if rank == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="microbench.py")
    p.add_argument("--spec", required=True, help="the run's JSON (sizes, repeats, backend, timeout)")
    args, _ = p.parse_known_args(argv)     # the launcher may add its own (--steps, --local_rank)
    result = run(json.loads(args.spec))
    if result is not None:
        print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
