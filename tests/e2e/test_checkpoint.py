"""Checkpoints and resume of the generated training program (``train.py --save DIR``, ``--resume DIR``).

- ``two``: a 2-rank plan (mlp, Adam, ``clip = 1e6`` so that rank 0 prints the gradient norms,
  ``save_every = 2``) trained 4 steps uninterrupted with ``--save``; resuming its step-2 checkpoint
  must print the losses, rates and gradient norms of ``independent_reference`` (plain torch, 4 steps)
  for steps 2 and 3 and end with its parameters, and the negative controls (the reference with
  gradients x2, or half the rows missing) must fail that comparison; beyond that, the resumed run
  is bit for bit the uninterrupted one. Checkpoints of another plan (another
  digest), missing, incomplete or damaged ones are refused with a clear message, exit 2, no
  traceback (in process through ``planc.runtime.main.main``, one real ``python train.py``).
- an unequal-mesh plan (GPT, SGD with momentum: stage 0 on a data-2 mesh, stage 1 on a tensor-2 mesh whose
  block is really sharded, one idle rank) whose first rank kills itself (SIGKILL, in the data
  function the test supplies) right after the step-2 checkpoint; resumed, the losses of both
  launches and the final parameters must be those of ``independent_reference`` (plain torch, 4
  steps, no planc code), and those of the negative controls must not. (Not Adam here: GPT's key biases get gradients that are zero up to rounding,
  and Adam turns rounding noise into full-size steps, so no two summation orders agree; against the
  uninterrupted run of the same program, above, Adam's state is compared exactly.)

Each rank's ``python OUT/train.py`` is started by hand, as a per-host launcher does (CPU/gloo; the
same program launch.sh starts through the `deepspeed` launcher, without the launcher's start-up
time, which would put these tests far over their budget); after the crash the surviving ranks end
by themselves (the dead peer's closed connection, or the plan's 20 s timeout).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

from e2e_util import (PY, ROOT, assert_controls_fail, compare_dumps, data_degree, independent_reference, launch_env,
                      stage_ranks, start_ranks, step_lines)

EXAMPLES = ROOT / "examples"
STEPS = 4

# A data function wrapping an example's: with CKPT_TEST_DIE_AT="<rank>:<batch>" in the environment,
# that rank SIGKILLs itself when it is about to yield batch number <batch> (0-based) of its stream.
DATA_FILE = '''
import os, signal, sys
sys.path.insert(0, {examples!r})
from {module} import batches as _batches


def batches(micro_batch, seed, **kwargs):
    die = os.environ.get("CKPT_TEST_DIE_AT")
    rank, at = die.split(":") if die else (None, None)
    for i, batch in enumerate(_batches(micro_batch, seed, **kwargs)):
        if rank is not None and os.environ.get("RANK") == rank and i == int(at):
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch
'''

TWO = """
plan ckpt_two {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 2 : bandwidth 10 GB/s, latency 2 us
  }
  model "EXAMPLES/mlp.py:build" { layers = 4, hidden = 16, inputs = 8, outputs = 4 }
  loss  "EXAMPLES/mlp.py:loss"
  data  "EXAMPLES/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..1 as (data = 1)
  stage 1 : layers 2..4 on devices 1..2 as (data = 1)
  transfer a : f32[8, 16] from stage 0 as R R to stage 1 as R R
  train {
    micro_batch = 8, micro_batches = 2, steps = 4, save_every = 2, timeout = 20 s
    schedule = 1f1b, optimizer = adam(lr = 0.01), clip = 1e6, precision = fp32, seed = 5
  }
}
"""
# clip = 1e6 never scales: it makes rank 0 print every step's gradient norm, which the reference's must match
# (Adam's parameters barely see a gradient-scale error; the norm does)

# 5 ranks: stage 0 (embedding, block 1) on a data-2 mesh {0, 1}; stage 1 (block 2, head) on a
# tensor-2 mesh {2, 3} (GPT opts in to tensor parallelism: block 2 is sharded); device 4 is idle
UNEQUAL = """
plan ckpt_unequal {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 5 : bandwidth 10 GB/s, latency 2 us
  }
  model "EXAMPLES/gpt.py:build" { layers = 2, hidden = 16, heads = 2, seq = 8, vocab = 32 }
  loss  "EXAMPLES/gpt.py:loss"
  data  "DATA:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..4 on devices 2..4 as (tensor = 2)
  transfer h : f32[8, 8, 16] from stage 0 as S0 R R to stage 1 as R R R
  reduce gradients over data
  train {
    micro_batch = 8, micro_batches = 2, steps = 4, save_every = 2, timeout = 20 s
    schedule = 1f1b, optimizer = sgd(lr = 0.2, momentum = 0.9), precision = fp32, seed = 3
  }
}
"""


def compile_text(tmp_path, name: str, text: str):
    path = tmp_path / f"{name}.plan"
    path.write_text(text.replace("EXAMPLES", str(EXAMPLES)))
    c = compile_file(path, probe=False)   # the transfers' types are written out; these tests are not about the probe
    assert not c.untrainable, "; ".join(d.message for d in c.untrainable)
    out = tmp_path / name
    write_output(c.plan_json, c.program, out)
    return out, json.loads((out / "plan.json").read_text())


def losses_of(stdout: str) -> dict[int, float]:
    return {int(s): float(x) for s, x in re.findall(r"^step (\d+) loss ([-0-9.e+]+)", stdout, re.M)}


def text_of(r) -> str:
    return r.stdout[-4000:] + r.stderr[-4000:]


def main_in_process(out, *args):
    """planc.runtime.main.main on OUT (the refusals happen before any process group starts)."""
    from planc.runtime.main import main
    return main([*map(str, args)], out_dir=str(out))


# ---------------------------------------------------------------- a 2-rank run, uninterrupted

@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    out, plan = compile_text(tmp, "two", TWO)
    assert plan["train"]["save_every"] == 2
    rc, text, every = start_ranks(out, 2, "--save", tmp / "ck", "--dump-params", tmp / "dump")
    assert rc == 0, every[-4000:]
    return {"tmp": tmp, "out": out, "plan": plan, "ck": tmp / "ck", "losses": losses_of(text)}


@pytest.mark.slow
def test_saves_every_n_steps_and_at_the_end(two):
    from torch.distributed.checkpoint import FileSystemReader
    ck, plan = two["ck"], two["plan"]
    assert sorted(two["losses"]) == list(range(STEPS))
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step2", "step4"]   # nothing partial left
    assert (ck / "latest").read_text().strip() == "step4"
    from planc.plan import digest, load
    want = digest(load(two["out"] / "plan.json"))
    for step in (2, 4):
        m = json.loads((ck / f"step{step}" / "planc.json").read_text())
        assert (m["format"], m["digest"], m["step"], m["world_size"], m["plan"]) == (2, want, step, 2, "ckpt_two")
        assert sorted(m["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert m["data"]["drawn"] == step * plan["train"]["micro_batches"]
        assert m["regime"]["t"] == step and sorted(m["rng"]) == ["0", "1"]
        names = [p["name"] for p in m["parameters"]]
        assert names == [f"layers.{i}.linear.{k}" for i in range(4) for k in ("weight", "bias")]
        md = FileSystemReader(str(ck / f"step{step}")).read_metadata().state_dict_metadata
        assert set(md) == {f"{kind}.{n}{state}" for n in names
                           for kind, state in (("model", ""), ("optim", ".exp_avg"), ("optim", ".exp_avg_sq"))}
        from torch.distributed.checkpoint import load as dcp_load
        sq = {f"optim.{n}.exp_avg_sq": torch.zeros(md[f"optim.{n}.exp_avg_sq"].size) for n in names}
        dcp_load(sq, checkpoint_id=str(ck / f"step{step}"), no_dist=True)   # the optimizer state is really kept
        assert all(v.abs().sum() > 0 for v in sq.values())


@pytest.mark.slow
def test_resume_prints_the_same_losses_and_ends_with_the_same_parameters(two, tmp_path):
    """Resumed at step 2: steps 2 and 3 (losses, rates, gradient norms) and the final parameters are the
    independent reference's (4 steps in one process, its dataflow from the plan text), and the controls
    (gradients x2, half of every micro-batch's rows missing) fail that same comparison; and, beyond,
    bit for bit the uninterrupted run's (the same masters, moments, step counts, data and RNG)."""
    rc, text, every = start_ranks(two["out"], 2, "--resume", two["ck"] / "step2", "--dump-params", tmp_path / "dump")
    assert rc == 0, every[-4000:]
    assert f"resumed from {two['ck'] / 'step2'} at step 2" in text
    lines = step_lines(text)
    assert sorted(lines) == [2, 3], text[-2000:]

    def compare(ref_losses, ref_state, record):
        assert [lines[s]["loss"] for s in (2, 3)] == pytest.approx(ref_losses[2:], rel=1e-4, abs=1e-6), "losses"
        assert [lines[s]["lr"] for s in (2, 3)] == pytest.approx(record["lr"][2:], rel=1e-6), "rates"
        assert [lines[s]["grad_norm"] for s in (2, 3)] == pytest.approx(record["grad_norm"][2:], rel=1e-4), "norms"
        compare_dumps(tmp_path / "dump", [0, 1], ref_state, rtol=1e-5, atol=1e-5)

    src = two["tmp"] / "two.plan"
    record: dict = {}
    compare(*independent_reference(two["plan"], two["out"], STEPS, record=record, source=src), record)
    assert_controls_fail(compare, two["plan"], two["out"], STEPS, source=src, data_parts=1)
    resumed = losses_of(text)
    for s in (2, 3):   # bit for bit: the same masters, moments, step counts, data and RNG
        assert resumed[s] == two["losses"][s], (s, resumed, two["losses"])
    for rank in (0, 1):
        want = torch.load(two["tmp"] / "dump" / f"rank{rank}.pt")
        got = torch.load(tmp_path / "dump" / f"rank{rank}.pt")
        assert set(got) == set(want) and want
        for k in want:
            assert torch.equal(got[k], want[k]), f"rank {rank} {k}"


@pytest.mark.slow
def test_a_checkpoint_of_another_global_batch_is_refused(two, tmp_path):
    """Same layout, 3 micro-batches: another global batch, whose data position does not carry over. A real
    ``python train.py`` (rank 0 of 2; the refusal comes before any process group)."""
    out2, _ = compile_text(tmp_path, "other", TWO.replace("micro_batches = 2", "micro_batches = 3"))
    env = dict(launch_env(), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    r = subprocess.run([PY, str(out2 / "train.py"), "--resume", str(two["ck"])], env=env, capture_output=True,
                       text=True, timeout=120, cwd=out2)
    assert r.returncode == 2, text_of(r)
    assert "Traceback" not in r.stdout + r.stderr
    assert (f"planc: rank 0: --resume {two['ck'] / 'step4'}: the checkpoint was trained with a global batch of "
            f"16 samples (8 x 2), this plan's is 24 (8 x 3)") in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_missing_incomplete_or_damaged_checkpoints_are_refused(two, tmp_path, capsys):
    out, ck = two["out"], two["ck"]

    def refused(path, *want):
        assert main_in_process(out, "--resume", path) == 2
        err = capsys.readouterr().err
        assert err.startswith("planc: rank 0: ") and "Traceback" not in err, err
        for w in want:
            assert w in err, err

    refused(tmp_path / "nowhere", "no such checkpoint folder")
    # a save interrupted before its manifest: only DIR/.step<N>.partial exists
    cut = tmp_path / "cut"
    shutil.copytree(ck / "step2", cut / ".step2.partial")
    (cut / ".step2.partial" / "planc.json").unlink()
    refused(cut, "only an incomplete checkpoint is there (.step2.partial", "never loaded")
    # a step folder without its planc.json (copied by hand, say), asked for directly
    refused(cut / ".step2.partial", "not a checkpoint", "an incomplete checkpoint is never loaded")
    # latest names a folder that is not complete
    (cut / "latest").write_text("step6\n")
    refused(cut, "names 'step6', which is not a complete checkpoint")
    # a rank's file cut short after planc.json was written
    damaged = tmp_path / "damaged"
    shutil.copytree(ck / "step2", damaged)
    data = (damaged / "__1_0.distcp").read_bytes()
    (damaged / "__1_0.distcp").write_bytes(data[: len(data) // 2])
    refused(damaged, f"--resume {damaged}: __1_0.distcp has {len(data) // 2} bytes, planc.json lists {len(data)} "
                     "(cut or changed)")
    (damaged / "__1_0.distcp").unlink()
    refused(damaged, f"--resume {damaged}: __1_0.distcp is missing (planc.json lists it with {len(data)} bytes)")
    shutil.copy(ck / "step2" / "__1_0.distcp", damaged / "__7_0.distcp")   # a file planc.json does not list
    shutil.copy(ck / "step2" / "__1_0.distcp", damaged / "__1_0.distcp")
    refused(damaged, f"--resume {damaged}: __7_0.distcp is not listed in planc.json's files (not part of this "
                     "checkpoint)")
    # --weights-only alone
    assert main_in_process(out, "--weights-only") == 2
    assert "--weights-only goes with --resume DIR" in capsys.readouterr().err
    # --save/--resume with --comm-only
    assert main_in_process(out, "--comm-only", "--save", tmp_path / "x") == 2
    assert "need a training run" in capsys.readouterr().err
    # --trace records training steps only
    assert main_in_process(out, "--comm-only", "--trace", tmp_path / "t") == 2
    err = capsys.readouterr().err
    assert "--trace records training steps" in err and "Traceback" not in err, err
    assert not (tmp_path / "t").exists()


# ---------------------------------------------------------------- unequal meshes, a crash, resume

@pytest.mark.slow
def test_unequal_mesh_run_killed_after_a_save_resumes_exactly(tmp_path):
    data = tmp_path / "ckdata.py"
    data.write_text(DATA_FILE.format(examples=str(EXAMPLES), module="gpt"))
    out, plan = compile_text(tmp_path, "unequal", UNEQUAL.replace("DATA", str(data)))
    assert [len(st["devices"]) for st in plan["stages"]] == [2, 2] and stage_ranks(plan) == [0, 1, 2, 3]
    micro_batches = plan["train"]["micro_batches"]
    ck = tmp_path / "ck"

    # rank 0 (stage 0) dies as it draws the first batch of step 2, just after the step-2 save
    rc, text, every = start_ranks(out, 5, "--save", ck, env={"CKPT_TEST_DIE_AT": f"0:{2 * micro_batches}"})
    assert rc != 0, every[-4000:]
    first = losses_of(text)
    assert sorted(first) == [0, 1], every[-4000:]
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step2"], every[-4000:]
    assert "Traceback" not in every, every[-4000:]   # the survivors say what failed, in one line each

    rc, text, every = start_ranks(out, 5, "--resume", ck, "--save", ck, "--dump-params", tmp_path / "dump")
    assert rc == 0, every[-4000:]
    second = losses_of(text)
    assert sorted(second) == [2, 3], every[-4000:]
    assert (ck / "latest").read_text().strip() == "step4"
    manifest = json.loads((ck / "step4" / "planc.json").read_text())
    assert manifest["world_size"] == 5 and sorted(manifest["rng"]) == [str(r) for r in range(5)]
    idle = [f for f in manifest["files"] if f.startswith("__4_")]   # the idle rank writes no tensor
    assert all(manifest["files"][f]["size"] == 0 for f in idle), manifest["files"]

    got = [first[0], first[1], second[2], second[3]]

    def compare(ref_losses, ref_state, _record):   # SGD: the parameters see a gradient scale
        assert got == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "losses"
        return compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)

    src = tmp_path / "unequal.plan"
    sharded = compare(*independent_reference(plan, out, STEPS, source=src), None)
    assert {int(k.split(".")[1]) for k in sharded} == {2}, sorted(sharded)   # block 2 really is sharded
    assert_controls_fail(compare, plan, out, STEPS, source=src, data_parts=data_degree(plan))


# ---------------------------------------------------------------- no launch: the checks alone

def test_resume_checks_on_a_hand_made_checkpoint(tmp_path):
    """checkpoint.resolve / check on a folder written here by hand (planc.json as docs/runtime.md says)."""
    import hashlib
    from types import SimpleNamespace

    from planc.runtime import checkpoint as C
    step = tmp_path / "ck" / "step3"
    step.mkdir(parents=True)
    files = {}
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        blob = f"bytes of {name}".encode()
        (step / name).write_bytes(blob)
        files[name] = {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    manifest = {"format": 2, "plan": "p", "digest": "a" * 64, "step": 3, "world_size": 2, "files": files,
                "global_batch": 16, "micro_batch": 8, "micro_batches": 2, "optimizer": {"name": "sgd"},
                "precision": "fp32", "zero": 0, "parameters": [], "an extra key": "tolerated"}
    (step / "planc.json").write_text(json.dumps(manifest))
    (tmp_path / "ck" / "latest").write_text("step3\n")

    def plan(micro_batch=8, micro_batches=2, optimizer="sgd"):
        return SimpleNamespace(train=SimpleNamespace(micro_batch=micro_batch, micro_batches=micro_batches,
                                                     optimizer=SimpleNamespace(name=optimizer)))

    assert C.resolve(str(tmp_path / "ck")) == str(step)
    assert C.check(str(step), plan()).step == 3
    assert C.check(str(step), plan(micro_batch=4, micro_batches=4)).step == 3   # the same global batch
    with pytest.raises(C.CheckpointError, match=r"global batch of 16 samples \(8 x 2\), this plan's is 8 \(4 x 2\)"):
        C.check(str(step), plan(micro_batch=4))
    assert C.check(str(step), plan(micro_batch=4), weights_only=True).step == 3
    with pytest.raises(C.CheckpointError, match="the checkpoint's optimizer is 'sgd', this plan's is 'adamw'"):
        C.check(str(step), plan(optimizer="adamw"))
    (step / "__1_0.distcp").write_bytes(b"bytes of __9_0.distcp"[:len(b"bytes of __1_0.distcp")])   # same size
    with pytest.raises(C.CheckpointError, match=re.escape(f"--resume {step}: __1_0.distcp's sha256 is ")):
        C.check(str(step), plan())
    (step / "planc.json").write_text(json.dumps(dict(manifest, format=1)))
    with pytest.raises(C.CheckpointError, match="is not a planc checkpoint of format 2 \\(format 1\\)"):
        C.check(str(step), plan())
    (step / "planc.json").unlink()
    with pytest.raises(C.CheckpointError, match="names 'step3', which is not a complete checkpoint"):
        C.resolve(str(tmp_path / "ck"))


def test_a_flat_range_is_a_few_rectangles_at_their_global_offsets():
    """ckpt_dcp.flat_rects / owned_rects against the elements themselves: a tensor of known values, a
    flat range of it, the rectangles read back in order give exactly that range; tensor-parallel blocks
    are cut and placed as tensor_parallel.shard_of places them."""
    import itertools

    from planc.runtime.ckpt_dcp import ParamInfo, flat_rects, owned_rects
    from planc.runtime.tensor_parallel import shard_of
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3)]:
        n = torch.Size(shape).numel()
        full = torch.arange(n).view(shape)
        for lo, hi in itertools.combinations(range(n + 1), 2):
            rects = flat_rects(lo, hi, shape)
            got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
                             for off, size in rects])
            assert got.tolist() == list(range(lo, hi)), (shape, lo, hi, rects)
            if len(shape) == 2:
                assert len(rects) <= 3
    glob = torch.arange(12 * 4).view(12, 4)          # 3 blocks (q|k|v) of 4 rows, in 2 parts of 2 rows
    for index in range(2):
        local = shard_of(glob, 0, index, 2, 3)
        info = ParamInfo("w", "w", local, (12, 4), (0, index, 2, 3), [], 0)
        for lo, hi in [(0, 24), (3, 17), (8, 9)]:
            for off, size, g in owned_rects(info, lo, hi):
                piece = local[tuple(slice(o, o + s) for o, s in zip(off, size))]
                assert torch.equal(piece, glob[tuple(slice(o, o + s) for o, s in zip(g, size))])
        rows = sorted(g[0] + j for off, size, g in owned_rects(info, 0, 24) for j in range(size[0]))
        assert rows == [b * 4 + index * 2 + j for b in range(3) for j in range(2)]   # part `index` of each block


def test_counting_iterator_replays_to_the_position():
    from planc.runtime.checkpoint import CheckpointError, CountingIterator
    it = CountingIterator(iter(range(10)))
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3] and it.drawn == 4
    again = CountingIterator(iter(range(10)))
    again.skip(it.drawn)
    assert next(again) == next(it) == 4
    with pytest.raises(CheckpointError, match="ended after 3 batch"):
        CountingIterator(iter(range(3))).skip(5)
