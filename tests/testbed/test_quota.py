"""CPU quotas for the testbed's ranks (benchmarks/testbed/quota.py): the figures and the text written
(anywhere), then, as root with a writable cgroup hierarchy, the cgroups made and removed (after a
normal and a failing run, and a dead owner's), a busy process held to its share (a generous bound, no
tight timing) and one short training launch under quotas."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.testbed import available, quota

ROOT = Path(__file__).resolve().parents[2]
CGROUPS = pytest.mark.skipif(quota.available() is not None, reason=f"CPU quotas unavailable: {quota.available()}")
BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}:\n    pass\n"


# ---------------------------------------------------------------- figures and text, anywhere

def test_quota_is_the_share_of_a_period_of_at_least_a_tick_and_a_quota_of_at_least_1_ms():
    assert quota.quota_of(0.5, tick_us=1000) == quota.Quota(0.5, 2000, 1000)     # 1 ms floor: 1 ms / 2 ms
    assert quota.quota_of(0.25, tick_us=1000) == quota.Quota(0.25, 4000, 1000)
    assert quota.quota_of(1.5, tick_us=1000) == quota.Quota(1.5, 1000, 1500)
    assert quota.quota_of(0.5, tick_us=4000) == quota.Quota(0.5, 4000, 2000)     # HZ=250: one tick
    third = quota.quota_of(1 / 3, tick_us=4000)
    assert (third.quota_us, third.period_us) == (1333, 4000)                     # never above the share
    assert quota.quota_of(None, tick_us=4000) == quota.Quota(None, 4000, None)
    for bad in (0, -1, float("nan"), "half"):
        with pytest.raises(quota.QuotaError, match="positive number of cores"):
            quota.quota_of(bad)
    with pytest.raises(quota.QuotaError, match="no period long enough"):
        quota.quota_of(0.0005)


def test_text_written_v1_and_v2():
    q = quota.quota_of(0.25, tick_us=1000)
    assert quota.v1_files(q) == {"cpu.cfs_period_us": "4000\n", "cpu.cfs_quota_us": "1000\n", "cpu.cfs_burst_us": "0\n"}
    assert quota.v2_files(q) == {"cpu.max": "1000 4000\n", "cpu.max.burst": "0\n"}
    unlimited = quota.quota_of(None, tick_us=1000)
    assert quota.v2_files(unlimited)["cpu.max"] == "max 1000\n"
    assert quota.v1_files(unlimited)["cpu.cfs_quota_us"] == "-1\n"
    assert quota.parent_weight(4, 1) == ("cpu.shares", "4096\n")
    assert quota.parent_weight(4, 2) == ("cpu.weight", "400\n")


def test_quotas_over_the_cores_are_refused_naming_the_figures():
    with pytest.raises(quota.QuotaError) as e:
        quota.share_for(0.5, 8, 2)
    assert str(e.value) == ("cpus_per_rank 0.5 x 8 ranks = 4 cores of quota, more than the 2 cores of this machine: "
                            "the ranks would still compete for them; give at most 0.25 per rank "
                            "('auto': 2 cores ÷ 8 ranks)")
    assert quota.share_for(0.25, 8, 2) == 0.25           # exactly the cores: accepted
    assert quota.share_for("auto", 3, 2) == pytest.approx(2 / 3)
    assert quota.cpus_option("auto") == "auto" and quota.cpus_option("0.25") == 0.25
    with pytest.raises(quota.QuotaError, match="a share of one core"):
        quota.cpus_option("lots")


def test_detect_reads_the_mounts(tmp_path):
    v1 = ("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
          "cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n"
          "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    assert quota.detect(v1) == quota.Hierarchy(1, Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpuacct"))
    together = quota.detect("cgroup /c/cpu,cpuacct cgroup rw,cpu,cpuacct 0 0\n")
    assert together.roots == (Path("/c/cpu,cpuacct"),)
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert quota.detect(f"cgroup2 {tmp_path} cgroup2 rw 0 0\n") == quota.Hierarchy(2, tmp_path, tmp_path)
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")    # cpu still bound to v1 (hybrid)
    assert quota.detect(f"cgroup2 {tmp_path} cgroup2 rw 0 0\n") is None


# ---------------------------------------------------------------- cgroups on this machine (root)

def _exists(rq: quota.RankQuotas) -> list[Path]:
    return [root / rq.name for root in rq.hierarchy.roots if (root / rq.name).exists()]


@CGROUPS
def test_cgroups_made_with_the_quota_and_removed_after_a_normal_run():
    q = quota.quota_of(0.25)
    with quota.RankQuotas(q, [0, 1]) as rq:
        h = rq.hierarchy
        for r in (0, 1):
            for root in h.roots:
                assert rq.group(r, root).is_dir()
            files = quota.v1_files(q) if h.version == 1 else quota.v2_files(q)
            for name, text in files.items():
                path = rq.group(r) / name
                if path.exists():
                    got = path.read_text().split()
                    assert got == text.split(), (name, got)
        env = dict(os.environ, RANK="1", **rq.environ())
        r = subprocess.run(rq.command([sys.executable, "-c", "print(open('/proc/self/cgroup').read())"]), env=env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert f"/{rq.name}/rank1" in r.stdout
    assert _exists(rq) == [] and rq.left == []


@CGROUPS
def test_cgroups_removed_when_the_run_fails_with_a_rank_still_running():
    with pytest.raises(RuntimeError, match="boom"):
        with quota.RankQuotas(quota.quota_of(0.25), [0]) as rq:
            env = dict(os.environ, RANK="0", **rq.environ())
            p = subprocess.Popen(rq.command(["sleep", "60"]), env=env)
            for _ in range(100):
                if rq.pids(0):
                    break
                time.sleep(0.02)
            assert rq.pids(0) == [p.pid]
            raise RuntimeError("boom")
    assert p.wait(timeout=10) == -9          # the straggler was killed, then its cgroup removed
    assert _exists(rq) == []


@CGROUPS
def test_a_rank_that_cannot_join_its_cgroup_does_not_run():
    env = dict(os.environ, RANK="0", PLANC_QUOTA_CGROUPS="/nonexistent/planc1q0-cpu0")
    r = subprocess.run(quota.RankQuotas.command(["echo", "ran"]), env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == "planc testbed: rank 0 could not join its CPU cgroup /nonexistent/planc1q0-cpu0/rank0"


@CGROUPS
def test_stale_cgroups_of_a_dead_owner_are_removed_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    h = quota.detect()
    stale = [root / f"planc{dead.pid}t0-cpu0" for root in h.roots]
    for d in stale:
        (d / "rank0").mkdir(parents=True)
    try:
        with quota.RankQuotas(quota.quota_of(0.5), [0]) as live:
            removed = quota.cleanup_stale()
            assert _exists(live)                          # its owner (this process) is alive
        assert {str(d) for d in stale} <= set(removed)    # (and any other dead testbed's on this machine)
        assert not any(d.exists() for d in stale)
    finally:
        for d in stale:
            for sub in (d / "rank0", d):
                if sub.exists():
                    sub.rmdir()


@CGROUPS
def test_a_busy_process_gets_about_its_share():
    with quota.RankQuotas(quota.quota_of(0.25), [0]) as rq:
        env = dict(os.environ, RANK="0", **rq.environ())
        t0 = time.monotonic()
        subprocess.run(rq.command([sys.executable, "-S", "-c", BUSY.format(s=1.0)]), env=env, check=True, timeout=60)
        wall = time.monotonic() - t0
        st = rq.stats()[0]
    # the share is 0.25 of a core: generous bounds, never a tight timing
    assert 0 < st["usage_s"] / wall < 0.5, (st, wall)
    assert st["nr_throttled"] > 0 and st["throttled_s"] > 0, st


# ---------------------------------------------------------------- a launch on the testbed

@pytest.mark.slow
@pytest.mark.testbed
@pytest.mark.skipif(available() is not None or quota.available() is not None,
                    reason=f"testbed or CPU quotas unavailable: {available() or quota.available()}")
def test_training_launch_under_quotas_and_the_refusal(tmp_path):
    """The per-host DeepSpeed launchers start every rank through the wrapper (``--no_python``): it
    trains, prints its losses, each rank's CPU is counted in its own cgroup, and nothing is left;
    a launch whose quotas exceed the cores is refused before anything starts."""
    from benchmarks.testbed import Testbed
    from planc.calibrate.clusterfile import cores_available
    from planc.driver.compile import compile_file
    from planc.output.codegen import write_output
    from tests.testbed.test_testbed import TRAIN, _leftovers

    src = tmp_path / "train.plan"
    src.write_text(TRAIN.format(mlp=ROOT / "examples" / "mlp.py"))
    c = compile_file(src, probe=False)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    cores = cores_available()
    with Testbed(2, 200, cpus_per_rank="auto") as tb:
        prefix = tb.prefix
        r = tb.launch(out, steps=3, timeout=240, comm_only=False)
        with pytest.raises(quota.QuotaError, match=r"more than the \d+ cores of this machine"):
            tb.cpus_per_rank = 1.0 * cores
            tb.launch(out, steps=1, timeout=60, comm_only=False)
    assert r.returncode == 0, r.check()
    assert len(re.findall(r"^step \d loss \S+ time", r.stdout, re.M)) == 3 and len(r.losses) == 3, r.stdout[-2000:]
    assert r.cpu_quota.cpus == pytest.approx(cores / 4)
    assert sorted(r.cpu_stats) == [0, 1, 2, 3]
    assert all(s["usage_s"] > 0.1 and s["nr_periods"] > 0 for s in r.cpu_stats.values()), r.cpu_stats
    assert _leftovers(prefix) == []
    h = quota.detect()
    assert not [p for root in h.roots for p in root.iterdir() if p.name.startswith(prefix)]
