"""The machine's side of the testbed: the ``ip``/``tc`` runner, the namespaces' names, finding and
removing stale ones, and a free subnet. Shared by ``netns`` (building and launching) and ``faults``
(loss, links down), so neither imports the other."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys

from benchmarks.testbed.result import TestbedError

IFNAME = "tb0"                  # the veth inside every host namespace
BRIDGE = "br0"                  # the bridge inside the bridge namespace
NAME_RE = re.compile(r"^planc(\d+)t(\d+)(?:h\d+|br)$")


def available() -> str | None:
    """Why a testbed cannot be built here, or None when it can."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "not root (network namespaces, veth and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def run(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def netns_list() -> list[str]:
    r = run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_netns_pids(ns: str) -> None:
    """Kill what still runs inside ``ns`` (only processes this testbed launched can be there)."""
    r = run(["ip", "netns", "pids", ns], check=False)
    for tok in r.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def delete_netns(ns: str) -> None:
    kill_netns_pids(ns)
    run(["ip", "netns", "del", ns], check=False)


def cleanup_stale() -> list[str]:
    """Remove testbed namespaces (``planc<pid>t<n>h<i>`` / ``...br``) whose creating process is gone."""
    removed = []
    for ns in netns_list():
        m = NAME_RE.match(ns)
        if m and not pid_alive(int(m.group(1))):
            delete_netns(ns)
            removed.append(ns)
    return removed


def used_networks() -> list[ipaddress.IPv4Network]:
    """Networks routed or addressed in the root namespace (so ours never overlaps them)."""
    nets = []
    for argv in (["ip", "-4", "route", "show", "table", "all"], ["ip", "-4", "-o", "addr", "show"]):
        out = run(argv, check=False).stdout
        for tok in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)\b", out):
            try:
                nets.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                pass
    return nets


def pick_subnet() -> ipaddress.IPv4Network:
    used = used_networks()
    start = os.getpid() % 200
    for i in range(254):
        n = 1 + (start + i) % 254
        net = ipaddress.ip_network(f"10.213.{n}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise TestbedError("no free /24 in 10.213.0.0/16 on this machine")
