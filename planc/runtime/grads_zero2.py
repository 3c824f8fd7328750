"""ZeRO-2's gradients: every micro-batch's gradient reduce-scattered, only the owned shard accumulated.

``ShardedGradientBuckets`` has ``grads.GradientBuckets``'s bucket layout (backward order, one dtype a
bucket, padded to the program's granule, a flag slot per parameter) but keeps no whole bucket across
micro-batches. What it keeps is one fp32 accumulator per bucket holding only the element ranges this rank
owns after the plan's reduce-scatter program (``executor.owned_slices``: the same ranges ZeRO-1's masters
and the ``parameters`` all-gather use, so the optimizer side is ZeRO-1's unchanged).

Per micro-batch (``arm`` starts it; the engine calls it before every backward):

- a parameter's post-accumulate hook adds its gradient (autograd's own tensor, any dtype) into a
  *staging* buffer of its bucket, allocated at the bucket's first gradient of the micro-batch, and drops
  ``.grad``;
- when every parameter of a bucket, and of every bucket before it, has had its gradient the bucket is
  released (bucket order only, so the members' collectives match whatever gradients each lacks): the
  reduce thread runs the reduce-scatter program on the staging buffer, adds the owned ranges into the
  accumulator and drops the staging buffer. At most ``WINDOW`` released buckets wait or run at once (a release past it waits
  for the oldest), so a rank holds ``WINDOW`` + the buckets being filled whole (one in backward order, two
  where a layer's parameters straddle a bucket boundary): the memory model counts ``WINDOW + 2`` buckets
  of staging (docs/memory.md). A parameter whose gradient comes out of backward order (used by several
  layers) keeps its bucket filling until it comes: more staging than the model counts;
- at the end of the backward (an autograd callback queued by the micro-batch's first hook) every bucket
  not released yet is released, in bucket order, an untouched one as zeros: every member of the data
  group runs the same reduce-scatters in each micro-batch. A micro-batch whose backward produced no
  gradient on this rank is flushed by the next ``arm`` or by ``finish``.

Nothing is ever all-reduced. Which parameters got no gradient in the step is voted with one all-reduce of
flags over the data group in ``finish`` (as ZeRO-1 does). ``grad(b, x, y)`` is the summed gradient of
bucket ``b``'s elements [x, y), which must be owned: what ``regime.Regime`` reads for its fragments and the
global norm.
"""
from __future__ import annotations

import threading

import torch

from .grads import GradientBuckets, grad_dtype

__all__ = ["ShardedGradientBuckets", "WINDOW", "make_buckets"]

WINDOW = 2     # released buckets waiting for, or in, their reduce-scatter at once


class ShardedGradientBuckets(GradientBuckets):
    def __init__(self, params, executor, device, bucket_bytes: int | None = None, tracer=None, layer_of=None):
        if executor is None:
            raise ValueError("zero = 2 needs the stage's gradients reduce-scatter program (a data group of 2 or more)")
        self._window = threading.Semaphore(WINDOW)
        self._staging: list[torch.Tensor | None] = []
        self._lock = threading.Lock()
        self.staged_bytes = 0        # staging buffers alive now (filling, queued or being reduced)
        self.peak_staged_bytes = 0   # their most at once since the buckets were built
        super().__init__(params, executor, device, bucket_bytes, tracer, layer_of)
        self.ranges: list[list[tuple[int, int, int]]] = []   # per bucket: (x, y, offset in its accumulator)
        self.accumulators: list[torch.Tensor] = []
        for buf, _ in self.buckets:
            merged: list[list[int]] = []
            for x, y in executor.owned_slices(buf.numel()):
                if merged and merged[-1][1] == x:
                    merged[-1][1] = y
                else:
                    merged.append([x, y])
            at, ranges = 0, []
            for x, y in merged:
                ranges.append((x, y, at))
                at += y - x
            self.ranges.append(ranges)
            self.accumulators.append(torch.zeros(at, dtype=buf.dtype, device=device))
        self._staging = [None] * len(self.buckets)
        self._open = False        # a micro-batch armed and not flushed yet
        self._callback = False    # its end-of-backward flush queued

    def _add(self, members, granule, device):
        """The bucket's layout only: a meta tensor stands for the whole buffer no one keeps."""
        n = sum(p.numel() for p in members)
        padded = -(-(n + len(members)) // granule) * granule
        placed, off = [], 0
        for p in members:
            placed.append((p, off))
            off += p.numel()
        self.buckets.append((torch.empty(padded, dtype=grad_dtype(members[0].dtype), device="meta"), placed))
        self.flags_at.append(n)

    # ---- what the regime reads
    def grad(self, b: int, x: int, y: int) -> torch.Tensor:
        for lo, hi, at in self.ranges[b]:
            if lo <= x and y <= hi:
                return self.accumulators[b][at + x - lo:at + y - lo]
        raise ValueError(f"elements [{x}, {y}) of gradient bucket {b} are not owned by this rank "
                         f"(it owns {[(lo, hi) for lo, hi, _ in self.ranges[b]]})")

    def held_bytes(self) -> int:
        """The accumulators (kept across the step) plus the most staging bytes alive at once so far."""
        return sum(a.numel() * a.element_size() for a in self.accumulators) + self.peak_staged_bytes

    def view(self, p) -> torch.Tensor:
        raise ValueError("zero = 2 keeps no whole gradient of a parameter (grad(bucket, x, y): an owned range)")

    # ---- a step
    def attach(self) -> None:
        self._used.clear()
        self.no_gradient = set()
        for a in self.accumulators:
            a.zero_()
        for p in self.params:
            p.grad = None
        self._open = False

    def arm(self, last: bool = True) -> None:
        """A micro-batch's backward begins (every one of them, ``last`` or not)."""
        if self._open:
            self._flush()
        self._left = [len(placed) for _, placed in self.buckets]
        self._released = [False] * len(self.buckets)
        self._next = 0            # buckets are released in bucket order only: [0, _next) are
        self._open, self._callback, self._armed = True, False, True

    def _hook(self, p) -> None:
        if not self._open:
            self.arm()
        if not self._callback:
            self._callback = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        self._used.add(id(p))
        b, off = self.slot[id(p)]
        if p.grad is not None:
            self._stage(b)[off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        self._left[b] -= 1
        # complete buckets go in bucket order, never past one still filling: every member of the group
        # issues the same reduce-scatters in the same order even where one lacks a gradient another has
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._release(self._next)
            self._next += 1

    def _stage(self, b: int) -> torch.Tensor:
        if self._staging[b] is None:
            buf = self.buckets[b][0]
            self._staging[b] = torch.zeros(buf.numel(), dtype=buf.dtype, device=self.device)
            self._count(buf.numel() * buf.element_size())
        return self._staging[b]

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.staged_bytes += nbytes
            self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def _release(self, b: int) -> None:
        if self._released[b]:
            return
        self._released[b] = True
        self._window.acquire()    # released by the reduce thread once this bucket is in its accumulator
        staged = self._stage(b)   # (an untouched bucket's zeros are allocated only now)
        self._staging[b] = None
        self._queue.put((b, staged))

    def _flush(self) -> None:
        """The end of a micro-batch's backward: every bucket not released yet, in bucket order."""
        if not self._open:
            return
        for b in range(self._next, len(self.buckets)):
            self._release(b)
        self._next = len(self.buckets)
        self._open = False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                b, staged = item
                if self._error is None:
                    t0 = self.tracer.now() if self.tracer is not None else 0.0
                    self.executor.run(staged)
                    acc = self.accumulators[b]
                    for x, y, at in self.ranges[b]:
                        acc[at:at + y - x].add_(staged[x:y])
                    if self.tracer is not None:
                        self.tracer.complete(f"reduce-scatter bucket {b}", t0, self.tracer.now(), "reduce",
                                             bytes=staged.numel() * staged.element_size())
            except BaseException as e:  # noqa: BLE001 - raised in the compute thread by finish()
                self._error = e
            finally:
                if item is not None:
                    self._count(-item[1].numel() * item[1].element_size())
                    item = staged = None    # the staging buffer freed before the next one is taken
                    self._window.release()
                self._queue.task_done()

    def finish(self, flags_group=None) -> None:
        """Flush what no backward end did, wait for every reduce-scatter, vote the parameters no member
        of ``flags_group`` (the stage's data group) got a gradient for."""
        self._flush()
        self._armed = False
        self._queue.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"gradient reduce-scatter failed: {e}") from e
        if flags_group is None:
            raise ValueError("zero = 2: finish needs the stage's data group to vote unused gradients")
        self._vote_unused(flags_group)


def make_buckets(plan, stage: int, params, executor, device, tracer=None, layers=()) -> GradientBuckets:
    """The stage's gradient buckets: ZeRO-2's sharded ones where its degree is 2 or 3 and it has data-parallel
    peers (a reduce-scatter executor), else whole ones (zero 0 and 1). Zero 3: no bucket straddles two of
    ``layers`` (the stage's), so a layer's all-gather unit is its own buckets (zero3.py); a parameter used
    by several layers belongs to its first."""
    cls = ShardedGradientBuckets if plan.zero_of(stage) >= 2 and executor is not None else GradientBuckets
    layer_of = None
    if plan.zero_of(stage) == 3:
        layer_of = {}
        for i, layer in enumerate(layers):
            for p in (layer.parameters() if isinstance(layer, torch.nn.Module) else ()):
                layer_of.setdefault(id(p), i)
    return cls(params, executor, device, bucket_bytes=plan.runtime.grad_bucket_bytes, tracer=tracer,
               layer_of=layer_of)
