"""Gradient buckets reduced while the last backward still runs, in place.

Gradients accumulate and are reduced in fp32 (fp64 for fp64 parameters) whatever the parameters'
dtype. An fp32 parameter's ``.grad`` is a view into one of a few flat bucket buffers (filled in
backward order: the last layer's parameters first; one dtype per bucket), so autograd accumulates
straight into the buffers and the reduction program runs on them with no concatenated copy and no
per-parameter clone. A bf16 or fp16 parameter's ``.grad`` is autograd's own (in its dtype) for one
micro-batch only: its post-accumulate hook adds it into the parameter's fp32 slot of the bucket and
drops it. During the
micro-batch that is the stage's last backward, a hook counts the parameters
whose gradient is final; when a bucket is complete its reduction starts at once
in a thread of its own, on communicators used by nothing else, while autograd
goes on with the earlier layers. ``finish()`` reduces what no hook released
(parameters that got no gradient) and waits for every bucket.

A parameter that got no gradient in the step, on any rank of its reduction
group, ends the step with ``.grad`` None, as in plain torch (whose optimizers
then leave it alone: no weight decay, no momentum, no Adam update). Each bucket
carries one flag per parameter after its gradients, 1 where this rank's
autograd produced that gradient; the flags are summed with the gradients by
the same collectives, so a zero after the reduction means no rank did.

Buckets are ``bucket_bytes`` (plan.json ``runtime.grad_bucket_bytes``, default 8 MiB),
each padded to a whole number of the program's cuts (``ReductionExecutor.granule``)
so every collective runs on the buffer itself. Without an executor (a stage with no data-parallel
peers, or DeepSpeed's own all-reduce) the buckets only accumulate.

With a reduce-scatter program (zero = 1) a member holds the summed flags only where it owns them, so
``finish(flags_group=...)`` sums every member's flags with one all-reduce over the stage's data group
instead of reading them from the buckets (see docs/runtime.md, "ZeRO-1"). ZeRO-2 keeps only the owned
shards and reduce-scatters every micro-batch's gradient: ``grads_zero2.ShardedGradientBuckets``.
"""
from __future__ import annotations

import queue
import threading

import torch

from planc.plan import DEFAULT_GRAD_BUCKET_BYTES

__all__ = ["GradientBuckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = DEFAULT_GRAD_BUCKET_BYTES   # the contract's default (plan.json runtime.grad_bucket_bytes)
GRAD_DTYPE = torch.float32     # gradients accumulate and reduce in fp32 (LANGUAGE.md, "Training settings")


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's gradient accumulates and is reduced in: fp32 for bf16/fp16 parameters,
    the parameter's own for fp32 and fp64 ones."""
    return GRAD_DTYPE if dtype.itemsize < GRAD_DTYPE.itemsize else dtype


class GradientBuckets:
    def __init__(self, params, executor, device, bucket_bytes: int | None = None, tracer=None, layer_of=None):
        self.tracer = tracer
        self.executor = executor
        self.device = device
        self.params = [p for p in params if p.requires_grad]
        limit = bucket_bytes or DEFAULT_BUCKET_BYTES   # the engine passes plan.json's runtime.grad_bucket_bytes
        granule = executor.granule if executor is not None else 1
        self.buckets: list[tuple[torch.Tensor, list[tuple[torch.nn.Parameter, int]]]] = []
        self.flags_at: list[int] = []     # per bucket: where its parameters' flags start in its buffer
        members: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):            # backward order
            if not p.dtype.is_floating_point:
                raise TypeError(f"a trainable parameter of dtype {p.dtype}: gradients are floating point")
            # a bucket is one flat buffer of one dtype: a parameter of another dtype starts the next bucket;
            # ``layer_of`` (zero = 3: {id(param): layer}) starts one at every layer boundary too
            if members and ((size + p.numel()) * grad_dtype(p.dtype).itemsize > limit or p.dtype != members[0].dtype
                            or (layer_of is not None and layer_of.get(id(p)) != layer_of.get(id(members[0])))):
                self._add(members, granule, device)
                members, size = [], 0
            members.append(p)
            size += p.numel()
        if members:
            self._add(members, granule, device)
        self.slot = {id(p): (b, off) for b, (_, ps) in enumerate(self.buckets) for p, off in ps}
        self._used: set[int] = set()     # ids of the parameters autograd produced a gradient for this step
        self.no_gradient: set[int] = set()   # after finish(): ids of the parameters no rank of the group had one for
        self._left: list[int] = []
        self._released: list[bool] = [False] * len(self.buckets)
        self._armed = False
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        if executor is not None:
            self._thread = threading.Thread(target=self._run, name="planc-reduce", daemon=True)
            self._thread.start()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _add(self, members, granule, device):
        n = sum(p.numel() for p in members)
        padded = -(-(n + len(members)) // granule) * granule    # the gradients, then one flag per parameter
        buf = torch.zeros(padded, dtype=grad_dtype(members[0].dtype), device=device)
        placed, off = [], 0
        for p in members:
            placed.append((p, off))
            off += p.numel()
        self.buckets.append((buf, placed))
        self.flags_at.append(n)

    def attach(self) -> None:
        """Zero the buffers and make every ``.grad`` a view into its bucket (at each step's start:
        the optimizer's ``zero_grad`` sets gradients to None)."""
        self._used.clear()
        self.no_gradient = set()
        for buf, placed in self.buckets:
            buf.zero_()
            for p, off in placed:
                p.grad = buf[off:off + p.numel()].view_as(p) if p.dtype == buf.dtype else None

    def grad(self, b: int, x: int, y: int) -> torch.Tensor:
        """Elements [x, y) of bucket ``b``'s gradient buffer (ZeRO-2's buckets keep owned ranges only)."""
        return self.buckets[b][0][x:y]

    def held_bytes(self) -> int:
        """The bytes of gradient buffers this rank keeps across the step."""
        return sum(buf.numel() * buf.element_size() for buf, _ in self.buckets)

    def view(self, p) -> torch.Tensor:
        """``p``'s fp32 gradient slot in its bucket, shaped like ``p``."""
        b, off = self.slot[id(p)]
        return self.buckets[b][0][off:off + p.numel()].view(p.shape)

    def arm(self, last: bool = True) -> None:
        """A backward begins; ``last``: it is this stage's last one of the step: release buckets as they
        fill (ZeRO-2's buckets, grads_zero2.py, reduce every micro-batch's)."""
        if not last:
            return
        self._left = [len(placed) for _, placed in self.buckets]
        self._released = [False] * len(self.buckets)
        self._armed = True

    def _hook(self, p) -> None:
        self._used.add(id(p))
        b, off = self.slot[id(p)]
        if p.dtype == self.buckets[b][0].dtype:
            self._keep_view(p, b, off)
        else:     # this micro-batch's bf16/fp16 gradient, added into the fp32 slot and dropped
            self.buckets[b][0][off:off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
        if not self._armed:
            return
        self._left[b] -= 1
        if self._left[b] == 0:
            self._release(b)

    def _keep_view(self, p, b: int, off: int) -> None:
        """Autograd accumulates into the view in place; should it ever have replaced ``.grad``,
        put the gradient back into the bucket before the bucket is reduced."""
        view = self.buckets[b][0][off:off + p.numel()]
        if p.dtype != view.dtype:
            return
        if p.grad is None:
            p.grad = view.view_as(p)
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)

    def _release(self, b: int) -> None:
        if not self._released[b]:
            self._released[b] = True
            buf, placed = self.buckets[b]
            at = self.flags_at[b]
            used = [float(id(p) in self._used) for p, _ in placed]
            if all(used):    # the usual case: a fill, no host-to-device copy (none on a CUDA stream either)
                buf[at:at + len(placed)].fill_(1.0)
            else:
                buf[at:at + len(placed)].copy_(torch.tensor(used, dtype=buf.dtype))
            if self.executor is not None:
                self._queue.put(b)

    def _run(self) -> None:
        while True:
            b = self._queue.get()
            try:
                if b is None:
                    return
                if self._error is None:
                    t0 = self.tracer.now() if self.tracer is not None else 0.0
                    self.executor.run(self.buckets[b][0])
                    if self.tracer is not None:
                        self.tracer.complete(f"reduce bucket {b}", t0, self.tracer.now(), "reduce",
                                             bytes=self.buckets[b][0].numel() * self.buckets[b][0].element_size())
            except BaseException as e:  # noqa: BLE001 - raised in the compute thread by finish()
                self._error = e
            finally:
                self._queue.task_done()

    def finish(self, flags_group=None) -> None:
        """Reduce every bucket not released yet, in bucket order, and wait for all of them; then work out
        ``no_gradient``: from the reduced flags, or (``flags_group``: a reduce-scatter program, whose
        members hold the flags they own only) from every member's flags summed over that group."""
        if not self._armed:
            self.arm()
        for b, (_, placed) in enumerate(self.buckets):
            if not self._released[b]:
                for p, off in placed:      # parameters no hook saw (no gradient this step)
                    self._keep_view(p, b, off)
            self._release(b)
        self._armed = False
        self._queue.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"gradient reduction failed: {e}") from e
        if flags_group is not None:
            self._vote_unused(flags_group)
        else:
            self._read_unused()
        for p in self.params:
            if id(p) in self.no_gradient:
                p.grad = None

    def _read_unused(self) -> None:
        """The parameters no rank of the group produced a gradient for, from the summed flags (an
        executor's all-reduce summed them; without one they are this rank's own). A bucket whose
        parameters all got a gradient here is not read (no device-to-host copy in the usual step): its
        summed flags are at least this rank's ones."""
        for b, (buf, placed) in enumerate(self.buckets):
            if all(id(p) in self._used for p, _ in placed):
                continue
            at = self.flags_at[b]
            for (p, _), flag in zip(placed, buf[at:at + len(placed)].tolist()):
                if flag == 0:
                    self.no_gradient.add(id(p))

    def _vote_unused(self, group) -> None:
        """Every member's flags summed with one all-reduce over ``group`` (the stage's data group)."""
        import torch.distributed as dist
        flags = torch.tensor([float(id(p) in self._used) for p in self.params], dtype=GRAD_DTYPE,
                             device=self.device)
        dist.all_reduce(flags, group=group)
        if bool((flags == 0).any()):
            self.no_gradient = {id(p) for p, f in zip(self.params, flags.tolist()) if f == 0}


class GroupAllReduce:
    """``using allreduce`` for bf16/fp16 plans: the fp32 buckets summed by one all-reduce over the stage's
    data group (DeepSpeed's own all-reduce reads ``.grad``, which bf16 parameters do not keep)."""

    granule = 1

    def __init__(self, group):
        self.group = group

    def run(self, flat: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        dist.all_reduce(flat, group=self.group)
        return flat
