"""Faults on a testbed and the account of a failed launch (helpers of ``netns.Testbed``).

- Packet loss on host links. The kernels this runs on need not have ``netem``
  (``sch_netem``), so loss is built from what a minimal kernel has: under each
  bridge port's ``tbf`` an ``htb`` whose default class keeps the tbf's byte
  queue (a ``bfifo``) and whose second class is a ``pfifo limit 0`` (drops all
  it gets); a classic-BPF ``cls_bpf`` filter sends a random share of IPv4
  packets to the second class (``ld rand``). Every packet between two hosts
  leaves the bridge through exactly one port, the receiver's, so the program
  of port k drops a packet from host h with probability
  ``1 - (1 - loss[k]) (1 - loss[h])``: host h's link loses ``loss[h]`` of its
  packets in each direction.
- A host link going down (``ip link set ... down`` on either end of its veth
  pair) and a rank killed by a signal: ``FaultsMixin``, methods of ``Testbed``.
"""
from __future__ import annotations

import os
import re
import signal
import time

from benchmarks.testbed.namespaces import IFNAME, run
from benchmarks.testbed.result import TestbedError

LOSS_HTB = "10:"            # the htb under a bridge port's tbf (only where loss was configured)
LOSS_KEEP = "10:1"          # default class: a bfifo as long as the tbf's own queue
LOSS_DROP = "10:2"          # the dropping class: pfifo limit 0
DROP_QDISC = "20:"          # its qdisc (its `dropped` counter is the packets lost to the fault)
KEEP_QDISC = "11:"

# classic BPF (struct sock_filter) opcodes
_LDH_ABS, _LDW_ABS, _JEQ_K, _JGE_K, _RET_K = 0x28, 0x20, 0x15, 0x35, 0x06
_SKF_AD_RANDOM = (0xFFFFF000 + 56) & 0xFFFFFFFF      # SKF_AD_OFF + SKF_AD_RANDOM: a random u32
_ETH_TYPE, _IPV4, _IPV4_SRC = 12, 0x0800, 26          # offsets in an Ethernet frame (tc egress sees L2)


def check_loss(loss, hosts: int) -> list[float]:
    """``loss`` (one fraction for every host link, or {host: fraction}) as one fraction per host."""
    if isinstance(loss, dict):
        out = [0.0] * hosts
        for h, x in loss.items():
            if not isinstance(h, int) or not 0 <= h < hosts:
                raise ValueError(f"loss: host {h!r} is not one of the testbed's hosts 0..{hosts - 1}")
            out[h] = _fraction(x)
        return out
    return [_fraction(loss)] * hosts


def _fraction(x) -> float:
    try:
        f = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"loss must be a fraction of packets in [0, 1], not {x!r}") from None
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"loss must be a fraction of packets in [0, 1] (0.05 is 5%), not {x!r}")
    return f


def _threshold(p: float) -> int:
    return min(int(round(p * 2 ** 32)), 2 ** 32 - 1)


def loss_program(port: int, losses: list[float], addresses: list[str]) -> str | None:
    """tc's ``bpf bytecode`` text for the bridge port towards host ``port`` (None: it drops nothing).

    Returns -1 (the filter's class, the dropping one) for a dropped packet, 0 (no match: the
    htb's default class) otherwise; only IPv4 is dropped (ARP keeps the hosts reachable)."""
    probs: dict[int, float] = {}        # source host -> drop probability of its packets into `port`
    for h in range(len(addresses)):
        if h != port:
            probs[h] = round(1 - (1 - losses[port]) * (1 - losses[h]), 12)
    default = round(losses[port], 12)              # a source that is no host (cannot happen: only our namespaces)
    if not any(probs.values()) and not default:
        return None
    # label-resolved program: ("op", code, k, jt_label, jf_label) or ("label", name)
    prog: list[tuple] = [("op", _LDH_ABS, _ETH_TYPE, None, None),
                         ("op", _JEQ_K, _IPV4, None, "pass"),
                         ("op", _LDW_ABS, _IPV4_SRC, None, None)]
    distinct = sorted({p for p in probs.values() if p > 0} | ({default} if default > 0 else set()))
    for h, p in sorted(probs.items()):
        if p > 0:
            prog.append(("op", _JEQ_K, _ip_u32(addresses[h]), f"p{distinct.index(p)}", None))
        else:
            prog.append(("op", _JEQ_K, _ip_u32(addresses[h]), "pass", None))
    prog.append(("op", _JEQ_K, 0, "pass", "pass") if default == 0 else
                ("op", _JEQ_K, 0, f"p{distinct.index(default)}", f"p{distinct.index(default)}"))
    for i, p in enumerate(distinct):
        prog.append(("label", f"p{i}"))
        if p >= 1.0:
            prog.append(("op", _JEQ_K, 0, "drop", "drop"))
        else:
            prog.append(("op", _LDW_ABS, _SKF_AD_RANDOM, None, None))
            prog.append(("op", _JGE_K, _threshold(p), "pass", "drop"))
    prog += [("label", "pass"), ("op", _RET_K, 0, None, None), ("label", "drop"), ("op", _RET_K, 0xFFFFFFFF, None, None)]
    where, n = {}, 0
    for item in prog:
        if item[0] == "label":
            where[item[1]] = n
        else:
            n += 1
    out, i = [], 0
    for item in prog:
        if item[0] == "label":
            continue
        _, code, k, jt, jf = item
        rel = [0 if lab is None else where[lab] - i - 1 for lab in (jt, jf)]
        if max(rel) > 255:
            raise ValueError("too many hosts for one loss program (classic BPF jumps reach 255 instructions)")
        out.append(f"{code} {rel[0]} {rel[1]} {k}")
        i += 1
    return f"{len(out)}," + ",".join(out)


def _ip_u32(addr: str) -> int:
    a, b, c, d = (int(x) for x in addr.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def tbf_handle(qdisc_show: str) -> str:
    """The handle (``8001:``) of the root tbf in ``tc qdisc show dev X`` output."""
    m = re.search(r"qdisc tbf (\w+:) root", qdisc_show)
    if not m:
        raise ValueError(f"no root tbf in: {qdisc_show.strip()!r}")
    return m.group(1)


def dropped(qdisc_show_s: str) -> int:
    """Packets the dropping class dropped, from ``tc -s qdisc show dev X`` output (0 if none installed)."""
    m = re.search(r"qdisc pfifo " + DROP_QDISC + r" .*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+)", qdisc_show_s)
    return int(m.group(1)) if m else 0


def _drop_percent(x: float) -> str:
    return f"{x * 100:g}%"


class FaultsMixin:
    """The fault methods of ``Testbed`` (it provides namespaces, bridge_ns, addresses, link_mbit,
    latency_ms, burst_bytes, up, _loss, _loss_ports, _events, _tracker)."""

    def set_loss(self, loss, host: int | None = None) -> None:
        """Drop ``loss`` (a fraction, 0.05 = 5%) of the packets on host ``host``'s link, each direction
        (every host's when None); 0 stops dropping. Also while a job runs."""
        if not self.up:
            raise TestbedError("the testbed is not up (use it as a context manager)")
        if host is not None and not (isinstance(host, int) and 0 <= host < self.hosts):
            raise ValueError(f"host must be one of 0..{self.hosts - 1}, not {host!r}")
        f = _fraction(loss)
        for h in (range(self.hosts) if host is None else [host]):
            self._loss[h] = f
        self._apply_loss()
        where = "every host link" if host is None else f"host {host}'s link"
        self._event(f"{where} drops {_drop_percent(f)} of its packets" if f else f"{where} drops no packets")

    @property
    def loss(self) -> list[float]:
        """The fraction of packets each host's link drops (per direction)."""
        return list(self._loss)

    def _apply_loss(self) -> None:
        """Install the drop stage on every bridge port (first time loss is configured), then its filters."""
        br = self.bridge_ns
        if any(self._loss) and not self._loss_ports:
            for h, ns in enumerate(self.namespaces):
                # one segment per packet: TCP would otherwise hand the veth 64 KB super-packets
                # (TSO/GSO) and one drop would lose ~45 segments at once
                run(["ip", "-n", ns, "link", "set", IFNAME, "gso_max_segs", "1"])
            for h in range(self.hosts):
                dev = f"p{h}"
                tbf = tbf_handle(run(["ip", "netns", "exec", br, "tc", "qdisc", "show", "dev", dev]).stdout)
                tc = ["ip", "netns", "exec", br, "tc"]
                run([*tc, "qdisc", "add", "dev", dev, "parent", f"{tbf}1", "handle", LOSS_HTB, "htb",
                      "default", "1", "r2q", "100000"])
                for cls in (LOSS_KEEP, LOSS_DROP):
                    run([*tc, "class", "add", "dev", dev, "parent", LOSS_HTB, "classid", cls, "htb", "rate", "100gbit"])
                run([*tc, "qdisc", "add", "dev", dev, "parent", LOSS_KEEP, "handle", KEEP_QDISC, "bfifo",
                      "limit", str(self._queue_bytes())])
                run([*tc, "qdisc", "add", "dev", dev, "parent", LOSS_DROP, "handle", DROP_QDISC, "pfifo", "limit", "0"])
                self._loss_ports.append(h)
        for h in self._loss_ports:
            tc = ["ip", "netns", "exec", br, "tc", "filter"]
            run([*tc, "del", "dev", f"p{h}", "parent", LOSS_HTB, "pref", "1"], check=False)
            prog = loss_program(h, self._loss, self.addresses)
            if prog is not None:
                run([*tc, "add", "dev", f"p{h}", "parent", LOSS_HTB, "protocol", "all", "pref", "1",
                      "bpf", "bytecode", prog, "classid", LOSS_DROP])

    def _queue_bytes(self) -> int:
        """The byte queue tbf keeps by itself (iproute2: rate x latency + burst)."""
        return int(self.link_mbit * 1e6 / 8 * self.latency_ms / 1000 + self.burst_bytes)

    def _resize_loss_queues(self) -> None:
        for h in self._loss_ports:
            run(["ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "change", "dev", f"p{h}", "parent",
                  LOSS_KEEP, "handle", KEEP_QDISC, "bfifo", "limit", str(self._queue_bytes())])

    def dropped_packets(self) -> dict[int, int]:
        """host -> packets dropped so far by the loss fault on their way into that host."""
        out = {}
        for h in self._loss_ports:
            r = run(["ip", "netns", "exec", self.bridge_ns, "tc", "-s", "qdisc", "show", "dev", f"p{h}"], check=False)
            out[h] = dropped(r.stdout)
        return out

    def link_down(self, host: int, end: str = "bridge") -> None:
        """Take host ``host``'s link down, also while a job runs: ``end="bridge"`` (default) sets the
        bridge's port ``p<h>`` down, as a pulled cable or a failed switch port (the host's ``tb0``
        stays up but has no carrier); ``end="host"`` sets ``tb0`` down inside the host."""
        self._set_link(host, end, "down")

    def link_up(self, host: int, end: str = "bridge") -> None:
        """Bring host ``host``'s link back up (the end ``link_down`` took down)."""
        self._set_link(host, end, "up")

    def _set_link(self, host: int, end: str, state: str) -> None:
        if not self.up:
            raise TestbedError("the testbed is not up (use it as a context manager)")
        if not (isinstance(host, int) and 0 <= host < self.hosts):
            raise ValueError(f"host must be one of 0..{self.hosts - 1}, not {host!r}")
        if end not in ("bridge", "host"):
            raise ValueError(f"end must be 'bridge' or 'host', not {end!r}")
        if end == "bridge":
            run(["ip", "-n", self.bridge_ns, "link", "set", f"p{host}", state])
        else:
            run(["ip", "-n", self.namespaces[host], "link", "set", IFNAME, state])
        if state == "down":
            self._down.add((host, end))
        else:
            self._down.discard((host, end))
        self._event(f"host {host}'s link set {state} ({f'bridge port p{host}' if end == 'bridge' else IFNAME})")

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default SIGKILL) to rank ``rank`` of the job now running; returns its pid."""
        tracker = self._tracker
        if tracker is None:
            raise TestbedError("no job is running (kill_rank works during launch, e.g. from on_step)")
        with self._lock:
            launched = list(self._procs)
        if rank not in tracker.pids:
            tracker.scan(launched)
        pid = tracker.pids.get(rank)
        if pid is None or rank in tracker.ended:
            raise TestbedError(f"rank {rank} is not running (running: {tracker.alive()})")
        os.kill(pid, sig)
        tracker.signalled.add(rank)
        if sig == signal.SIGKILL:
            tracker.sigkilled[pid] = -signal.SIGKILL
        host = self._host_of.get(rank, "?")
        self._event(f"rank {rank} (host {host}) sent {signal.Signals(sig).name} by the testbed")
        return pid

    def _event(self, what: str) -> None:
        self._events.append((time.monotonic(), what))
