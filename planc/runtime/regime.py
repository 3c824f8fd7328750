"""The optimizer step of one stage rank as plan.json ``train`` says (LANGUAGE.md, "Training settings").

``Regime`` owns what DeepSpeed's fp16/bf16 optimizers, ZeRO and clipping would otherwise do, none of
which DeepSpeed runs here (codegen's ds_config enables none of them):

- master weights: in fp32 plans without ZeRO the parameters are their own masters; otherwise the
  optimizer updates fp32 masters (zero = 1 or 2: only this rank's owned slices of each gradient bucket, one
  fragment per parameter piece, so weight decay and Adam's elementwise state are exact) and the
  parameters are copied from them (zero = 1 or 2: written into a flat parameter buffer with the bucket's
  layout, which the plan's ``parameters`` all-gather program fills);
- gradients are the fp32 buckets of ``grads.GradientBuckets`` (reduced, or reduce-scattered), or with
  zero = 2 the owned shards of ``grads_zero2.ShardedGradientBuckets`` (read through ``buckets.grad``);
- clip = X: every gradient multiplied by min(1, X / (N + 1e-6)), N the L2 norm of the whole model's
  gradient, each element counted by exactly one rank (``counted`` below) and the squares summed over
  ``train.norm_group``;
- fp16: the loss is multiplied by the loss scale S before backward, gradients by 1/S before the norm;
  a step whose summed squares are not finite (the same all-reduce is the vote: any rank's inf or nan
  reaches every member) is skipped everywhere and S backs off; ``window`` clean steps grow it;
- before optimizer step t (t = applied steps so far, continuing across a resume) lr = lr0 * factor(t).

Imports only torch, the standard library and the contract.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from planc.plan import Collective, Precision

from .tensor_parallel import shard_info

__all__ = ["Regime", "PARAM_DTYPES", "cast_stage", "param_dtype", "make_optimizer"]

PARAM_DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def param_dtype(precision) -> torch.dtype:
    return PARAM_DTYPES[Precision(str(precision))]


def cast_stage(layers, precision) -> dict | None:
    """Cast a stage's layers (parameters and floating buffers) to the plan's precision, in place; returns
    ``{id(param): its fp32 tensor from before}`` (the masters start from the weights as built, not from
    their rounding; the fp32 storage itself, not a copy: casting replaces the parameter's data), None for fp32."""
    dtype = param_dtype(precision)
    if dtype == torch.float32:
        return None
    initial = {id(p): p.detach() for layer in layers for p in layer.parameters()
               if p.requires_grad and p.dtype == torch.float32}
    for layer in layers:
        layer.to(dtype)
    return initial


def make_optimizer(optimizer, tensors):
    """torch's optimizer of plan.json ``train.optimizer`` with every argument it writes."""
    kwargs = optimizer.kwargs()
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    tensors = list(tensors) or [torch.zeros(0)]   # a stage (or shard) without parameters steps over nothing
    return OPTIMIZERS[optimizer.name](tensors, **kwargs)


class Fragment:
    """Elements [lo, hi) of ``param`` (flattened), at ``offset`` in gradient bucket ``bucket`` of ``source``
    (a ``GradientBuckets``: the stage's, or the tied parameters'); ``master`` is the fp32 tensor the
    optimizer updates for them (``param`` itself in fp32 plans without ZeRO)."""

    __slots__ = ("param", "bucket", "offset", "lo", "hi", "master", "whole", "source")

    def __init__(self, param, bucket, offset, lo, hi, master, whole, source=None):
        self.param, self.bucket, self.offset, self.lo, self.hi = param, bucket, offset, lo, hi
        self.master, self.whole, self.source = master, whole, source


class Regime:
    """One stage rank's optimizer step.

    ``buckets``: the stage's ``GradientBuckets``; ``initial``: ``cast_stage``'s fp32 copies (None in fp32);
    ``owned``: per bucket, the element ranges this rank owns (zero = 1 or 2 with a reduce-scatter program;
    None: every element); ``gather``: the ``parameters`` all-gather executor (zero = 1 or 2); ``norm_group``:
    the process group of ``train.norm_group`` (None: this rank alone); ``tensor_index``: the rank's
    position along its stage's ``tensor`` axis (parameters replicated over it count at 0 only);
    ``share``: (k, D), this rank's position in a data group of D members that all hold the summed
    gradient (zero = 0): it counts the k-th of D equal parts of each bucket. ``tied``: the rank's parameters
    tied across stages (``tied.TiedGradients``): whole fragments of their own buckets, never sharded (their
    fp32 master replicated on every holder), counted in the norm by their ``norm_device`` only.
    """

    def __init__(self, train, buckets, device, initial=None, owned=None, gather=None, norm_group=None,
                 tensor_index: int = 0, share=(0, 1), tied=None):
        self.train, self.buckets, self.device = train, buckets, device
        self.precision = Precision(str(train.precision))
        self.fp16 = self.precision is Precision.FP16
        self.sharded = owned is not None
        self.gather = gather
        self.zero3 = False   # zero = 3 (zero3.py sets it): the flat parameter buffers are freed between uses
        self.norm_group = norm_group
        self.lr0 = train.optimizer.lr
        self.t = 0                                   # optimizer steps applied (the schedule's step)
        scale = train.loss_scale
        self.scale = float(scale.initial) if self.fp16 and scale is not None else 1.0
        self.clean = 0                               # clean steps in a row since the last change of scale
        self.needs_norm = train.clip is not None or self.fp16
        self.fragments: list[Fragment] = []
        self.pbufs: list[torch.Tensor] = []
        initial = initial or {}
        for b, (buf, placed) in enumerate(buckets.buckets):
            ranges = owned[b] if owned is not None else [(0, buf.numel())]
            for p, off in placed:
                n = p.numel()
                source = initial.get(id(p))
                for x, y in ranges:
                    lo, hi = max(x, off) - off, min(y, off + n) - off
                    if lo >= hi:
                        continue
                    whole = (lo, hi) == (0, n) and not self.sharded
                    if whole and source is None and p.dtype == buf.dtype:
                        master = p     # fp32 (fp64), not sharded: the parameter is its own master
                    else:   # cast_stage's fp32 tensor is the master itself (nothing else holds it)
                        src = (source if source is not None else p.detach()).to(device, buf.dtype)
                        master = (src if source is not None else src.clone()) if whole else src.reshape(-1)[lo:hi].clone()
                    self.fragments.append(Fragment(p, b, off, lo, hi, master, whole, buckets))
            if self.sharded:   # the parameters become views of a flat buffer with the bucket's layout
                dtype = placed[0][0].dtype
                pbuf = torch.zeros(buf.numel(), dtype=dtype, device=device)
                for p, off in placed:
                    if p.dtype != dtype:
                        raise TypeError(f"bucket {b} holds parameters of {dtype} and {p.dtype}")
                    pbuf[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = pbuf[off:off + p.numel()].view_as(p)
                self.pbufs.append(pbuf)
        self.tied = self._tied_fragments(tied, initial, device)
        self.separate = [f for f in self.fragments + self.tied if f.master is not f.param]
        self.optimizer = make_optimizer(train.optimizer, [f.master for f in self.fragments + self.tied])
        self.counted = self._counted(tensor_index, share)
        counts = tied.counts_norm if tied is not None else {}
        for f in self.tied:   # a tied parameter once in the norm: whole, or the pieces this rank counts
            if id(f.param) in counts:
                flat = self._grad_view(f).reshape(-1)
                spans = counts[id(f.param)]
                self.counted += [flat] if spans is None else [flat[x:y] for x, y in spans]

    def _tied_fragments(self, tied, initial: dict, device) -> list[Fragment]:
        """One whole fragment per tied parameter; its master the parameter itself in fp32, else an fp32 copy."""
        if tied is None or tied.buckets is None:
            return []
        out = []
        for b, (buf, placed) in enumerate(tied.buckets.buckets):
            for p, off in placed:
                source = initial.get(id(p))
                master = p if source is None and p.dtype == buf.dtype else (
                    source.to(device, buf.dtype) if source is not None else p.detach().to(device, buf.dtype).clone())
                out.append(Fragment(p, b, off, 0, p.numel(), master, True, tied.buckets))
        return out

    # ---- the gradient norm's counting rule
    def _counted(self, tensor_index: int, share) -> list[torch.Tensor]:
        """Views of the bucket elements this rank counts in the global norm: each parameter once over the
        model (a tensor-replicated one at tensor position 0 only), each element of a data group's summed
        gradient once (zero = 1 or 2: the owned fragments; zero = 0: the k-th of D equal parts)."""
        views = []
        k, d = share
        for b, (buf, placed) in enumerate(self.buckets.buckets):
            flags = self.buckets.flags_at[b]
            part = -(-flags // d)
            lo_share, hi_share = min(flags, k * part), min(flags, (k + 1) * part)
            spans = []
            if self.sharded:
                spans = [(f.offset + f.lo, f.offset + f.hi, f.param) for f in self.fragments if f.bucket == b]
            else:
                for p, off in placed:
                    x, y = max(off, lo_share), min(off + p.numel(), hi_share)
                    if x < y:
                        spans.append((x, y, p))
            for x, y, p in spans:
                if tensor_index != 0 and shard_info(p) is None:
                    continue
                if views and views[-1][0] == b and views[-1][2] == x:   # merge neighbours
                    views[-1] = (b, views[-1][1], y)
                else:
                    views.append((b, x, y))
        return [self.buckets.grad(b, x, y) for b, x, y in views]

    # ---- the step
    @property
    def loss_scale(self) -> float:
        return self.scale

    def lr(self) -> float:
        return self.lr0 * self.train.lr_schedule.factor(self.t)

    def step(self) -> dict:
        """Norm, clip, overflow vote, learning rate, optimizer step, parameters from the masters.
        Returns what rank 0 prints: ``lr``, ``norm`` (a tensor, None when not computed), ``skipped``,
        ``scale`` (the loss scale this step used; 1 but in fp16) and ``next_scale``."""
        no_grad = self.buckets.no_gradient
        for f in self.separate:
            f.master.grad = None if id(f.param) in no_grad and f.source is self.buckets else self._grad_view(f)
        lr = self.lr()
        norm = None
        coef = None
        if self.needs_norm:
            if self.counted:
                sumsq = torch.stack([torch.linalg.vector_norm(v).float() for v in self.counted]).pow(2).sum()
            else:
                sumsq = torch.zeros((), dtype=torch.float32, device=self.device)
            if self.norm_group is not None:
                dist.all_reduce(sumsq, group=self.norm_group)
            norm = sumsq.sqrt() / self.scale
            if self.fp16 and not bool(torch.isfinite(sumsq)):
                used, scale = self.scale, self.train.loss_scale
                self.scale = max(scale.minimum, self.scale * scale.backoff)
                self.clean = 0
                return {"lr": lr, "norm": norm, "skipped": True, "scale": used, "next_scale": self.scale}
            if self.train.clip is not None:
                coef = torch.clamp(self.train.clip / (norm + 1e-6), max=1.0)
            if self.fp16:
                coef = coef / self.scale if coef is not None else torch.tensor(1.0 / self.scale, device=self.device)
        if coef is not None:
            by_dtype: dict = {}
            for f in self.fragments + self.tied:
                if f.master.grad is not None:
                    by_dtype.setdefault(f.master.grad.dtype, []).append(f.master.grad)
            for dtype, grads in by_dtype.items():
                torch._foreach_mul_(grads, coef.to(dtype))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.t += 1
        self._publish()
        used = self.scale
        if self.fp16:
            self.clean += 1
            if self.clean >= self.train.loss_scale.window:
                self.scale *= self.train.loss_scale.growth
                self.clean = 0
        return {"lr": lr, "norm": norm, "skipped": False, "scale": used, "next_scale": self.scale}

    def _grad_view(self, f: Fragment) -> torch.Tensor:
        view = f.source.grad(f.bucket, f.offset + f.lo, f.offset + f.hi)
        return view.view(f.master.shape)

    @torch.no_grad()
    def _publish(self) -> None:
        """The parameters from the updated masters: copied (cast) into them, or (zero = 1 or 2) written into the
        flat parameter buffers and all-gathered by the plan's ``parameters`` program; zero = 3: nothing but the
        tied parameters (the buffers are gathered from the masters at each use)."""
        if not self.sharded:
            for f in self.separate:
                f.param.copy_(f.master)
            return
        for f in self.tied:   # zero = 1 or 2: tied parameters stay whole, outside the flat parameter buffers
            if f.master is not f.param:
                f.param.copy_(f.master)
        if self.zero3:   # the masters are the parameters' only values: each use gathers from them (zero3.py)
            return
        for f in self.fragments:
            self.pbufs[f.bucket][f.offset + f.lo:f.offset + f.hi].copy_(f.master)
        if self.gather is not None:
            for pbuf in self.pbufs:
                self.gather.run(pbuf)

    @torch.no_grad()
    def whole_masters(self) -> dict:
        """``{id(param): fp32 master}``, whole: the masters this rank holds whole, or (zero = 1 or 2 in bf16/fp16,
        zero = 3 in every precision; collective over the data group) every parameter's, its fragments all-gathered by the plan's
        ``parameters`` program into an fp32 buffer of the bucket's layout. Empty where the parameters
        are their masters' exact values (fp32)."""
        tied = {id(f.param): f.master for f in self.tied if f.master is not f.param}
        if not self.sharded:
            return {id(f.param): f.master for f in self.fragments if f.whole} | tied
        if not self.zero3 and all(pbuf.dtype == buf.dtype for pbuf, (buf, _) in zip(self.pbufs, self.buckets.buckets)):
            return tied   # (zero = 3: the parameters are freed, every master is gathered here)
        out = dict(tied)
        for b, (buf, placed) in enumerate(self.buckets.buckets):
            flat = torch.zeros(buf.numel(), dtype=buf.dtype, device=self.device)
            for f in self.fragments:
                if f.bucket == b:
                    flat[f.offset + f.lo:f.offset + f.hi] = f.master
            if self.gather is not None:
                self.gather.run(flat)
            for p, off in placed:
                out[id(p)] = flat[off:off + p.numel()].view(p.shape)
        return out

    # ---- checkpoints
    def state_dict(self) -> dict:
        """The schedule's step, the loss scale and the fp32 masters that are not the parameters themselves
        (the optimizer's state is saved beside it, as ``engine.optimizer``'s)."""
        return {"t": self.t, "scale": self.scale, "clean": self.clean,
                "masters": [f.master.detach().cpu() for f in self.separate]}

    def load_state_dict(self, state: dict) -> None:
        masters = state["masters"]
        if len(masters) != len(self.separate) or any(
                tuple(m.shape) != tuple(f.master.shape) for m, f in zip(masters, self.separate)):
            raise ValueError(f"the checkpoint holds {len(masters)} master tensors, this rank has "
                             f"{len(self.separate)} (or their shapes differ)")
        with torch.no_grad():
            for m, f in zip(masters, self.separate):
                f.master.copy_(m)
        self.t, self.scale, self.clean = int(state["t"]), float(state["scale"]), int(state["clean"])


def zero_sharding(plan, stage: int, red, executor, buckets) -> list | None:
    """Per gradient bucket, the element ranges this rank owns under zero = 1 or 2 (its reduce-scatter
    executor's ``owned_slices``); None where nothing is sharded (zero = 0, or no data-parallel peers)."""
    zero = plan.zero_of(stage)
    if zero == 0 or red is None or executor is None:
        return None
    if red.target is not Collective.REDUCE_SCATTER:
        raise ValueError(f"zero = {zero} needs the plan's gradients reduction to be a reduce_scatter program, "
                         f"got target {red.target} ({red.text})")
    return [list(executor.owned_slices(buf.numel())) for buf, _ in buckets.buckets]

