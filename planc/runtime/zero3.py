"""ZeRO-3: a stage's parameters sharded over its data group, all-gathered per layer (LANGUAGE.md ``zero``;
docs/training.md "ZeRO-3").

The ZeRO-1/2 machinery is kept: the gradient buckets are ZeRO-2's (``grads_zero2``), laid out so that no
bucket straddles two of the stage's layers; ``regime.Regime`` keeps this rank's owned ranges of each bucket
as fp32 masters and makes the parameters views of one flat buffer per bucket (``Regime.pbufs``). Here
those buffers' storages are freed (``untyped_storage().resize_(0)``): between uses a rank holds only its
masters (and the parameters outside the buckets: tied across stages, or not trainable, whole). A layer's
*unit* is the buckets of its parameters. A gather of a bucket: the storage is allocated again, the owned
ranges written from the masters (cast to the parameters' dtype) and the plan's ``parameters`` all-gather
program run on the buffer, on that program's own communicators (``topology.gather_groups``). The
parameters are ``.data`` views of the buffer, whose version counter is not theirs: refilling it while
autograd holds the parameters saved for backward is not an in-place change of the parameters.

When (hooks on each layer of the stage):

- forward pre-hook: the layer gathered (waited for, if prefetched); with prefetch the next layer's
  gather queued; the layer's inputs that require grad pass through ``_AfterBackward``, whose backward
  runs once the gradients of all of them are computed: the layer's backward is done, it is freed;
- forward post-hook: the layer freed, unless ``keep_gathered`` or its backward has begun (a recompute
  inside that backward reruns the layer's forward: it stays for the backward); a hook on each output
  that requires grad;
- that output hook (its gradient is ready: the layer's backward starts): the layer gathered and
  pinned until its backward is done; with prefetch the previous layer's gather queued; at the first
  one of a backward an autograd callback that frees what is left at the backward's end;
- ``end_step`` (before the step's gradient reduction ends, so before the optimizer step): every gather
  waited for, every layer freed; with ``keep_gathered`` this is the only place layers are freed.

Prefetch: one gather thread per rank runs the queued gathers in queue order; without it the compute
thread runs them. Either way one thread at a time uses the communicators, and every rank of a data
group queues the same gathers in the same order (the hooks are deterministic). Gathers per layer and
micro-batch: two (forward, backward); with recompute three (forward, recompute, backward), but for
the layer whose backward starts the recompute (the stage recomputes as one region, from that
layer's first saved tensor; it is gathered already): 3L - 1 for L layers; keep_gathered: one per
layer and step. What is gathered at once stays a few layers: the one in backward, the one being
recomputed and (prefetch) the next.

Imports only torch and the standard library.
"""
from __future__ import annotations

import queue
import threading

import torch

__all__ = ["Zero3", "NoZero3", "layer_units", "zero3_for"]

FREE, PENDING, READY = 0, 1, 2


def _tensors(out):
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class _AfterBackward(torch.autograd.Function):
    """Identity on a layer's inputs; its backward (all their gradients computed) frees the layer."""

    @staticmethod
    def forward(ctx, z3, layer, *xs):
        ctx.z3, ctx.layer = z3, layer
        return xs

    @staticmethod
    def backward(ctx, *grads):
        ctx.z3._backward_done(ctx.layer)
        return (None, None, *grads)


def layer_units(layers, placed_lists) -> list[list[int]]:
    """Per layer, the sorted indices of the buckets (``placed_lists[b]``: bucket b's ``(param, offset)``s)
    holding its parameters."""
    where = {id(p): b for b, placed in enumerate(placed_lists) for p, _ in placed}
    out = []
    for layer in layers:
        params = layer.parameters() if isinstance(layer, torch.nn.Module) else ()
        out.append(sorted({where[id(p)] for p in params if id(p) in where}))
    return out


class NoZero3:
    """What the engine calls on a stage without zero = 3 (or without data-parallel peers): nothing."""

    def end_step(self) -> None:
        pass

    def report(self) -> dict:
        return {}


class Zero3:
    """The gathers and frees of one stage rank's zero-3 buffers.

    ``layers``: the stage's layers in order (modules; hooks are registered on them); ``pbufs``: the flat
    parameter buffer of each bucket (the parameters are views of it); ``units``: per layer, its buckets;
    ``fill(b)``: writes this rank's owned ranges of bucket ``b`` into ``pbufs[b]``; ``gather(buf)``: the
    all-gather program; ``names``: the layers' global indices (for counts and traces)."""

    def __init__(self, layers, pbufs, units, fill, gather, prefetch: bool = True, keep_gathered: bool = False,
                 tracer=None, names=None, rank=None):
        self.layers, self.pbufs, self.units = list(layers), list(pbufs), units
        self.fill, self.gather_fn = fill, gather
        self.prefetch, self.keep = bool(prefetch), bool(keep_gathered)
        self.tracer, self.rank = tracer, rank
        self.names = list(names) if names is not None else list(range(len(self.layers)))
        self.nbytes = [b.untyped_storage().nbytes() for b in self.pbufs]
        self.state = [READY] * len(self.pbufs)
        self.events: dict[int, threading.Event] = {}
        self.active: set[int] = set()        # layers gathered (or queued) and not freed yet
        self.gathers = [0] * len(self.layers)   # per layer: the times its parameters were gathered
        self.bucket_gathers = 0
        self.whole_bytes = 0                 # parameters outside the buffers (tied, not trainable): kept whole
        self.peak_bytes = 0                  # the most gathered parameter bytes at once
        self._lock = threading.Lock()
        self._held = sum(self.nbytes)        # gathered bytes now (the buffers start whole, freed below)
        self._in_bwd = False
        self.pinned: set[int] = set()        # layers whose backward has begun and not ended
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        if self.prefetch:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._run, name="planc-gather", daemon=True)
            self._thread.start()
        self.handles = []
        for i, layer in enumerate(self.layers):
            if not self.units[i]:
                continue
            self.handles.append(layer.register_forward_pre_hook(self._make_pre(i)))
            self.handles.append(layer.register_forward_hook(self._make_post(i)))
        for b in range(len(self.pbufs)):   # sharded from here on: only the masters hold the values
            self._free(b)

    # ---- hooks
    def _make_pre(self, i):
        def pre(module, args):
            self.use(i)
            if self.prefetch and i + 1 < len(self.layers):
                self.queue(i + 1)
            if not torch.is_grad_enabled():
                return None
            at = [k for k, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
            if not at:
                return None
            outs = _AfterBackward.apply(self, i, *[args[k] for k in at])
            args = list(args)
            for k, o in zip(at, outs):
                args[k] = o
            return tuple(args)
        return pre

    def _make_post(self, i):
        def post(module, args, out):
            if torch.is_grad_enabled():
                for t in _tensors(out):
                    if t.requires_grad:
                        t.register_hook(lambda g, i=i: self._before_backward(i))
            if not self.keep and i not in self.pinned:   # (a recompute: the layer in backward stays)
                self.release(i)
        return post

    def _before_backward(self, i) -> None:
        if not self._in_bwd:
            self._in_bwd = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.pinned.add(i)
        self.use(i)
        if self.prefetch and i > 0:
            self.queue(i - 1)

    def _backward_done(self, i) -> None:
        self.pinned.discard(i)
        if not self.keep:
            self.release(i)

    def _end_backward(self) -> None:
        self._in_bwd = False
        self.pinned.clear()
        if not self.keep:
            for i in sorted(self.active):
                self.release(i)

    # ---- gathers and frees
    def queue(self, i: int) -> None:
        """Start layer ``i``'s gather: queued to the gather thread (prefetch), or run now."""
        self.active.add(i)
        todo = [b for b in self.units[i] if self.state[b] == FREE]
        if not todo:
            return
        self.gathers[i] += 1
        for b in todo:
            if self._queue is None:
                self._gather(b, i)
                self.state[b] = READY
            else:
                self.state[b] = PENDING
                self.events[b] = threading.Event()
                self._queue.put((b, i, self.events[b]))

    def use(self, i: int) -> None:
        """Layer ``i`` gathered when this returns."""
        self.queue(i)
        for b in self.units[i]:
            self._wait(b)

    def release(self, i: int) -> None:
        """Free layer ``i``'s buckets that no other gathered layer needs."""
        self.active.discard(i)
        needed = {b for j in self.active for b in self.units[j]}
        for b in self.units[i]:
            if b not in needed:
                self._wait(b)
                self._free(b)

    def end_step(self) -> None:
        """Every queued gather done, every layer freed (before the optimizer step changes the masters)."""
        for b in range(len(self.pbufs)):
            self._wait(b)
        for i in sorted(self.active):
            self.release(i)
        self._in_bwd = False
        self.pinned.clear()

    def _wait(self, b: int) -> None:
        if self.state[b] == PENDING:
            self.events[b].wait()
            del self.events[b]
            if self._error is not None:
                e = self._error
                raise RuntimeError(f"rank {self.rank}: zero 3 parameter all-gather failed: {e}") from e
            self.state[b] = READY

    def _free(self, b: int) -> None:
        st = self.pbufs[b].untyped_storage()
        if st.nbytes():
            with self._lock:
                self._held -= st.nbytes()
            st.resize_(0)
        self.state[b] = FREE

    @torch.no_grad()
    def _gather(self, b: int, i: int) -> None:
        t0 = self.tracer.now() if self.tracer is not None else 0.0
        buf = self.pbufs[b]
        buf.untyped_storage().resize_(self.nbytes[b])
        with self._lock:
            self._held += self.nbytes[b]
            self.peak_bytes = max(self.peak_bytes, self._held)
            self.bucket_gathers += 1
        self.fill(b)
        self.gather_fn(buf)
        if self.tracer is not None:
            self.tracer.complete(f"gather layer {self.names[i]} bucket {b}", t0, self.tracer.now(), "gather",
                                 bytes=self.nbytes[b])

    def _run(self) -> None:
        while True:
            b, i, event = self._queue.get()
            try:
                if self._error is None:
                    self._gather(b, i)
            except BaseException as e:  # noqa: BLE001 - raised in the compute thread by _wait
                self._error = e
            finally:
                event.set()

    # ---- what --memory-stats reports
    def held_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.pbufs)

    def report(self) -> dict:
        return {"parameter_bytes": self.whole_bytes + self.peak_bytes,   # what this rank held at most
                "zero3_gathers": {str(n): self.gathers[k] for k, n in enumerate(self.names) if self.units[k]},
                "zero3_bucket_gathers": self.bucket_gathers,
                "zero3_peak_gathered_bytes": self.peak_bytes,
                "zero3_gathered_bytes_now": self.held_bytes(),
                "zero3_sharded_parameter_bytes": sum(self.nbytes)}


def zero3_for(engine):
    """The engine's ``Zero3`` (its stage has zero = 3 and data-parallel peers) or a ``NoZero3``."""
    regime, plan = engine.regime, engine.plan
    if plan.zero_of(engine.stage_id) != 3 or not regime.sharded:
        return NoZero3()
    regime.zero3 = True
    layers = list(engine.module.forward_funcs)
    placed = [placed for _, placed in regime.buckets.buckets]
    by_bucket: dict[int, list] = {}
    for f in regime.fragments:
        by_bucket.setdefault(f.bucket, []).append(f)

    def fill(b: int) -> None:
        buf = regime.pbufs[b]
        for f in by_bucket.get(b, ()):
            buf[f.offset + f.lo:f.offset + f.hi].copy_(f.master)

    gather = regime.gather.run if regime.gather is not None else (lambda buf: buf)
    start = engine.module._local_start
    units = layer_units(layers, placed)
    orphans = sorted(set(range(len(placed))) - {b for u in units for b in u})
    if orphans:   # never gathered by any layer's hooks: their parameters would read freed memory
        names = [n for n, p in engine.module.named_parameters() if any(p is q for q, _ in placed[orphans[0]])]
        raise ValueError(f"rank {engine.rank}: zero 3: parameters {names[:3]} are in none of the stage's layers "
                         f"(as modules), so no layer would gather them")
    z3 = Zero3(layers, regime.pbufs, units, fill, gather,
               prefetch=plan.train.zero3.prefetch, keep_gathered=plan.train.zero3.keep_gathered,
               tracer=engine.tracer, names=[start + k for k in range(len(layers))], rank=engine.rank)
    inside = {id(p) for pl in placed for p, _ in pl}
    z3.whole_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters() if id(p) not in inside)
    return z3
