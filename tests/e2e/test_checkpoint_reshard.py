"""Checkpoints that outlive their plan: saved under one plan, resumed under another (docs/runtime.md
"Checkpoints", format 2).

One tiny GPT (2 blocks, hidden 16), fp32, AdamW + warmup_cosine + clip (so the optimizer state, the step
count and the schedule's position all matter), under four plans of the same model and global batch:

- ``a``: 4 ranks on 1 host, stage 0 (embedding, block 1) on a data-2 mesh with zero = 1, stage 1
  (block 2, head) on a tensor-2 mesh (GPT opts in: block 2 really is sharded);
- ``b``: 2 ranks on 2 hosts, one stage, data 2, zero = 0;
- ``c``: 3 ranks, 3 stages cut at layers 1 and 3;
- ``d``: 4 ranks on 2 hosts, stage 0 (layers 0..3) on a tensor-2 mesh, stage 1 (head) on data 2, zero = 1.

A chain of six launches, one step each after the first, each resuming the checkpoint the one before it
wrote: b[0] -> a[1] -> c[2] -> d[3] -> a[4] -> b[5]; five pairs that change pipe depth, stage cuts, data
and tensor degrees, zero 0 <-> 1 and the host count. Every launch's losses, rates and gradient norms must
be those of one uninterrupted ``independent_reference`` run (plain torch, one process, no planc code) at
rtol 1e-4, and the last launch's parameters the reference's after 6 steps; the negative controls (the
reference with gradients x2, or one data rank's rows missing) must fail that same comparison.

Then the refusals: a checkpoint without planc.json or with a truncated .distcp file is never loaded;
another model (hidden size, layer count) is refused naming the first differing parameters; another global
batch is refused, and with ``--weights-only`` its weights are taken (exactly the reference's after the
steps it holds).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

from e2e_util import ROOT, compare_dumps, independent_reference, stage_ranks, start_ranks

EXAMPLES = ROOT / "examples"
STEPS = 6

TEMPLATE = """
plan ckpt_NAME {
  cluster {
    level node x HOSTS : bandwidth 1 GB/s, latency 20 us
    level gpu  x GPUS : bandwidth 10 GB/s, latency 2 us
  }
  model "EXAMPLES/gpt.py:build" { layers = LAYERS, hidden = HIDDEN, heads = 2, seq = 8, vocab = 32 }
  loss  "EXAMPLES/gpt.py:loss"
  data  "EXAMPLES/gpt.py:batches"
BODY
  train {
    micro_batch = 8, micro_batches = MICRO, steps = 6, save_every = 2, timeout = 30 s
    schedule = 1f1b, precision = fp32, seed = 3, zero = ZERO
    optimizer = adamw(lr = 0.01, weight_decay = 0.1, eps = 1e-5, betas = (0.8, 0.99))
    lr_schedule = warmup_cosine(warmup = 2, min_ratio = 0.1), clip = 0.5
  }
}
"""
# eps 1e-5: GPT's key biases get gradients that are zero up to rounding, which Adam with eps 1e-8 would
# turn into full-size steps of any sign (no two summation orders agree; test_e2e_regime.py)

PLANS = {   # name: (hosts, gpus per host, zero, stage lines)
    "a": (1, 4, 1, """
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..4 on devices 2..4 as (tensor = 2)
  transfer h : f32[8, 8, 16] from stage 0 as S0 R R to stage 1 as R R R
  reduce gradients over data"""),
    "b": (2, 1, 0, """
  stage 0 : layers 0..4 on devices 0..2 as (data = 2)
  reduce gradients over data"""),
    "c": (1, 3, 0, """
  stage 0 : layers 0..1 on devices 0..1 as (data = 1)
  stage 1 : layers 1..3 on devices 1..2 as (data = 1)
  stage 2 : layers 3..4 on devices 2..3 as (data = 1)
  transfer h1 : f32[8, 8, 16] from stage 0 as R R R to stage 1 as R R R
  transfer h2 : f32[8, 8, 16] from stage 1 as R R R to stage 2 as R R R"""),
    "d": (2, 2, 1, """
  stage 0 : layers 0..3 on devices 0..2 as (tensor = 2)
  stage 1 : layers 3..4 on devices 2..4 as (data = 2)
  transfer h : f32[8, 8, 16] from stage 0 as R R R to stage 1 as S0 R R
  reduce gradients over data"""),
}
CHAIN = ["b", "a", "c", "d", "a", "b"]   # launch i trains step i (b: steps 0 only) and saves step i + 1


def plan_text(name: str, hosts=1, gpus=1, zero=0, body="", layers=2, hidden=16, micro=2) -> str:
    return (TEMPLATE.replace("NAME", name).replace("HOSTS", str(hosts)).replace("GPUS", str(gpus))
            .replace("ZERO", str(zero)).replace("BODY", body).replace("LAYERS", str(layers))
            .replace("HIDDEN", str(hidden)).replace("MICRO", str(micro)).replace("EXAMPLES", str(EXAMPLES)))


def single(name: str, layers=2, hidden=16, micro=2) -> str:
    """One rank, one stage holding the whole model."""
    body = f"\n  stage 0 : layers 0..{layers + 2} on devices 0..1 as (data = 1)"
    return plan_text(name, body=body, layers=layers, hidden=hidden, micro=micro)


def compile_text(tmp, name: str, text: str):
    path = tmp / f"{name}.plan"
    path.write_text(text)
    c = compile_file(path, probe=False)   # the transfers' types are written out; these tests are not about the probe
    assert not c.untrainable, "; ".join(d.message for d in c.untrainable)
    out = tmp / name
    write_output(c.plan_json, c.program, out)
    return out, json.loads((out / "plan.json").read_text())


def world(plan: dict) -> int:
    return max(d for st in plan["stages"] for d in st["devices"]) + 1


def main_in_process(out, *args):
    """planc.runtime.main.main on OUT (the refusals before any process group)."""
    from planc.runtime.main import main
    return main([*map(str, args)], out_dir=str(out))


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chain")
    compiled = {n: compile_text(tmp, n, plan_text(n, *spec)) for n, spec in PLANS.items()}
    runs = []
    for i, name in enumerate(CHAIN):
        out, plan = compiled[name]
        args = ["--steps", i + 1, "--save", tmp / f"ck{i}"]
        if i:
            args += ["--resume", tmp / f"ck{i - 1}"]
        if i == len(CHAIN) - 1:
            args += ["--dump-params", tmp / "dump"]
        rc, text, every = start_ranks(out, world(plan), *args)
        runs.append((rc, text, every))
    return {"tmp": tmp, "compiled": compiled, "runs": runs}


@pytest.mark.slow
def test_a_chain_of_plans_prints_the_losses_of_one_uninterrupted_run(chain):
    from e2e_util import assert_controls_fail, data_degree, step_lines
    tmp, compiled, runs = chain["tmp"], chain["compiled"], chain["runs"]
    a_out, a_plan = compiled["a"]
    record = {}
    ref_losses, ref_state = independent_reference(a_plan, a_out, STEPS, record=record, source=tmp / "a.plan")
    assert len(set(record["lr"])) == STEPS - 1 and max(record["grad_norm"]) > 0.5   # schedule and clip matter
    for i, (name, (rc, text, every)) in enumerate(zip(CHAIN, runs)):
        assert rc == 0 and "Traceback" not in every, every[-4000:]
        assert sorted(step_lines(text)) == list(range(0 if i == 0 else i, i + 1)), (name, text[-2000:])
        if i:
            before = CHAIN[i - 1]
            assert (f"resumed from {tmp / f'ck{i - 1}' / f'step{i}'} at step {i} (written by plan "
                    f"'ckpt_{before}' on {world(compiled[before][1])} ranks)" in text), text[-2000:]
    last = compiled[CHAIN[-1]][1]

    def compare(ref_losses, ref_state, record):
        for i, (name, (_, text, _)) in enumerate(zip(CHAIN, runs)):
            lines = step_lines(text)
            for s in lines:
                assert lines[s]["loss"] == pytest.approx(ref_losses[s], rel=1e-4, abs=1e-6), (i, name, s)
                assert lines[s]["lr"] == pytest.approx(record["lr"][s], rel=1e-6), (i, name, s)
                # AdamW barely sees a gradient scale in its parameters: the printed norm (clip) does
                assert lines[s]["grad_norm"] == pytest.approx(record["grad_norm"][s], rel=1e-4), (i, name, s)
        # the last launch's parameters: the reference's after every step
        compare_dumps(tmp / "dump", stage_ranks(last), ref_state, rtol=1e-4, atol=1e-5)

    compare(ref_losses, ref_state, record)
    assert_controls_fail(compare, a_plan, a_out, STEPS, source=tmp / "a.plan", data_parts=data_degree(a_plan))


@pytest.mark.slow
def test_every_rank_writes_only_the_rectangles_it_owns(chain):
    """Plan ``a``'s step-2 checkpoint (launch 1): planc.json's records, and DCP's chunks: block 2's
    tensor-parallel shards at their global offsets, stage 0's zero = 1 masters split between its data ranks,
    each rectangle written once."""
    from torch.distributed.checkpoint import FileSystemReader
    folder = chain["tmp"] / "ck1" / "step2"
    m = json.loads((folder / "planc.json").read_text())
    assert (m["format"], m["plan"], m["step"], m["world_size"], m["zero"], m["global_batch"]) == (
        2, "ckpt_a", 2, 4, 1, 16)
    assert m["data"] == {"drawn": 4} and sorted(m["rng"]) == ["0", "1", "2", "3"]
    assert m["regime"]["t"] == 2 and m["optimizer"]["name"] == "adamw"
    assert [(s["index"], s["layers"], s["tensor"], s["data"]) for s in m["sharding"]["stages"]] == [
        (0, [0, 2], 1, 2), (1, [2, 4], 2, 1)]
    assert sorted(m["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert m["bytes"] == sum(f.stat().st_size for f in folder.iterdir() if f.name != "planc.json")
    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    names = [p["name"] for p in m["parameters"]]
    assert {k for k in md} == {f"model.{n}" for n in names} | {f"optim.{n}.{s}" for n in names
                                                               for s in ("exp_avg", "exp_avg_sq")}
    shapes = {p["name"]: p["shape"] for p in m["parameters"]}
    for key, tmd in md.items():
        name = key.split(".", 1)[1].rsplit(".", 1)[0] if key.startswith("optim.") else key[len("model."):]
        assert list(tmd.size) == shapes[name], key
        assert sum(torch.Size(c.sizes).numel() for c in tmd.chunks) == torch.Size(tmd.size).numel(), key
    # block 2's fused q|k|v rows: rank 2 holds part 0 of each of the 3 blocks, rank 3 part 1
    qkv = md["model.layers.2.qkv.weight"]
    assert sorted(tuple(c.offsets) for c in qkv.chunks) == [(r * 8, 0) for r in range(6)]


@pytest.mark.slow
def test_a_partial_or_corrupted_checkpoint_is_never_loaded(chain, tmp_path, capsys):
    out = chain["compiled"]["a"][0]
    src = chain["tmp"] / "ck1" / "step2"

    def refused(path, *want):
        assert main_in_process(out, "--resume", path) == 2
        err = capsys.readouterr().err
        assert err.startswith("planc: rank 0: ") and "Traceback" not in err and err.count("\n") == 1, err
        for w in want:
            assert w in err, err

    cut = tmp_path / "cut"           # a save interrupted before planc.json
    shutil.copytree(src, cut / ".step2.partial")
    (cut / ".step2.partial" / "planc.json").unlink()
    refused(cut, "only an incomplete checkpoint is there (.step2.partial", "never loaded")
    refused(cut / ".step2.partial", "not a checkpoint", "an incomplete checkpoint is never loaded")
    damaged = tmp_path / "damaged"   # a .distcp file cut short after planc.json was written
    shutil.copytree(src, damaged)
    data = (damaged / "__1_0.distcp").read_bytes()
    (damaged / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    refused(damaged, f"--resume {damaged}: __1_0.distcp has {len(data) // 2} bytes, planc.json lists {len(data)} "
                     "(cut or changed)")
    (damaged / "__1_0.distcp").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))   # same size, one bit flipped
    refused(damaged, f"--resume {damaged}: __1_0.distcp's sha256 is ", "(the file was changed or damaged)")
    (damaged / "__1_0.distcp").unlink()
    refused(damaged, f"--resume {damaged}: __1_0.distcp is missing (planc.json lists it with {len(data)} bytes)")


@pytest.mark.slow
@pytest.mark.parametrize("layers,hidden,first", [
    (2, 24, "parameter 0 is layers.0.positions [8, 24] here, layers.0.positions [8, 16] in the checkpoint"),
    (3, 16, "this model has"),
])
def test_another_model_is_refused_naming_the_first_differing_parameters(chain, tmp_path, layers, hidden, first):
    out, plan = compile_text(tmp_path, "other", single("other", layers=layers, hidden=hidden))
    rc, text, every = start_ranks(out, 1, "--resume", chain["tmp"] / "ck1")
    assert rc == 2 and "Traceback" not in every, every[-3000:]
    assert "the checkpoint holds another model: " in text, text[-3000:]
    assert first in text, text[-3000:]
    if layers == 3:   # the first block's names agree; the head sits at another layer index
        m = json.loads((chain["tmp"] / "ck1" / "step2" / "planc.json").read_text())
        n = len(m["parameters"])
        assert (f"the checkpoint's {n}; parameter {n - 4} is layers.3.ln1.weight [16] here, "
                f"layers.3.ln.weight [16] in the checkpoint") in text, text[-3000:]


@pytest.mark.slow
def test_another_global_batch_is_refused_and_taken_with_weights_only(chain, tmp_path, capsys):
    out, plan = compile_text(tmp_path, "batch", single("batch", micro=4))
    ck = chain["tmp"] / "ck1"
    assert main_in_process(out, "--resume", ck) == 2
    err = capsys.readouterr().err
    assert ("the checkpoint was trained with a global batch of 16 samples (8 x 2), this plan's is 32 (8 x 4)"
            in err and "--weights-only" in err and "Traceback" not in err), err
    rc, text, every = start_ranks(out, 1, "--resume", ck, "--weights-only", "--steps", 0,
                                  "--dump-params", tmp_path / "dump")
    assert rc == 0 and "Traceback" not in every, every[-3000:]
    assert f"resumed from {ck / 'step2'} (weights only) of step 2" in text, text[-3000:]
    a_out, a_plan = chain["compiled"]["a"]
    _, ref_state = independent_reference(a_plan, a_out, 2)   # the weights after the 2 steps it holds
    compare_dumps(tmp_path / "dump", [0], ref_state, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_bf16_zero1_plan_takes_the_fp32_masters_of_an_fp32_run(chain, tmp_path):
    """Plan ``b`` in bf16 with zero = 1 resumes plan ``a``'s fp32 step-2 checkpoint: its fp32 masters (each
    data rank reading its owned half, then all-gathered) are the reference's parameters after 2 steps, to
    fp32 rounding; its bf16 parameters are their casts. No step is trained (``--steps 2``)."""
    text = plan_text("b16", *PLANS["b"]).replace("precision = fp32", "precision = bf16").replace(
        "zero = 0", "zero = 1")
    out, plan = compile_text(tmp_path, "b16", text)
    assert (plan["train"]["precision"], plan["train"]["zero"]) == ("bf16", 1)
    rc, text, every = start_ranks(out, 2, "--resume", chain["tmp"] / "ck1", "--steps", 2,
                                  "--dump-params", tmp_path / "dump")
    assert rc == 0 and "Traceback" not in every, every[-3000:]
    assert "resumed from" in text and "(written by plan 'ckpt_a' on 4 ranks)" in text, text[-3000:]
    a_out, a_plan = chain["compiled"]["a"]
    _, ref_state = independent_reference(a_plan, a_out, 2)
    compare_dumps(tmp_path / "dump", [0, 1], ref_state, rtol=1e-4, atol=1e-5)
