"""Failing ranks on the multi-host testbed (docs/reliability.md "Failing ranks"): every host's ranks
are started by DeepSpeed's launcher in that host's namespace, under that host's own hostname.

- a rank that hangs in compute (alive, its layer never returns) on host 1: every rank on every host
  ends non-zero by itself within the plan's collective timeout, and the account names the rank
  that failed first and the instruction the others waited in, with the hung rank among their peers;
  the launch's DeepSpeed /dev/shm buffers are gone afterwards;
- start-up refusals, one launch each, side by side on three testbeds: host 1 running another
  plan's output with a world of 3 for a plan of 2 (both digests and both numbers named), ranks
  split 1 + 3 over hosts the plan gives 2 + 2 (each host's ranks and the plan's hosts named), and
  a stage producing a tensor whose shape differs from its transfer (stage, transfer and both shapes);
- `planc bench testbed` with a host link going down in its first case (PLANC_BENCH_LINK_DOWN):
  exits 1 with the account within the collective timeout, and leaves no namespace, link, qdisc
  or /dev/shm buffer behind.

Single-host versions: tests/e2e/test_failures.py. Needs root and iproute2."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from benchmarks.testbed import Testbed, available

from e2e_util import ROOT, extensions_env
from test_failures import FOUR, HANGING_MODEL
from test_testbed_faults import _leftovers, _machine_state, ended_within

pytestmark = [pytest.mark.testbed, pytest.mark.slow,
              pytest.mark.skipif(available() is not None, reason=f"testbed unavailable: {available()}")]

TIMEOUT_S = 30          # the hang plan's train { timeout = 30 s }, and the bench's collective timeout
                        # (it also bounds the start-up rendezvous: ranks start far apart on loaded cores)
REFUSE_TIMEOUT_S = 60   # the other plans': they never wait it out, but it also bounds the start-up
                        # rendezvous, and three launches side by side on 2 loaded cores start far apart

# 2 hosts x 1 device, one stage per host; the last layer hangs on the rank HANG_TEST_RANK names
PLAN = """
plan tb_failures {
  cluster {
    level node x 2 : bandwidth 100 MB/s, latency 50 us
    level gpu  x 1 : bandwidth 10 GB/s,  latency 2 us
    host = node
  }
  model "MODEL:build" { layers = 4, hidden = 16, inputs = 8, outputs = 4 }
  loss  "EXAMPLES/mlp.py:loss"
  data  "EXAMPLES/mlp.py:batches"
  stage 0 : layers 0..2 on devices 0..1 as (data = 1)
  stage 1 : layers 2..4 on devices 1..2 as (data = 1)
  transfer h : f32[8, 16] from stage 0 as R R to stage 1 as R R
  train {
    micro_batch = 8, micro_batches = 2, steps = 3, timeout = TIMEOUT s
    schedule = 1f1b, optimizer = sgd(lr = LR), precision = fp32, seed = 5
  }
}
"""


def _compile(text: str, out):
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    src = out.with_suffix(".plan")
    src.write_text(text)
    c = compile_file(src, probe=False)
    write_output(c.plan_json, c.program, out)
    return out


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """One compile per variant, shared: the 2 x 1 plan (a), the same with another learning rate (b:
    another digest), a's output with transfer 'h' one column narrower in plan.json than what stage 0
    produces (shape), and tests/e2e/test_failures.py's 2 hosts x 2 devices plan (four); all with the
    model whose last layer hangs on the rank HANG_TEST_RANK names."""
    d = tmp_path_factory.mktemp("tbfail")
    model = d / "hang_model.py"
    model.write_text(HANGING_MODEL.format(examples=str(ROOT / "examples")))

    def text(tmpl, timeout=REFUSE_TIMEOUT_S):
        return (tmpl.replace("MODEL", str(model)).replace("EXAMPLES", str(ROOT / "examples"))
                .replace("TIMEOUT", str(timeout)))
    a = _compile(text(PLAN).replace("LR", "0.1"), d / "a")
    b = _compile(text(PLAN).replace("LR", "0.2"), d / "b")
    shape = _compile(text(PLAN).replace("LR", "0.1"), d / "shape")
    plan = json.loads((shape / "plan.json").read_text())
    h = plan["transfers"][0]
    assert h["name"] == "h" and h["shape"] == [8, 16]
    h["shape"] = [8, 15]
    for route in (h, h["backward"]):
        for box in [t["slice"] for t in route["tasks"]] + [b for side in route["regions"].values()
                                                          for b in side.values()]:
            box[1] = [0, 15]
    (shape / "plan.json").write_text(json.dumps(plan, indent=2))
    two = _compile(text(PLAN, TIMEOUT_S).replace("LR", "0.1"), d / "two")
    four_refuse = _compile(text(FOUR), d / "four_refuse")
    one_host = _compile(text(PLAN).replace("LR", "0.1").replace("level node x 2", "level node x 1")
                        .replace("level gpu  x 1", "level gpu  x 2"), d / "one_host")
    return {"a": a, "b": b, "shape": shape, "two": two, "four_refuse": four_refuse, "one_host": one_host}


@pytest.fixture(scope="module")
def started(outs):
    """The two runs that wait out a collective timeout, started together so that each one's wait
    overlaps the other's start-up: the hang on its own testbed (a thread) and `planc bench testbed`
    with host 1's link going down (a process)."""
    hang = {"before": _machine_state(), "seen": {}}

    def on_step(n, seconds):
        hang["seen"][n] = time.monotonic()

    def run_hang():
        try:
            with Testbed(2, 100) as tb:
                hang["prefix"], hang["master"] = tb.prefix, tb.addresses[0]
                hang["t0"] = time.monotonic()
                hang["r"] = tb.launch(outs["two"], steps=1000, timeout=240, comm_only=False,
                                      env={"HANG_TEST_RANK": "1", **extensions_env()}, on_step=on_step)
        except BaseException as e:      # shown by the test
            hang["error"] = f"{type(e).__name__}: {e}"

    bench = {"shm_before": set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))}
    env = dict(os.environ, PLANC_BENCH_LINK_DOWN="0@1", PLANC_BENCH_COLLECTIVE_TIMEOUT_S=str(TIMEOUT_S), **extensions_env())
    bench["p"] = subprocess.Popen([sys.executable, "-m", "benchmarks", "bench", "testbed"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    th = threading.Thread(target=run_hang, daemon=True)
    th.start()
    yield {"hang": hang, "hang_thread": th, "bench": bench}
    th.join(timeout=330)
    if bench["p"].poll() is None:       # SIGTERM: the bench's testbed removes itself
        bench["p"].terminate()
        try:
            bench["p"].communicate(timeout=60)
        except subprocess.TimeoutExpired:
            bench["p"].kill()
            bench["p"].communicate()


def _digest(out) -> str:
    from planc.plan import digest, load
    return digest(load(out / "plan.json"))


def _all_refused(r, world: int, *texts: str) -> None:
    """Every rank refused by itself (exit 2, seen before any kill) and rank 0 said each of ``texts`` (a
    failure that is the same on every rank is worded once, by rank 0); no traceback anywhere. (A
    launcher slow to notice, on loaded cores, may still be ended by the testbed's grace kill.)"""
    assert sorted(r.rank_exits) == list(range(world)) and not r.timed_out, r.failure
    assert all(code in (2, None) for code in r.rank_exits.values()), r.failure   # None: reaped unseen
    for text in texts:
        assert text in r.logs[0], r.logs[0][-3000:]
    assert not any("Traceback" in log for log in r.logs.values()), r.failure
    assert sorted(r.host_exits) == [0, 1] and all(c not in (0, None) for c in r.host_exits.values()), r.host_exits


def test_start_up_refusals_on_the_testbed(outs):
    """Three launches side by side, each on its own testbed: other digests and another world size at
    once, ranks per host, a tensor of the wrong shape; every rank refuses at start-up (exit 2)."""
    before = _machine_state()
    launches = {
        "digest": dict(out=outs["a"], host_outs={1: outs["b"]}, ranks_per_host=[1, 2]),
        "per_host": dict(out=outs["four_refuse"], ranks_per_host=[1, 3]),
        "shape": dict(out=outs["shape"]),
    }
    results, prefixes, errors = {}, [], []

    def run(name, kw):
        try:
            with Testbed(2, 100) as tb:
                prefixes.append(tb.prefix)
                results[name] = tb.launch(kw.pop("out"), steps=2, timeout=240, comm_only=False, env=extensions_env(),
                                          **kw)
        except BaseException as e:      # shown by the assertion below
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in launches.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=330)
    assert not errors and sorted(results) == sorted(launches), errors

    # host 0 runs plan a, host 1 plan b with two ranks: both digests and both world sizes named
    r = results["digest"]
    da, db = _digest(outs["a"]), _digest(outs["b"])
    assert da != db
    _all_refused(r, 3, "world size 3 does not match the plan 'tb_failures': cluster.devices = 2 (2 hosts of "
                       "[1, 1] devices); launch 2 processes",
                 f"ranks disagree on the plan: ranks [0] have sha256 {da[:16]}…; "
                 f"ranks [1, 2] have sha256 {db[:16]}…")
    assert re.search(r"^first to fail: rank \d \(host \d\) exited 2 at [0-9.]+ s: planc: rank \d: rank \d: "
                     r"plan 'tb_failures' cannot run here:", r.failure, re.M), r.failure

    # 1 + 3 ranks on hosts node0 and node1 (their own hostnames) for a plan of 2 + 2
    r = results["per_host"]
    _all_refused(r, 4, "host 'node0' runs ranks [0], but the plan's hosts are [[0, 1], [2, 3]]",
                 "host 'node1' runs ranks [1, 2, 3], but the plan's hosts are [[0, 1], [2, 3]]")

    # stage 0 produces [8, 16] where plan.json's transfer 'h' now says f32[8, 15]
    _all_refused(results["shape"], 2, "stage 0, transfer 'h': the plan moves a [8, 15] shard from rank 0 (of "
                                      "f32[8, 15]) but the stage produces [8, 16]")

    for prefix in prefixes:
        assert _leftovers(prefix) == []
    assert _machine_state() == before


def test_the_dev_shm_buffers_a_launch_leaves_are_removed(outs):
    """DeepSpeed's CPU ranks map a ~69 MB /dev/shm buffer each when all of a job's ranks are on one
    launcher node (LOCAL_SIZE = world: here a one-host plan) and never unlink it. Rank 1 is killed
    after step 0; afterwards the launch's buffers (named by its master address and port) are gone."""
    seen = []

    def on_step(n, seconds):
        if n == 0:
            seen.extend(p for p in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*") if f"_{tb.addresses[0]}_" in p)
            tb.kill_rank(1)

    with Testbed(1, 100) as tb:
        prefix = tb.prefix
        r = tb.launch(outs["one_host"], steps=1000, timeout=240, comm_only=False, env=extensions_env(),
                      on_step=on_step)
    assert r.returncode != 0 and r.rank_exits.get(1) == -9, r.failure
    uid = os.getuid()
    assert sorted(seen) == [f"/dev/shm/deepspeed_allreduce_buffer_{uid}_{tb.addresses[0]}_{p}_{rank}"
                            for p in {re.search(r"_(\d+)_\d$", seen[0]).group(1)} for rank in (0, 1)], seen
    assert sorted(r.shm_removed) == sorted(seen)
    assert not any(os.path.exists(p) for p in seen), seen
    assert _leftovers(prefix) == []


def test_a_rank_hanging_in_compute_alone_on_host_1_ends_every_rank_within_the_timeout(started):
    """Rank 1, the only rank of host 1, never returns from its last layer in step 2: rank 0 waits for
    it (its gradient) until the collective timeout and fails naming the instruction and rank 1; rank 1,
    in no collective and with no sibling for its launcher to notice, is ended by its failure watch
    (planc/runtime/failwatch.py: rank 0's failure, seen in the rendezvous store); every rank has
    ended by itself, non-zero, within the timeout."""
    started["hang_thread"].join(timeout=330)
    hang = started["hang"]
    assert "error" not in hang and "r" in hang, hang.get("error")
    r, seen = hang["r"], hang["seen"]
    assert 1 in seen and 2 not in seen, r.stdout[-3000:]        # trained step 0 and 1, then rank 1 hung
    assert r.returncode != 0 and not r.timed_out and not r.killed, r.failure
    assert sorted(r.rank_exits) == [0, 1] and all(c != 0 for c in r.rank_exits.values()), r.failure
    assert sorted(r.host_exits) == [0, 1] and all(c not in (0, None) for c in r.host_exits.values()), r.host_exits
    assert r.collective_timeout_s == TIMEOUT_S
    assert max(r.rank_ended_s.values()) - (seen[1] - hang["t0"]) < ended_within(TIMEOUT_S), r.failure
    # rank 0 names the instruction it waited in and the hung rank; rank 1 says why it ended
    assert re.search(r"planc: rank 0: rank 0 \(stage 0\) failed in .* with ranks \[1\]", r.logs[0]), r.failure
    assert re.search(r"planc: rank 1: ending: rank 0: rank 0 \(stage 0\) failed in .*rendezvous store",
                     r.logs[1]), r.failure
    assert _leftovers(hang["prefix"]) == []
    assert _machine_state() == hang["before"]


def test_a_link_going_down_during_planc_bench_testbed_ends_it(started):
    """`planc bench testbed` with host 1's link down right at the first case's first step: within the
    collective timeout every rank has failed, the bench prints the account and exits 1, and nothing
    of its testbed is left (namespaces, links, qdiscs, /dev/shm buffers)."""
    p = started["bench"]["p"]
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr[-3000:]
    from benchmarks.bench import testbed as bench_testbed
    cases = len(bench_testbed.STRATEGIES) * (len(bench_testbed.TRANSFERS) + len(bench_testbed.WIDE)) \
        + len(bench_testbed.PROGRAMS) + len(bench_testbed.GLOO_IN_HOST)
    assert re.search(r"^benchmarks bench testbed: case '1 -> \(1,4\)  R R -> R R' \(send_recv\) failed \(exit \d+\) "
                     rf"after host 1's link went down \(collective timeout {TIMEOUT_S} s\); the other {cases - 1} "
                     r"case\(s\) were not run", stderr, re.M), stderr[-3000:]
    down = re.search(r"^faults: ([0-9.]+) s: host 1's link set down \(bridge port p1\)$", stderr, re.M)
    assert down, stderr[-3000:]
    ended = [float(t) for t in re.findall(r"^  rank \d \(host \d\): (?:exited \d+|killed by SIG\w+|ended \(exit "
                                          r"status not seen\)) at ([0-9.]+) s", stderr, re.M)]
    assert len(ended) == 8, stderr[-3000:]          # every rank ended by itself (none killed by the testbed)
    assert max(ended) - float(down.group(1)) < ended_within(TIMEOUT_S), stderr[-3000:]
    assert f"bench testbed [1/{cases}]" in stderr and f"bench testbed [2/{cases}]" not in stderr, stderr[:2000]
    assert _leftovers(f"planc{p.pid}t") == []
    assert _machine_state() == started["hang"]["before"]
    shm_before = started["bench"]["shm_before"]
    assert not [q for q in set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) - shm_before if "_10.213." in q]
