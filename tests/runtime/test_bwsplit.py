"""The backward split (planc/runtime/bwsplit.py) against the fused backward, in float64, one process.

The reference is what engine.py runs today: one ``torch.autograd.backward`` per micro-batch from the
stage's outputs (or loss), accumulating into every ``.grad``. B's input gradients and, after the W
passes, every parameter's accumulated gradient must equal it (rtol 1e-10), whatever order the passes
interleave in; hooks, gradient buckets, recompute, skips, tied parameters, Hugging Face layers, what is
held between B and W and the two misuse errors are pinned here.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

from planc.runtime import grads, grads_zero2
from planc.runtime.bwsplit import BackwardSplit
from planc.runtime.dataflow import EngineError

from e2e_util import load_example

F64 = dict(rtol=1e-10, atol=1e-12)


gpt = load_example("gpt")


def _leaves(xs):
    return [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]


def _list(y):
    return list(y) if isinstance(y, (tuple, list)) else [y]


def _forward(stage, xs, recompute):
    if recompute:
        return torch.utils.checkpoint.checkpoint(stage, *xs, use_reentrant=False)
    return stage(*xs)


def fused(stage, batches, recompute=False):
    """engine.py's backward: per micro-batch one autograd call over the outputs that require grad (autograd
    sums an output listed twice); returns each micro-batch's input gradients and every parameter's gradient."""
    stage.zero_grad(set_to_none=True)
    input_grads = {}
    for m, (xs, gs) in enumerate(batches):
        xs = _leaves(xs)
        outs = _list(_forward(stage, xs, recompute))
        if gs is None:
            torch.autograd.backward(outs[0])
        else:
            pairs = [(o, g) for o, g in zip(outs, gs) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads[m] = [x.grad for x in xs]
    return input_grads, {n: p.grad for n, p in stage.named_parameters()}


def split(stage, batches, order, recompute=False, saving=True, on_b=None):
    """The same micro-batches as B and W passes in ``order`` (e.g. "B0 B1 W0 B2 W1 W2")."""
    stage.zero_grad(set_to_none=True)
    bw = BackwardSplit(stage.parameters())
    input_grads = {}
    for op in order.split():
        m = int(op[1:])
        if op[0] == "W":
            bw.backward_weight(m)
            continue
        xs, gs = batches[m]
        xs = _leaves(xs)
        with bw.saving(m) if saving else contextlib.nullcontext():
            outs = _list(_forward(stage, xs, recompute))
        bw.backward_input(m, outs[:1] if gs is None else outs, gs, xs)
        input_grads[m] = [x.grad for x in xs]
        if on_b is not None:
            on_b(bw, m)
    assert bw.pending == []
    return input_grads, {n: p.grad for n, p in stage.named_parameters()}


def drive(bw, stage, batches, order, before_w=lambda: None, after=lambda op: None):
    """``order``'s passes on a one-input, one-output stage; ``after(op)`` following each."""
    for op in order.split():
        m = int(op[1:])
        if op[0] == "B":
            xs = _leaves(batches[m][0])
            bw.backward_input(m, [stage(*xs)], batches[m][1], xs)
        else:
            before_w()
            bw.backward_weight(m)
        after(op)


def assert_same(ref, got):
    (ref_in, ref_w), (got_in, got_w) = ref, got
    assert ref_in.keys() == got_in.keys()
    for m in ref_in:
        for a, b in zip(ref_in[m], got_in[m]):
            assert (a is None) == (b is None), m
            if a is not None:
                torch.testing.assert_close(b, a, **F64)
    assert ref_w.keys() == got_w.keys()
    for name, a in ref_w.items():
        assert (a is None) == (got_w[name] is None), name
        if a is not None:
            torch.testing.assert_close(got_w[name], a, **F64, msg=lambda s, name=name: f"{name}: {s}")


def gpt_blocks(layers=2, hidden=16, heads=2, seq=8):
    torch.manual_seed(0)
    return nn.Sequential(*gpt.build(layers=layers, hidden=hidden, heads=heads, seq=seq)[1:-1]).double()


def hidden_batches(n=3, shape=(2, 8, 16), outputs=1):
    g = torch.Generator().manual_seed(1)
    return [([torch.randn(*shape, generator=g, dtype=torch.float64)],
             [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(outputs)]) for _ in range(n)]


ORDER = "B0 B1 W0 B2 W1 W2"


# ---- the builder's GPT blocks: a middle stage

def test_middle_stage_interleaved_equals_fused():
    stage, batches = gpt_blocks(), hidden_batches()
    assert_same(fused(stage, batches), split(stage, batches, ORDER))
    assert_same(fused(stage, batches), split(stage, batches, "B0 B1 B2 W2 W0 W1", saving=False))


def test_b_computes_no_weight_gradient():
    stage, batches = gpt_blocks(), hidden_batches(n=1)

    def after_b(bw, m):
        assert all(p.grad is None for p in stage.parameters())
        assert bw.pending == [m] and bw.held_bytes(m) > 0
    split(stage, batches, "B0 W0", on_b=after_b)


def test_post_accumulate_hooks_fire_once_per_parameter_per_w():
    stage, batches = gpt_blocks(), hidden_batches()
    count = {id(p): 0 for p in stage.parameters()}
    for p in stage.parameters():
        p.register_post_accumulate_grad_hook(lambda p: count.__setitem__(id(p), count[id(p)] + 1))
    tensor_hooks = {id(p): 0 for p in stage.parameters()}
    for p in stage.parameters():   # a gradient hook (hf_tp's all-reduce of a replicated parameter's gradient)
        p.register_hook(lambda g, p=p: tensor_hooks.__setitem__(id(p), tensor_hooks[id(p)] + 1))
    seen, norms, linears = [], [], []

    def after(op):
        seen.append(set(count.values()))
        norms.append({tensor_hooks[id(p)] for n, p in stage.named_parameters() if ".ln" in n})
        linears.append({tensor_hooks[id(p)] for n, p in stage.named_parameters() if ".ln" not in n})
    drive(BackwardSplit(stage.parameters()), stage, batches, ORDER, after=after)
    assert seen == [{0}, {0}, {1}, {1}, {2}, {3}]
    assert linears == seen                                  # a linear's gradients are computed in W
    assert norms == [{1}, {2}, {2}, {3}, {3}, {3}]          # a norm's (vectors only) in B, kept until W


def test_gradient_buckets_views_accumulate_in_place():
    """grads.py makes every .grad a view into a flat bucket: W adds into it, as AccumulateGrad does."""
    stage, batches = gpt_blocks(), hidden_batches()
    ref = fused(stage, batches)[1]
    buckets = grads.GradientBuckets(list(stage.parameters()), None, "cpu", bucket_bytes=4096)
    buckets.attach()
    views = {n: p.grad for n, p in stage.named_parameters()}
    bw = BackwardSplit(stage.parameters())
    for m, (xs, gs) in enumerate(batches):
        xs = _leaves(xs)
        bw.backward_input(m, [stage(*xs)], gs, xs)
        bw.backward_weight(m)
    for n, p in stage.named_parameters():
        assert p.grad is views[n]
        torch.testing.assert_close(p.grad, ref[n], **F64)


class _OneRank:
    """A reduce-scatter program over a group of one: it owns everything and counts its runs."""
    granule = 1

    def __init__(self):
        self.runs = 0

    def owned_slices(self, n):
        return [(0, n)]

    def run(self, buf):
        self.runs += 1


def test_zero2_end_of_backward_callback_runs_once_per_w():
    """grads_zero2's hook queues an autograd callback; W runs in one graph task, so each micro-batch
    releases every bucket exactly once and its gradients reach the accumulators."""
    stage, batches = gpt_blocks(), hidden_batches()
    ref = fused(stage, batches)[1]
    ex = _OneRank()
    buckets = grads_zero2.ShardedGradientBuckets(list(stage.parameters()), ex, "cpu", bucket_bytes=4096)
    buckets.attach()
    runs = []

    def after(op):
        if op[0] == "W":
            buckets._queue.join()
            runs.append(ex.runs)
    drive(BackwardSplit(stage.parameters()), stage, batches, ORDER, before_w=buckets.arm, after=after)
    assert runs == [len(buckets.buckets) * k for k in (1, 2, 3)]
    for b, (_, placed) in enumerate(buckets.buckets):
        for p, off in placed:
            name = next(n for n, q in stage.named_parameters() if q is p)
            torch.testing.assert_close(buckets.accumulators[b][off:off + p.numel()].view_as(p), ref[name], **F64)


def test_w_reads_no_weight_matrix():
    """A linear's weight gradient needs its input and output gradient, not the weight: W runs with every
    matrix's storage freed (as ZeRO-3 frees a layer between its uses)."""
    stage, batches = gpt_blocks(), hidden_batches()
    ref = fused(stage, batches)
    stage.zero_grad(set_to_none=True)
    matrices = [p for p in stage.parameters() if p.dim() > 1]
    bw = BackwardSplit(stage.parameters())
    got = {}
    for m, (xs, gs) in enumerate(batches):
        xs = _leaves(xs)
        with bw.saving(m):
            y = stage(*xs)
        bw.backward_input(m, [y], gs, xs)
        got[m] = [x.grad for x in xs]
        del y
        kept = [p.detach().clone() for p in matrices]
        for p in matrices:
            p.untyped_storage().resize_(0)
        bw.backward_weight(m)
        for p, k in zip(matrices, kept):
            p.untyped_storage().resize_(k.untyped_storage().nbytes())
            p.data.copy_(k)
    assert_same(ref, (got, {n: p.grad for n, p in stage.named_parameters()}))


# ---- first stage, last stage, recompute, several outputs, tied parameters

def test_first_stage_b_is_empty_and_w_runs_the_whole_backward():
    torch.manual_seed(0)
    stage = nn.Sequential(*gpt.build(layers=1, hidden=16, heads=2, seq=8)[:2]).double()
    g = torch.Generator().manual_seed(2)
    batches = [([torch.randint(0, 256, (2, 8), generator=g)], [torch.randn(2, 8, 16, generator=g, dtype=torch.float64)])
               for _ in range(3)]

    def after_b(bw, m):   # B kept the output's gradient for W (and the forward's graph: nothing is freed)
        assert bw.held_bytes(m) == batches[m][1][0].numel() * 8
        if m == 0:
            assert all(p.grad is None for p in stage.parameters())
    assert_same(fused(stage, batches), split(stage, batches, ORDER, saving=False, on_b=after_b))
    assert_same(fused(stage, batches), split(stage, batches, ORDER))


def test_last_stage_from_the_loss():
    torch.manual_seed(0)
    layers = gpt.build(layers=1, hidden=16, heads=2, seq=8)
    body = nn.Sequential(*layers[1:]).double()

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x, labels):
            return gpt.loss(self.body(x), labels) * 0.5

    stage = Last()
    g = torch.Generator().manual_seed(3)
    batches = [([torch.randn(2, 8, 16, generator=g, dtype=torch.float64), torch.randint(0, 256, (2, 8), generator=g)],
                None) for _ in range(3)]
    assert_same(fused(stage, batches), split(stage, batches, ORDER))


def test_recompute_equals_fused_and_w_recomputes_once():
    stage, batches = gpt_blocks(), hidden_batches()
    runs = []
    stage[0].register_forward_hook(lambda *a: runs.append(1))
    ref = fused(stage, batches, recompute=True)
    assert len(runs) == 2 * 3                      # the forward, and its recompute in the backward
    runs.clear()
    assert_same(ref, split(stage, batches, ORDER, recompute=True))
    assert len(runs) == 3 * 3                      # the forward, the recompute in B and one in W


class Skips(nn.Module):
    """Outputs (main, skip, skip, mask, table): the skip feeds the main path and two transfers; the mask
    needs no gradient; the table's gradient comes from its output alone, off the input path."""

    def __init__(self):
        super().__init__()
        self.a, self.b = gpt.Block(16, 2), gpt.Block(16, 2)
        self.table = nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        skip = self.a(x)
        return self.b(skip), skip, skip, (x > 0).double(), self.table.expand_as(x) * 2


def test_several_outputs_are_summed_per_tensor_and_non_grad_outputs_skipped():
    torch.manual_seed(0)
    stage = Skips().double()
    g = torch.Generator().manual_seed(4)
    batches = [([torch.randn(2, 8, 16, generator=g, dtype=torch.float64)],
                [torch.randn(2, 8, 16, generator=g, dtype=torch.float64) for _ in range(5)]) for _ in range(3)]
    assert_same(fused(stage, batches), split(stage, batches, ORDER))


class Tied(nn.Module):
    """One block applied twice (its parameters at two depths of the stage), a linear shared by two
    branches, and a vector added at the output."""

    def __init__(self):
        super().__init__()
        self.block = gpt.Block(16, 2)
        self.shared = nn.Linear(16, 16)
        self.offset = nn.Parameter(torch.randn(16))

    def forward(self, x):
        h = self.block(self.block(x))
        return self.shared(h) * self.shared(x).tanh() + self.offset.exp()


def test_tied_parameters_used_twice_in_a_stage():
    torch.manual_seed(0)
    stage, batches = Tied().double(), hidden_batches()
    assert_same(fused(stage, batches), split(stage, batches, ORDER))
    assert_same(fused(stage, batches), split(stage, batches, ORDER, recompute=True))


# ---- Hugging Face decoder layers

def _hf_llama_layers():
    pytest.importorskip("transformers")
    from planc.runtime import hf
    config = hf.config_from_keys("LlamaForCausalLM", {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32, "num_hidden_layers": 2})
    return config, hf.pipeline_layers(hf.build_model(config, 9))


def test_hf_llama_decoder_layers():
    _, layers = _hf_llama_layers()
    stage = nn.Sequential(*layers[1:3]).double()
    batches = hidden_batches(shape=(2, 6, 16))
    assert_same(fused(stage, batches), split(stage, batches, ORDER))


def test_hf_gpt2_blocks():
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    stage = nn.Sequential(*load_example("hf_gpt2").build(layers=2, hidden=16, heads=2, seq=8)[1:-1]).double()
    batches = hidden_batches(shape=(2, 8, 16))
    assert_same(fused(stage, batches), split(stage, batches, ORDER))


class _LoggedTP:
    """A tensor group of 2 seen from rank 0 whose all-reduce is the identity and is logged."""

    def __init__(self, log):
        from planc.runtime.tensor_parallel import TensorParallel

        class Logged(TensorParallel):
            def all_reduce(self, t):
                log.append((log.phase, t.numel()))
                return t
        self.tp = Logged(None, 0, 2)


class _Log(list):
    phase = ""


def test_tensor_parallel_backward_collectives_all_run_in_b():
    """hf_tp on Qwen3 (q_norm/k_norm replicated with a gradient all-reduce): every backward all-reduce is the
    input path's (f of the column-parallel inputs) or a vector parameter's gradient hook, so B issues the
    fused backward's collectives, W none, in one order every run (so on every rank)."""
    pytest.importorskip("transformers")
    from planc.runtime import hf, hf_tp
    config = hf.config_from_keys("Qwen3ForCausalLM", {
        "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 4, "max_position_embeddings": 32, "num_hidden_layers": 1})
    layer = hf.pipeline_layers(hf.build_model(config, 9))[1].double()
    log = _Log()
    hf_tp.parallelize_layer(layer.layer, hf_tp.layer_tp_plan(config), _LoggedTP(log).tp)
    batches = hidden_batches(n=2, shape=(2, 6, 16))
    replicated = [p.numel() for n, p in layer.named_parameters() if "q_norm" in n or "k_norm" in n]

    def run(order):
        del log[:]
        bw = BackwardSplit(layer.parameters())
        for op in order.split():
            m = int(op[1:])
            if op[0] in "FB":
                xs = _leaves(batches[m][0])
                log.phase = "F"
                out = layer(*xs)
                log.phase = "fused" if op[0] == "F" else "B"
                if op[0] == "F":
                    torch.autograd.backward(out, batches[m][1][0])
                else:
                    bw.backward_input(m, [out], batches[m][1], xs)
            else:
                log.phase = "W"
                bw.backward_weight(m)
        return list(log)

    ref = run("F0 F1")
    got = run("B0 B1 W0 W1")
    assert got == run("B0 B1 W0 W1")                   # one order, every run (so every rank alike)
    assert [n for phase, n in got if phase == "F"] == [n for phase, n in ref if phase == "F"]
    b = [n for phase, n in got if phase == "B"]
    assert b == [n for phase, n in ref if phase == "fused"] and not [1 for phase, _ in got if phase == "W"]
    assert sorted(set(replicated)) == [4] and b.count(4) == 2 * len(replicated)   # the norms' hooks, in B


# ---- what is held between B and W, and what is left after W

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.storages = {}

    def forward(self, x):
        h = self.fc1(x)
        a = nn.functional.gelu(h)
        self.storages = {"gelu input": weakref.ref(h.untyped_storage()),
                         "fc2 input": weakref.ref(a.untyped_storage())}
        return self.fc2(a)


def _alive(stage):
    gc.collect()
    return sorted(k for k, ref in stage.storages.items() if ref() is not None)


@pytest.mark.parametrize("drop_outputs", [True, False])
def test_b_keeps_only_what_w_reads_and_w_leaves_nothing(drop_outputs):
    torch.manual_seed(0)
    stage = Mlp().double()
    bw = BackwardSplit(stage.parameters())
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with bw.saving(0):
        y = stage(x)
    assert _alive(stage) == ["fc2 input", "gelu input"]
    in_b = []   # x's gradient comes last in B: the GELU, which ran before, has dropped its input already
    x.register_hook(lambda g: in_b.append(_alive(stage)))
    bw.backward_input(0, [y], [torch.ones_like(y)], [x])
    assert in_b == [["fc2 input"]]
    if drop_outputs:
        del y
    assert _alive(stage) == ["fc2 input"]      # the GELU's saved input is the input path's only
    # held: the linears' inputs (x: 4 x 8, the GELU's output: 4 x 32) and the gradients at their outputs
    assert bw.held_bytes(0) == (4 * 8 + 4 * 32 + 4 * 8 + 4 * 32) * 8
    during = []   # W runs fc2's group first: its input is freed before fc1's gradient is accumulated
    stage.fc1.weight.register_post_accumulate_grad_hook(lambda p: during.append(_alive(stage)))
    bw.backward_weight(0)
    assert during == [[]] and _alive(stage) == []
    assert bw.pending == [] and not bw._boxes


# ---- misuse

def test_w_without_b_and_b_twice_name_the_micro_batch():
    stage, batches = gpt_blocks(layers=1), hidden_batches(n=1)
    bw = BackwardSplit(stage.parameters())
    with pytest.raises(EngineError) as e:
        bw.backward_weight(4)
    assert str(e.value) == "micro-batch 4: W (the weight gradients) ran before its B (the input gradients)"
    xs = _leaves(batches[0][0])
    bw.backward_input(4, [stage(*xs)], batches[0][1], xs)
    xs = _leaves(batches[0][0])
    with pytest.raises(EngineError) as e:
        bw.backward_input(4, [stage(*xs)], batches[0][1], xs)
    assert str(e.value) == "micro-batch 4: B (the input gradients) ran twice without its W between"
    bw.backward_weight(4)
    with pytest.raises(EngineError, match="micro-batch 4: W"):
        bw.backward_weight(4)
