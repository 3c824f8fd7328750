"""Communication-only outputs: stages of different sizes and shapes, 1-to-m fan-out,
every strategy, launched with deepspeed; every byte delivered is checked by the
program itself against a pattern any rank can predict."""

from __future__ import annotations

import re

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file
from tests.e2e_util import launch_sh, run_direct

COMM_PLAN = """
plan uneven_meshes {
  cluster {
    level node x 3 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 4 : bandwidth 20 GB/s, latency 2 us
  }
  stage 0 on devices 0..6  as (data = 2, tensor = 3)
  stage 1 on devices 6..10 as (data = 2, tensor = 2)
  stage 2 on devices 10..11 as (1, 1)

  transfer a : f32[12, 6, 4]  from stage 0 as S0 S1 R to stage 1 as S1 S0 R
  transfer b : f32[8, 4, 4]   from stage 0 as R R R   to stage 1 as S01 R R
  transfer c : bf16[6, 4]     from stage 2 as R R     to stage 0 as S1 S0
  transfer d : i32[4, 6]      from stage 1 as S0 R    to stage 0 as R S1
  reduce grads over data : f32[1000]
  reduce acts over tensor : f32[24]

  resharding { strategy = STRATEGY, chunks = 3, schedule = load_balance }
}
"""


@pytest.mark.slow
# one strategy through the real launcher (12 ranks); every strategy's regions are checked bit for
# bit on the same kind of meshes by tests/runtime/test_runtime_reshard.py, in one spawn of 8 ranks
@pytest.mark.parametrize("strategy", ["broadcast"])
def test_uneven_meshes_deliver_exact_regions(tmp_path, strategy):
    src = tmp_path / "uneven.plan"
    src.write_text(COMM_PLAN.replace("STRATEGY", strategy))
    c = compile_file(src)
    assert [t["strategy"] for t in c.plan_json["transfers"]] == [strategy] * 4
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    r = launch_sh(out, "--steps", "2")      # no model: train.py runs communication only
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = re.findall(r"step \d+ comm [0-9.]+ s \(verified 4 transfer\(s\), 2 reduction\(s\)\)", r.stdout)
    assert len(lines) == 2, r.stdout[-3000:]
    # launch.sh: every rank's log under OUT/logs/ with the rank in its name; rank 0's reached the terminal
    world = sum(len(h) for h in c.plan_json["cluster"]["hosts"])
    logs = sorted((out / "logs").glob("*_rank*.log"))
    assert sorted(int(re.search(r"_rank(\d+)\.log$", p.name).group(1)) for p in logs) == list(range(world))
    rank0 = next(p for p in logs if p.name.endswith("_rank0.log")).read_text()
    assert re.findall(r"^step \d+ comm .*$", rank0, re.M) == re.findall(r"^step \d+ comm .*$", r.stdout, re.M)
    assert not list((out / "logs").glob(".launch.*"))     # the launch's own marker files are gone


KILL_PLAN = """
plan two_hosts {
  cluster {
    level node x 2 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 1 : bandwidth 20 GB/s, latency 2 us
  }
  stage 0 on devices 0..1 as (1)
  stage 1 on devices 1..2 as (1)
  transfer a : f32[65536] from stage 0 as R to stage 1 as R
}
"""


@pytest.mark.slow
def test_a_killed_rank_is_named_with_the_transfer_it_was_in(tmp_path):
    """--comm-only: the surviving rank of a killed peer ends non-zero within the collective timeout and
    names the transfer and the ranks it was exchanging with (not a bare gloo error)."""
    import os
    import signal
    import subprocess
    import time

    from tests.e2e_util import launch_env
    from test_failures import _pid_of

    src = tmp_path / "two.plan"
    src.write_text(KILL_PLAN)
    c = compile_file(src)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    env = launch_env()   # a plan without train: the runtime's collective timeout, 300 s
    p = subprocess.Popen(["bash", str(out / "launch.sh"), "--steps", "10000000"], env=env, cwd=out,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        for line in p.stdout:                      # communication has started: rank 0 printed a step
            lines.append(line)
            if re.match(r"step 3 comm", line) or time.monotonic() > deadline:
                break
        assert any(re.match(r"step 3 comm", ln) for ln in lines), "".join(lines[-40:])
        victim = _pid_of(out, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        # liveness, not a timing: the killed peer's closed connection ends it long before, but the bound
        # is the collective timeout (no train block, so the runtime's default) and a minute more
        from planc.runtime.dist_util import DEFAULT_TIMEOUT_S
        rest, _ = p.communicate(timeout=DEFAULT_TIMEOUT_S + 60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = "".join(lines) + rest
    assert p.returncode != 0, text[-3000:]
    # rank 0 was in the transfer or in one of the step's barriers: either way it says which, and with whom
    assert re.search(r"planc: rank 0: rank 0 failed in (transfer 'a'|the barrier that (starts|ends) the step|"
                     r"gathering every rank's check) at step \d+ with ranks \[1\]", text), text[-3000:]


def test_the_reduction_check_sees_a_misplaced_piece():
    """--comm-only sums each member's ``contribution``, which depends on the element's position (a
    hash, not a period): the right sum differs from every shifted copy of itself and from the sum
    with one member's piece taken from another offset or another member."""
    import torch

    from planc.runtime.main import contribution
    n, group = 1000, [0, 3, 5, 6]
    right = sum(contribution(n, d) for d in group)
    assert all(not torch.equal(torch.roll(right, k), right) for k in range(1, n))
    quarter = n // 4
    for piece in range(4):
        a, b = piece * quarter, (piece + 1) * quarter
        moved = right.clone()
        moved[a:b] = right[(a + quarter) % n:(b + quarter - 1) % n + 1] if b + quarter <= n else right[0:quarter]
        assert not torch.equal(moved, right)
        other = sum(contribution(n, d) for d in group[:-1]) + contribution(n, 7)   # a wrong member
        assert not torch.equal(other[a:b], right[a:b])
    assert right.dtype == torch.float32 and int(right.max()) <= 63 * len(group)


ZERO_PLAN = """
plan zero_comm {
  cluster {
    level node x 2 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 2 : bandwidth 20 GB/s, latency 2 us
  }
  model "MLP:build" { layers = 2, hidden = 40, inputs = 8, outputs = 4 }
  loss  "MLP:loss"
  data  "MLP:batches"
  stage 0 : layers 0..2 on devices 0..4 as (data = 4)
  reduce gradients over data
  train { micro_batch = 4, micro_batches = 1, zero = 1, optimizer = adamw(lr = 0.01) }
}
"""


@pytest.mark.slow
def test_zero_programs_are_checked_on_the_pieces_they_own(tmp_path):
    """--comm-only on a zero = 1 plan: the reduce-scatter is checked on each rank's owned slices only, the
    all-gather starts from the reduced sum in those slices and must give every rank the whole sum."""
    from pathlib import Path
    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    src = tmp_path / "zero.plan"
    src.write_text(ZERO_PLAN.replace("MLP", str(mlp)))
    c = compile_file(src)
    targets = sorted(r.get("target") for r in c.plan_json["reductions"])
    assert targets == ["all_gather", "reduce_scatter"]
    assert all(len(r["program"]["steps"]) == 2 for r in c.plan_json["reductions"])   # in-host, then across
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    r = run_direct(out, "--comm-only", "--steps", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(re.findall(r"step \d+ comm [0-9.]+ s \(verified 0 transfer\(s\), 2 reduction\(s\)\)", r.stdout)) == 2
