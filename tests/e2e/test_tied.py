"""Parameters tied across stages (docs/reduction.md, "Tied parameters"): found by the probe, reduced over
the devices of every stage holding them, checked by the independent checkers, and trained by gloo ranks
exactly as one process trains the model with one parameter.

The launches (2-4 CPU ranks, 3 steps) are compared with single-process references that know nothing of
planc's runtime: GPT-2 against transformers' own ``GPT2LMHeadModel`` with tied embeddings; a builder
model that shares one ``nn.Linear`` between its first and its last layer against
``e2e_util.independent_reference`` (plain torch; its optimizer and ``clip_grad_norm_`` see the shared
parameter once).
"""
from __future__ import annotations

import json

import pytest

from e2e_util import ROOT, _load_callable, compare_dumps, edit_plan, independent_reference, stage_ranks, \
    start_ranks, step_lines

STEPS = 3

MODEL = '''
"""A chain whose first and last layers share one nn.Linear; the middle layers split over a tensor group."""
import torch
from torch import nn


class Shared(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return torch.tanh(self.lin(x))


class MLP(nn.Module):
    """Megatron's MLP: fc1 split by output rows, fc2 by input columns, the partial sums all-reduced."""

    def __init__(self, width, tp=None):
        super().__init__()
        self.fc1, self.fc2, self.tp = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), tp
        if tp is not None and tp.size > 1:
            self.fc1.weight = tp.shard(self.fc1.weight, 0)
            self.fc1.bias = tp.shard(self.fc1.bias, 0)
            self.fc2.weight = tp.shard(self.fc2.weight, 1)

    def forward(self, x):
        if self.tp is None or self.tp.size == 1:
            return x + self.fc2(torch.tanh(self.fc1(x)))
        h = torch.tanh(self.fc1(self.tp.copy_to_region(x)))
        return x + self.tp.reduce_from_region(nn.functional.linear(h, self.fc2.weight)) + self.fc2.bias


def build(width=8, layers=4, tensor_parallel=None):
    lin = nn.Linear(width, width)
    return [Shared(lin), *[MLP(width, tensor_parallel) for _ in range(layers - 2)], Shared(lin)]


def loss(out, y):
    return ((out - y) ** 2).mean()


def batches(micro_batch, seed, width=8, **_):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, width, generator=g)
        yield x, torch.sin(2 * x)
'''


def _plan(devices: int, stage0: str, stage1: str, train: str = "", typed: bool = False) -> str:
    hidden = "hidden : f32[4, 8] " if typed else "hidden "
    return f"""plan tied {{
  cluster {{
    level node x 1 : bandwidth 1 GB/s, latency 50 us
    level cpu  x {devices} : bandwidth 10 GB/s, latency 2 us
    host = node
  }}
  model "tiedmodel.py:build" {{ width = 8, layers = 4 }}
  loss  "tiedmodel.py:loss"
  data  "tiedmodel.py:batches"
  stage 0 : layers 0..2 {stage0}
  stage 1 : layers 2..4 {stage1}
  transfer {hidden}from stage 0 to stage 1
  reduce gradients over data
  train {{
    micro_batch = 4, micro_batches = 2, steps = {STEPS}
    schedule = 1f1b, optimizer = sgd(lr = 0.5), precision = fp32, seed = 5
    {train}
  }}
}}
"""


def _compile(tmp_path, text: str, probe: bool = True):
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    (tmp_path / "tiedmodel.py").write_text(MODEL)
    src = tmp_path / "tied.plan"
    src.write_text(text)
    compiled = compile_file(src, probe=probe)
    out = tmp_path / "out"
    write_output(compiled.plan_json, compiled.program, out)
    return compiled, out


def _tied(plan: dict) -> list[dict]:
    return [r for r in plan["reductions"] if "tied" in r]


# ---------------------------------------------------------------- detection and planning (no launch)

def test_shared_parameters_finds_a_module_used_by_two_layers():
    from torch import nn
    from planc.runtime.tied import shared_parameters
    lin, other = nn.Linear(2, 2), nn.Linear(2, 2)
    twice = nn.ModuleDict({"a": lin, "b": lin})   # one layer using it twice: one parameter, not a tie
    layers = [nn.Sequential(lin), nn.Sequential(other), twice, nn.ModuleDict({"head": lin})]
    assert shared_parameters(layers) == [[(0, "0.weight"), (2, "a.weight"), (3, "head.weight")],
                                         [(0, "0.bias"), (2, "a.bias"), (3, "head.bias")]]
    assert shared_parameters([nn.Sequential(lin), nn.Sequential(other)]) == []


def test_a_tie_the_tensor_axis_would_split_is_refused_at_the_stage(tmp_path):
    """The shared Linear split over a tensor group (the builder shards it): every copy of a tied parameter
    must take the same whole update, so the compiler refuses the plan at the stage whose tensor axis
    splits it, naming the holders; the same model with that stage replicated compiles with its tie."""
    from planc.lang.errors import PlanError
    split_model = MODEL.replace(
        "    lin = nn.Linear(width, width)\n",
        "    lin = nn.Linear(width, width)\n"
        "    if tensor_parallel is not None and tensor_parallel.size > 1:\n"
        "        lin.weight = tensor_parallel.shard(lin.weight, 0)\n")
    assert split_model != MODEL
    text = _plan(4, "on devices 0..2 as (data = 2)", "on devices 2..4 as (tensor = 2)")
    (tmp_path / "tiedmodel.py").write_text(split_model)
    (tmp_path / "tied.plan").write_text(text)
    from planc.driver.compile import compile_file
    with pytest.raises(PlanError) as e:
        compile_file(tmp_path / "tied.plan")
    msg = str(e.value)
    stage1 = next(i for i, line in enumerate(text.splitlines(), 1) if line.lstrip().startswith("stage 1"))
    assert f"tied.plan:{stage1}:" in msg, msg
    assert "stage 1 splits a parameter tied across stages over its 'tensor' axis (2)" in msg, msg
    assert "layers.0.lin.weight (stage 0), layers.3.lin.weight (stage 1)" in msg, msg
    assert "Traceback" not in msg
    # the bias is not split: only the weight's tie is refused, once
    assert msg.count("splits a parameter") == 1, msg
    (tmp_path / "tied.plan").write_text(_plan(4, "on devices 0..2 as (data = 2)", "on devices 2..4 as (data = 2)"))
    assert len(_tied(compile_file(tmp_path / "tied.plan").plan_json)) == 2


def test_unequal_tensor_degrees_count_tensor_replicas_once(tmp_path):
    """Stage 0 data = 2, stage 1 tensor = 2: one group of the 4 devices, tensor coordinate 1 enters zeros;
    the plan passes the contract's outside checker, and the independent checker rejects mutations."""
    import plan_contract
    from planc import plan as P
    from planc.reduction.check import check_tied
    compiled, out = _compile(tmp_path, _plan(4, "on devices 0..2 as (data = 2)", "on devices 2..4 as (tensor = 2)"))
    plan = compiled.plan_json
    tied = _tied(plan)
    assert [t["tied"]["parameter"] for t in tied] == ["layers.0.lin.weight", "layers.0.lin.bias"]
    for t in tied:
        assert t["groups"] == [[0, 1, 2, 3]] and t["tied"]["contributors"] == [0, 1, 2]
        assert t["tied"]["norm_device"] == 0
        assert [(h["stage"], h["layer"]) for h in t["tied"]["holders"]] == [(0, 0), (1, 3)]
    assert tied[0]["bytes"] == 8 * 8 * 4
    violations, _ = plan_contract.check(out)
    assert violations == []

    keys = {0: (0, (0,)), 1: (0, (1,)), 2: (1, ()), 3: (1, ())}
    steps = [(s["collective"], s["groups"]) for s in tied[0]["program"]["steps"]]
    assert check_tied(steps, [[0, 1, 2, 3]], [0, 1, 2], keys) is None
    assert "contributions" in check_tied(steps, [[0, 1, 2, 3]], [0, 1, 2, 3], keys)   # a tensor replica twice
    # a group missing a holder: the program leaves device 3 out
    why = check_tied([("allreduce", [[0, 1, 2]])], [[0, 1, 2]], [0, 1, 2], keys)
    assert why is not None and "3" in why

    doc = json.loads((out / "plan.json").read_text())   # the same mutation in plan.json: refused three ways
    i = next(k for k, r in enumerate(doc["reductions"]) if "tied" in r)
    doc["reductions"][i]["groups"] = [[0, 1, 2]]
    doc["reductions"][i]["program"]["steps"][0]["groups"] = [[0, 1, 2]]
    doc["groups"].append([0, 1, 2])
    (out / "plan.json").write_text(json.dumps(doc))
    violations, _ = plan_contract.check(out)
    assert any("do not partition the holding stages' devices" in v for v in violations), violations
    with pytest.raises(P.PlanFileError, match=r"reductions\[\d\]\.groups: a tied parameter's groups"):
        P.Plan.from_json(doc).check()


def test_equal_tensor_degrees_reduce_per_tensor_coordinate():
    from planc import ir
    from planc.reduction.tied import tied_groups
    a = ir.StageLayout(0, (0, 2), (2, 2), ("data", "tensor"), (0, 1, 2, 3))
    b = ir.StageLayout(1, (2, 4), (2,), ("tensor",), (4, 5))
    groups, contributors = tied_groups([a, b])
    assert groups == ((0, 2, 4), (1, 3, 5)) and contributors == (0, 1, 2, 3, 4, 5)
    c = ir.StageLayout(1, (2, 4), (1,), ("data",), (4,))
    groups, contributors = tied_groups([a, c])
    assert groups == ((0, 1, 2, 3, 4),) and contributors == (0, 2, 4)


# ---------------------------------------------------------------- launches against references

def _run(out, world: int, plan: dict, **ref):
    rc, rank0, every = start_ranks(out, world, "--steps", STEPS, "--dump-params", out / "dump")
    assert rc == 0, every[-4000:]
    record: dict = {}
    losses, state = independent_reference(plan, out, STEPS, record=record, **ref)
    got = step_lines(rank0)
    assert [got[s]["loss"] for s in range(STEPS)] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    assert losses[-1] != losses[0]
    compare_dumps(out / "dump", stage_ranks(plan), state, rtol=1e-4, atol=1e-6)
    _copies_identical(out / "dump", plan)
    return got, record, rank0


def _copies_identical(dump, plan: dict) -> None:
    """Every holder's copy of every tied parameter is bitwise the same: the identical update on every rank."""
    import torch
    dumps = {r: torch.load(dump / f"rank{r}.pt") for r in stage_ranks(plan)}
    for t in _tied(plan):
        names = {f"layers.{h['layer']}.{h['name']}" for h in t["tied"]["holders"]}
        copies = [(r, k, v) for r, d in dumps.items() for k, v in d.items() if k in names]
        assert sorted({r for r, _, _ in copies}) == sorted(d for g in t["groups"] for d in g)
        for r, k, v in copies[1:]:
            assert torch.equal(v, copies[0][2]), f"rank {r} {k} differs from rank {copies[0][0]} {copies[0][1]}"


@pytest.mark.slow
def test_shared_linear_across_a_data_stage_and_a_tensor_stage_with_clip(tmp_path):
    """The first layer on 2 data devices, the last on 2 tensor devices, SGD with clip: every copy of the
    shared Linear ends equal to the single process's, and the clipped norm counts it once."""
    from planc import plan as P
    _, out = _compile(tmp_path, _plan(4, "on devices 0..2 as (data = 2)", "on devices 2..4 as (tensor = 2)"))
    plan = edit_plan(out, clip=0.05)
    got, record, _ = _run(out, 4, plan)
    assert [got[s]["grad_norm"] for s in range(STEPS)] == pytest.approx(record["grad_norm"], rel=1e-4)
    assert min(record["grad_norm"]) > 0.05   # the clip acts: a norm counted twice would scale differently
    assert P.load(out / "plan.json").train.clip == 0.05


@pytest.mark.slow
def test_equal_tensor_degrees_reduce_per_coordinate_at_run_time(tmp_path):
    """Both stages on 2 tensor devices: the shared Linear is summed by two groups, one per tensor coordinate
    ([0, 2] and [1, 3]), every device contributing; SGD with momentum, as the single process."""
    from planc import plan as P
    _, out = _compile(tmp_path, _plan(4, "on devices 0..2 as (data = 1, tensor = 2)",
                                      "on devices 2..4 as (data = 1, tensor = 2)"))
    plan = edit_plan(out, optimizer=P.Optimizer.make("sgd", 0.2, momentum=0.9))
    for t in _tied(plan):
        assert t["groups"] == [[0, 2], [1, 3]] and t["tied"]["contributors"] == [0, 1, 2, 3]
    _run(out, 4, plan)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_one_with_a_tie_and_adamw(tmp_path, zero):
    """zero = 1 (and 2) on a stage of 2 data devices, the tie reaching a stage of one device: the tied parameter
    stays outside the sharded buffers (a replicated fp32 master, with zero 2 a whole gradient of its own);
    AdamW as the single process's."""
    _, out = _compile(tmp_path, _plan(3, "on devices 0..2 as (data = 2)", "on devices 2..3 as (data = 1)",
                                      f"zero = {zero}"))
    from planc import plan as P
    plan = edit_plan(out, optimizer=P.Optimizer.make("adamw", 1e-2))
    assert plan["train"]["zero"] == zero
    assert any(r.get("target") == "reduce_scatter" for r in plan["reductions"])
    (t, _) = _tied(plan)
    assert t["groups"] == [[0, 1, 2]] and t["tied"]["contributors"] == [0, 1, 2]
    _run(out, 3, plan)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_bf16_masters_and_zero_one_with_a_tie(tmp_path, zero):
    """bf16 with zero = 1 (and 2) and clip: the tied parameter's fp32 master is replicated on its holders, every
    copy steps identically, and the update is the fp32 reference's within bf16's tolerance (a 5 % rate error
    is not)."""
    _, out = _compile(tmp_path, _plan(3, "on devices 0..2 as (data = 2)", "on devices 2..3 as (data = 1)",
                                      f"zero = {zero}, clip = 0.05"))
    run_bf16(out, edit_plan(out, transfer_dtype="bf16", precision="bf16"), 3)


def run_bf16(out, plan: dict, world: int) -> None:
    """A bf16 launch of ``STEPS`` steps against the fp32 reference within bf16's tolerance: losses at rel
    1e-2, the update's error under 2 % while a 5 % rate error's is over it, every tied copy identical."""
    from e2e_util import update_error
    rc, rank0, every = start_ranks(out, world, "--steps", STEPS, "--dump-params", out / "dump")
    assert rc == 0 and "Traceback" not in every, every[-4000:]
    losses, state = independent_reference(plan, out, STEPS)
    _, init = independent_reference(plan, out, 0)
    got = step_lines(rank0)
    assert [got[s]["loss"] for s in range(STEPS)] == pytest.approx(losses, rel=1e-2)
    assert update_error(out / "dump", plan, state, init) < 0.02
    _, wrong = independent_reference(plan, out, STEPS, lr_factor=1.05)
    assert update_error(out / "dump", plan, wrong, init) > 0.02
    _copies_identical(out / "dump", plan)


@pytest.mark.slow
def test_a_plan_without_the_tie_is_refused_at_launch(tmp_path):
    """Compiled without the probe (the transfer's type written out), the plan knows nothing of the tie: the
    ranks refuse it, naming the layers, instead of letting the copies drift apart."""
    compiled, out = _compile(tmp_path, _plan(2, "on devices 0..1 as (data = 1)", "on devices 1..2 as (data = 1)",
                                             typed=True), probe=False)
    assert _tied(compiled.plan_json) == []
    rc, _, every = start_ranks(out, 2, "--steps", 1)
    assert rc != 0
    assert "ties one parameter across stages (layers.0.lin.weight (stage 0), layers.3.lin.weight (stage 1))" in every


# ---------------------------------------------------------------- GPT-2 with tied embeddings

def _hf_reference(plan: dict, steps: int):
    """GPT2LMHeadModel (tied embeddings: one parameter) trained in this process with the plan's optimizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from test_hf_gpt2 import planc_name
    train = plan["train"]
    a = dict(train["model"]["args"])
    torch.manual_seed(train["seed"])
    model = GPT2LMHeadModel(GPT2Config(n_layer=a["layers"], n_embd=a["hidden"], n_head=a["heads"], n_positions=a["seq"],
                                       vocab_size=a["vocab"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       tie_word_embeddings=True, bos_token_id=a["vocab"] - 1,
                                       eos_token_id=a["vocab"] - 1))
    assert model.lm_head.weight is model.transformer.wte.weight
    opt = dict(train["optimizer"])
    name, lr = opt.pop("name"), opt.pop("lr")
    opt["betas"] = tuple(opt["betas"])
    optimizer = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name](model.parameters(), lr=lr, **opt)
    data = _load_callable(ROOT / "examples", train["data"])(train["micro_batch"], train["seed"], **a)
    losses = []
    for _ in range(steps):
        rows = [next(data) for _ in range(train["micro_batches"])]
        loss = model(input_ids=torch.cat([x for x, _ in rows]), labels=torch.cat([y for _, y in rows])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    named = dict(model.named_parameters(remove_duplicate=False))
    return losses, {planc_name(k, a["layers"]): v.detach().clone() for k, v in named.items()}


@pytest.mark.slow
def test_gpt2_tied_embeddings_on_unequal_meshes_with_adamw(tmp_path):
    """plans/hf-gpt2.plan (embeddings on stage 0's one device, the head on stage 1's two data devices), AdamW:
    the embedding on stage 0 and the head on stage 1 end equal to the HF model's one tied weight."""
    pytest.importorskip("transformers", reason="transformers (the 'hf' extra) is not installed")
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    from planc import plan as P
    out = tmp_path / "out"
    compiled = compile_file(ROOT / "plans" / "hf-gpt2.plan")
    write_output(compiled.plan_json, compiled.program, out)
    # eps well above rounding noise: GPT-2's key biases have gradients that are zero up to rounding, which
    # Adam's default eps would turn into full steps of either sign (docs/training.md)
    plan = edit_plan(out, optimizer=P.Optimizer.make("adamw", 1e-2, eps=1e-3))
    (t,) = _tied(plan)
    assert t["groups"] == [[0, 1, 2]] and t["tied"]["contributors"] == [0, 1, 2]
    rc, rank0, every = start_ranks(out, 3, "--steps", STEPS, "--dump-params", out / "dump")
    assert rc == 0, every[-4000:]
    losses, state = _hf_reference(plan, STEPS)
    got = step_lines(rank0)
    assert [got[s]["loss"] for s in range(STEPS)] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    compare_dumps(out / "dump", stage_ranks(plan), state, rtol=1e-4, atol=1e-6)
    assert P.load(out / "plan.json").reductions[-1].tied.parameter == "layers.0.wte.weight"
