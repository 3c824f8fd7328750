"""``python -m benchmarks bench zero3``'s parts: the torch baseline (``benchmarks/bench/torch_fsdp_pp.py``:
torch's fully_shard + pipelining on a compiled plan's model) trains like the single-process reference,
refuses a plan it cannot lay out, and the report's table and loss check."""
from __future__ import annotations

import subprocess
import sys

import pytest

from planc.ports import free_port

from e2e_util import ROOT, launch_env

WORKER = ROOT / "benchmarks" / "bench" / "torch_fsdp_pp.py"
PLAN = """
plan fsdp_tiny {{
  cluster {{
    level node x 2 : bandwidth 100 MB/s, latency 50 us
    level gpu  x 2 : bandwidth 10 GB/s,  latency 2 us
  }}
  model "{mlp}:build" {{ layers = 4, hidden = 16, inputs = 8, outputs = 4 }}
  loss  "{mlp}:loss"
  data  "{mlp}:batches"
  stage 0 : layers 0..2 on devices {first} as (data = 2)
  stage 1 : layers 2..4 on devices {second} as (data = 2)
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 2, steps = 3, schedule = 1f1b, optimizer = sgd(lr = 0.1), seed = 3,
          zero = 3 }}
}}
"""


def _compiled(tmp_path, first="0..2", second="2..4"):
    from planc.driver.compile import compile_file
    from planc.output.codegen import write_output
    src = tmp_path / "p.plan"
    src.write_text(PLAN.format(mlp=ROOT / "examples" / "mlp.py", first=first, second=second))
    c = compile_file(src, probe=True)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    return c.plan_json, out


def _launch(out, world=4, timeout=240, extra=()):
    env = dict(launch_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--out", str(out), *extra], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        texts = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], texts


@pytest.mark.slow
def test_torch_fully_shard_and_pipelining_train_like_the_reference(tmp_path):
    from benchmarks.bench.zero3 import losses_equal
    from e2e_util import independent_reference
    plan, out = _compiled(tmp_path)
    codes, texts = _launch(out)
    assert codes == [0] * 4, "\n".join(texts)[-4000:]
    assert "Schedule1F1B, pp 2 x dp 2, every layer fully_shard over dp, kept gathered through the step" in texts[0]
    ref, _ = independent_reference(plan, out, 3)

    def losses(text):
        return [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]
    assert losses_equal(losses(texts[0]), ref), (texts[0], ref)
    assert not losses_equal([x * 1.01 for x in losses(texts[0])], ref)   # the check sees a 1 % difference
    codes, texts = _launch(out, extra=("--per-micro-batch",))         # FSDP2's defaults on every layer
    assert codes == [0] * 4, "\n".join(texts)[-4000:]
    assert "gathered and reduce-scattered every micro-batch" in texts[0]
    assert losses_equal(losses(texts[0]), ref), (texts[0], ref)


def test_the_torch_baseline_refuses_a_plan_it_cannot_lay_out(tmp_path):
    """Stage s must hold devices [s·D, (s+1)·D) (the (pp, dp) mesh's rank order): else exit 2, said why,
    before any process group is formed."""
    from benchmarks.bench.torch_fsdp_pp import layout_error, main
    good, _ = _compiled(tmp_path)
    assert layout_error(good) is None
    plan, out = _compiled(tmp_path, first="2..4", second="0..2")
    assert "stage 0 runs on devices [2, 3]: the baseline needs a uniform plan" in layout_error(plan)
    assert main(["--out", str(out)]) == 2


def test_the_zero3_table_reports_ratios_losses_and_failures():
    from benchmarks.bench.zero3 import losses_equal, table
    rows = [{"what": "planc zero = 1", "ok": True, "measured": 0.5, "predicted": 0.4, "same_losses": True,
             "peak_rss_mb": 100.0, "error": None},
            {"what": "planc zero = 3", "ok": True, "measured": 0.75, "predicted": 0.45, "same_losses": True,
             "peak_rss_mb": 90.0, "error": None},
            {"what": "planc zero = 3, zero_keep_gathered = true", "ok": True, "measured": 0.6, "predicted": 0.4,
             "same_losses": True, "peak_rss_mb": 95.0, "error": None},
            {"what": "torch fully_shard + Schedule1F1B, per micro-batch", "ok": True, "measured": 1.0,
             "predicted": None, "same_losses": True, "peak_rss_mb": 99.0, "error": None},
            {"what": "torch fully_shard + Schedule1F1B, kept for the step", "ok": False, "measured": None,
             "predicted": None, "same_losses": False, "peak_rss_mb": None, "error": "rank 3 died"}]
    text = table(rows)
    assert "| planc zero = 3 | 0.750 | 1.50 | 0.75 | 0.450 | yes | 90 |" in text        # ÷ torch per micro-batch
    assert "| planc zero = 3, zero_keep_gathered = true | 0.600 | 1.20 | — |" in text  # its torch twin failed
    assert "| torch fully_shard + Schedule1F1B, kept for the step | failed | — | — | — | no | — |" in text
    assert "kept for the step: rank 3 died" in text
    assert losses_equal([1.0, 2.0], [1.00001, 2.0]) and not losses_equal([1.0], [1.0, 2.0])
    assert not losses_equal([], [])
