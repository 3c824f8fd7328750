"""Hugging Face decoder layers split by their config's tp plan (planc/runtime/hf_tp.py).

References, neither of them planc code: the unsharded layer in one process (plain transformers), and
torch's own tensor-parallel API (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``,
DTensor, a gloo mesh of 2 CPU ranks) applied to a copy of the same layer. One gloo job runs every
model: forward outputs, the input's gradient and every parameter's gradient (a planc shard against
the slice of the unsharded gradient and against DTensor's local shard), and the all-reduces the layer
issues (logged as they happen) against ``layer_traffic``.
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

transformers = pytest.importorskip("transformers")

from planc.runtime import hf_tp  # noqa: E402

ROWS, SEQ = 2, 5


def make_config(name: str):
    """Tiny configs: hidden 32, 4 heads of 8 (2 key/value heads where the model has GQA)."""
    common = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1,
                  vocab_size=64, max_position_embeddings=64)
    gqa = dict(common, num_key_value_heads=2)
    if name == "llama":
        return transformers.LlamaConfig(**gqa)
    if name == "qwen2":
        return transformers.Qwen2Config(**gqa)
    if name == "qwen3":
        return transformers.Qwen3Config(**gqa, head_dim=8)
    if name == "mistral":
        return transformers.MistralConfig(**gqa, head_dim=8)
    if name == "gemma":
        return transformers.GemmaConfig(**gqa, head_dim=8)
    if name == "olmo2":
        return transformers.Olmo2Config(**gqa)
    if name == "phi3":
        return transformers.Phi3Config(**gqa, pad_token_id=0)
    if name == "exaone4":   # keeps its head counts as attributes of the attention module
        return transformers.Exaone4Config(**gqa, head_dim=8)
    if name == "gpt_neox":
        return transformers.GPTNeoXConfig(**common, hidden_dropout=0.0, attention_dropout=0.0)
    raise KeyError(name)


MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "olmo2", "phi3", "gpt_neox", "exaone4")


# ---- one process: the plan, the refusals ----

def test_layer_plan_is_relative_to_one_decoder_layer():
    assert hf_tp.layer_tp_plan(make_config("llama")) == {
        "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise"}
    neox = hf_tp.layer_tp_plan(make_config("gpt_neox"))
    assert "embed_in" not in neox and not any(k.startswith("layers") for k in neox)
    assert neox["attention.query_key_value"] == "colwise"
    assert hf_tp.layer_tp_plan(make_config("qwen3"))["self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert hf_tp.layer_tp_plan(transformers.GPT2Config()) == {}


@pytest.mark.parametrize("name", MODELS)
def test_every_model_splits_in_two(name):
    assert hf_tp.check_degree(make_config(name), 2) is None
    assert hf_tp.check_degree(make_config(name), 1) is None


def test_refusals_name_the_reason():
    cfg = make_config("llama")   # 4 heads, 2 key/value heads
    assert hf_tp.check_degree(cfg, 4) == ("num_key_value_heads = 2 does not split into 4 equal parts "
                                          "(layers.*.self_attn is split by heads)")
    cfg = transformers.LlamaConfig(hidden_size=48, intermediate_size=64, num_attention_heads=6,
                                   num_key_value_heads=6, num_hidden_layers=1, vocab_size=64)
    assert hf_tp.check_degree(cfg, 4) == ("num_attention_heads = 6 does not split into 4 equal parts "
                                          "(layers.*.self_attn is split by heads)")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=66, num_attention_heads=4,
                                   num_key_value_heads=4, num_hidden_layers=1, vocab_size=64)
    assert hf_tp.check_degree(cfg, 4) == ("layers.*.mlp.gate_proj (colwise): its output width 66 does not "
                                          "split into 4 equal parts")
    # Phi-3's fused q|k|v is gathered: its width (4 + 2 * 2) * 8 = 64 must split, not the 2 kv heads
    phi = make_config("phi3")
    assert hf_tp.check_degree(phi, 4) is None
    phi = transformers.Phi3Config(hidden_size=24, intermediate_size=48, num_attention_heads=3,
                                  num_key_value_heads=1, num_hidden_layers=1, vocab_size=64, pad_token_id=0)
    assert hf_tp.check_degree(phi, 3) == ("layers.*.self_attn.qkv_proj (colwise_gather_output): its output "
                                          "width 40 does not split into 3 equal parts")
    cfg = make_config("llama")
    cfg.base_model_tp_plan = dict(cfg.base_model_tp_plan, **{"layers.*.mlp.gate_proj": "packed_colwise"})
    why = hf_tp.check_degree(cfg, 2)
    assert why.startswith("tensor-parallel style not supported for a decoder layer: "
                          "layers.*.mlp.gate_proj: packed_colwise (supported: colwise, ")
    assert hf_tp.check_degree(transformers.GPT2Config(), 2).startswith("GPT2Config (gpt2) has no base_model_tp_plan")
    assert hf_tp.check_degree(make_config("llama"), 0) == "tensor degree 0 is not a positive integer"
    assert hf_tp.check_degree(make_config("llama"), True) == "tensor degree True is not a positive integer"


def test_parallelize_refuses_what_check_degree_refuses():
    import torch
    from planc.runtime.tensor_parallel import TensorParallel
    cfg = make_config("llama")
    torch.manual_seed(0)
    layer = transformers.AutoModel.from_config(cfg).layers[0]
    whole = copy.deepcopy(layer)
    hf_tp.parallelize_layer(whole, hf_tp.layer_tp_plan(cfg), None)   # no tensor axis: left whole
    hf_tp.parallelize_layer(whole, hf_tp.layer_tp_plan(cfg), TensorParallel(None, 0, 1))
    assert [(k, p.shape) for k, p in whole.named_parameters()] == [(k, p.shape) for k, p in layer.named_parameters()]
    assert type(whole.self_attn.q_proj) is torch.nn.Linear
    with pytest.raises(ValueError, match="no tp plan entries for LlamaDecoderLayer"):
        hf_tp.parallelize_layer(whole, {}, TensorParallel(None, 1, 2))
    with pytest.raises(ValueError, match="num_key_value_heads = 2 does not split into 4 equal parts"):
        hf_tp.parallelize_layer(layer, hf_tp.layer_tp_plan(cfg), TensorParallel(None, 0, 4))
    assert all(type(p) is torch.nn.Parameter and not hasattr(p, "planc_shard") for p in layer.parameters())
    hf_tp.parallelize_layer(layer, hf_tp.layer_tp_plan(cfg), TensorParallel(None, 1, 2))
    assert layer.self_attn.q_proj.weight.planc_shard == (0, 1, 2)
    with pytest.raises(ValueError, match="already split"):
        hf_tp.parallelize_layer(layer, hf_tp.layer_tp_plan(cfg), TensorParallel(None, 1, 2))


def test_traffic_of_llama_by_hand():
    """Per layer: g after o_proj and after down_proj forward; f before q|k|v and before gate|up backward."""
    t = hf_tp.layer_traffic(make_config("llama"), rows=3, seq=7, dtype_bytes=2)
    assert t == {"forward": [3 * 7 * 32 * 2] * 2, "backward": [3 * 7 * 32 * 2] * 2, "errors": [],
                 "forward_kinds": ["all_reduce"] * 2, "backward_kinds": ["all_reduce"] * 2}
    # sequence-parallel: each region's input gathered and its output reduce-scattered (full widths), the two
    # norms' gradients (32 each) summed last
    t = hf_tp.layer_traffic(make_config("llama"), rows=3, seq=8, dtype_bytes=2, sequence=True)
    tok = 3 * 8 * 2
    assert t == {"forward": [tok * 32] * 4, "forward_kinds": ["all_gather", "reduce_scatter"] * 2,
                 "backward": [tok * 32] * 4 + [64, 64],
                 "backward_kinds": ["all_gather", "reduce_scatter"] * 2 + ["all_reduce"] * 2, "errors": []}
    # Phi-3: gathers of q|k|v (64 wide) and gate|up (128), g after o_proj and down_proj; backward the
    # gradient gathers of o_proj's input (32) and down_proj's (64), f before qkv_proj and gate_up_proj
    t = hf_tp.layer_traffic(make_config("phi3"), rows=1, seq=1, dtype_bytes=4)
    assert t == {"forward": [4 * 64, 4 * 32, 4 * 128, 4 * 32], "backward": [4 * 64, 4 * 32, 4 * 32, 4 * 32],
                 "errors": [], "forward_kinds": ["all_reduce"] * 4, "backward_kinds": ["all_reduce"] * 4}
    t = hf_tp.layer_traffic(transformers.GPT2Config(), rows=1, seq=1, dtype_bytes=4)
    assert t == {"forward": [], "backward": [], "errors": ["GPT2Config has no base_model_tp_plan entries 'layers.*.…'"],
                 "forward_kinds": [], "backward_kinds": []}


# ---- two gloo ranks against the unsharded layer and torch's DTensor tensor parallelism ----

def _dtensor_plan(plan):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
              "rowwise_split_input": RowwiseParallel(input_layouts=Replicate())}
    return {k: styles[s] for k, s in plan.items() if s in styles}


def _run_layer(layer, base, x, weights):
    import torch
    x = x.detach().clone().requires_grad_(True)
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
    pe = base.rotary_emb(x, pos)
    out = layer(x, position_embeddings=pe)
    out = out[0] if isinstance(out, tuple) else out
    (out * weights).sum().backward()
    return out.detach(), x.grad


def _layer_case(name: str, seq: int):
    """(config, base model, tp plan, its decoder layer 0, input x, output weights w) of one model: every
    value moved off transformers' init (biases 0, norms 1), x and w of ROWS x seq tokens."""
    import torch
    config = make_config(name)
    torch.manual_seed(0)
    base = transformers.AutoModel.from_config(config)
    with torch.no_grad():   # transformers initializes biases to 0 and norms to 1: move every value
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    base.train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, seq, config.hidden_size, generator=gen)
    w = torch.randn(ROWS, seq, config.hidden_size, generator=gen)
    return config, base, hf_tp.layer_tp_plan(config), base.layers[0], x, w


def compare_worker(rank, world, payload):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_of

    class Logged(TensorParallel):
        def __init__(self, *a):
            super().__init__(*a)
            self.log = []

        def all_reduce(self, t):
            self.log.append(t.numel() * t.element_size())
            return super().all_reduce(t)

    mesh = init_device_mesh("cpu", (world,))
    # float64: the three computations sum in different orders; in float32 that alone moves small
    # gradient elements by more than rtol 1e-5 of themselves (about 1e-7 of the largest)
    torch.set_default_dtype(torch.float64)
    close = dict(rtol=1e-5, atol=1e-9)
    report = {}
    for name in payload["models"]:
        config, base, plan, full, x, w = _layer_case(name, SEQ)
        ours, theirs = copy.deepcopy(full), copy.deepcopy(full)
        ref_out, ref_dx = _run_layer(full, base, x, w)
        ref = dict(full.named_parameters())

        tp = Logged(dist.group.WORLD, rank, world, tuple(range(world)))
        hf_tp.parallelize_layer(ours, plan, tp)
        if name == "exaone4":   # the attention module describes its local heads
            a = ours.self_attn
            assert (a.num_attention_heads, a.num_key_value_heads) == (4 // world, 2 // world), vars(a)
        tp.log = []
        out, dx = _run_layer(ours, base, x, w)
        traffic = tp.log
        tp.log = []

        parallelize_module(theirs, mesh, _dtensor_plan(plan))
        d_out, d_dx = _run_layer(theirs, base, x, w)
        for k, s in plan.items():   # torch's API has no such style: the gradient summed by hand
            if s == "replicated_with_grad_allreduce":
                for p in theirs.get_submodule(k).parameters():
                    dist.all_reduce(p.grad)
        torch.testing.assert_close(out, ref_out, **close, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(out, d_out, **close, msg=lambda m: f"{name} output vs DTensor: {m}")
        torch.testing.assert_close(dx, ref_dx, **close, msg=lambda m: f"{name} input grad: {m}")
        torch.testing.assert_close(dx, d_dx, **close, msg=lambda m: f"{name} input grad vs DTensor: {m}")

        dt = dict(theirs.named_parameters())
        sharded = 0
        for k, p in ours.named_parameters():
            assert type(p) is torch.nn.Parameter, (name, k, type(p))
            info = shard_info(p)
            want_p, want_g = ref[k], ref[k].grad
            if info is not None:
                sharded += 1
                want_p = shard_of(want_p, info[0], info[1], info[2], info[3])
                want_g = shard_of(want_g, info[0], info[1], info[2], info[3])
            torch.testing.assert_close(p.detach(), want_p.detach(), rtol=0, atol=0)
            torch.testing.assert_close(p.grad, want_g, **close, msg=lambda m: f"{name} {k}.grad: {m}")
            theirs_g = dt[k].grad
            theirs_g = theirs_g.to_local() if isinstance(theirs_g, DTensor) else theirs_g
            assert theirs_g.shape == p.grad.shape, (name, k, theirs_g.shape, p.grad.shape)
            torch.testing.assert_close(p.grad, theirs_g, **close, msg=lambda m: f"{name} {k}.grad vs DTensor: {m}")
        expect = hf_tp.layer_traffic(config, ROWS, SEQ, 8)
        n = len(expect["forward"])   # in the order issued, forward then backward
        assert (traffic[:n], traffic[n:]) == (expect["forward"], expect["backward"]), (name, traffic, expect)
        # a second micro-batch accumulates: every gradient (the all-reduced replicated ones too) doubles
        first = {k: q.grad.clone() for k, q in ours.named_parameters()}
        _run_layer(ours, base, x, w)
        for k, q in ours.named_parameters():
            torch.testing.assert_close(q.grad, 2 * first[k], **close, msg=lambda m: f"{name} {k} accumulated: {m}")
        for k, q in ours.named_parameters():
            q.grad = first[k]
        if name in payload["recompute"]:   # the engine's recompute: a non-reentrant checkpoint of the layer
            again = copy.deepcopy(full)
            for q in again.parameters():
                q.grad = None
            hf_tp.parallelize_layer(again, plan, tp)

            def run(h, pe):
                return again(h, position_embeddings=pe)
            xr = x.detach().clone().requires_grad_(True)
            pe = base.rotary_emb(xr, torch.arange(SEQ).unsqueeze(0).expand(ROWS, -1))
            tp.log = []
            o2 = torch.utils.checkpoint.checkpoint(run, xr, pe, use_reentrant=False)
            (o2 * w).sum().backward()
            torch.testing.assert_close(o2.detach(), out, rtol=0, atol=0)
            torch.testing.assert_close(xr.grad, dx, rtol=0, atol=0)
            mine = dict(ours.named_parameters())
            for k, q in again.named_parameters():
                torch.testing.assert_close(q.grad, mine[k].grad, rtol=0, atol=0, msg=lambda m: f"{name} {k}: {m}")
            # the forward's all-reduces (some: torch's recompute stops once it has what the backward
            # needs) run again in the backward, before the backward's own
            f, b = expect["forward"], expect["backward"]
            again_fwd = tp.log[len(f):len(tp.log) - len(b)]
            assert tp.log[:len(f)] == f and tp.log[len(tp.log) - len(b):] == b, (name, tp.log, expect)
            assert again_fwd and again_fwd == f[:len(again_fwd)], (name, tp.log, expect)
        report[name] = (sharded, len(traffic))
    return report


def test_two_ranks_match_the_unsharded_layer_and_torch_tensor_parallel():
    texts = H.run_ranks(compare_worker, 2, {"models": MODELS, "recompute": ("qwen3", "phi3")})
    import ast
    for r in range(2):
        report = ast.literal_eval(texts[r].strip())
        assert set(report) == set(MODELS)
        for name, (sharded, reduces) in report.items():
            assert sharded >= 4 and reduces >= 4, (r, name, sharded, reduces)


# ---- sequence parallelism: two gloo ranks, each with its part of the sequence, against the unsharded layer ----

SP_SEQ = 6


def sequence_worker(rank, world, payload):
    import torch
    import torch.distributed as dist

    from planc.runtime.tensor_parallel import TensorParallel, shard_info, shard_of

    class Logged(TensorParallel):   # every collective the layer issues, in order: (kind, bytes of the whole)
        def __init__(self, *a):
            super().__init__(*a)
            self.log = []

        def all_reduce(self, t):
            self.log.append(("all_reduce", t.numel() * t.element_size()))
            return super().all_reduce(t)

        def all_gather_seq(self, x):
            self.log.append(("all_gather", x.numel() * x.element_size() * self.size))
            return super().all_gather_seq(x)

        def reduce_scatter_seq(self, x):
            self.log.append(("reduce_scatter", x.numel() * x.element_size()))
            return super().reduce_scatter_seq(x)

    torch.set_default_dtype(torch.float64)
    close = dict(rtol=1e-5, atol=1e-9)
    report = {}
    part = SP_SEQ // world
    own = slice(rank * part, (rank + 1) * part)
    for name in payload["models"]:
        config, base, plan, full, x, w = _layer_case(name, SP_SEQ)
        ours = copy.deepcopy(full)
        ref_out, ref_dx = _run_layer(full, base, x, w)
        ref = dict(full.named_parameters())

        tp = Logged(dist.group.WORLD, rank, world, tuple(range(world)))
        tp.sequence_parallel = True
        hf_tp.parallelize_layer(ours, plan, tp)
        pos = torch.arange(SP_SEQ).unsqueeze(0).expand(ROWS, -1)
        xs = x[:, own].detach().clone().requires_grad_(True)
        tp.log = []
        out = ours(xs, position_embeddings=base.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        assert out.shape == (ROWS, part, config.hidden_size), (name, out.shape)
        (out * w[:, own]).sum().backward()
        torch.testing.assert_close(out.detach(), ref_out[:, own], **close, msg=lambda m: f"{name} output: {m}")
        torch.testing.assert_close(xs.grad, ref_dx[:, own], **close, msg=lambda m: f"{name} input grad: {m}")
        summed = 0
        for k, p in ours.named_parameters():
            info = shard_info(p)
            want_p, want_g = ref[k], ref[k].grad
            if info is not None:
                want_p, want_g = (shard_of(t, *info) for t in (want_p, want_g))
            else:
                summed += 1
            torch.testing.assert_close(p.detach(), want_p.detach(), rtol=0, atol=0)
            torch.testing.assert_close(p.grad, want_g, **close, msg=lambda m: f"{name} {k}.grad: {m}")
        expect = hf_tp.layer_traffic(config, ROWS, SP_SEQ, 8, sequence=True)
        kinds = {"forward": expect["forward_kinds"], "backward": expect["backward_kinds"]}
        n = len(expect["forward"])
        want = (list(zip(kinds["forward"], expect["forward"])), list(zip(kinds["backward"], expect["backward"])))
        # forward in the order issued; backward as a multiset (the sums of the norms' gradients come where
        # the model applies the norms, which layer_traffic lists last)
        assert tp.log[:n] == want[0] and sorted(tp.log[n:]) == sorted(want[1]), (name, tp.log, expect)
        if name in payload["recompute"]:   # the engine's recompute: a non-reentrant checkpoint of the layer
            again = copy.deepcopy(full)
            for q in again.parameters():
                q.grad = None
            hf_tp.parallelize_layer(again, plan, tp)
            xr = x[:, own].detach().clone().requires_grad_(True)
            pe = base.rotary_emb(x, pos)
            o2 = torch.utils.checkpoint.checkpoint(lambda h: again(h, position_embeddings=pe), xr, use_reentrant=False)
            o2 = o2[0] if isinstance(o2, tuple) else o2
            (o2 * w[:, own]).sum().backward()
            torch.testing.assert_close(o2.detach(), out.detach(), rtol=0, atol=0)
            torch.testing.assert_close(xr.grad, xs.grad, rtol=0, atol=0)
            mine = dict(ours.named_parameters())
            for k, q in again.named_parameters():
                torch.testing.assert_close(q.grad, mine[k].grad, rtol=0, atol=0, msg=lambda m: f"{name} {k}: {m}")
        report[name] = (summed, len(tp.log))
    return report


SP_MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "olmo2", "phi3", "gpt_neox", "exaone4")


def test_sequence_parallel_layers_match_the_unsharded_layer_on_their_part_of_the_sequence():
    can = [m for m in SP_MODELS if hf_tp.check_sequence(make_config(m), 2) is None]
    assert {"llama", "qwen3", "phi3", "olmo2"} <= set(can), can
    texts = H.run_ranks(sequence_worker, 2, {"models": can, "recompute": ("llama", "phi3")})
    import ast
    for r in range(2):
        report = ast.literal_eval(texts[r].strip())
        assert set(report) == set(can)
        for name, (summed, collectives) in report.items():
            assert summed >= 2 and collectives >= 8, (r, name, summed, collectives)


def test_sequence_parallel_refusals_name_the_reason():
    import torch
    config = make_config("llama")
    layer = copy.deepcopy(transformers.AutoModel.from_config(config).layers[0])
    plan = dict(hf_tp.layer_tp_plan(config))
    assert hf_tp.sequence_problem(layer, plan) is None
    flat = {**plan, "input_layernorm": "replicated_with_grad_allreduce"}
    assert hf_tp.sequence_problem(layer, flat) is None   # a replicated module outside the regions: summed anyway
    direct = {"proj": "colwise", **plan}
    layer.proj = torch.nn.Linear(32, 32)
    assert hf_tp.sequence_problem(layer, direct) == \
        "the tp plan splits proj directly in the decoder layer (no module to gather around)"
    no_row = {k: v for k, v in plan.items() if k != "mlp.down_proj"}
    assert hf_tp.sequence_problem(copy.deepcopy(transformers.AutoModel.from_config(config).layers[0]), no_row) == \
        "layers.*.mlp has no row-parallel projection to scatter its output along the sequence"
