"""Devices of fixed speed: each rank in its own CPU cgroup with a quota over a short period.

DESIGN.md, "Devices of fixed speed in the lab": on the testbed every rank computes on the machine's
shared cores, so one rank's idle time (a pipeline bubble) becomes another rank's compute and
schedules cannot be compared. Here every rank gets a cgroup whose CFS bandwidth quota is a fixed
share of one core per short period, with no burst: a rank never runs faster than its share, and
an idle rank banks nothing to run faster later.

* cgroup v1 (a ``cpu`` hierarchy mounted, as on this machine): ``cpu.cfs_period_us``,
  ``cpu.cfs_quota_us``, ``cpu.cfs_burst_us = 0``; usage from ``cpuacct.usage`` (the ``cpuacct``
  hierarchy, which may be mounted apart: the rank joins a cgroup of the same name there too).
* cgroup v2 (the unified hierarchy holds the ``cpu`` controller): ``cpu.max`` and
  ``cpu.max.burst`` (:func:`v2_files`), the parent's ``cgroup.subtree_control`` gets ``+cpu``.

The period is 1 ms, or one scheduler tick where that is longer (the kernel checks a running rank's
quota at ticks: at HZ=250, here, a busy rank given 1 ms per 1 ms got 0.64 of a core, 1 ms per 2 ms
0.88 of the half core given, a period of one tick or more 0.99–1.00 of its share), stretched where the
quota would be under the kernel's floor of 1 ms (EINVAL, v1 and v2 alike) to ``1 ms ÷ share``. Here (HZ=250): 0.5 core
is 2 ms per 4 ms, 0.25 core 1 ms per 4 ms, 0.1 core 1 ms per 10 ms.

Layout: ``<hierarchy>/<name>/rank<r>`` with ``name`` = ``planc<pid>t<n>-cpu<k>`` (a testbed's
prefix and its launch counter) or ``planc<pid>q<n>-cpu0`` (standalone); only this module makes
names of that form, so :func:`cleanup_stale` removes those whose pid is gone. A rank joins its
cgroup through ``quota_exec.sh`` before it runs anything (:meth:`RankQuotas.command`); its threads
and children inherit the cgroup. Inside ``ip netns exec`` (which mounts a fresh /sys with no
cgroup file systems) the folders are reached through ``/proc/<creator pid>/root``.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.testbed.namespaces import pid_alive
from benchmarks.testbed.result import TestbedError
from planc.calibrate.clusterfile import cores_available

PERIOD_US = 1000             # the shortest period (DESIGN.md: 1–2 ms); at least a tick, stretched for MIN_QUOTA_US
DEFAULT_TICK_US = 4000       # HZ=250 where the kernel's configuration cannot be read
MIN_QUOTA_US = 1000          # the kernel's floor for a quota (tg_set_cfs_bandwidth: 1 ms)
MAX_PERIOD_US = 1_000_000    # and its ceiling for a period
NAME_RE = re.compile(r"^planc(\d+)[tq]\d+-cpu\d+$")
WRAPPER = Path(__file__).resolve().with_name("quota_exec.sh")
_counter = itertools.count()


class QuotaError(ValueError):
    """Quotas that cannot be given as asked (a bad share, or more quota than the machine has cores)."""


# ---------------------------------------------------------------- the figures and the text written

@dataclass(frozen=True, slots=True)
class Quota:
    """A rank's CPU bandwidth: ``quota_us`` of CPU time per ``period_us`` (None: no limit, the
    cgroup only counts)."""
    cpus: float | None
    period_us: int
    quota_us: int | None

    def describe(self) -> str:
        if self.cpus is None:
            return "no CPU quota"
        return f"{self.cpus:g} CPU per rank ({self.quota_us} us per {self.period_us} us period, no burst)"


@functools.lru_cache(maxsize=1)
def scheduler_tick_us() -> int:
    """One scheduler tick, from the kernel's ``CONFIG_HZ`` (/proc/config.gz or /boot/config-*), else
    :data:`DEFAULT_TICK_US`."""
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{os.uname().release}")):
        try:
            text = (gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()).decode()
        except (OSError, EOFError, ValueError):
            continue
        m = re.search(r"^CONFIG_HZ=(\d+)$", text, re.M)
        if m and int(m.group(1)) > 0:
            return round(1e6 / int(m.group(1)))
    return DEFAULT_TICK_US


def quota_of(cpus: float | None, period_us: int = PERIOD_US, tick_us: int | None = None) -> Quota:
    """``cpus`` of one core as a quota and a period: ``period_us``, at least one scheduler tick
    (``tick_us``, default the kernel's), stretched so the quota is at least the kernel's 1 ms."""
    if cpus is not None and not (isinstance(cpus, (int, float)) and math.isfinite(cpus) and cpus > 0):
        raise QuotaError(f"cpus_per_rank must be a positive number of cores, not {cpus!r}")
    period_us = max(period_us, scheduler_tick_us() if tick_us is None else tick_us)
    if cpus is None:
        return Quota(None, period_us, None)
    quota = math.floor(cpus * period_us + 1e-9)   # never above the share
    if quota < MIN_QUOTA_US:
        quota, period_us = MIN_QUOTA_US, math.ceil(MIN_QUOTA_US / cpus - 1e-9)   # never above the share
    if period_us > MAX_PERIOD_US:
        raise QuotaError(f"cpus_per_rank {cpus:g}: under {MIN_QUOTA_US / MAX_PERIOD_US:g} of a core the kernel "
                         f"has no period long enough")
    return Quota(float(cpus), period_us, quota)


def v1_files(q: Quota) -> dict[str, str]:
    """What a v1 ``cpu`` cgroup gets, file by file, in the order written."""
    return {"cpu.cfs_period_us": f"{q.period_us}\n", "cpu.cfs_quota_us": f"{q.quota_us or -1}\n",
            "cpu.cfs_burst_us": "0\n"}


def v2_files(q: Quota) -> dict[str, str]:
    """What a v2 cgroup gets, file by file: ``cpu.max`` is ``$MAX $PERIOD`` (``max``: no limit)."""
    return {"cpu.max": f"{q.quota_us or 'max'} {q.period_us}\n", "cpu.max.burst": "0\n"}


def parent_weight(ranks: int, version: int) -> tuple[str, str]:
    """(file, text) that makes the parent cgroup weigh as much as ``ranks`` ordinary processes against the
    machine's other work: a cgroup is one scheduling entity of one process's weight by default, so
    without this all the ranks together would get one process's share of a loaded machine."""
    if version == 1:
        return "cpu.shares", f"{min(262144, 1024 * ranks)}\n"
    return "cpu.weight", f"{min(10000, 100 * ranks)}\n"


def check_total(cpus_per_rank: float, ranks: int, cores: int) -> None:
    """Refuse quotas that add up to more than the machine's cores: the ranks would still compete."""
    total = cpus_per_rank * ranks
    if total > cores * (1 + 1e-9):
        most = math.floor(cores / ranks * 1000) / 1000
        raise QuotaError(f"cpus_per_rank {cpus_per_rank:g} x {ranks} ranks = {total:g} cores of quota, more than the "
                         f"{cores} cores of this machine: the ranks would still compete for them; give at most "
                         f"{most:g} per rank ('auto': {cores} cores ÷ {ranks} ranks)")


def share_for(cpus_per_rank: float | str, ranks: int, cores: int) -> float:
    """The share of one core each of ``ranks`` ranks gets: ``'auto'`` splits the ``cores`` evenly, a
    number is checked against them (:func:`check_total`)."""
    if cpus_per_rank == "auto":
        return cores / ranks
    quota_of(cpus_per_rank)   # a positive, finite number
    check_total(float(cpus_per_rank), ranks, cores)
    return float(cpus_per_rank)


def cpus_option(value: float | str | None) -> float | str | None:
    """``cpus_per_rank`` as given (a command line's text too): None, ``'auto'`` or a positive number
    of cores (QuotaError otherwise)."""
    if value is None or (isinstance(value, str) and value.strip() == "auto"):
        return None if value is None else "auto"
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise QuotaError(f"--cpus-per-rank {value!r}: a share of one core (e.g. 0.25) or 'auto'") from None
    quota_of(value)
    return value


def for_launch(cpus_per_rank: float | str | None, ranks: int, name: str) -> RankQuotas | None:
    """The cgroups (not made yet) of a launch of ``ranks`` ranks under ``cpus_per_rank`` (None: none),
    refused (QuotaError) when the quotas add up to more than this machine's cores."""
    if cpus_per_rank is None:
        return None
    return RankQuotas(quota_of(share_for(cpus_per_rank, ranks, cores_available())), range(ranks), name=name)


def command(quotas: RankQuotas | None, argv: list[str]) -> list[str]:
    """A rank's command: through the wrapper that joins its cgroup under ``quotas``, else as it is."""
    return argv if quotas is None else quotas.command(argv)


# ---------------------------------------------------------------- the machine's hierarchies

@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Where the quotas are written (``cpu``) and the usage counted (``usage``): two v1 hierarchies
    (the same folder where cpu and cpuacct are mounted together) or the v2 unified one twice."""
    version: int
    cpu: Path
    usage: Path

    @property
    def roots(self) -> tuple[Path, ...]:
        return (self.cpu,) if self.usage == self.cpu else (self.cpu, self.usage)


def detect(mounts: str | None = None) -> Hierarchy | None:
    """The hierarchy to use, from ``/proc/self/mounts``: v1 where a ``cpu`` hierarchy is mounted,
    else v2 where the unified hierarchy has the ``cpu`` controller; None without either."""
    if mounts is None:
        try:
            mounts = Path("/proc/self/mounts").read_text()
        except OSError:
            return None
    v1: dict[str, Path] = {}
    v2: list[Path] = []
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        where, fstype, options = Path(parts[1].replace("\\040", " ")), parts[2], parts[3].split(",")
        if fstype == "cgroup":
            for controller in ("cpu", "cpuacct"):
                if controller in options:
                    v1.setdefault(controller, where)
        elif fstype == "cgroup2":
            v2.append(where)
    if "cpu" in v1:
        return Hierarchy(1, v1["cpu"], v1.get("cpuacct", v1["cpu"]))
    for where in v2:
        try:
            controllers = (where / "cgroup.controllers").read_text().split()
        except OSError:
            continue
        if "cpu" in controllers:
            return Hierarchy(2, where, where)
    return None


def available() -> str | None:
    """Why ranks cannot run under CPU quotas here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "CPU quotas need Linux cgroups"
    if os.geteuid() != 0:
        return "not root (creating cgroups needs root)"
    h = detect()
    if h is None:
        return "no cgroup hierarchy with the cpu controller is mounted (v1 cpu, or v2 with cpu enabled)"
    for root in h.roots:
        if not os.access(root, os.W_OK):
            return f"the cgroup hierarchy {root} is not writable"
    if h.version == 2 and "cpu" not in _read(h.cpu / "cgroup.subtree_control").split():
        return (f"cgroup v2: the cpu controller is not enabled for {h.cpu}'s children "
                f"({h.cpu / 'cgroup.subtree_control'} lacks cpu)")
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _pids(group: Path) -> list[int]:
    return [int(x) for x in _read(group / "cgroup.procs").split()]


def _stat(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in text.splitlines() if len(line.split()) == 2)}


def _kill_and_remove(groups: list[Path], wait_s: float = 10.0) -> list[Path]:
    """SIGKILL what runs in ``groups`` (only ranks this module placed there), then remove them in
    the order given (children before parents); returns those that could not be removed."""
    for g in groups:
        for pid in _pids(g):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    left = []
    for g in groups:
        while True:
            try:
                g.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:   # EBUSY: a killed process has not exited yet
                if time.monotonic() > deadline:
                    left.append(g)
                    break
                time.sleep(0.02)
    return left


def cleanup_stale(hierarchy: Hierarchy | None = None) -> list[str]:
    """Remove the cgroups (``planc<pid>[tq]<n>-cpu<k>``) of owners that died, and what still runs
    in them; returns their paths."""
    h = hierarchy or detect()
    removed = []
    for root in (h.roots if h else ()):
        try:
            entries = sorted(root.iterdir())
        except OSError:
            continue
        for entry in entries:
            m = NAME_RE.match(entry.name)
            if m and entry.is_dir() and not pid_alive(int(m.group(1))):
                tree = [Path(d) for d, _, _ in os.walk(entry, topdown=False)]
                _kill_and_remove(tree)
                removed.append(str(entry))
    return removed


# ---------------------------------------------------------------- one cgroup per rank

class RankQuotas:
    """``ranks``' cgroups under one parent, each holding ``quota``; a context manager that removes
    every cgroup it created on exit (after killing what still runs in them), also on errors.

    ``command(argv)`` wraps a rank's command so it joins its cgroup first (``RANK`` and
    :meth:`environ` in its environment); ``stats()`` reads each rank's usage and throttling."""

    def __init__(self, quota: Quota, ranks, *, name: str | None = None, hierarchy: Hierarchy | None = None):
        self.quota = quota
        self.ranks = tuple(int(r) for r in ranks)
        self.name = name or f"planc{os.getpid()}q{next(_counter)}-cpu0"
        if not NAME_RE.match(self.name):
            raise ValueError(f"cgroup name {self.name!r} must look like planc<pid>t<n>-cpu<k>")
        h = hierarchy or detect()
        if h is None:
            raise TestbedError("no cgroup hierarchy with the cpu controller is mounted")
        self.hierarchy = h
        self._made: list[Path] = []
        self.left: list[Path] = []      # what close() could not remove

    def __enter__(self) -> "RankQuotas":
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def group(self, rank: int, root: Path | None = None) -> Path:
        return (root or self.hierarchy.cpu) / self.name / f"rank{rank}"

    def _mkdir(self, path: Path) -> None:
        try:
            path.mkdir()
        except FileExistsError:
            raise TestbedError(f"cgroup {path} already exists (run `python -m benchmarks testbed down`)") from None
        except OSError as e:
            raise TestbedError(f"cannot create cgroup {path}: {e.strerror or e}") from None
        self._made.append(path)

    def _write(self, path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as e:
            raise TestbedError(f"cannot write {text.strip()!r} to {path}: {e.strerror or e}") from None

    def create(self) -> None:
        h = self.hierarchy
        for root in h.roots:
            self._mkdir(root / self.name)
        if h.version == 2:
            self._write(h.cpu / self.name / "cgroup.subtree_control", "+cpu\n")
        fname, text = parent_weight(len(self.ranks), h.version)
        self._write(h.cpu / self.name / fname, text)
        files = v1_files(self.quota) if h.version == 1 else v2_files(self.quota)
        for r in self.ranks:
            for root in h.roots:
                self._mkdir(self.group(r, root))
            for fname, text in files.items():
                path = self.group(r) / fname
                if fname.endswith("burst") and not path.exists():   # kernels before 5.14 have no burst
                    continue
                self._write(path, text)

    def close(self) -> None:
        """Kill what still runs in the ranks' cgroups, remove every cgroup created (idempotent, never raises)."""
        made, self._made = self._made, []
        if made:
            try:
                self.left = _kill_and_remove(list(reversed(made)))
            except Exception:   # never raise from cleanup
                self.left = made

    def environ(self) -> dict[str, str]:
        """What a rank started by :meth:`command` needs in its environment besides ``RANK``: the
        parent folders as seen from any mount namespace (``ip netns exec`` hides /sys/fs/cgroup)."""
        me = os.getpid()
        return {"PLANC_QUOTA_CGROUPS": ":".join(f"/proc/{me}/root{root / self.name}" for root in self.hierarchy.roots),
                "PLANC_CPUS_PER_RANK": "" if self.quota.cpus is None else f"{self.quota.cpus:g}"}

    @staticmethod
    def command(argv: list[str]) -> list[str]:
        """``argv`` started through the wrapper that joins the rank's cgroup (``$RANK``) and execs it."""
        return ["/bin/sh", str(WRAPPER), "--", *argv]

    def join(self, rank: int, pid: int) -> None:
        """Move a running process (all its threads) into ``rank``'s cgroup."""
        for root in self.hierarchy.roots:
            self._write(self.group(rank, root) / "cgroup.procs", f"{pid}\n")

    def pids(self, rank: int) -> list[int]:
        return _pids(self.group(rank))

    def stats(self) -> dict[int, dict[str, float]]:
        """Per rank: CPU ``usage_s``, ``nr_periods``, ``nr_throttled`` (periods it hit its quota) and
        ``throttled_s`` (time it waited for the next period), read from cpu.stat (and cpuacct.usage)."""
        out = {}
        for r in self.ranks:
            st = _stat(_read(self.group(r) / "cpu.stat"))
            if self.hierarchy.version == 1:
                usage = int(_read(self.group(r, self.hierarchy.usage) / "cpuacct.usage").strip() or 0) / 1e9
                throttled = st.get("throttled_time", 0) / 1e9
            else:
                usage, throttled = st.get("usage_usec", 0) / 1e6, st.get("throttled_usec", 0) / 1e6
            out[r] = {"usage_s": usage, "nr_periods": st.get("nr_periods", 0),
                      "nr_throttled": st.get("nr_throttled", 0), "throttled_s": throttled}
        return out
