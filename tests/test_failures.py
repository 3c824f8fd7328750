"""A rank killed mid-iteration ends the whole job, non-zero, within the collective timeout, and the
surviving ranks say which instruction they were in and which ranks they were waiting for (single
host, the real `deepspeed` launcher, CPU/gloo)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from planc.codegen import write_output
from planc.compile import compile_file

from e2e_util import ROOT, launch_env

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
    c = compile_file(ROOT / "plans" / "unet-skip.plan")
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    env = dict(launch_env(), PLANC_COLLECTIVE_TIMEOUT_S=str(TIMEOUT_S))
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
        killed = time.monotonic()
        rest, _ = p.communicate(timeout=2 * TIMEOUT_S + 60)
        ended = time.monotonic() - killed
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = "".join(lines) + rest
    assert p.returncode != 0, text[-3000:]
    assert ended < TIMEOUT_S + 30, f"the job took {ended:.0f} s to end after the kill"
    # every message of a surviving rank names the instruction it was in and the ranks it waited for;
    # at least one names rank 3 (its peers in the plan are stage 1's)
    named = re.findall(r"planc: rank \d+: rank \d+ \(stage \d\) failed in (\w+)[^\n]* with ranks \[([0-9, ]+)\]", text)
    assert named and any("3" in peers.split(", ") for _, peers in named), text[-3000:]
    assert _pid_of(out, 0) is None and _pid_of(out, 5) is None   # nothing left running
