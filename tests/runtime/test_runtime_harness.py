"""Spawning small gloo jobs for the runtime tests (no tests here).

`run_ranks(target, world, payload)` starts `world` processes (forks of multiprocessing's fork server,
torch imported once) on a free port, each calling `target(rank, world, payload)` after init_process_group
(gloo). Every process writes "ok" or its traceback to a file; the parent joins
with a timeout, kills stragglers (by their own pid) and fails with the
tracebacks, so a test never hangs.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import traceback

from planc.ports import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
JOB_TIMEOUT_S = float(os.environ.get("PLANC_TEST_JOB_TIMEOUT_S", "240"))
COLLECTIVE_TIMEOUT_S = 60




def _entry(rank, world, port, target_mod, target_name, payload, outdir, env):
    path = os.path.join(outdir, f"rank{rank}.txt")
    try:
        os.environ.clear()          # the caller's environment when it ran them (a spawned process's), not
        os.environ.update(env)      # the fork server's, which started with an earlier test's
        for p in (ROOT, HERE):
            if p not in sys.path:
                sys.path.insert(0, p)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world),
                          OMP_NUM_THREADS="1")
        import importlib

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        # the harness's own world (no plan here): a bounded wait; the groups a worker creates from a plan
        # (topology.create_groups) get that plan's train { timeout }, else the runtime's 300 s
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        fn = getattr(importlib.import_module(target_mod), target_name)
        result = fn(rank, world, payload)
        dist.barrier()
        dist.destroy_process_group()
        with open(path, "w") as f:
            f.write("ok\n" + (repr(result) if result is not None else ""))
    except BaseException:
        with open(path, "w") as f:
            f.write("error\n" + traceback.format_exc())
        raise SystemExit(1)


# What every rank imports, once: the ranks are forks of multiprocessing's fork server, which imported these
# and nothing else (no tensor op, no thread pool, no process group before the fork), so each rank starts
# without importing torch again (~2 CPU seconds a rank spawned); each still builds its own process group.
PRELOAD = ["torch", "torch.distributed", "planc.runtime.reduce", "planc.runtime.reshard"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(target, world: int, payload, timeout: float = JOB_TIMEOUT_S) -> dict[int, str]:
    """Run target on `world` gloo ranks; returns {rank: result text}; raises on any failure."""
    ctx = _context()
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, target.__module__, target.__name__,
                                                   payload, outdir, dict(os.environ)), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        import time
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        texts = {}
        for r in range(world):
            fp = os.path.join(outdir, f"rank{r}.txt")
            texts[r] = open(fp).read() if os.path.exists(fp) else "missing\n"
    bad = {r: t for r, t in texts.items() if not t.startswith("ok")}
    if hung or bad:
        msg = f"gloo job of {world} ranks failed" + (f"; ranks {hung} timed out after {timeout:.0f}s" if hung else "")
        for r, t in sorted(bad.items()):
            msg += f"\n--- rank {r}:\n{t[-3000:]}"
        raise AssertionError(msg)
    return {r: t[3:] for r, t in texts.items()}
