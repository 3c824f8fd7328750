"""The intra-op threads a CPU rank takes (planc.runtime.dist_util.cpu_threads): its share of the
machine's cores, the user's OMP_NUM_THREADS kept, NCCL ranks left alone."""

from __future__ import annotations

import os
import subprocess
import sys

from planc.runtime.dist_util import cpu_threads, machine_cores


def test_a_gloo_rank_takes_its_share_of_the_cores():
    assert cpu_threads("gloo", {"LOCAL_SIZE": "8"}, cores=2) == (
        1, "2 core(s) ÷ 8 rank(s) on this machine (LOCAL_SIZE); OMP_NUM_THREADS overrides")
    assert cpu_threads("gloo", {"LOCAL_WORLD_SIZE": "4", "LOCAL_SIZE": "8"}, cores=16)[0] == 4   # torchrun's first
    assert cpu_threads("gloo", {"WORLD_SIZE": "3"}, cores=16)[0] == 5     # no local size: the whole world here
    assert cpu_threads("gloo", {}, cores=6)[0] == 6                       # one rank, no launcher
    # a local size that is no positive number is passed over, not trusted
    assert cpu_threads("gloo", {"LOCAL_SIZE": "x", "WORLD_SIZE": "2"}, cores=8)[0] == 4
    assert cpu_threads("gloo", {"LOCAL_SIZE": "0", "WORLD_SIZE": "2"}, cores=8)[0] == 4


def test_the_users_setting_and_gpu_ranks_are_left_alone():
    assert cpu_threads("gloo", {"OMP_NUM_THREADS": "3", "LOCAL_SIZE": "8"}, cores=2) == (
        None, "OMP_NUM_THREADS=3 (set by the user)")
    assert cpu_threads("nccl", {"LOCAL_SIZE": "8"}, cores=2)[0] is None
    assert cpu_threads("gloo", {"OMP_NUM_THREADS": " ", "LOCAL_SIZE": "2"}, cores=4)[0] == 2   # blank: not set


def test_limit_cpu_threads_sets_torchs_threads():
    code = ("import os, torch; os.environ.pop('OMP_NUM_THREADS', None); os.environ['LOCAL_SIZE'] = '1000'; "
            "torch.set_num_threads(2); "
            "from planc.runtime.dist_util import limit_cpu_threads; line = limit_cpu_threads('gloo'); "
            "print(torch.get_num_threads(), line.split(' (')[0]); print(limit_cpu_threads('nccl'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1 cpu threads: 1 per rank", "None"]


def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path):
    f = tmp_path / "cpu.max"
    f.write_text("150000 100000\n")              # docker --cpus=1.5: two cores' worth, rounded up
    assert machine_cores(str(f)) == min(2, len(os.sched_getaffinity(0)))
    f.write_text("max 100000\n")                 # no quota: the affinity
    assert machine_cores(str(f)) == len(os.sched_getaffinity(0))
    f.write_text("garbage\n")                    # unreadable: the affinity, no error
    assert machine_cores(str(f)) == len(os.sched_getaffinity(0))
    assert machine_cores(str(tmp_path / "absent")) == len(os.sched_getaffinity(0))
