"""A link's bandwidth while it carries data both ways (``both_ways``): the cluster file's figure and its
bad values, plan.json, the event simulation's capacity, the runtime's NIC turn, `planc calibrate`'s fit
of it, and the runtime's wait for a rank's TCP send queues to empty (docs/calibrate.md,
docs/runtime-engine.md)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from planc import calibrate as cal
from planc import ir
from benchmarks.bench import accuracy
from planc.cost import events
from planc.cost.network import Network
from planc.lang import load
from planc.lang.errors import PlanError
from planc.pipeline.schedules import build
from planc.pipeline.simulate import SimInput, SimTask, SimTransfer, StageCompute, predict, predict_schedule
from planc.runtime import nicorder
from planc.runtime.nicorder import CrossHostSockets, NicOrder, NicOrderError


def two_hosts(bw=1e9, both=None):
    return ir.Cluster((ir.Level("node", 2, bw, 0.0, both_ways=both),), "node")


# ---------------------------------------------------------------- the simulation

def test_opposite_flows_share_the_both_ways_capacity_and_one_way_keeps_the_full_one():
    net = Network(two_hosts(1e9, 0.5e9))
    g = events.Graph()
    a = g.add(flows=[(0, 1, 1e9)])          # 1 GB each way at once: each direction at 0.5 GB/s
    b = g.add(flows=[(1, 0, 0.25e9)])       # ...until this one is done (0.5 s), then a alone at 1 GB/s
    t = events.run(g, net)
    assert t.finish[b] == pytest.approx(0.5)
    assert t.finish[a] == pytest.approx(0.5 + (1e9 - 0.25e9) / 1e9)
    g2 = events.Graph()                     # two flows the same way: the one-way capacity, shared
    x, y = g2.add(flows=[(0, 1, 1e9)]), g2.add(flows=[(0, 1, 1e9)])
    t2 = events.run(g2, net)
    assert t2.finish[y] == pytest.approx(2.0) and t2.finish[x] == pytest.approx(1.0)
    g3 = events.Graph()                     # no both_ways figure: the directions are independent
    p, q = g3.add(flows=[(0, 1, 1e9)]), g3.add(flows=[(1, 0, 1e9)])
    t3 = events.run(g3, Network(two_hosts(1e9)))
    assert t3.finish[p] == pytest.approx(1.0) and t3.finish[q] == pytest.approx(1.0)


@pytest.mark.parametrize("B", [1, 3, 8])
def test_link_bound_1f1b_pays_both_ways_while_activations_and_gradients_cross(B):
    """Compute ~0, N bytes each way per micro-batch: the first activation and the last gradient cross
    alone (rate R), the other B - 1 of each cross together (rate W each way): 2 N/R + (B - 1) N/W."""
    N, R, W = 4e6, 1e9, 0.6e9
    comp = tuple(StageCompute((1e-15,), (2e-15,), (0.0,), 0.0) for _ in range(2))
    trs = (SimTransfer("t0", 0, 1, (SimTask(0, (1,), N, "send_recv"),), (SimTask(1, (0,), N, "send_recv"),)),)
    sim = SimInput(two_hosts(R, W), ((0,), (1,)), comp, trs)
    p = predict_schedule(sim, "1f1b", B)
    assert p.iteration == pytest.approx(2 * N / R + (B - 1) * N / W, rel=1e-9)


def test_loaded_both_ways_is_never_above_the_bandwidth():
    assert ir.Level("n", 2, 1e9, both_ways=2e9).loaded_both_ways == 1e9
    assert ir.Level("n", 2, 1e9, both_ways=4e8).loaded_both_ways == 4e8
    assert ir.Level("n", 2, 1e9).loaded_both_ways == 1e9


# ---------------------------------------------------------------- the cluster file and plan.json

def _plan(tmp_path, level_extra: str):
    (tmp_path / "c.yaml").write_text(
        "levels:\n"
        f"- {{name: host, fanout: 2, bandwidth: 1.25 MB/s, latency: 0{level_extra}}}\n"
        "- {name: device, fanout: 2, bandwidth: 2 GB/s, latency: 0.0001}\n"
        "host: host\n")
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\nparallel { pipe = 2, data = 2 }\n')
    return tmp_path / "p.plan"


def test_cluster_file_both_ways_loads_with_units_or_plain_numbers(tmp_path):
    c = load(_plan(tmp_path, ", both_ways: 1.1 MB/s")).cluster
    assert c.levels[0].both_ways == pytest.approx(1.1e6) and c.levels[1].both_ways is None
    c = load(_plan(tmp_path, ", both_ways: 1000000")).cluster
    assert c.levels[0].both_ways == pytest.approx(1e6)


@pytest.mark.parametrize("value, message", [
    ("2 MB/s", "at most the level's bandwidth"),
    ("-1", "both_ways"),
    ("0", "must be positive"),
    ("fast", "both_ways"),
])
def test_cluster_file_bad_both_ways_is_an_error_naming_it(tmp_path, value, message):
    with pytest.raises(PlanError) as e:
        load(_plan(tmp_path, f", both_ways: {value}"))
    text = str(e.value)
    assert message in text and "levels[0]" in text and "c.yaml" in text


def test_plan_json_carries_both_ways_and_the_runtime_reads_it(tmp_path):
    from planc.driver.compile import compile_program
    from planc.plan import Level

    program = load(_plan(tmp_path, ", both_ways: 1.1 MB/s"))
    compiled = compile_program(program, None)
    levels = compiled.plan_json["cluster"]["levels"]
    assert levels[0]["both_ways"] == pytest.approx(1.1e6) and "both_ways" not in levels[1]
    from planc.plan import At
    assert Level.read(At(levels[0], "cluster.levels[0]")).both_ways == pytest.approx(1.1e6)
    assert Level.read(At(levels[1], "cluster.levels[1]")).both_ways is None


def test_nic_turn_is_held_at_the_one_way_rate_and_the_drain_adds_the_rest():
    """The hold is the least a turn takes (one way); how much longer the bytes take to leave with
    traffic both ways is seen on the rank's send queues, not guessed from a figure."""
    from planc.plan import Cluster, Level

    class P:
        cluster = Cluster((Level("host", 2, 1.25e6, 0.0, 1.1e6), Level("device", 2, 2e9, 0.0)), "host", 4,
                          ((0, 1), (2, 3)))
    assert nicorder.host_bandwidth(P) == pytest.approx(1.25e6)


# ---------------------------------------------------------------- planc calibrate

def _raw(one_way=(1e-4, 3e6), exchange_bw=2.4e6):
    sizes = cal.outer_sizes(25)
    raw = {"hosts": 2, "per_host": 1, "backend": "gloo", "device": "cpu",
           "p2p": {"outer": [[s, [one_way[0] + s / one_way[1]] * 3] for s in sizes]},
           "allreduce": {"outer": {"k": 2, "samples": [[s, [2 * one_way[0] + s / one_way[1]] * 3] for s in sizes]}},
           "matmul": [[{"n": 256, "flop": 2 * 256 ** 3, "seconds": 2 * 256 ** 3 / 30e9}]]}
    if exchange_bw is not None:
        raw["exchange"] = {"outer": [[8 * s, [one_way[0] + 8 * s / exchange_bw] * 3] for s in sizes]}
    return raw


def test_calibrate_fits_both_ways_from_the_exchange_and_writes_it(tmp_path):
    f = cal.fit(_raw())
    assert f["levels"]["host"]["both_ways"] == pytest.approx(2.4e6, rel=1e-6)
    doc = cal.cluster_doc([f], "testbed", [25.0], 3)
    assert doc["levels"][0]["both_ways"] == pytest.approx(2.4e6, rel=1e-5)
    assert doc["calibration"]["by_rate"][0]["both_ways"] == pytest.approx(2.4e6, rel=1e-5)
    assert "both ways 2.4 MB/s per direction" in cal.summary(doc)
    cal.write_yaml(doc, tmp_path / "cal.yaml", "planc calibrate --on testbed cal.yaml")
    (tmp_path / "p.plan").write_text('cluster "cal.yaml"\nparallel { pipe = 2 }\n')
    assert load(tmp_path / "p.plan").cluster.levels[0].both_ways == pytest.approx(2.4e6, rel=1e-5)
    # what `planc bench accuracy` and `planc bench iteration --cluster` put into a plan at a rate
    c = accuracy.read_calibrated(tmp_path / "cal.yaml")
    assert c.both_ways(25.0) == pytest.approx(2.4e6, rel=1e-5)
    assert c.both_ways(50.0) == pytest.approx(4.8e6, rel=1e-5)          # scaled as the bandwidth is
    sub = accuracy.substitute(two_hosts(1e9), c, 25.0)
    assert sub.levels[0].bandwidth == pytest.approx(3e6, rel=1e-5)
    assert sub.levels[0].both_ways == pytest.approx(2.4e6, rel=1e-5)


def test_calibrate_both_ways_is_at_most_one_way_and_absent_without_the_phase():
    assert cal.fit(_raw(exchange_bw=5e6))["levels"]["host"]["both_ways"] == pytest.approx(3e6, rel=1e-6)
    f = cal.fit(_raw(exchange_bw=None))
    assert "both_ways" not in f["levels"]["host"]
    doc = cal.cluster_doc([f], "testbed", [25.0], 3)
    assert "both_ways" not in doc["levels"][0] and "both_ways" not in doc["calibration"]["by_rate"][0]


# ---------------------------------------------------------------- the rank's TCP send queues

def _pair():
    """A TCP connection 127.0.0.1 -> 127.0.0.2 (two addresses: counted as a connection to another host)
    whose receiver reads only when told to; (client socket, server socket, event to start reading)."""
    srv = socket.socket()
    try:
        srv.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("no 127.0.0.2 on this machine's loopback")
    srv.listen(1)
    cli = socket.socket()
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    cli.bind(("127.0.0.1", 0))
    cli.connect(srv.getsockname())
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    srv.close()
    return cli, conn


def test_cross_host_sockets_see_the_bytes_not_yet_sent():
    cli, conn = _pair()
    try:
        s = CrossHostSockets()
        s.refresh()
        assert cli.fileno() in s.fds and conn.fileno() in s.fds      # both ends: remote != local address
        assert s.unsent() == 0
        cli.setblocking(False)
        sent = 0
        try:
            while sent < 64 << 20:          # until the receiver's window and our buffer are full
                sent += cli.send(b"x" * (1 << 16))
        except BlockingIOError:
            pass
        deadline = time.monotonic() + 10    # a hang guard only: the kernel queues them at its own pace
        while not s.unsent() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.unsent() > 0               # the receiver reads nothing: bytes wait in our queue
        got = 0
        conn.settimeout(10)
        while got < sent:
            got += len(conn.recv(1 << 20))
        deadline = time.monotonic() + 10
        while s.unsent() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.unsent() == 0
    finally:
        cli.close()
        conn.close()


def test_a_turn_whose_bytes_never_leave_is_an_error_naming_the_send(monkeypatch):
    class Stuck:
        fds = (99,)

        def refresh(self):
            pass

        def unsent(self):
            return 1000

    c = memoryview(bytearray(8)).cast("q")
    nic = NicOrder(0, 0, ((0, "h", "forward", 0),), c, 0.2)
    nic.sockets = Stuck()
    nic.begin_step()
    h = nic.submit("h", "forward", 0, lambda: [])
    with pytest.raises(NicOrderError, match="send h forward m0: its bytes have not left"):
        h.wait()


def test_drain_can_be_turned_off():
    """plan.json runtime.nic_drain = false (passed by the runtime as ``drain``)."""
    c = memoryview(bytearray(8)).cast("q")
    assert NicOrder(0, 0, ((0, "h", "forward", 0),), c, 1.0, drain=False).sockets is None
    assert NicOrder(0, 0, ((0, "h", "forward", 0),), c, 1.0).sockets is not None
