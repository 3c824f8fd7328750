"""What the testbed's shaped links give plain TCP: the physical bound the training figures sit under.

``tcp_rates(tb)`` runs, inside a live :class:`benchmarks.testbed.netns.Testbed`, a few
traffic patterns of plain TCP streams between hosts (no gloo, no torch: a
socket server and a client per flow, started in the hosts' namespaces), each
flow moving ``mbytes`` MiB. Every connection is made first; the clients then
start sending at one agreed instant, so connection set-up (a SYN lost in a full
queue costs 1 s, then 2 s, ...) is outside the timed region. Reported per
pattern: the busiest link direction's bytes ÷ the time the last flow took, and
that as a fraction of the nominal rate.

Measured (``python -m benchmarks testbed check --link-mbit 25``, docs/testbed.md): plain TCP
moves 96–97 % of the rate one way and 83–95 % with data both ways at once (each
direction's ACKs queue behind the other's data in the same tbf FIFO); gloo with
every receive posted, 96 % and 81–89 %. Training moves data both ways
(activations forward, gradients back), so this is the ceiling its link-bound
steps can approach. ``gloo_rates`` runs ``benchmarks/testbed/gloocheck.py``.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

GLOOCHECK = Path(__file__).resolve().parent / "gloocheck.py"   # run by every rank, torch only

PATTERNS = (
    ("one flow, host 0 → 1", ((0, 1),)),
    ("two flows, host 0 → 1", ((0, 1), (0, 1))),
    ("one flow each way, 0 ⇄ 1", ((0, 1), (1, 0))),
    ("two flows each way, 0 ⇄ 1", ((0, 1), (0, 1), (1, 0), (1, 0))),
)
_PORT = 6390

_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    while c.recv(1 << 20):
        pass
    c.close()
""")
_CLIENT = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
    buf = b"x" * (1 << 20)
    time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
    t = time.time()
    for _ in range(int(sys.argv[3])):
        c.sendall(buf)
    c.shutdown(socket.SHUT_WR)
    c.recv(1)
    print(time.time() - t, flush=True)
""")


def _flows(tb, pairs, mbytes: int, timeout: float) -> float:
    """Seconds until the last of ``pairs`` (src host, dst host) flows has delivered ``mbytes`` MiB."""
    procs = []
    try:
        servers = []
        for i, (_, d) in enumerate(pairs):
            p = subprocess.Popen(["ip", "netns", "exec", tb.namespaces[d], sys.executable, "-c", _SERVER,
                                  tb.addresses[d], str(_PORT + i)], stdout=subprocess.PIPE, text=True)
            procs.append(p)
            servers.append(p)
        for p in servers:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a link-check server did not start")
        start_at = time.time() + 1.0 + 0.1 * len(pairs)   # every connection is up before anyone sends
        clients = []
        for i, (s, d) in enumerate(pairs):
            p = subprocess.Popen(["ip", "netns", "exec", tb.namespaces[s], sys.executable, "-c", _CLIENT,
                                  tb.addresses[d], str(_PORT + i), str(mbytes), f"{start_at:.6f}"],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
            clients.append(p)
        took = []
        for p in clients:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"a link-check client failed (exit {p.returncode})")
            took.append(float(out.strip()))
        return max(took)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _record(pattern: str, flows: int, seconds: float, busiest: float, tb) -> dict:
    """One pattern's result: the busiest link direction's bytes over the time, and its share of the rate."""
    rate = busiest / seconds
    return {"pattern": pattern, "flows": flows, "seconds": seconds, "busiest_bytes": busiest, "rate": rate,
            "fraction": rate / (tb.link_mbit * 1e6 / 8)}


def gloo_rates(tb, messages: int = 16, mib: float = 0.5, timeout: float = 300, repeats: int = 3) -> list[dict]:
    """gloo p2p (``benchmarks/testbed/gloocheck.py``) on a live 2-host testbed with 2 ranks per host:
    per pattern the same record as :func:`tcp_rates`. Raises ``RuntimeError`` when the launch fails."""
    with tempfile.TemporaryDirectory(prefix="planc-gloocheck-") as tmp:
        (Path(tmp) / "plan.json").write_text(json.dumps({"cluster": {"hosts": [[0, 1], [2, 3]], "devices": 4},
                                                         "stages": []}))
        r = tb.launch(tmp, script=GLOOCHECK, args=(), steps=1, timeout=timeout,
                      env={"GLOOCHECK_MESSAGES": str(messages), "GLOOCHECK_MIB": str(mib),
                           "GLOOCHECK_REPEATS": str(repeats)}, memory=False, launcher="direct",
                      progress=False)
    rows = []
    for line in r.stdout.splitlines():
        if line.startswith("gloo ") and line.count("|") == 3:
            name, flows, seconds, busiest = line[5:].split("|")
            rows.append(_record(f"gloo: {name}", int(flows), float(seconds), float(busiest), tb))
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"the gloo link check failed (exit {r.returncode}): {r.failure or r.stdout[-1000:]}")
    return rows


def tcp_rates(tb, mbytes: int = 8, patterns=PATTERNS, timeout: float = 300, repeats: int = 3) -> list[dict]:
    """Per pattern: ``pattern``, ``flows``, ``seconds`` (the median of ``repeats`` runs),
    ``busiest_bytes``, ``rate`` (bytes/s through the busiest link direction) and ``fraction`` of the
    testbed's nominal rate."""
    rows = []
    for name, pairs in patterns:
        load: dict[tuple[str, int], float] = {}
        for s, d in pairs:
            load[("out", s)] = load.get(("out", s), 0.0) + mbytes * 2 ** 20
            load[("in", d)] = load.get(("in", d), 0.0) + mbytes * 2 ** 20
        seconds = sorted(_flows(tb, pairs, mbytes, timeout) for _ in range(max(1, repeats)))[max(1, repeats) // 2]
        rows.append(_record(name, len(pairs), seconds, max(load.values()), tb))
    return rows
