"""The host NIC order (planc/runtime/nicorder.py, plan.json pipeline.nic_order): the runtime's turn
taking between a host's ranks, its errors, the plan file's checks of the order, and the compiler's
choice of it (every listed send is a real cross-host send, each once; kept only when predicted to
pay). The multi-process run is in tests/e2e/test_e2e_nic_order.py."""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest

from planc.runtime import nicorder
from planc.runtime.nicorder import NicOrder, NicOrderError
from planc.plan import Plan, PlanFileError

from e2e_util import ROOT


def counter():
    return memoryview(bytearray(8)).cast("q")


ORDER = ((1, "h", "forward", 0), (0, "h", "forward", 0), (0, "h", "forward", 1), (1, "h", "forward", 1),
         (0, "e", "backward", 0))


def _ranks(order=ORDER, timeout=30.0, **kw):
    c = counter()
    return c, {r: NicOrder(r, 0, order, c, timeout, **kw) for r in (0, 1)}


def test_sends_go_in_the_hosts_order_whatever_order_the_ranks_submit_them():
    c, nic = _ranks()
    log, lock = [], threading.Lock()

    def issue(rank, key):
        def go():
            with lock:
                log.append((rank, *key))
            return []
        return go

    handles = []
    for step in range(2):
        for n in nic.values():
            n.begin_step()
        # rank 0 submits everything at once; rank 1 later and backwards: the turns still follow ORDER
        for key in [k[1:] for k in ORDER if k[0] == 0]:
            handles.append(nic[0].submit(*key, issue(0, key)))
        time.sleep(0.01)
        for key in reversed([k[1:] for k in ORDER if k[0] == 1]):
            handles.append(nic[1].submit(*key, issue(1, key)))
        for h in handles:
            h.wait()
        assert log == list(ORDER) * (step + 1)
        assert c[0] == len(ORDER) * (step + 1)       # the positions of the next step follow on
    assert nic[0].gated("h", "forward", 1) and not nic[0].gated("h", "forward", 7)


def test_a_sibling_that_never_sends_is_an_error_naming_it():
    c, nic = _ranks(timeout=0.2)
    for n in nic.values():
        n.begin_step()
    h = nic[0].submit("h", "forward", 0, lambda: [])          # its turn is after rank 1's, which never comes
    with pytest.raises(NicOrderError, match=r"rank 0: waited 0.2 s for its turn on host 0's NIC \(send h forward "
                                            r"m0\); the host is waiting for rank 1's send h forward m0 \(step 0\)"):
        h.wait()
    later = nic[0].submit("h", "forward", 1, lambda: [])      # after the thread's error: at once
    with pytest.raises(NicOrderError):
        later.wait()


def test_a_failed_send_fails_its_handle_and_the_ones_after_it():
    c, nic = _ranks()
    nic[1].begin_step()

    def broken():
        raise RuntimeError("Connection reset by peer")

    h = nic[1].submit("h", "forward", 0, broken)
    with pytest.raises(RuntimeError, match="Connection reset"):
        h.wait()
    assert c[0] == 0                                         # the host's turn did not move


def test_a_turn_is_held_for_the_bytes_time_at_the_link_rate(monkeypatch):
    """On a clock that stands still (the send takes no time), the turn is held for exactly the bytes'
    time at the link's rate: 200 kB at 1 MB/s."""
    import types
    slept = []
    real_sleep = time.sleep
    clock = types.SimpleNamespace(monotonic=lambda: 100.0,
                                  sleep=lambda s: slept.append(s) if s > nicorder.POLL_S else real_sleep(s))
    monkeypatch.setattr(nicorder, "time", clock)
    c = counter()
    n = NicOrder(1, 0, ORDER[:1], c, 30.0, bandwidth=1e6)
    n.begin_step()
    n.submit("h", "forward", 0, lambda: [], nbytes=2e5).wait()
    assert slept == [pytest.approx(0.2)]
    assert c[0] == 1


def test_host_bandwidth_is_the_slowest_link_at_or_above_the_host_level(plan_json):
    assert nicorder.host_bandwidth(Plan.from_json(plan_json)) == pytest.approx(3.1e6)


# ---------------------------------------------------------------- the compiled order and its checks

SLOW = """
  cluster {
    level node x 2 : bandwidth 3.1 MB/s, latency 100 us
    level gpu  x 2 : bandwidth 1 GB/s, latency 50 us
    host = node
    flops = 50 GFLOP/s
    cores = 2 per cluster
  }
"""


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory):
    """plans/gpt-bench-2x2.plan on a 25 Mbit/s host link, 1f1b (with the probe: the order needs the
    simulator's compute model)."""
    from planc.driver.compile import compile_file

    text = (ROOT / "plans" / "gpt-bench-2x2.plan").read_text()
    start = text.index("  cluster {")
    end = text.index("  }", start) + 3
    text = text[:start] + SLOW + text[end:]
    text = text.replace("schedule = eager_1f1b", "schedule = 1f1b")
    tmp = tmp_path_factory.mktemp("nic")
    src = tmp / "gpt-slow.plan"
    src.write_text(text.replace('"../examples/', f'"{ROOT}/examples/'))
    return compile_file(src).plan_json


def cross_host_sends(plan: dict) -> set:
    """Independently of the simulator: every (sender, transfer, direction, m) with a receiver on
    another host, from the routes' tasks."""
    host = {d: h for h, devs in enumerate(plan["cluster"]["hosts"]) for d in devs}
    out = set()
    for t in plan["transfers"]:
        for direction, route in (("forward", t), ("backward", t.get("backward"))):
            for task in (route or {}).get("tasks", ()):
                if any(host[r] != host[task["sender"]] for r in task["receivers"]):
                    out.update((task["sender"], t["name"], direction, m)
                               for m in range(plan["pipeline"]["micro_batches"]))
    return out


def test_the_compiled_order_lists_every_cross_host_send_once_on_its_host(plan_json):
    pipe = plan_json["pipeline"]
    assert pipe["schedule"] == "1f1b"
    sched = pipe["predicted"]["schedules"]["1f1b"]
    assert sched["nic_ordered"] and sched["iteration"] <= 0.98 * sched["unordered_iteration"], sched
    host = {d: h for h, devs in enumerate(plan_json["cluster"]["hosts"]) for d in devs}
    listed = [tuple(k) for e in pipe["nic_order"] for k in e["sends"]]
    assert len(listed) == len(set(listed))
    assert set(listed) == cross_host_sends(plan_json)
    for e in pipe["nic_order"]:
        assert all(host[k[0]] == e["host"] for k in e["sends"])
        # a rank's own sends of one transfer direction keep their micro-batch order
        for r in {k[0] for k in e["sends"]}:
            for name, direction in {(k[1], k[2]) for k in e["sends"] if k[0] == r}:
                ms = [k[3] for k in e["sends"] if k[:3] == [r, name, direction]]
                assert ms == sorted(ms), (r, name, direction, ms)
    Plan.from_json(plan_json)       # the runtime's reader accepts it


def _bad(plan_json, mutate):
    doc = copy.deepcopy(plan_json)
    mutate(doc["pipeline"]["nic_order"])
    with pytest.raises(PlanFileError) as e:
        Plan.from_json(json.loads(json.dumps(doc)))
    return str(e.value)


@pytest.mark.parametrize("mutate,message", [
    (lambda o: o[0]["sends"][0].__setitem__(0, 3), r"nic_order\[0\]\.sends\[0\]: rank 3 is not on host 0"),
    (lambda o: o[0]["sends"][0].__setitem__(1, "nope"), r"no transfer 'nope'"),
    (lambda o: o[0]["sends"][0].__setitem__(2, "sideways"), r"expected forward or backward, got 'sideways'"),
    (lambda o: o[0]["sends"][0].__setitem__(3, 99), r"micro-batch 99 of 8"),
    (lambda o: o[0]["sends"].append(list(o[0]["sends"][0])), r"is listed twice"),
    (lambda o: o[0]["sends"][0].__setitem__(2, "backward"), r"sends nothing of transfer 'hidden' \(backward\)"),
    (lambda o: o.append(dict(o[0])), r"host 0 has two orders"),
    (lambda o: o[0].__setitem__("host", 5), r"no host 5"),
    (lambda o: o[0]["sends"][0].pop(), r"expected \[rank, transfer, direction, micro-batch\]"),
])
def test_bad_orders_are_refused_naming_the_entry(plan_json, mutate, message):
    import re
    assert re.search(message, _bad(plan_json, mutate))


@pytest.mark.parametrize("argv,message", [
    (["bench", "nic"], "needs --cluster CALIBRATED.yaml"),
    (["bench", "nic", "--cluster", "c.yaml", "--rates", "25,x"], "not a comma-separated list of positive Mbit/s"),
    (["bench", "nic", "--cluster", "c.yaml", "--rates", "0"], "not a comma-separated list of positive Mbit/s"),
    (["bench", "nic", "--cluster", "/nonexistent/c.yaml"], "cluster file /nonexistent/c.yaml not found"),
    (["bench", "iteration", "plans/gpt-bench-2x2.plan", "--rates", "25", "--cluster", "/nonexistent/c.yaml"],
     "cluster file /nonexistent/c.yaml not found"),
])
def test_bench_nic_bad_inputs_exit_2(argv, message, capsys, monkeypatch):
    from benchmarks import cli, testbed
    from benchmarks.testbed import netns
    monkeypatch.setattr(netns, "available", lambda: None)     # reach the cluster file check without root
    monkeypatch.setattr(testbed, "available", lambda: None)
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_the_deadlock_check_accepts_the_compiled_order_and_rejects_one_that_would_hang(plan_json):
    """Under gloo's rules (a send completes when its receive is posted; a rank's receives of one
    transfer are posted micro-batch after micro-batch), a host order that puts a rank's m1 before
    its m0 hangs: the NIC thread holds m1 for a receive the peer posts only after m0 arrived."""
    from planc.pipeline.deadlock import check_rendezvous

    assert check_rendezvous(Plan.from_json(plan_json), backend="gloo") == []
    doc = copy.deepcopy(plan_json)
    sends = doc["pipeline"]["nic_order"][0]["sends"]
    i = next(k for k, s in enumerate(sends) if s[2] == "forward" and s[3] == 0)
    j = next(k for k, s in enumerate(sends) if s[:3] == sends[i][:3] and s[3] == 1)
    sends[i], sends[j] = sends[j], sends[i]
    rank = sends[i][0]
    hangs = check_rendezvous(Plan.from_json(doc), backend="gloo")
    assert hangs, "an order that sends m1 before m0 must hang"
    text = "\n".join(str(h) for h in hangs)
    assert f"from rank {rank} on communicator p2p/forward" in text and "(micro-batch 0)" in text, text
    assert f"rank {rank} has not issued the matching send: its NIC thread holds that send for its turn" in text, text
    # NCCL runs no NIC order (the runtime keeps it to gloo): the same plan is fine there
    assert check_rendezvous(Plan.from_json(doc), backend="nccl") == []


def test_explain_says_whether_the_order_was_kept_and_why(plan_json):
    from planc.commands.explain import explain, explain_data
    pipe = plan_json["pipeline"]
    sched = pipe["predicted"]["schedules"]["1f1b"]
    per = ", ".join(f"host {e['host']}: {len(e['sends'])}" for e in pipe["nic_order"])
    text = " ".join(explain(plan_json).split())
    assert f"host NIC order: kept; each host's cross-host sends one at a time in the plan's order ({per} per step)" \
        in text, text[-600:]
    data = explain_data(plan_json)["pipeline"]["nic_order"]
    assert data["ordered"] == sched["iteration"] and data["unordered"] == sched["unordered_iteration"]
    doc = copy.deepcopy(plan_json)
    del doc["pipeline"]["nic_order"]
    doc["pipeline"]["predicted"]["schedules"]["1f1b"]["nic_ordered"] = False
    assert "host NIC order: none; one at a time was not predicted at least 2 % faster" in " ".join(explain(doc).split())
