"""``python -m benchmarks.bench.cores [--procs 1,2,4] [--iters 30]``: does processor sharing hold here?

The simulator shares a pool's cores equally among the devices computing at once
(docs/simulator.md, "Shared cores"). This times the forward and backward of one
``torch.nn.TransformerEncoderLayer`` (hidden 256, 4 heads, batch 8 x 64 tokens, the
calibration's block) in N processes at once (``OMP_NUM_THREADS=1`` each, started together), for
each N of ``--procs``: with C cores, processor sharing says each takes ``max(1, N / C)`` times its
time alone. Prints one line per N: the milliseconds per iteration of every process and that ratio.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time


def _work(start: float, q, iters: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    layer = torch.nn.TransformerEncoderLayer(256, 4, batch_first=True)
    x = torch.randn(8, 64, 256)
    for _ in range(2):
        layer(x).sum().backward()
    while time.time() < start:
        time.sleep(0.001)
    t0 = time.perf_counter()
    for _ in range(iters):
        layer(x).sum().backward()
    q.put((time.perf_counter() - t0) / iters)


def measure(procs=(1, 2, 4), iters: int = 30) -> list[dict]:
    ctx = mp.get_context("spawn")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    out, alone = [], None
    for n in procs:
        q = ctx.Queue()
        start = time.time() + 3.0 + 0.5 * n          # every process imported torch and warmed up by then
        ps = [ctx.Process(target=_work, args=(start, q, iters)) for _ in range(n)]
        for p in ps:
            p.start()
        times = [q.get(timeout=600) for _ in ps]
        for p in ps:
            p.join()
        med = statistics.median(times)
        alone = med if n == 1 else alone
        out.append({"procs": n, "cores": cores, "ms": [round(t * 1e3, 2) for t in times],
                    "vs_alone": med / alone if alone else None, "sharing_says": max(1.0, n / cores)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.cores", description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="1,2,4", help="process counts, comma-separated; the first should be 1")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args(argv)
    try:
        procs = [int(x) for x in a.procs.split(",") if x.strip()]
    except ValueError:
        print(f"python -m benchmarks.bench.cores: --procs {a.procs!r}: not whole numbers", file=sys.stderr)
        return 2
    if not procs or any(n < 1 for n in procs) or a.iters < 1:
        print("python -m benchmarks.bench.cores: --procs and --iters must be at least 1", file=sys.stderr)
        return 2
    for r in measure(procs, a.iters):
        ratio = "—" if r["vs_alone"] is None else f"{r['vs_alone']:.2f}"
        print(f"{r['procs']} process(es) on {r['cores']} cores: {r['ms']} ms per iteration; "
              f"median ÷ alone {ratio}, processor sharing says {r['sharing_says']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
