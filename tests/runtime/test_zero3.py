"""ZeRO-3's per-layer gathers (planc/runtime/zero3.py) in one process: a small chain whose parameters are views
of one flat buffer per layer, as ``Regime`` makes them, sharded by ``Zero3`` (the buffers freed). A fake
all-gather (this rank's "owned" first half written by ``fill``, the other half from a copy, as the plan's
program would bring it) stands for the collective. Checked: gradients equal the plain model's; between
layers the storage really is freed (``untyped_storage().nbytes() == 0``); the gathers per layer are what
docs/training.md "ZeRO-3" says (two per micro-batch: forward and backward, or forward and recompute; one
per step with keep_gathered), with and without the gather thread (prefetch).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from planc.runtime.grads import GradientBuckets
from planc.runtime.zero3 import Zero3, layer_units

WIDTH, LAYERS = 6, 6


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return torch.tanh(self.norm(self.lin(x))) + x


def chain():
    torch.manual_seed(0)
    return [Block(WIDTH) for _ in range(LAYERS)]


def shard(layers, prefetch, keep, log=None):
    """``Zero3`` over one flat buffer per layer (the parameters made views of it, as ``Regime`` does)."""
    pbufs, placed_lists, masters = [], [], []
    for layer in layers:
        params = list(layer.parameters())
        buf = torch.zeros(sum(p.numel() for p in params))
        placed, off = [], 0
        for p in params:
            buf[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = buf[off:off + p.numel()].view_as(p)
            placed.append((p, off))
            off += p.numel()
        pbufs.append(buf)
        placed_lists.append(placed)
        masters.append(buf.clone())
    half = [m.numel() // 2 for m in masters]
    where = {id(b): k for k, b in enumerate(pbufs)}

    def fill(b):   # this rank's owned range, from its "masters"
        pbufs[b][:half[b]].copy_(masters[b][:half[b]])

    def gather(buf):   # the rest, as the all-gather would bring it; the storage must be allocated
        k = where[id(buf)]
        assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size()
        buf[half[k]:].copy_(masters[k][half[k]:])
        if log is not None:
            log.append(k)

    units = layer_units(layers, placed_lists)
    assert units == [[k] for k in range(len(layers))]
    return Zero3(layers, pbufs, units, fill, gather, prefetch=prefetch, keep_gathered=keep), pbufs


def run(layers, xs, recompute=False):
    loss = 0.0
    for x in xs:
        def f(x):
            for layer in layers:
                x = layer(x)
            return x
        out = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False) if recompute else f(x)
        y = (out ** 2).mean()
        y.backward()
        loss += float(y.detach())
    return loss


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_gradients_equal_the_plain_model_and_gathers_are_counted(prefetch, keep, recompute):
    plain = chain()
    layers = copy.deepcopy(plain)
    z3, pbufs = shard(layers, prefetch, keep)
    assert z3.held_bytes() == 0                 # sharded from the start
    torch.manual_seed(1)
    xs = [torch.randn(3, WIDTH, requires_grad=True) for _ in range(3)]
    xs2 = [x.detach().clone().requires_grad_(True) for x in xs]
    ref = run(plain, xs)
    got = run(layers, xs2, recompute)
    if not keep:
        assert z3.held_bytes() == 0             # every layer freed after each backward
    z3.end_step()
    assert z3.held_bytes() == 0
    assert got == pytest.approx(ref, rel=1e-6)
    for a, b in zip(plain, layers):
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)
    for x, x2 in zip(xs, xs2):
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-7)
    # docs/training.md "ZeRO-3": two per micro-batch (forward, backward); with recompute three (forward,
    # recompute, backward) but for the last layer, whose backward starts the recompute; keep_gathered one a step
    m = len(xs)
    want = [1] * LAYERS if keep else [3 * m] * (LAYERS - 1) + [2 * m] if recompute else [2 * m] * LAYERS
    assert z3.gathers == want, z3.gathers
    if recompute and not keep:   # a few layers at once, never the whole chain
        assert z3.peak_bytes <= (4 if prefetch else 2) * max(b.numel() * b.element_size() for b in pbufs)


@pytest.mark.parametrize("prefetch", [False, True])
def test_storage_between_layers_is_freed(prefetch):
    """During layer k's forward only layer k (and, prefetching, layer k + 1) hold storage; during its
    backward only k, k + 1 until its backward is done (and, prefetching, k - 1); the rest is freed."""
    layers = chain()
    z3, pbufs = shard(layers, prefetch, keep=False)
    seen_fwd, seen_bwd = {}, {}

    def held():
        return {k for k, b in enumerate(pbufs) if b.untyped_storage().nbytes() > 0}

    for k, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, k=k: seen_fwd.update({k: held()}))   # after zero3's
    x = torch.randn(3, WIDTH, requires_grad=True)
    h = x
    for k, layer in enumerate(layers):
        h = layer(h)
        h.register_hook(lambda g, k=k: seen_bwd.update({k: held()}))   # after zero3's own hook: gathered
        # layer k freed after its forward; the prefetched k + 1 allocated once the gather thread got to it
        assert held() <= ({k + 1} if prefetch and k + 1 < LAYERS else set())
    (h ** 2).mean().backward()
    assert held() == set()
    for k in range(LAYERS):
        assert k in seen_fwd[k] and seen_fwd[k] <= {k} | ({k + 1} if prefetch and k + 1 < LAYERS else set()), seen_fwd
        allowed = {k, k + 1} | ({k - 1} if prefetch and k else set())   # k + 1 until its input's gradient is out
        assert k in seen_bwd[k] and seen_bwd[k] <= allowed, (k, seen_bwd)
    assert 0 < z3.peak_bytes <= 3 * max(b.numel() * 4 for b in pbufs)
    assert z3.peak_bytes < sum(b.numel() * 4 for b in pbufs)   # never the stage whole


def test_the_gather_order_is_the_same_every_micro_batch():
    """Every rank of a data group must queue the same gathers in the same order: the hooks are deterministic."""
    log = []
    layers = chain()
    z3, _ = shard(layers, prefetch=True, keep=False, log=log)
    run(layers, [torch.randn(3, WIDTH, requires_grad=True) for _ in range(2)])
    z3.end_step()
    one = list(range(LAYERS)) + list(reversed(range(LAYERS)))
    assert log == one * 2, log


def test_a_failed_gather_is_raised_in_the_compute_thread():
    layers = chain()
    z3, _ = shard(layers, prefetch=True, keep=False)

    def broken(buf):
        raise RuntimeError("peer gone")
    z3.gather_fn = broken
    with pytest.raises(RuntimeError, match="zero 3 parameter all-gather failed: peer gone"):
        layers[0](torch.randn(2, WIDTH))


def test_zero3_buckets_never_straddle_two_layers():
    layers = chain()
    params = [p for layer in layers for p in layer.parameters()]
    layer_of = {id(p): k for k, layer in enumerate(layers) for p in layer.parameters()}
    whole = GradientBuckets(params, None, "cpu", bucket_bytes=1 << 20)
    assert len(whole.buckets) == 1
    aligned = GradientBuckets(params, None, "cpu", bucket_bytes=1 << 20, layer_of=layer_of)
    assert [sorted({layer_of[id(p)] for p, _ in placed}) for _, placed in aligned.buckets] == [[k] for k in reversed(range(LAYERS))]
    small = GradientBuckets(params, None, "cpu", bucket_bytes=4 * WIDTH * WIDTH, layer_of=layer_of)
    assert all(len({layer_of[id(p)] for p, _ in placed}) == 1 for _, placed in small.buckets)
    assert len(small.buckets) > LAYERS
