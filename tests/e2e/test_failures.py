"""Failing ranks, single host, CPU/gloo:

- a rank killed mid-iteration, and a rank that hangs in compute (alive, never returning from its
  layer), end the whole job by themselves, non-zero (bounded by a generous multiple of the collective
  timeout, never a tight wall time), and the surviving ranks say
  which instruction they were in and which ranks they were waiting for (launch.sh: DeepSpeed's
  launch.py, as the `deepspeed` runner starts it on one host);
- ranks started with plans of different digests refuse to start naming both digests; a world of
  another size, or ranks per host not matching the plan, is refused with both numbers (each rank
  started by hand as a per-host launcher would; other hostnames through ``unshare --uts``).

A stage producing a tensor of the wrong shape: tests/e2e/test_e2e.py::test_shape_mismatch_is_reported.
The same cases on the multi-host testbed: tests/testbed/test_testbed_failures.py (HANGING_MODEL and FOUR are
shared with it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file
from planc.ports import free_port

from e2e_util import ROOT, edit_plan, launch_env, spelled

TIMEOUT_S = 30


def _pid_of(out, local_rank: int) -> int | None:
    want = f"{out}/train.py --local_rank={local_rank}"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if want in cmd and "deepspeed.launcher" not in cmd:
            return int(pid)
    return None


@pytest.mark.slow
def test_a_killed_rank_ends_every_rank_within_the_timeout(tmp_path):
    c = compile_file(spelled("unet-skip.plan"), probe=False)   # not about the probe: its types written out
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    edit_plan(out, timeout=float(TIMEOUT_S))    # the plan's train { timeout = 30 s }: plan.json decides it
    env = launch_env()
    p = subprocess.Popen(["bash", str(out / "launch.sh"), "--steps", "100000"], env=env, cwd=out,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        for line in p.stdout:                     # training has started: rank 0 printed a step
            lines.append(line)
            if re.match(r"step 2 loss", line) or time.monotonic() > deadline:
                break
        assert any(re.match(r"step 2 loss", l) for l in lines), "".join(lines[-40:])
        victim = _pid_of(out, 3)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        try:   # liveness, not a timing: a generous multiple of the collective timeout
            rest, _ = p.communicate(timeout=4 * TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end by itself within {4 * TIMEOUT_S + 60} s of the kill "
                        f"(collective timeout {TIMEOUT_S} s)")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = "".join(lines) + rest
    assert p.returncode != 0, text[-3000:]
    # every message of a surviving rank names the instruction it was in and the ranks it waited for;
    # at least one names rank 3 (its peers in the plan are stage 1's)
    # (unless the kill found rank 3 past its part of the step, every rank then waiting in the step's loss
    # all-reduce: a race with how far ahead rank 3 ran, which a loaded machine makes likelier)
    named = re.findall(r"planc: rank \d+: rank \d+ \(stage \d\) failed in (\w+)[^\n]* with ranks \[([0-9, ]+)\]", text)
    between = re.search(r"failed in the step \d+ loss all-reduce over every rank", text)
    assert (named and any("3" in peers.split(", ") for _, peers in named)) or (not named and between), text[-3000:]
    assert _pid_of(out, 0) is None and _pid_of(out, 5) is None   # nothing left running


# ---------------------------------------------------------------- a hang, other plans, other worlds

HANG_TIMEOUT_S = 10

# 2 hosts x 2 devices: stage 0 on host 0, stage 1 on host 1 (data = 2 each)
FOUR = """
plan failures_four {
  cluster {
    level node x 2 : bandwidth 1 GB/s, latency 20 us
    level gpu  x 2 : bandwidth 10 GB/s, latency 2 us
    host = node
  }
  model "MODEL:build" { layers = 4, hidden = 16, inputs = 8, outputs = 4 }
  loss  "EXAMPLES/mlp.py:loss"
  data  "EXAMPLES/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..4 on devices 2..4 as (data = 2)
  transfer a : f32[8, 16] from stage 0 as S0 R to stage 1 as S0 R
  reduce gradients over data
  train {
    micro_batch = 8, micro_batches = 2, steps = 3, timeout = TIMEOUT s
    schedule = 1f1b, optimizer = sgd(lr = 0.1), precision = fp32, seed = 5
  }
}
"""

# mlp whose last layer, on the rank named by HANG_TEST_RANK, never returns from its 6th forward call
# (the start-up shape check is its 1st, then 2 per step: the first of step 2): alive, not killed
HANGING_MODEL = '''
import os, sys, time
import torch
sys.path.insert(0, {examples!r})
from mlp import build as _build


class HangAfter(torch.nn.Module):
    def __init__(self, inner, after):
        super().__init__()
        self.inner, self.after, self.calls = inner, after, 0

    def forward(self, x):
        self.calls += 1
        hang = os.environ.get("HANG_TEST_RANK")
        if hang is not None and os.environ.get("RANK") == hang and self.calls > self.after:
            while True:
                time.sleep(0.05)
        return self.inner(x)


def build(**kwargs):
    layers = list(_build(**kwargs))
    layers[-1] = HangAfter(layers[-1], 5)
    return layers
'''


def _four(tmp_path, name="four", edits=()):
    model = tmp_path / "hang_model.py"
    model.write_text(HANGING_MODEL.format(examples=str(ROOT / "examples")))
    text = (FOUR.replace("MODEL", str(model)).replace("EXAMPLES", str(ROOT / "examples"))
            .replace("TIMEOUT", str(HANG_TIMEOUT_S)))
    for a, b in edits:
        assert a in text
        text = text.replace(a, b)
    path = tmp_path / f"{name}.plan"
    path.write_text(text)
    c = compile_file(path, probe=False)    # the transfer's type is written out; these tests are not about the probe
    out = tmp_path / name
    write_output(c.plan_json, c.program, out)
    return out


@pytest.mark.slow
def test_a_rank_hanging_in_compute_ends_every_rank_within_the_timeout(tmp_path):
    out = _four(tmp_path)
    env = dict(launch_env(), HANG_TEST_RANK="3")   # the plan's train { timeout = 10 s } bounds the wait
    p = subprocess.Popen(["bash", str(out / "launch.sh"), "--steps", "1000"], env=env, cwd=out,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text, _ = p.communicate(timeout=240 + 3 * HANG_TIMEOUT_S)   # start-up, then the hang's timeout
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode != 0, text[-3000:]
    assert re.search(r"^step 1 loss", text, re.M), text[-3000:]    # it trained, then rank 3 hung in step 2
    assert not re.search(r"^step 2 loss", text, re.M), text[-3000:]
    # the ranks that wait for rank 3 say where they were and that they waited for it
    named = re.findall(r"planc: rank (\d+): rank \d+ \(stage \d\) failed in (\w+)[^\n]* with ranks \[([0-9, ]+)\]",
                       text)
    assert any("3" in peers.split(", ") for _, _, peers in named), text[-3000:]
    for rank in range(4):
        assert _pid_of(out, rank) is None, f"rank {rank} still running"




def _start_ranks(outs, hosts=None, timeout=180):
    """One ``python OUT/train.py`` per rank (as a per-host launcher would start them): rank r runs
    outs[r] (its collective timeout: the plan's train { timeout }); with ``hosts``, rank r runs under hostname hosts[r] (its own UTS namespace) with
    LOCAL_WORLD_SIZE = how many ranks share that name. Returns [(returncode, output)] by rank."""
    port, world = free_port(), len(outs)
    procs = []
    for rank, out in enumerate(outs):
        env = dict(launch_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK="0", GLOO_SOCKET_IFNAME="lo")
        cmd = [sys.executable, str(out / "train.py"), "--steps", "1"]
        if hosts is not None:
            env["LOCAL_WORLD_SIZE"] = str(hosts.count(hosts[rank]))
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {hosts[rank]} && exec "$@"', "sh", *cmd]
        procs.append(subprocess.Popen(cmd, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    results = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return results


@pytest.mark.slow
def test_ranks_with_plans_of_different_digests_refuse_naming_both(tmp_path):
    from planc.plan import digest, load
    a = _four(tmp_path, "a")
    b = _four(tmp_path, "b", edits=[("lr = 0.1", "lr = 0.2")])
    da, db = digest(load(a / "plan.json")), digest(load(b / "plan.json"))
    assert da != db
    results = _start_ranks([a, a, b, b])
    assert all(rc == 2 for rc, _ in results), results
    text = results[0][1]
    assert "Traceback" not in "".join(t for _, t in results)
    assert (f"planc: rank 0: rank 0: plan 'failures_four' cannot run here:\n  ranks disagree on the plan: "
            f"ranks [0, 1] have sha256 {da[:16]}…; ranks [2, 3] have sha256 {db[:16]}…") in text, text[-3000:]


def _can_unshare_uts() -> bool:
    import shutil
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--uts", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_world_of_another_size_is_refused_with_both_numbers(tmp_path):
    out = _four(tmp_path)
    results = _start_ranks([out] * 3)
    assert all(rc == 2 for rc, _ in results), results
    assert ("world size 3 does not match the plan 'failures_four': cluster.devices = 4 (2 hosts of [2, 2] devices); "
            "launch 4 processes") in results[0][1], results[0][1][-3000:]
    assert "Traceback" not in "".join(t for _, t in results)


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare_uts(), reason="needs unshare --uts (root) to give ranks their own hostnames")
def test_ranks_per_host_not_matching_the_plan_are_refused(tmp_path):
    """4 ranks on two hostnames, 1 + 3, for a plan of 2 hosts x 2 devices."""
    out = _four(tmp_path)
    results = _start_ranks([out] * 4, hosts=["h0", "h1", "h1", "h1"])
    assert all(rc == 2 for rc, _ in results), results
    text = results[0][1]
    assert "host 'h0' runs ranks [0], but the plan's hosts are [[0, 1], [2, 3]]" in text, text[-3000:]
    assert "host 'h1' runs ranks [1, 2, 3], but the plan's hosts are [[0, 1], [2, 3]]" in text, text[-3000:]
    assert "rank 0 on 'h0': LOCAL_WORLD_SIZE=1 but the plan puts 2 devices on its host" in text, text[-3000:]
