"""The testbed (network namespaces + tc): what it creates, that it removes all of it, and a
comm-only launch inside it. Needs root and iproute2; skipped otherwise. No timing assertions."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.testbed import IFNAME, Testbed, available

ROOT = Path(__file__).resolve().parents[2]

# what needs the testbed (root, network namespaces) is marked `testbed` and skipped with the reason
# without it; the argument checks and the step bar run anywhere
TESTBED = [pytest.mark.testbed,
           pytest.mark.skipif(available() is not None, reason=f"testbed unavailable: {available()}")]


def on_testbed(f):
    for mark in reversed(TESTBED):
        f = mark(f)
    return f


def _sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout


def _root_state() -> tuple[str, str, str]:
    """The machine's own interfaces, addresses and routes (the testbed must leave them alone)."""
    links = re.sub(r"\s+", " ", " ".join(sorted(
        line.split(":")[1].strip() for line in _sh("ip", "-o", "link", "show").splitlines())))
    return links, _sh("ip", "-o", "addr", "show"), _sh("ip", "route", "show", "table", "all")


def _leftovers(prefix: str) -> list[str]:
    names = [n for n in _sh("ip", "netns", "list").split() if n.startswith(prefix)]
    names += [l for l in _sh("ip", "-o", "link", "show").splitlines() if prefix in l]
    return names


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5011)); s.listen(1); s.settimeout(20)
    c, peer = s.accept(); c.sendall(b"hello " + peer[0].encode()); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    for _ in range(100):
        try:
            c = socket.create_connection((sys.argv[1], 5011), timeout=2); break
        except ConnectionRefusedError:
            time.sleep(0.05)
    print(c.recv(100).decode())
""")
PROBE = textwrap.dedent("""
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], 22), timeout=2); print("reached")
    except OSError as e:
        print("unreachable", e.errno)
""")


@on_testbed
def test_namespaces_links_shaping_and_cleanup():
    before = _root_state()
    root_addrs = [a.split("/")[0] for a in re.findall(r"inet (\S+)", _sh("ip", "-4", "-o", "addr", "show"))
                  if not a.startswith("127.")]
    with Testbed(2, 100) as tb:
        prefix = tb.prefix
        assert set(tb.namespaces) | {tb.bridge_ns} <= set(_sh("ip", "netns", "list").split())
        for h in range(2):
            addrs = re.findall(r"inet (\S+)", tb.exec(h, ["ip", "-4", "-o", "addr", "show"]).stdout)
            assert sorted(addrs) == sorted(["127.0.0.1/8", f"{tb.addresses[h]}/24"])
            assert tb.addresses[h].startswith("10.213.")
            links = tb.exec(h, ["ip", "-o", "link", "show"]).stdout
            assert "lo:" in links and "LOWER_UP" in links.split("lo:")[1].splitlines()[0]
            assert f"{IFNAME}@" in links
            qdisc = tb.exec(h, ["tc", "qdisc", "show", "dev", IFNAME]).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        bridge_qdisc = _sh("ip", "netns", "exec", tb.bridge_ns, "tc", "qdisc", "show")
        assert bridge_qdisc.count("tbf") == 2, bridge_qdisc
        # host 0 reaches host 1 on its created address...
        srv = subprocess.Popen(["ip", "netns", "exec", tb.namespaces[1], sys.executable, "-c", SERVER,
                                tb.addresses[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            r = tb.exec(0, [sys.executable, "-c", CLIENT, tb.addresses[1]], timeout=30)
            assert r.stdout.strip() == f"hello {tb.addresses[0]}", r.stderr
        finally:
            srv.kill()
            srv.wait()
        # ...and nothing of the machine's own
        for a in root_addrs:
            r = tb.exec(0, [sys.executable, "-c", PROBE, a], timeout=30)
            assert r.stdout.startswith("unreachable"), (a, r.stdout, r.stderr)
        assert _root_state() == before          # nothing created in the root namespace
    assert _leftovers(prefix) == []
    assert _root_state() == before


@on_testbed
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_cleanup_when_the_body_raises(error):
    before = _root_state()
    with pytest.raises(error, match="boom"):
        with Testbed(2, 50) as tb:
            prefix = tb.prefix
            assert _leftovers(prefix)
            raise error("boom")
    assert _leftovers(prefix) == []
    assert _root_state() == before


@on_testbed
def test_cleanup_stale_removes_only_dead_testbeds():
    from benchmarks.testbed import cleanup_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"planc{dead.pid}t0h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    with Testbed(1, 50) as tb:
        try:
            removed = cleanup_stale()
        finally:
            subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        assert stale in removed
        assert tb.namespaces[0] in _sh("ip", "netns", "list").split()   # a live testbed is kept


TINY = """
plan tb_tiny {
  cluster {
    level node x 2 : bandwidth 10 MB/s, latency 100 us
    level gpu  x 2 : bandwidth 3 GB/s,  latency 20 us
  }
  stage 0 on devices 0..2 as (data = 2)
  stage 1 on devices 2..4 as (data = 2)
  transfer a : f32[8, 6]  from stage 0 as S0 R to stage 1 as R R
  transfer b : i32[4, 10] from stage 1 as R R  to stage 0 as R S0
  reduce g over data : f32[256]
  resharding { strategy = broadcast, chunks = 2 }
}
"""


@on_testbed
@pytest.mark.slow
def test_comm_only_plan_runs_inside_the_testbed(tmp_path):
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    src = tmp_path / "tiny.plan"
    src.write_text(TINY)
    c = compile_file(src, probe=False)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    with Testbed(2, 80) as tb:
        prefix = tb.prefix
        r = tb.launch(out, steps=2, timeout=90)
    assert r.returncode == 0, "\n".join(f"rank {k}: {v[-1500:]}" for k, v in r.logs.items())
    lines = re.findall(r"step \d+ comm [0-9.]+ s \(verified 2 transfer\(s\), 1 reduction\(s\)\)", r.stdout)
    assert len(lines) == 2, r.stdout[-2000:]
    assert len(r.step_times) == 2
    assert _leftovers(prefix) == []


TRAIN = """
plan tb_train {{
  cluster {{
    level node x 2 : bandwidth 100 MB/s, latency 50 us
    level gpu  x 2 : bandwidth 10 GB/s,  latency 2 us
  }}
  parallel {{ pipe = 2, data = 2, place = [[2, 1], [1, 2]] }}
  model "{mlp}:build" {{ layers = 4, hidden = 16, inputs = 8, outputs = 4 }}
  loss  "{mlp}:loss"
  data  "{mlp}:batches"
  stage 0 : layers 0..2
  stage 1 : layers 2..4
  transfer h : f32[4, 16] from stage 0 as S0 R to stage 1 as S0 R
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 2, steps = 2, schedule = 1f1b, optimizer = sgd(lr = 0.1), seed = 3 }}
}}
"""


@on_testbed
@pytest.mark.slow
def test_training_plan_launched_per_host_by_the_deepspeed_launcher(tmp_path):
    """Each host's namespace runs `deepspeed --no_ssh --node_rank=h ...` for its own ranks, as a
    multi-node job without ssh does; rank 0's step lines come back, the rate can change mid-run."""
    from pathlib import Path

    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    src = tmp_path / "train.plan"
    src.write_text(TRAIN.format(mlp=mlp))
    c = compile_file(src, probe=False)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    seen = []
    with Testbed(2, 200) as tb:
        prefix = tb.prefix

        def on_step(n, seconds):
            seen.append((n, seconds))
            if n == 0:
                tb.set_link_mbit(50)

        r = tb.launch(out, steps=3, timeout=240, comm_only=False, on_step=on_step)
        qdisc = tb.exec(1, ["tc", "qdisc", "show", "dev", IFNAME]).stdout
    assert r.returncode == 0, r.check()
    assert r.launcher == "deepspeed"
    lines = re.findall(r"step (\d) loss \S+ time [0-9.]+ s [0-9.]+ samples/s", r.stdout)
    assert lines == ["0", "1", "2"], r.stdout[-2000:]
    assert len(r.step_times) == 3 and len(r.losses) == 3
    assert [n for n, _ in seen] == [0, 1, 2]
    assert "50Mbit" in qdisc, qdisc
    for h in (0, 1):   # one DeepSpeed launcher per host, started without ssh for its own node
        log = r.host_logs[h]
        assert "deepspeed.launcher.launch" in log and f"--node_rank={h}" in log, log[-2000:]
        assert "dist_world_size=4" in log
    assert sorted(r.logs) == [0, 1, 2, 3] and all(r.logs.values())
    assert sorted(r.peak_rss_kb) == [0, 1, 2, 3]
    assert _leftovers(prefix) == []


class _Terminal(__import__("io").StringIO):
    def isatty(self):
        return True


def test_step_bar_follows_rank_0s_steps_on_a_terminal_only(monkeypatch):
    """`planc testbed run`'s bar (planc.commands.ui.progress over the steps): on a terminal it counts the step
    lines seen, skipping none when lines arrive late; piped it writes nothing."""
    from benchmarks.testbed.watch import StepBar

    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = StepBar(3, "testbed: out", None)
    assert bar.shown
    bar.step(1)            # steps 0 and 1 in one poll
    bar.step(2)
    bar.close()
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", term.getvalue())
    assert "testbed: out" in shown and "3/3" in shown, shown
    piped = __import__("io").StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    bar = StepBar(3, "testbed: out", None)
    assert not bar.shown
    bar.step(2)
    bar.close()
    assert piped.getvalue() == ""


@on_testbed
def test_link_check_moves_every_flow_and_accounts_the_busiest_direction():
    """``planc testbed check``'s measurement (benchmarks.testbed.linkcheck): every flow of a pattern
    delivers its bytes (a client that does not exits non-zero and fails the call), the busiest
    direction's bytes are counted from the pattern, and the rate is those bytes over the time."""
    from benchmarks.testbed.linkcheck import PATTERNS, tcp_rates
    with Testbed(2, 200) as tb:
        prefix = tb.prefix
        rows = tcp_rates(tb, mbytes=2, patterns=(PATTERNS[0], PATTERNS[3]), repeats=1)
    assert not _leftovers(prefix)
    assert [r["pattern"] for r in rows] == [PATTERNS[0][0], PATTERNS[3][0]]
    one, both = rows
    assert (one["flows"], both["flows"]) == (1, 4)
    assert one["busiest_bytes"] == 2 * 2 ** 20 and both["busiest_bytes"] == 2 * 2 * 2 ** 20   # two flows a way
    for r in rows:
        assert r["seconds"] > 0 and r["rate"] == pytest.approx(r["busiest_bytes"] / r["seconds"])
        assert r["fraction"] == pytest.approx(r["rate"] / (200e6 / 8))


@on_testbed
@pytest.mark.slow
def test_gloo_link_check_reports_every_pattern():
    """The gloo half of ``planc testbed check``: 2 hosts x 2 ranks run benchmarks/testbed/gloocheck.py;
    every pattern is reported with the bytes through its busiest direction."""
    from benchmarks.testbed.linkcheck import gloo_rates
    with Testbed(2, 200) as tb:
        rows = gloo_rates(tb, messages=4, mib=0.25, repeats=1, timeout=180)
    assert [r["pattern"] for r in rows] == ["gloo: one pair, one way", "gloo: two pairs, one way",
                                            "gloo: two pairs, both ways"]
    one = 4 * 0.25 * 2 ** 20
    assert [r["busiest_bytes"] for r in rows] == [one, 2 * one, 2 * one]
    assert [r["flows"] for r in rows] == [1, 2, 4]
    for r in rows:
        assert r["seconds"] > 0 and r["rate"] == pytest.approx(r["busiest_bytes"] / r["seconds"])


def test_link_check_and_run_refuse_bad_arguments(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text('{"cluster": {"hosts": [[0], [1]]}}')   # enough for the argument checks
    for argv, want in ((["check", "somewhere"], "takes no target"), (["check", "--link-mbit", "0"], "must be positive"),
                       (["run", str(out), "--link-mbit", "-3"], "--link-mbit must be positive, not -3"),
                       (["run", str(out), "--trace", str(tmp_path / "t")], "--trace needs --train")):
        r = subprocess.run([sys.executable, "-m", "benchmarks", "testbed", *argv], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
        assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
