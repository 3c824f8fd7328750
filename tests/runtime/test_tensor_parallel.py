"""Tensor parallelism in one process: examples/gpt.py's Megatron-style split (2 shards) against the
full layers, the compiler's tensor_groups, and the runtime's choice of calling a builder with or
without ``tensor_parallel``."""

import copy
import threading

import pytest
import torch

from planc.runtime.main import accepts_tensor_parallel, build_layers
from planc.runtime.tensor_parallel import TensorParallel, context_from_plan, shard_info, shard_of

from e2e_util import ROOT, load_example


gpt = load_example("gpt")


class NoReduce(TensorParallel):
    """A shard whose all-reduce does nothing: its outputs are its partial sums."""

    def all_reduce(self, t):
        return t


class ThreadGroup:
    """An all-reduce among threads of this process (one thread per fake tensor rank)."""

    def __init__(self, size):
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size, timeout=30)

    def member(self, rank):
        group = self

        class Member(TensorParallel):
            def all_reduce(self, t):
                group.slots[self.rank] = t.detach().clone()
                group.barrier.wait()
                total = sum(group.slots[1:], group.slots[0].clone())
                group.barrier.wait()
                with torch.no_grad():
                    t.copy_(total)
                return t
        return Member(None, rank, group.size)


def split(block, size=2, cls=NoReduce):
    return [copy.deepcopy(block).shard(cls(None, r, size)) for r in range(size)]


def test_shard_of_tiles_plain_and_blocked():
    t = torch.arange(24.).view(6, 4)
    assert torch.equal(torch.cat([shard_of(t, 1, i, 2) for i in range(2)], 1), t)
    parts = [shard_of(t, 0, i, 2, blocks=3) for i in range(2)]   # rows [q|k|v] of 2 each
    assert torch.equal(parts[0], t[[0, 2, 4]]) and torch.equal(parts[1], t[[1, 3, 5]])
    with pytest.raises(ValueError):
        shard_of(t, 0, 0, 4)


def test_column_and_row_split_sum_to_the_full_block():
    torch.manual_seed(0)
    block = gpt.Block(16, 4)
    x = torch.randn(2, 5, 16)
    shards = split(block)
    for s, r in zip(shards, range(2)):
        assert shard_info(s.qkv.weight) == (0, r, 2, 3) and s.qkv.weight.shape == (24, 16)
        assert shard_info(s.qkv.bias) == (0, r, 2, 3)
        assert shard_info(s.proj.weight) == (1, r, 2, 1) and shard_info(s.proj.bias) is None
        assert shard_info(s.mlp[0].weight) == (0, r, 2, 1) and shard_info(s.mlp[0].bias) == (0, r, 2, 1)
        assert shard_info(s.mlp[2].weight) == (1, r, 2, 1) and shard_info(s.mlp[2].bias) is None
        assert shard_info(s.ln1.weight) is None
        for name, p in s.named_parameters():   # every shard is its slice of the full parameter
            full = dict(block.named_parameters())[name]
            info = shard_info(p)
            assert torch.equal(p, full if info is None else shard_of(full, info[0], info[1], info[2], info[3]))
    with torch.no_grad():
        # attention: column-parallel qkv by heads, row-parallel projection, bias once after the sum
        b, t, h = x.shape
        q, k, v = block.qkv(block.ln1(x)).split(h, dim=2)
        q, k, v = (z.view(b, t, 4, 4).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        full_attn = block.proj(y.transpose(1, 2).reshape(b, t, h))
        got = sum(s.attention_partial(x) for s in shards) + block.proj.bias
        torch.testing.assert_close(got, full_attn, rtol=1e-5, atol=1e-6)
        # MLP: column-parallel fc1, row-parallel fc2
        full_mlp = block.mlp(block.ln2(x))
        got = sum(s.mlp_partial(x) for s in shards) + block.mlp[2].bias
        torch.testing.assert_close(got, full_mlp, rtol=1e-5, atol=1e-6)


def test_two_shards_forward_and_backward_match_the_full_model():
    """The whole model split over 2 fake ranks (threads, a real summing all-reduce through
    copy_to_region / reduce_from_region): same output, and every gradient is the slice of the
    full model's gradient."""
    torch.manual_seed(3)
    full = gpt.build(layers=2, hidden=16, heads=4, seq=8, vocab=32)
    x, y = next(gpt.batches(3, 0, seq=8, vocab=32))
    out = x
    for layer in full:
        out = layer(out)
    loss = gpt.loss(out, y)
    loss.backward()

    group = ThreadGroup(2)
    results, errors = [None, None], []
    built = []
    for r in range(2):   # built here, one after the other: torch's global generator is not per thread
        torch.manual_seed(3)
        built.append(gpt.build(layers=2, hidden=16, heads=4, seq=8, vocab=32, tensor_parallel=group.member(r)))

    def run(r):
        try:
            layers = built[r]
            o = x
            for layer in layers:
                o = layer(o)
            lo = gpt.loss(o, y)
            lo.backward()
            results[r] = (o.detach(), lo.detach(), layers)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    full_params = {f"{i}.{k}": p for i, l in enumerate(full) for k, p in l.named_parameters()}
    for r in range(2):
        o, lo, layers = results[r]
        torch.testing.assert_close(o, out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lo, loss.detach(), rtol=1e-6, atol=1e-6)
        sharded = 0
        for i, layer in enumerate(layers):
            for k, p in layer.named_parameters():
                ref = full_params[f"{i}.{k}"]
                info = shard_info(p)
                want_p, want_g = (ref, ref.grad) if info is None else (
                    shard_of(ref, *info[:3], blocks=info[3]), shard_of(ref.grad, *info[:3], blocks=info[3]))
                sharded += info is not None
                torch.testing.assert_close(p.detach(), want_p.detach(), rtol=0, atol=0)
                torch.testing.assert_close(p.grad, want_g, rtol=1e-4, atol=1e-6, msg=f"rank {r} {i}.{k}")
        assert sharded == 2 * 6   # qkv.weight/bias, proj.weight, fc1.weight/bias, fc2.weight per block


def test_heads_must_divide_over_the_tensor_group():
    with pytest.raises(ValueError, match="heads = 4 do not divide over a tensor group of 3"):
        gpt.build(layers=1, hidden=12, heads=4, seq=4, vocab=8, tensor_parallel=NoReduce(None, 0, 3))


def test_builder_without_tensor_parallel_gets_replicas():
    calls = []

    def plain(width=3):
        calls.append(width)
        return [torch.nn.Linear(width, width)]

    def opted(width=3, tensor_parallel=None):
        calls.append(tensor_parallel)
        return [torch.nn.Linear(width, width)]

    tp = NoReduce(None, 1, 2)
    assert not accepts_tensor_parallel(plain) and accepts_tensor_parallel(opted)
    assert not accepts_tensor_parallel(lambda **kw: None)   # only an explicit keyword opts in
    layers = build_layers(plain, {"width": 4}, tp)   # called as before: full layers, nothing marked
    assert calls == [4] and layers[0].weight.shape == (4, 4)
    assert all(shard_info(p) is None for p in layers[0].parameters())
    build_layers(opted, {"width": 4}, tp)
    assert calls[-1] is tp
    unet = load_example("unet")
    assert not accepts_tensor_parallel(unet.build)
    assert accepts_tensor_parallel(gpt.build)


TP_PLAN = """
plan tp_coords {
  cluster {
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu  x 5 : bandwidth 150 GB/s,  latency 2 us
  }
  model "ROOT/examples/gpt.py:build" { layers = 4, hidden = 64, heads = 4, seq = 32, vocab = 256 }
  loss  "ROOT/examples/gpt.py:loss"
  data  "ROOT/examples/gpt.py:batches"
  stage 0 : layers 0..3 on devices 0..4 as (data = 2, tensor = 2)
  stage 1 : layers 3..5 on devices 4..8 as (tensor = 2, data = 2)
  stage 2 : layers 5..6 on devices 8..9 as (data = 1)
  transfer h1 : f32[8, 32, 64] from stage 0 to stage 1
  transfer h2 : f32[8, 32, 64] from stage 1 to stage 2
  reduce gradients over data
  train { micro_batch = 8, micro_batches = 2, steps = 1, schedule = gpipe, optimizer = sgd(lr = 0.1),
          precision = fp32, seed = 1 }
}
"""


def _tp_plan_json():
    from planc.driver.compile import compile_program
    from planc.lang import load_text
    return compile_program(load_text(TP_PLAN.replace("ROOT", str(ROOT)), "tp_coords.plan"), probe=None).plan_json


def _explicit_tensor_coord(device):
    """(tensor coordinate, tensor group) from the stage lines above: row-major meshes, stage 0 is
    data x tensor on 0..3 (tensor = column), stage 1 is tensor x data on 4..7 (tensor = row)."""
    if device < 4:
        i, j = divmod(device, 2)
        return j, (2 * i, 2 * i + 1)
    i, j = divmod(device - 4, 2)
    return i, (4 + j, 6 + j)


def test_context_from_plan_uses_the_tensor_coordinate():
    from planc.plan import Plan
    from schedule_util import compute_lists, set_compute_lists
    d = _tp_plan_json()
    plan = Plan.from_json(d)
    assert plan.tensor_groups == ((0, 1), (2, 3), (4, 6), (5, 7))
    groups = {tuple(g): f"g{g}" for g in d["groups"]}
    for rank in range(8):
        coord, members = _explicit_tensor_coord(rank)
        tp = context_from_plan(plan, groups, rank)
        assert (tp.group, tp.rank, tp.size, tp.members) == (groups[members], coord, 2, members), rank
    assert context_from_plan(plan, groups, 8) is None      # stage 2 has no tensor axis
    assert context_from_plan(plan, groups, 9) is None      # idle device
    with pytest.raises(KeyError, match=r"tensor group \[4, 6\] is not in plan.json"):
        context_from_plan(plan, {k: v for k, v in groups.items() if k != (4, 6)}, 6)

    # the same plan as a placement may lay it out: stage 0's mesh data x tensor = [[3, 1], [2, 0]], so
    # tensor coordinate 0 is the higher rank of each group (the shard index is the coordinate, not
    # the place in the sorted group); every stage-0 field is rewritten to match, transfers dropped
    st = d["stages"][0]
    st["mesh"], st["mesh_devices"] = [[3, 1], [2, 0]], [3, 1, 2, 0]
    st["rows"] = {"0": [4, 8], "1": [0, 4], "2": [4, 8], "3": [0, 4]}
    st["data_groups"], st["model_groups"] = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    d["tensor_groups"] = [[0, 2], [1, 3], [4, 6], [5, 7]]
    d["groups"] = [list(g) for g in sorted({tuple(g) for g in d["groups"]} | {(0, 2), (1, 3)})]
    d["transfers"] = []
    set_compute_lists(d, compute_lists(d))   # the actions without the dropped transfers' sends and receives
    permuted = Plan.from_json(d)
    groups = {tuple(g): f"g{list(g)}" for g in d["groups"]}
    tp = context_from_plan(permuted, groups, 0)
    assert (tp.group, tp.rank, tp.size, tp.members) == (groups[(0, 2)], 1, 2, (0, 2))
    assert context_from_plan(permuted, groups, 2).rank == 0
    assert context_from_plan(permuted, groups, 3).rank == 0 and context_from_plan(permuted, groups, 1).rank == 1
    assert [context_from_plan(permuted, groups, r).rank for r in range(4, 8)] == [0, 0, 1, 1]

    # no tensor axis anywhere: no context
    flat = TP_PLAN.replace("(data = 2, tensor = 2)", "(data = 4)").replace("(tensor = 2, data = 2)", "(data = 4)")
    from planc.driver.compile import compile_program
    from planc.lang import load_text
    none = Plan.from_json(compile_program(load_text(flat.replace("ROOT", str(ROOT)), "flat.plan")).plan_json)
    assert none.tensor_groups == ()
    assert all(context_from_plan(none, groups, r) is None for r in range(10))


def test_compiler_lists_tensor_groups(tmp_path):
    from planc.driver.compile import compile_file
    from e2e_util import spelled
    text = spelled("gpt-2x4.plan").read_text().replace('"../../examples/', f'"{ROOT}/examples/')
    # no reduction over tensor (none declared): no other pass uses the tensor groups, they are appended
    assert "over tensor" not in text
    path = tmp_path / "gpt.plan"
    path.write_text(text)
    plan = compile_file(path, probe=False).plan_json
    tg = plan["tensor_groups"]
    assert len(tg) == 4 and all(len(g) == 2 and g == sorted(g) for g in tg) and tg == sorted(tg)
    # appended after the other passes' groups (none repeated), in tensor_groups order
    assert all(g in plan["groups"] for g in tg)
    n = len(plan["groups"])
    k = next(i for i in range(n) if all(h in tg for h in plan["groups"][i:]))
    assert k < n and plan["groups"][k:] == [g for g in tg if g in plan["groups"][k:]]
    for st in plan["stages"]:   # devices equal on every mesh dimension but tensor
        k = st["mesh_axes"].index("tensor")
        rows = st["mesh"] if k == 1 else [list(c) for c in zip(*st["mesh"])]
        assert sorted(sorted(r) for r in rows) == sorted(g for g in tg if set(g) <= set(st["devices"]))
    no_tensor = path.read_text().replace("    tensor = 2\n", "").replace("data = 2", "data = 4").replace(
        "place = [[1, 2], [2, 1], [1, 2]]", "place = auto")   # the spelled copy pins the probed choice
    path.write_text(no_tensor)
    assert "tensor_groups" not in compile_file(path, probe=False).plan_json
