"""Reduction-program executor (P² programs lowered to collectives on groups).

Executes plan.json `reductions[i].program.steps` on a flat buffer, following the
collective semantics of DESIGN.md. Before any traffic the whole program is
simulated for every device (intervals of [0, 1) as exact fractions plus
contributor sets), which re-checks the plan independently of how it was found
and tells every rank which region it holds at every step, including the region
a broadcast delivers to ranks that held nothing.

Public API (stable; used by engine.py):

    ReductionExecutor(reduction, groups, rank, bucket_bytes=None, impl=None, backend=None, host_of=None,
                      shared_memory=True)
        .run(flat: Tensor) -> Tensor
            every rank of a reduction group returns the full SUM over its group
            (in place in `flat` when possible; the returned tensor is the result);
            ranks in no group of the program return `flat` unchanged.
        .steps          list of (collective, group or None, held-before, held-after)
                        for this rank, intervals as Fractions
    simulate(steps, devices) -> dict[rank, list[state]]   pure semantics checker
    ReductionError(ValueError)

Buckets: the buffer is processed in buckets of `bucket_bytes` (plan.json
runtime.reduce_bucket_bytes, default 32 MiB); each bucket is zero-padded so every
reduce_scatter cut is whole. Collectives, per backend (`impl` overrides):
  allreduce       all_reduce SUM on the step's group
  reduce_scatter  gloo: all_reduce of the held region, then keep the piece
                  (measured faster than gloo's reduce_scatter, see docs/runtime.md);
                  nccl: reduce_scatter_tensor
  all_gather      all_gather_into_tensor (exact, no arithmetic on the data)
  reduce          reduce SUM to the first member
  broadcast       broadcast from the first member
On gloo, a step whose group lies on one host (``host_of``, the plan's placement, says so) runs
through the host's shared memory instead (shmcoll.py; plan.json runtime.in_host = backend turns it off), and
falls back to the above when the members share no /dev/shm. ``.shm_groups`` lists the groups that
use it, ``.shm_fallback`` the one-host groups that keep gloo and why.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch
import torch.distributed as dist

from . import shmcoll
from .dist_util import all_gather_flat, lookup_group, reduce_scatter_flat

__all__ = ["ReductionExecutor", "simulate", "ReductionError", "COLLECTIVES"]

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "reduce", "broadcast")
DEFAULT_BUCKET_BYTES = 32 << 20


class ReductionError(ValueError):
    pass


def simulate(steps, devices):
    """Apply the steps to the initial state; return per-device history.

    A state is None (holds nothing) or (a, b, contributors) with a, b Fractions.
    history[d][i] is d's state before step i; history[d][-1] the final state.
    Raises ReductionError naming the step and group whose precondition fails.
    """
    state = {d: (Fraction(0), Fraction(1), frozenset([d])) for d in devices}
    hist = {d: [state[d]] for d in devices}
    for si, step in enumerate(steps):
        coll = step["collective"]
        if coll not in COLLECTIVES:
            raise ReductionError(f"step {si}: unknown collective {coll!r}")
        seen = set()
        for g in step["groups"]:
            g = tuple(g)
            if list(g) != sorted(g) or len(set(g)) != len(g):
                raise ReductionError(f"step {si} {coll}: group {list(g)} is not sorted and distinct")
            if seen & set(g):
                raise ReductionError(f"step {si} {coll}: groups overlap on {sorted(seen & set(g))}")
            seen |= set(g)
            for d in g:
                if d not in state:
                    raise ReductionError(f"step {si} {coll}: device {d} is not part of the reduction")
            sts = [state[d] for d in g]
            where = f"step {si} {coll} on {list(g)}"
            if coll in ("allreduce", "reduce_scatter", "reduce"):
                if any(s is None for s in sts) or len({(s[0], s[1]) for s in sts}) != 1:
                    raise ReductionError(f"{where}: members must hold the same region, hold "
                                         f"{[_fmt(s) for s in sts]}")
                union = frozenset()
                for s in sts:
                    if union & s[2]:
                        raise ReductionError(f"{where}: contributor sets overlap")
                    union |= s[2]
                a, b = sts[0][0], sts[0][1]
                k = len(g)
                for r, d in enumerate(g):
                    if coll == "allreduce":
                        state[d] = (a, b, union)
                    elif coll == "reduce_scatter":
                        w = (b - a) / k
                        state[d] = (a + r * w, a + (r + 1) * w, union)
                    else:
                        state[d] = (a, b, union) if r == 0 else None
            elif coll == "all_gather":
                if any(s is None for s in sts):
                    raise ReductionError(f"{where}: a member holds nothing")
                w = sts[0][1] - sts[0][0]
                ok = all(s[1] - s[0] == w and s[2] == sts[0][2] for s in sts) and all(
                    sts[r + 1][0] == sts[r][1] for r in range(len(sts) - 1))
                if not ok:
                    raise ReductionError(f"{where}: members must hold equal consecutive pieces with "
                                         f"equal contributors, hold {[_fmt(s) for s in sts]}")
                for d in g:
                    state[d] = (sts[0][0], sts[-1][1], sts[0][2])
            else:  # broadcast
                if sts[0] is None or any(s is not None for s in sts[1:]):
                    raise ReductionError(f"{where}: the root must hold a region and the others nothing, "
                                         f"hold {[_fmt(s) for s in sts]}")
                for d in g:
                    state[d] = sts[0]
        for d in devices:
            hist[d].append(state[d])
    return hist


def _fmt(s):
    return "nothing" if s is None else f"[{s[0]}, {s[1]}) of {sorted(s[2])}"


class ReductionExecutor:
    def __init__(self, reduction: dict, groups: dict, rank: int, bucket_bytes: int | None = None,
                 impl: dict | None = None, backend: str | None = None, host_of=None, shared_memory: bool = True):
        self.name = reduction.get("name", "?")
        self.rank = int(rank)
        self.red_groups = [tuple(g) for g in reduction["groups"]]
        steps = reduction["program"]["steps"]
        devices = sorted({d for g in self.red_groups for d in g}
                         | {d for s in steps for g in s["groups"] for d in g})
        hist = simulate(steps, devices)
        for g in self.red_groups:
            for d in g:
                if hist[d][-1] != (0, 1, frozenset(g)):
                    raise ReductionError(
                        f"reduction {self.name!r}: program {reduction['program'].get('text', '')!r} leaves "
                        f"device {d} with {_fmt(hist[d][-1])}, not [0, 1) of {sorted(g)}")
        # denominators of every cut, so a padded bucket splits into whole elements
        den = 1
        for d in devices:
            for s in hist[d]:
                if s is not None:
                    den = math.lcm(den, s[0].denominator, s[1].denominator)
        self.granule = den
        self.steps = []
        mine = self.rank in devices
        self.backend = backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        # every member of a one-host group sets up (and votes whether its members share memory), so they agree
        use_shm = self.backend == "gloo" and host_of is not None
        self.segments: dict = {}      # in-host group -> shmcoll.HostSegment, or None: it keeps gloo ...
        self.shm_fallback: dict = {}  # ... and why
        for si, step in enumerate(steps):
            grp = next((tuple(g) for g in step["groups"] if self.rank in g), None) if mine else None
            if grp is not None and len(grp) > 1:
                pg = lookup_group(groups, grp)
                # set up in step order on every member, so the collective set-ups cannot cross
                if use_shm and grp not in self.segments and len({host_of(d) for d in grp}) == 1:
                    self.segments[grp], why = shmcoll.HostSegment.open(pg, grp, self.rank, want=shared_memory)
                    if why:
                        self.shm_fallback[grp] = why
            else:
                pg = None
            before = hist[self.rank][si] if mine else None
            after = hist[self.rank][si + 1] if mine else None
            self.steps.append((step["collective"], grp, pg, before, after))
        self.active = mine and any(g is not None for _, g, _, _, _ in self.steps)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES   # the engine passes plan.json's
        default = {"reduce_scatter": "allreduce_slice" if self.backend == "gloo" else "native"}
        self.impl = {**default, **(impl or {})}

    @property
    def shm_groups(self) -> list:
        """The in-host groups whose steps go through shared memory."""
        return sorted(g for g, seg in self.segments.items() if seg is not None)

    def run(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return flat
        if flat.dim() != 1:
            raise ValueError(f"reduction {self.name!r}: expected a flat 1-d buffer, got shape {tuple(flat.shape)}")
        per = max(self.granule, (self.bucket_bytes // flat.element_size()) // self.granule * self.granule)
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

        def rng(s):
            return int(s[0] * padded), int(s[1] * padded)

        for coll, grp, pg, before, after in self.steps:
            if grp is None or len(grp) == 1:
                continue
            root = grp[0]
            seg = self.segments.get(grp)
            if seg is not None:
                self._shm_step(seg, coll, buf, rng(before) if before is not None else None,
                               rng(after) if after is not None else None)
                continue
            if coll == "allreduce":
                x, y = rng(before)
                dist.all_reduce(buf[x:y], group=pg)
            elif coll == "reduce_scatter":
                x, y = rng(before)
                if self.impl["reduce_scatter"] == "native":
                    p, q = rng(after)
                    out = torch.empty(q - p, dtype=buf.dtype, device=buf.device)
                    reduce_scatter_flat(out, buf[x:y], group=pg)
                    buf[p:q] = out
                else:
                    dist.all_reduce(buf[x:y], group=pg)
            elif coll == "all_gather":
                p, q = rng(before)
                x, y = rng(after)
                all_gather_flat(buf[x:y], buf[p:q].clone(), group=pg)
            elif coll == "reduce":
                x, y = rng(before)
                dist.reduce(buf[x:y], dst=root, group=pg)
            elif coll == "broadcast":
                x, y = rng(after)
                dist.broadcast(buf[x:y], src=root, group=pg)
        if padded != n:
            flat[a:b] = buf[:n]

    @staticmethod
    def _shm_step(seg, coll, buf, before, after):
        if coll == "allreduce":
            seg.allreduce(buf, *before)
        elif coll == "reduce_scatter":
            seg.reduce_scatter(buf, *before, *after)
        elif coll == "all_gather":
            seg.all_gather(buf, *after, *before)
        elif coll == "reduce":
            seg.reduce(buf, *before)
        else:   # broadcast: the root's region, which every member holds afterwards
            seg.broadcast(buf, *after)
