"""The training regime's pieces in one process (planc/runtime/regime.py, grads.py), against plain torch:
bf16 gradients accumulated in fp32 buckets, the optimizer step over fp32 masters (clip, schedule, AdamW)
against torch.optim.AdamW + clip_grad_norm_, ZeRO-1 fragments (two owners' halves) against the whole
optimizer, the gradient norm's counting rule, and the ds_config DeepSpeed must leave its own regime off
in. The multi-process runs: test_e2e_regime.py."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from planc import plan as P
from planc.runtime.grads import GradientBuckets
from planc.runtime.regime import Regime, cast_stage

from e2e_util import schedule_factor


def train_record(**kw) -> P.Train:
    base = P.Train(P.CodeRef("m.py", "build"), P.CodeRef("m.py", "loss"), P.CodeRef("m.py", "batches"),
                   micro_batch=4, micro_batches=2, steps=4, schedule=P.Schedule("1f1b"),
                   optimizer=P.Optimizer.make("sgd", 0.1), precision=P.Precision("fp32"), seed=0, trainable=True,
                   not_trainable_because=())
    return dataclasses.replace(base, **kw)


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def batches(n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(n)]


def test_bf16_gradients_accumulate_into_fp32_buckets():
    m = model()
    cast_stage([m], "bf16")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    buckets = GradientBuckets(m.parameters(), None, torch.device("cpu"), bucket_bytes=64)
    buckets.attach()
    want = {id(p): torch.zeros(p.shape) for p in m.parameters()}
    for x, y in batches(2):
        probe = model()
        cast_stage([probe], "bf16")
        probe.load_state_dict(m.state_dict())
        torch.nn.functional.mse_loss(probe(x.bfloat16()).float(), y).backward()
        for p, q in zip(m.parameters(), probe.parameters()):
            want[id(p)] += q.grad.float()       # each micro-batch's bf16 gradient, summed in fp32
        torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
        assert all(p.grad is None for p in m.parameters())   # moved into the bucket by the hook
    buckets.finish()
    assert len(buckets.buckets) > 1 and all(b.dtype == torch.float32 for b, _ in buckets.buckets)
    for p in m.parameters():
        assert torch.equal(buckets.view(p), want[id(p)])


def step_like_torch(reference, params, train, t):
    clip = train.clip
    norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip is not None else None
    for g in reference.param_groups:
        g["lr"] = train.optimizer.lr * schedule_factor(train.lr_schedule.to_json(), t)
    reference.step()
    reference.zero_grad()
    return norm


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_step_is_torch_adamw_with_clip_and_schedule_on_fp32_masters(precision):
    train = train_record(optimizer=P.Optimizer.make("adamw", 0.05, weight_decay=0.1), clip=0.2,
                         lr_schedule=P.LrSchedule("warmup_cosine", 2, 4, 0.1), precision=P.Precision(precision))
    m, ref = model(), model()
    initial = cast_stage([m], precision)
    buckets = GradientBuckets(m.parameters(), None, torch.device("cpu"))
    regime = Regime(train, buckets, torch.device("cpu"), initial=initial)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    dtype = next(m.parameters()).dtype
    for t, (x, y) in enumerate(batches(4)):
        buckets.attach()
        torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
        buckets.finish()
        report = regime.step()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        norm = step_like_torch(opt, list(ref.parameters()), train, t)
        assert report["lr"] == pytest.approx(0.05 * schedule_factor(train.lr_schedule.to_json(), t))
        tol = 1e-6 if precision == "fp32" else 2e-2
        assert float(report["norm"]) == pytest.approx(float(norm), rel=tol)
    masters = regime.whole_masters()
    for p, q in zip(m.parameters(), ref.parameters()):
        master = masters.get(id(p), p)
        assert master.dtype == torch.float32
        if precision == "fp32":
            torch.testing.assert_close(master, q, rtol=1e-6, atol=1e-7)
        else:   # the bf16 parameter is the master rounded
            assert torch.equal(p, master.to(torch.bfloat16))
            torch.testing.assert_close(master, q, rtol=0, atol=2e-2)
    assert regime.t == 4


class NoGather:
    granule = 1

    def run(self, flat):
        return flat


def test_zero1_fragments_step_as_the_whole_optimizer():
    """Two owners of complementary element ranges of each bucket (as a reduce-scatter leaves them, both
    holding the summed gradient here), each stepping AdamW over its fragments only: together they are
    the whole optimizer's step, element for element; the parameters are views of the flat buffer."""
    train = train_record(optimizer=P.Optimizer.make("adamw", 0.05, weight_decay=0.1))
    models = [model(), model()]
    full = model()
    opt = torch.optim.AdamW(full.parameters(), lr=0.05, weight_decay=0.1)
    regimes, all_buckets = [], []
    for owner, m in enumerate(models):
        buckets = GradientBuckets(m.parameters(), None, torch.device("cpu"), bucket_bytes=48)
        owned = []
        for buf, _ in buckets.buckets:
            half = buf.numel() // 2 + 1          # a cut inside a parameter
            owned.append([(0, half)] if owner == 0 else [(half, buf.numel())])
        regimes.append(Regime(train, buckets, torch.device("cpu"), owned=owned, gather=NoGather()))
        all_buckets.append(buckets)
    assert any(f.lo > 0 or f.hi < f.param.numel() for f in regimes[1].fragments)   # a parameter is split
    for x, y in batches(3):
        for m, buckets in zip(models, all_buckets):
            buckets.attach()
            torch.nn.functional.mse_loss(m(x), y).backward()
            buckets.finish()
        for r in regimes:
            r.step()
        for mine, theirs in zip(regimes[0].pbufs, regimes[1].pbufs):   # the all-gather, by hand
            cut = mine.numel() // 2 + 1
            mine[cut:] = theirs[cut:]
            theirs[:cut] = mine[:cut]
        torch.nn.functional.mse_loss(full(x), y).backward()
        opt.step()
        opt.zero_grad()
    for m in models:
        for p, q in zip(m.parameters(), full.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_norm_counts_each_element_once_over_data_and_tensor():
    """The counting rule: the k-th of D equal parts of each bucket's gradients, parameters replicated over
    the tensor group at tensor position 0 only; over D ranks and both tensor positions every element of
    a sharded parameter, and of a replicated one once."""
    m = model()
    shard = m[0].weight
    shard.planc_shard = (0, 0, 2)             # a tensor-parallel shard; the rest replicated
    buckets = GradientBuckets(m.parameters(), None, torch.device("cpu"))
    buckets.attach()
    for buf, _ in buckets.buckets:
        buf.copy_(torch.arange(1, buf.numel() + 1, dtype=torch.float32))
    train = train_record(clip=1.0)
    total = {}
    for tensor_index in (0, 1):
        s = 0.0
        for k in range(3):
            r = Regime(train, buckets, torch.device("cpu"), tensor_index=tensor_index, share=(k, 3))
            s += sum(float(v.pow(2).sum()) for v in r.counted)
        total[tensor_index] = s
    grads = {id(p): buckets.view(p) for p in m.parameters()}
    every = sum(float(g.pow(2).sum()) for g in grads.values())
    assert total[0] == pytest.approx(every)
    assert total[1] == pytest.approx(float(grads[id(shard)].pow(2).sum()))
    assert math.isfinite(total[0])


def test_deepspeed_leaves_precision_zero_and_clipping_to_the_engine(tmp_path):
    from planc.output.codegen import CodegenError, ds_config, write_output
    from planc.driver.compile import compile_file
    from planc.runtime.dsplan import check_ds_config
    from planc.runtime.dataflow import EngineError
    from e2e_util import ROOT, spelled
    text = spelled("gpt-2x4.plan").read_text().replace("../../examples/", str(ROOT / "examples") + "/")
    src = tmp_path / "p.plan"
    src.write_text(text.replace("precision = fp32", "precision = bf16"))
    c = compile_file(src, probe=False)
    cfg = ds_config(c.plan_json, c.program)
    assert "bf16" not in cfg and "fp16" not in cfg and cfg["zero_optimization"] == {"stage": 0}
    assert cfg["gradient_clipping"] == 0.0
    check_ds_config(cfg)
    for bad in ({"bf16": {"enabled": True}}, {"fp16": {"enabled": True}}, {"zero_optimization": {"stage": 1}},
                {"gradient_clipping": 1.0}):
        with pytest.raises(EngineError, match="planc's engine runs the precision, ZeRO and clipping"):
            check_ds_config({**cfg, **bad})
    (tmp_path / "ds.yaml").write_text("bf16:\n  enabled: true\n")
    program = dataclasses.replace(c.program, deepspeed_overrides="ds.yaml", source_dir=str(tmp_path))
    with pytest.raises(CodegenError, match="bf16.enabled: the precision is the plan's"):
        write_output(c.plan_json, program, tmp_path / "out")


def test_zero1_leaves_a_parameter_no_member_used_alone(tmp_path):
    """zero = 1: the no-gradient flags are summed over the data group (here a gloo group of one, in this
    process); an owner leaves the fragments of a parameter nobody produced a gradient for untouched,
    as torch leaves a parameter whose .grad is None (AdamW's weight decay would move it)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        m, unused = model(), torch.nn.Linear(3, 3)
        params = list(m.parameters()) + list(unused.parameters())
        buckets = GradientBuckets(params, None, torch.device("cpu"))
        owned = [[(0, buf.numel() // 2 + 1)] for buf, _ in buckets.buckets]
        train = train_record(optimizer=P.Optimizer.make("adamw", 0.05, weight_decay=0.5))
        regime = Regime(train, buckets, torch.device("cpu"), owned=owned, gather=NoGather())
        held = {id(f.param) for f in regime.fragments}
        assert id(unused.weight) in held and id(m[2].weight) in held
        before = {id(p): p.detach().clone() for p in params}
        x, y = batches(1)[0]
        buckets.attach()
        torch.nn.functional.mse_loss(m(x), y).backward()
        buckets.finish(flags_group=dist.group.WORLD)
        assert buckets.no_gradient == {id(p) for p in unused.parameters()}
        regime.step()
        for p in unused.parameters():
            assert torch.equal(p, before[id(p)])
        assert not torch.equal(m[2].weight, before[id(m[2].weight)])
    finally:
        dist.destroy_process_group()
