"""Reduction-program executor (P² programs lowered to collectives on groups).

Executes plan.json ``reductions[i].program`` on a flat buffer, step by step, as typed records
(``planfile.Reduction``: every step's collective, its groups and the interval each group works on,
in units of ``1/unit`` of the buffer). The compiler computed those intervals from the collective
semantics of DESIGN.md (planc.reduction.regions) and its independent checker replayed them; the
executor derives each member's slice by the collective's rule (``Step.slices``) and re-derives
nothing: it holds no copy of the semantics.

Public API (stable; used by engine.py and main.py, and by the training regime for ZeRO-1):

    ReductionExecutor.for_plan(plan, reduction, groups, rank) -> ReductionExecutor
        the executor as plan.json says to run it (its runtime's bucket size, in-host path and slot size)
    ReductionExecutor(reduction, groups, rank, bucket_bytes=None, impl=None, backend=None, host_of=None,
                      shared_memory=True, slot_bytes=None)
        .run(flat: Tensor) -> Tensor
            executes the program on `flat` (in place when possible; the returned tensor is the
            result); what it leaves depends on the reduction's target (plan.json `target`):
              allreduce       every rank of a reduction group holds the full SUM over its group;
              reduce_scatter  (ZeRO-1's gradients) the SUM over the group in this rank's
                              owned_slices(n); the rest of the buffer is unspecified;
              all_gather      (ZeRO-1's parameters) reads this rank's owned_slices(n) (the rest is
                              ignored) and leaves every member the whole buffer.
            Ranks in no group of the program return `flat` unchanged.
        .owned_slices(n: int) -> list[(start, end)]
            the element ranges of a flat buffer of n elements this rank owns after the
            reduce_scatter program, which is where the all_gather program reads it: plan.json
            `owned` (units of 1/unit of each bucket) mapped through the bucket chunking and the
            padding below, clipped to n, empty ranges left out, in increasing order. The gradients'
            and the parameters' executors of a stage give the same slices (their plan.json entries
            share `unit` and `owned`, and the chunking does not depend on the dtype). A rank in no
            group, or an allreduce target, owns the whole buffer: [(0, n)] (n > 0).
        .target         the reduction's target (planc.plan.Collective)
        .granule        the program's unit: a bucket is padded to a multiple of it
    ReductionError(ValueError)

Buckets: the buffer is processed in buckets of `bucket_bytes` (plan.json
runtime.reduce_bucket_bytes, default 32 MiB); each bucket is zero-padded to a multiple of the
program's ``unit`` so every cut is whole. For the allreduce target a bucket holds
`bucket_bytes` of the buffer's own dtype; for reduce_scatter and all_gather targets it holds
`bucket_bytes` ÷ 4 elements whatever the dtype (fp32 gradients and bf16 parameters are cut alike,
so the owned slices agree). Collectives, per backend (`impl` overrides):
  allreduce       all_reduce SUM on the step's group
  reduce_scatter  gloo: all_reduce of the held region, then keep the piece
                  (measured faster than gloo's reduce_scatter, see docs/runtime.md);
                  nccl: reduce_scatter_tensor
  all_gather      all_gather_into_tensor (exact, no arithmetic on the data)
  reduce          reduce SUM to the first member
  broadcast       broadcast from the first member
On gloo, a step whose group lies on one host (``host_of``, the plan's placement, says so) runs
through the host's shared memory instead (shmcoll.py; plan.json runtime.in_host = backend turns it
off), and falls back to the above when the members share no /dev/shm. ``.shm_groups`` lists the
groups that use it, ``.shm_fallback`` the one-host groups that keep gloo and why.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import shmcoll
from .dist_util import all_gather_flat, lookup_group, reduce_scatter_flat
from planc.plan import DEFAULT_REDUCE_BUCKET_BYTES, Collective, InHost, Reduction

__all__ = ["ReductionExecutor", "ReductionError", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = DEFAULT_REDUCE_BUCKET_BYTES   # the contract's default (plan.json runtime)
TARGET_ELEMENT_BYTES = 4   # reduce_scatter / all_gather targets count a bucket in 4-byte elements


class ReductionError(ValueError):
    pass


class ReductionExecutor:
    def __init__(self, reduction: Reduction, groups: dict, rank: int, bucket_bytes: int | None = None,
                 impl: dict | None = None, backend: str | None = None, host_of=None, shared_memory: bool = True,
                 slot_bytes: int | None = None):
        self.name = reduction.name
        self.rank = int(rank)
        self.target = reduction.target
        self.owned = reduction.owned_by(self.rank) if self.target is not Collective.ALLREDUCE else None
        self.red_groups = list(reduction.groups)
        self.granule = reduction.unit
        self.backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        # every member of a one-host group sets up (and votes whether its members share memory), so they agree
        use_shm = self.backend == "gloo" and host_of is not None
        self.segments: dict = {}      # in-host group -> shmcoll.HostSegment, or None: it keeps gloo ...
        self.shm_fallback: dict = {}  # ... and why
        self.steps = []               # (collective, group, process group, held before, held after), in units
        for step in reduction.steps:
            j = next((j for j, g in enumerate(step.groups) if self.rank in g), None)
            grp = step.groups[j] if j is not None else None
            if grp is None or len(grp) == 1:
                self.steps.append((step.collective, None, None, None, None))
                continue
            pg = lookup_group(groups, grp)
            # set up in step order on every member, so the collective set-ups cannot cross
            if use_shm and grp not in self.segments and len({host_of(d) for d in grp}) == 1:
                self.segments[grp], why = shmcoll.HostSegment.open(pg, grp, self.rank, slot_bytes=slot_bytes,
                                                                    want=shared_memory)
                if why:
                    self.shm_fallback[grp] = why
            before, after = step.slices(j, grp.index(self.rank))
            self.steps.append((step.collective, grp, pg, before, after))
        self.active = any(g is not None for _, g, _, _, _ in self.steps)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES   # the engine passes plan.json's
        default = {"reduce_scatter": "allreduce_slice" if self.backend == "gloo" else "native"}
        self.impl = {**default, **(impl or {})}

    @classmethod
    def for_plan(cls, plan, reduction: Reduction, groups: dict, rank: int) -> "ReductionExecutor":
        """The executor of ``reduction`` as ``plan`` says to run it: its runtime's bucket size and in-host
        path, on its cluster's hosts (the engine and --comm-only both build it so)."""
        return cls(reduction, groups, rank, bucket_bytes=plan.runtime.reduce_bucket_bytes, host_of=plan.cluster.host_of,
                   shared_memory=plan.runtime.in_host is InHost.SHARED_MEMORY, slot_bytes=plan.runtime.shm_slot_bytes)

    @property
    def shm_groups(self) -> list:
        """The in-host groups whose steps go through shared memory."""
        return sorted(g for g, seg in self.segments.items() if seg is not None)

    def _per_bucket(self, element_size: int) -> int:
        """Elements per bucket, a multiple of the unit (target programs: counted as 4-byte elements)."""
        size = element_size if self.target is Collective.ALLREDUCE else TARGET_ELEMENT_BYTES
        return max(self.granule, (self.bucket_bytes // size) // self.granule * self.granule)

    def owned_slices(self, n: int) -> list[tuple[int, int]]:
        """The element ranges of a flat buffer of ``n`` elements this rank owns after the reduce-scatter
        program (where the all-gather reads it); see the module docstring."""
        n = int(n)
        if n < 0:
            raise ValueError(f"reduction {self.name!r}: a buffer of {n} elements")
        if self.owned is None:
            return [(0, n)] if n else []
        u0, u1 = self.owned
        per = self._per_bucket(TARGET_ELEMENT_BYTES)
        out = []
        for a in range(0, n, per):
            b = min(n, a + per)
            scale = -(-(b - a) // self.granule)        # elements per unit in this (padded) bucket
            lo, hi = min(b, a + u0 * scale), min(b, a + u1 * scale)
            if hi > lo:
                if out and out[-1][1] == lo:
                    out[-1] = (out[-1][0], hi)
                else:
                    out.append((lo, hi))
        return out

    def run(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return flat
        if flat.dim() != 1:
            raise ValueError(f"reduction {self.name!r}: expected a flat 1-d buffer, got shape {tuple(flat.shape)}")
        per = self._per_bucket(flat.element_size())
        n = flat.numel()
        for a in range(0, n, per):
            b = min(n, a + per)
            self._bucket(flat, a, b)
        return flat

    def _bucket(self, flat, a, b):
        n = b - a
        padded = -(-n // self.granule) * self.granule
        if padded == n:
            buf = flat[a:b]
        else:
            buf = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
            buf[:n] = flat[a:b]

        scale = padded // self.granule

        def rng(s):
            return s[0] * scale, s[1] * scale

        for coll, grp, pg, before, after in self.steps:
            if grp is None or len(grp) == 1:
                continue
            root = grp[0]
            seg = self.segments.get(grp)
            if seg is not None:
                self._shm_step(seg, coll, buf, rng(before) if before is not None else None,
                               rng(after) if after is not None else None)
                continue
            if coll is Collective.ALLREDUCE:
                x, y = rng(before)
                dist.all_reduce(buf[x:y], group=pg)
            elif coll is Collective.REDUCE_SCATTER:
                x, y = rng(before)
                if self.impl["reduce_scatter"] == "native":
                    p, q = rng(after)
                    out = torch.empty(q - p, dtype=buf.dtype, device=buf.device)
                    reduce_scatter_flat(out, buf[x:y], group=pg)
                    buf[p:q] = out
                else:
                    dist.all_reduce(buf[x:y], group=pg)
            elif coll is Collective.ALL_GATHER:
                p, q = rng(before)
                x, y = rng(after)
                all_gather_flat(buf[x:y], buf[p:q].clone(), group=pg)
            elif coll is Collective.REDUCE:
                x, y = rng(before)
                dist.reduce(buf[x:y], dst=root, group=pg)
            elif coll is Collective.BROADCAST:
                x, y = rng(after)
                dist.broadcast(buf[x:y], src=root, group=pg)
        if padded != n:
            flat[a:b] = buf[:n]

    @staticmethod
    def _shm_step(seg, coll, buf, before, after):
        if coll is Collective.ALLREDUCE:
            seg.allreduce(buf, *before)
        elif coll is Collective.REDUCE_SCATTER:
            seg.reduce_scatter(buf, *before, *after)
        elif coll is Collective.ALL_GATHER:
            seg.all_gather(buf, *after, *before)
        elif coll is Collective.REDUCE:
            seg.reduce(buf, *before)
        else:   # broadcast: the root's region, which every member holds afterwards
            seg.broadcast(buf, *after)
