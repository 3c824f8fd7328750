"""``train.py --comm-only`` (and a plan without ``train``): every transfer and reduction of the plan run
on known data and checked byte for byte (``comm_only``); moved out of main.py unchanged.

    comm_only(plan, groups, rank, steps)     collective: per step a barrier, the transfers, the reductions,
                                             a barrier; rank 0 prints the time between the barriers
    pattern(shape, region, dtype)            a transfer's known values over a region
    contribution(n, device)                  a device's input to a checked reduction
    plan_micro_batches(plan)                 the plan's micro-batches per step (1 without a pipeline)
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from planc.plan import Collective, Direction, Plan

from .engine import EngineError
from .reduce import ReductionExecutor
from .reshard import TransferExecutor

__all__ = ["comm_only", "pattern", "contribution", "plan_micro_batches"]


def pattern(shape, region, dtype) -> torch.Tensor:
    """A tensor's values over ``region``, a pure function of the global index (so any rank can predict them)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    values = torch.zeros([b - a for a, b in region], dtype=torch.int64)
    for d, (a, b) in enumerate(region):
        view = [1] * len(region)
        view[d] = b - a
        values = values + (torch.arange(a, b, dtype=torch.int64) * strides[d]).view(view)
    modulus = 2 if dtype == torch.bool else 127 if dtype in (torch.int8, torch.uint8) else 251
    return (values % modulus).to(dtype)


def contribution(n: int, device: int) -> torch.Tensor:
    """Device ``device``'s input to a checked reduction: small integers (0..63, so sums stay exact in
    f32 for groups of up to 2^18 members) that depend on the element's position through a hash, not
    a period, so a piece reduced into the wrong offset (or from the wrong member) gives another sum."""
    mask, out = 0xFFFFFFFF, torch.empty(n, dtype=torch.float32)
    for a in range(0, n, 1 << 20):       # in windows: the int64 temporaries stay small for any buffer
        b = min(n, a + (1 << 20))
        h = (torch.arange(a, b, dtype=torch.int64) * 0x9E3779B1 + (device + 1) * 0x85EBCA6B) & mask
        h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & mask
        out[a:b] = (h ^ (h >> 12)) & 63
    return out


def _transfer_peers(transfer, rank: int) -> list[int]:
    """The ranks this rank exchanges data with in ``transfer`` (either direction), from the plan's tasks."""
    peers = set()
    for task in transfer.forward.tasks:
        ends = {task.sender, *task.receivers, *(r for part in task.parts for r in part)}
        if rank in ends:
            peers |= ends
    peers.discard(rank)
    return sorted(peers)


@contextlib.contextmanager
def _naming(rank: int, step: int, what: str, peers):
    """A communication failure (a dead or hung peer, the collective timeout) reported naming this rank,
    the step, the transfer or reduction and the ranks it was exchanging with."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EngineError(f"rank {rank} failed in {what} at step {step}"
                          f"{f' with ranks {list(peers)}' if peers else ''}: {first}") from e


def comm_only(plan: Plan, groups: dict, rank: int, steps: int) -> None:
    """Run every transfer forward and every reduction once per step, and check every byte.

    Source ranks send a known pattern; each destination rank compares what it
    assembled with the pattern over its own region. Each reduction sums
    every member's :func:`contribution`, which depends on the element's position, so a piece reduced
    into the wrong place is found. Any difference stops the run with the
    transfer or reduction named; rank 0 prints the time per step: the
    communication alone, between two barriers (patterns are made before it,
    and checked after it).
    """
    tags = plan.tag_layout()
    transfers = [(t, TransferExecutor(t, Direction.FORWARD, rank, groups, tags, index=i,
                                      signal=plan.runtime.signal_transfers))
                 for i, t in enumerate(plan.transfers)]
    reductions = [(r, ReductionExecutor.for_plan(plan, r, groups, rank), r.group_of(rank))
                  for r in plan.reductions if r.group_of(rank) is not None]
    # patterns, expected regions and reduction inputs are made before the timed region, and checked after it
    sent = {i: pattern(t.shape, ex.my_src, ex.dtype) for i, (t, ex) in enumerate(transfers) if ex.is_sender}
    want = {i: pattern(t.shape, ex.my_dst, ex.dtype) for i, (t, ex) in enumerate(transfers) if ex.my_dst is not None}
    # who each operation waits for, named when it fails (worked out once, outside the timed region)
    others = [r for r in range(dist.get_world_size()) if r != rank]
    transfer_peers = [_transfer_peers(t, rank) for t, _ in transfers]
    sizes = [max(1, r.nbytes // 4) for r, _, _ in reductions]
    sums = []
    for (_, _, group), n in zip(reductions, sizes):   # summed in place: one buffer more per reduction
        total = torch.zeros(n, dtype=torch.float32)
        for d in group:
            total += contribution(n, d)
        sums.append(total)
    for step in range(steps):
        problems = []
        mb = step % plan_micro_batches(plan)
        inputs = [_reduction_input(r, ex, n, rank, total)
                  for (r, ex, _), n, total in zip(reductions, sizes, sums)]
        got, outs = {}, []
        with _naming(rank, step, "the barrier that starts the step", others):
            dist.barrier()
        t0 = time.perf_counter()
        for i, (t, ex) in enumerate(transfers):
            with _naming(rank, step, f"transfer {t.name!r}", transfer_peers[i]):
                works = ex.send(sent[i], micro_batch=mb) if ex.is_sender else []
                if ex.my_dst is not None:
                    got[i] = ex.recv(micro_batch=mb)
                for w in works or ():
                    w.wait()
        for (r, ex, group), x in zip(reductions, inputs):
            with _naming(rank, step, f"reduction {r.name!r}", [g for g in group if g != rank]):
                outs.append(ex.run(x))
        with _naming(rank, step, "the barrier that ends the step", others):
            dist.barrier()
        elapsed = time.perf_counter() - t0
        for i, g in got.items():
            if not torch.equal(g, want[i]):
                t, ex = transfers[i]
                problems.append(f"rank {rank}: transfer {t.name!r} delivered wrong data for region {ex.my_dst}")
        for (r, ex, group), out, total in zip(reductions, outs, sums):
            if r.target is Collective.REDUCE_SCATTER:   # only this rank's owned slices hold the sum
                keep = torch.zeros(total.numel(), dtype=torch.bool)
                for a, b in ex.owned_slices(total.numel()):
                    keep[a:b] = True
                out, total = out[keep], total[keep]
            if not torch.equal(out, total):
                wrong = (out != total).nonzero().flatten()
                problems.append(f"rank {rank}: reduction {r.name!r} over {list(group)} gave a wrong sum at "
                                f"{wrong.numel()} of {total.numel()} elements (first: {int(wrong[0])})")
        gathered = [None] * dist.get_world_size()
        with _naming(rank, step, "gathering every rank's check", others):
            dist.all_gather_object(gathered, problems)
        every = [p for ps in gathered for p in ps]
        if every:
            raise EngineError("communication check failed:\n  " + "\n  ".join(every))
        if rank == 0:
            print(f"step {step} comm {elapsed:.6f} s (verified {len(transfers)} transfer(s), "
                  f"{len(plan.reductions)} reduction(s))", flush=True)


def _reduction_input(r, ex, n: int, rank: int, total):
    """What rank ``rank`` puts into reduction ``r`` at each step: its :func:`contribution`; for an all-gather
    target (ZeRO-1's parameters) the reduced sum in the slices it owns and zeros elsewhere, as the
    reduce-scatter leaves it."""
    if r.target is not Collective.ALL_GATHER:
        return contribution(n, rank)
    x = torch.zeros(n, dtype=torch.float32)
    for a, b in ex.owned_slices(n):
        x[a:b] = total[a:b]
    return x


def plan_micro_batches(plan: Plan) -> int:
    return plan.pipeline.micro_batches if plan.pipeline is not None else 1
