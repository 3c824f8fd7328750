"""The GPU tier (``pytest -m gpu``): the runtime's NCCL path (CUDA tensors, streams and events, bf16 on
the device) against the independent plain-torch reference (CPU, fp32). Skipped with the reason on a
machine without CUDA.

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected", NCCL >= 2.5),
so ranks cannot share one GPU under NCCL: the one-GPU test runs a one-device plan (one rank: bf16
masters, clip, recompute, AdamW and its schedule on the device, NCCL initialised); the several-rank
test (a data-2 stage with ZeRO-1 feeding a one-device stage, fp16 loss scaling) needs one GPU per rank
and is skipped, saying so, on a machine with fewer.

Each rank is ``python OUT/train.py`` (``e2e_util.start_ranks``) with ``DS_ACCELERATOR=cuda``; the plan's
backend is ``auto``, which is NCCL where CUDA is present. Rank 0's start-up line ``devices: ...`` (every
rank's backend and device, gathered) must show NCCL on a CUDA device of its own for every rank: a
silent fallback to gloo or the CPU fails.
"""
from __future__ import annotations

import json

import pytest
import torch

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

from e2e_util import ROOT, independent_reference, rank_devices, start_ranks, step_lines, update_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the NCCL tier needs a GPU")]

STEPS = 4
UPDATE_TOL = 0.02       # as tests/e2e/test_e2e_regime.py: bf16/fp16 against the fp32 reference's update

ONE = """
plan gpu_one {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 1 : bandwidth 10 GB/s, latency 2 us
  }
  model "EXAMPLES/gpt.py:build" { layers = 2, hidden = 16, heads = 2, seq = 8, vocab = 32 }
  loss  "EXAMPLES/gpt.py:loss"
  data  "EXAMPLES/gpt.py:batches"
  stage 0 : layers 0..4 on devices 0..1 as (data = 1) recompute
  train {
    micro_batch = 8, micro_batches = 2, steps = 4, timeout = 60 s, schedule = 1f1b, seed = 3
    optimizer = sgd(lr = 0.2, momentum = 0.9), precision = bf16, clip = 0.3
    lr_schedule = warmup_cosine(warmup = 1, min_ratio = 0.1)
  }
}
"""

SEVERAL = """
plan gpu_several {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 3 : bandwidth 10 GB/s, latency 2 us
  }
  model "EXAMPLES/gpt.py:build" { layers = 2, hidden = 16, heads = 2, seq = 8, vocab = 32 }
  loss  "EXAMPLES/gpt.py:loss"
  data  "EXAMPLES/gpt.py:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..4 on devices 2..3 as (data = 1) recompute
  reduce gradients over data
  train {
    micro_batch = 8, micro_batches = 2, steps = 4, timeout = 60 s, schedule = 1f1b, seed = 3
    optimizer = sgd(lr = 0.2, momentum = 0.9), precision = fp16, zero = 1, clip = 0.3
  }
}
"""


def compiled(tmp_path, text):
    src = tmp_path / "gpu.plan"
    src.write_text(text.replace("EXAMPLES", str(ROOT / "examples")))
    c = compile_file(src)
    assert not c.untrainable, "; ".join(d.message for d in c.untrainable)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    return out, json.loads((out / "plan.json").read_text())


def train_on_gpus(tmp_path, text, world):
    out, plan = compiled(tmp_path, text)
    rc, rank0, every = start_ranks(out, world, "--dump-params", tmp_path / "dump", env={"DS_ACCELERATOR": "cuda"}, fork=False,
                                   timeout=600)
    assert rc == 0, every[-4000:]
    assert "Traceback" not in every, every[-4000:]
    # every rank really ran NCCL on its own CUDA device (a silent fallback to gloo or the CPU would
    # otherwise pass every number below)
    where = rank_devices(rank0)
    assert sorted(where) == list(range(world)), rank0[-3000:]
    assert all(b == "nccl" and d.startswith("cuda:") for b, d in where.values()), where
    assert len({d for _, d in where.values()}) == world, f"ranks share a GPU: {where}"
    record = {}
    src = tmp_path / "gpu.plan"
    ref_losses, ref_state = independent_reference(plan, out, STEPS, record=record, source=src)
    _, init = independent_reference(plan, out, 0, source=src)
    lines = step_lines(rank0)
    assert sorted(lines) == list(range(STEPS)) and not any("skipped" in v for v in lines.values()), rank0[-3000:]
    assert [lines[s]["loss"] for s in range(STEPS)] == pytest.approx(ref_losses, rel=2e-3)
    assert [lines[s]["lr"] for s in range(STEPS)] == pytest.approx(record["lr"], rel=1e-5)
    assert [lines[s]["grad_norm"] for s in range(STEPS)] == pytest.approx(record["grad_norm"], rel=2e-2)
    assert update_error(tmp_path / "dump", plan, ref_state, init) < UPDATE_TOL
    return plan, rank0


def test_one_gpu_bf16_clip_recompute_schedule_over_nccl(tmp_path):
    _, rank0 = train_on_gpus(tmp_path, ONE, 1)
    assert "gradients: none" in rank0


@pytest.mark.skipif(torch.cuda.device_count() < 3,
                    reason="3 ranks need 3 GPUs: NCCL refuses two ranks on one GPU ('Duplicate GPU detected')")
@pytest.mark.parametrize("zero", [1, 2])
def test_three_gpus_zero1_fp16_clip_over_nccl(tmp_path, zero):
    plan, rank0 = train_on_gpus(tmp_path, SEVERAL.replace("zero = 1", f"zero = {zero}"), 3)
    assert f"ZeRO-{zero}" in rank0 and [r["target"] for r in plan["reductions"] if r["stage"] == 0] == [
        "reduce_scatter", "all_gather"]
