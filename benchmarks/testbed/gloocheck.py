"""gloo point-to-point through the testbed's links, every receive posted first (``python -m benchmarks testbed check``).

Run by ``benchmarks.testbed.linkcheck.gloo_rates`` as the script of a 2-host x 2-rank
testbed launch: rank k of host 0 pairs with rank k of host 1. Per pattern, after
a barrier, the receivers post all their irecvs, the senders isend ``N`` messages of
``MIB`` MiB each, and everyone waits; the slowest rank's time is printed by rank 0
as ``gloo PATTERN|FLOWS|SECONDS|BUSIEST_BYTES`` (the median of ``GLOOCHECK_REPEATS`` runs). Patterns: one pair one way; both pairs
one way (two flows through the link); both pairs both ways (four flows).
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

PATTERNS = ("one pair, one way", "two pairs, one way", "two pairs, both ways")


def _run(pattern: str, rank: int, n: int, numel: int) -> float:
    peer = (rank + 2) % 4
    sends = {"one pair, one way": rank == 0, "two pairs, one way": rank < 2}.get(pattern, True)
    recvs = {"one pair, one way": rank == 2, "two pairs, one way": rank >= 2}.get(pattern, True)
    dist.barrier()
    t = time.perf_counter()
    works = [dist.irecv(torch.empty(numel), src=peer, tag=i) for i in range(n)] if recvs else []
    if sends:
        x = torch.ones(numel)
        works += [dist.isend(x, dst=peer, tag=i) for i in range(n)]
    for w in works:
        w.wait()
    took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("GLOOCHECK_TIMEOUT", 120))))
    rank = dist.get_rank()
    if dist.get_world_size() != 4:
        raise SystemExit("gloocheck needs 2 hosts x 2 ranks")
    n, mib = int(os.environ.get("GLOOCHECK_MESSAGES", 16)), float(os.environ.get("GLOOCHECK_MIB", 0.5))
    numel = int(mib * 2 ** 20) // 4
    _run("two pairs, one way", rank, 2, numel)          # warm-up: every connection made
    repeats = int(os.environ.get("GLOOCHECK_REPEATS", 3))
    for pattern in PATTERNS:
        seconds = sorted(_run(pattern, rank, n, numel) for _ in range(repeats))[repeats // 2]   # the median
        flows = {"one pair, one way": 1, "two pairs, one way": 2}.get(pattern, 4)
        busiest = min(flows, 2) * n * numel * 4          # bytes through the busiest link direction
        if rank == 0:
            print(f"gloo {pattern}|{flows}|{seconds:.6f}|{busiest}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
