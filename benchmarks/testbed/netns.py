"""Network namespaces, a bridge, veth pairs and tc shaping; launching a compiled output's ranks inside them.

Everything lives in namespaces this module creates: one per host (``<prefix>h<i>``)
and one for the bridge (``<prefix>br``). Nothing is added to, or changed in, the
machine's own (root) namespace: veth pairs are created inside the bridge
namespace with their peer placed directly in the host namespace, so no
interface, address or route of the machine is ever touched. Removing the
namespaces removes every interface, address, route and qdisc with them.
"""

from __future__ import annotations

import atexit
import ipaddress
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from planc.plan import DEFAULT_TIMEOUT_S

from benchmarks.testbed import quota
from benchmarks.testbed.faults import FaultsMixin, check_loss
from benchmarks.testbed.namespaces import (BRIDGE, IFNAME, NAME_RE, available, cleanup_stale,  # noqa: F401
                                           delete_netns, netns_list, pick_subnet, run)
from benchmarks.testbed.result import LaunchResult, TestbedError
from benchmarks.variant import with_timeout
from benchmarks.testbed.watch import (_RANK_FAILED_RE, STEP_RE, TRAIN_STEP_RE, RankTracker, StepBar,  # noqa: F401
                                 _rank_failed, _StepWatch, deepspeed_command, describe_failure, remove_shm,
                                 sample_hwm, shm_buffers, uts_wrapper)

LAB_ROOT = Path(__file__).resolve().parents[2]   # the repository root: benchmarks/ and planc/ beside each other
_counter = itertools.count()
_ports = itertools.count(29500)   # one master port per launch of this process, so that two testbeds up at
                                  # once never share DeepSpeed's /dev/shm buffer names (address_port_rank)



def scaled_link_mbit(plan: dict, intra_bytes_per_s: float = 3e9) -> float:
    """The host-link rate (Mbit/s) that keeps the plan's host-level ÷ innermost-level bandwidth ratio,
    given the testbed's in-namespace rate (DESIGN.md measured ≈ 3 GB/s)."""
    levels = plan["cluster"]["levels"]
    host = plan["cluster"].get("host_level") or levels[0]["name"]
    host_bw = next(float(lv["bandwidth"]) for lv in levels if lv["name"] == host)
    inner_bw = float(levels[-1]["bandwidth"])
    return intra_bytes_per_s * host_bw / inner_bw * 8 / 1e6


class Testbed(FaultsMixin):
    """``hosts`` network namespaces on one bridge, each host's link shaped to ``link_mbit`` per direction.

    Ranks inside one namespace talk over its own stack (loopback path); between
    namespaces traffic crosses the host's veth (shaped on the way out) and the
    bridge port towards the receiver (shaped on the way in), so a host's link
    is ``link_mbit`` in each direction, as in the cost model's tree of links.

    Faults (benchmarks/testbed/faults.py, docs/testbed.md "Faults"): ``loss`` (a fraction, or
    {host: fraction}) drops that share of each host link's packets from the start,
    ``set_loss``, ``link_down``/``link_up`` and ``kill_rank`` apply them while a job runs.
    ``cpus_per_rank`` (quota.py; a share of one core, or ``'auto'``: the cores ÷ the ranks): every rank of a
    launch in its own CPU cgroup under that quota (refused, ``quota.QuotaError``, beyond the cores).
    """

    __test__ = False   # not a pytest class

    def __init__(self, hosts: int, link_mbit: float, *, subnet: str | None = None,
                 burst_kb: float | None = None, latency_ms: float = 50.0, prefix: str | None = None,
                 loss: float | dict[int, float] = 0.0, cpus_per_rank: float | str | None = None):
        if hosts < 1 or hosts > 250:
            raise ValueError(f"hosts must be 1..250, not {hosts}")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, not {link_mbit}")
        self.hosts = hosts
        self.link_mbit = float(link_mbit)
        self.prefix = prefix or f"planc{os.getpid()}t{next(_counter)}"
        if prefix is not None and not NAME_RE.match(prefix + "br"):
            raise ValueError(f"prefix {prefix!r} must look like planc<pid>t<n>")
        self.namespaces = [f"{self.prefix}h{h}" for h in range(hosts)]
        self.bridge_ns = f"{self.prefix}br"
        self.ifname = IFNAME
        self._subnet = ipaddress.ip_network(subnet) if subnet else None
        # tbf needs a bucket of at least one (GSO) packet; ~2 ms of traffic, at least 64 KB
        self._burst_kb = burst_kb
        self.burst_bytes = self._burst(self.link_mbit)
        self.latency_ms = latency_ms
        self.addresses: list[str] = []
        self._created: list[str] = []
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._ports = _ports
        self._old_sigterm = None
        self.up = False
        self._loss = check_loss(loss, hosts)      # per host link, each direction
        self._loss_ports: list[int] = []          # bridge ports with the drop stage installed
        self._down: set[tuple[int, str]] = set()  # (host, end) taken down
        self._events: list[tuple[float, str]] = []
        self._tracker: RankTracker | None = None  # the running launch's ranks (kill_rank)
        self._host_of: dict[int, int] = {}
        self.cpus_per_rank = quota.cpus_option(cpus_per_rank)
        self._quotas: list[quota.RankQuotas] = []  # the running launch's cgroups (close() removes them)
        self._quota_launches = itertools.count()

    def _burst(self, mbit: float) -> int:
        return int((self._burst_kb * 1024) if self._burst_kb else max(64 * 1024, mbit * 1e6 / 8 * 0.002))

    # -- building and removing -------------------------------------------------
    def __enter__(self) -> "Testbed":
        why = available()
        if why:
            raise TestbedError(f"cannot build a testbed: {why}")
        why = quota.available() if self.cpus_per_rank is not None else None
        if why:
            raise TestbedError(f"cannot run ranks under CPU quotas (cpus_per_rank={self.cpus_per_rank!r}): {why}")
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM → SystemExit, so __exit__ (and the cleanup) runs
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self.up = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns_add(self, ns: str) -> None:
        if ns in netns_list():
            raise TestbedError(f"network namespace {ns} already exists (run `python -m benchmarks testbed down`)")
        run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def _build(self) -> None:
        net = self._subnet or pick_subnet()
        self.subnet = str(net)
        hosts_ip = list(net.hosts())
        self.addresses = [str(hosts_ip[h]) for h in range(self.hosts)]
        br = self.bridge_ns
        self._ns_add(br)
        run(["ip", "-n", br, "link", "set", "lo", "up"])
        run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        rate = f"{self.link_mbit:g}mbit"
        tbf = ["tbf", "rate", rate, "burst", str(self.burst_bytes), "latency", f"{self.latency_ms:g}ms"]
        for h, ns in enumerate(self.namespaces):
            self._ns_add(ns)
            port = f"p{h}"
            # both ends are born inside our namespaces: nothing appears in the machine's own
            run(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns])
            run(["ip", "-n", br, "link", "set", port, "master", BRIDGE])
            run(["ip", "-n", br, "link", "set", port, "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
            run(["ip", "-n", ns, "addr", "add", f"{self.addresses[h]}/{net.prefixlen}", "dev", IFNAME])
            run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, "root", *tbf])   # host → bridge
            run(["ip", "netns", "exec", br, "tc", "qdisc", "add", "dev", port, "root", *tbf])     # bridge → host
        if any(self._loss):
            self._apply_loss()

    def close(self) -> None:
        """Kill what was launched, delete every namespace created (idempotent, never raises)."""
        with self._lock:
            for p in self._procs:
                _killpg(p)
            self._procs.clear()
            for q in self._quotas:
                q.close()
            self._quotas.clear()
            for ns in reversed(self._created):
                try:
                    delete_netns(ns)
                except Exception:   # keep removing the rest
                    pass
            self._created.clear()
            self.up = False
        try:
            atexit.unregister(self.close)
        except Exception:
            pass
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- running inside --------------------------------------------------------
    def exec(self, host: int, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` inside host ``host``'s namespace (subprocess.run keyword arguments pass through)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(["ip", "netns", "exec", self.namespaces[host], *argv], **kwargs)

    def set_link_mbit(self, link_mbit: float) -> None:
        """Change every host link's rate (both directions) in place, between launches."""
        if not self.up:
            raise TestbedError("the testbed is not up (use it as a context manager)")
        if link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive, not {link_mbit}")
        self.link_mbit = float(link_mbit)
        self.burst_bytes = self._burst(self.link_mbit)
        tbf = ["tbf", "rate", f"{self.link_mbit:g}mbit", "burst", str(self.burst_bytes),
               "latency", f"{self.latency_ms:g}ms"]
        for h, ns in enumerate(self.namespaces):
            for where, dev in ((ns, IFNAME), (self.bridge_ns, f"p{h}")):
                # `change` keeps the queued packets (a running job only sees the new rate)
                r = run(["ip", "netns", "exec", where, "tc", "qdisc", "change", "dev", dev, "root", *tbf], check=False)
                if r.returncode != 0:
                    run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", *tbf])
        self._resize_loss_queues()

    def launch(self, out: str | os.PathLike, steps: int = 3, timeout: float = 300, *,
               comm_only: bool = True, extra_args: tuple[str, ...] | list[str] = (),
               args: tuple[str, ...] | None = None, script: str | os.PathLike | None = None,
               launcher: str = "deepspeed", env: dict | None = None, python: str | None = None,
               grace: float = 15.0, memory: bool = True,
               on_step: Callable[[int, float], None] | None = None,
               collective_timeout: float | None = None, ranks_per_host: list[int] | None = None,
               host_outs: dict[int, str | os.PathLike] | None = None,
               progress: bool | None = None) -> LaunchResult:
        """Run a compiled output: plan host h's ranks in namespace h, gloo over the veth.
        A launch whose rank 0 could not bind its rendezvous port (EADDRINUSE: something on the machine
        holds it; no step ran) is started once more on the next port.

        ``launcher="deepspeed"`` (default) starts, in each host's namespace, the
        DeepSpeed launcher for that node as a multi-node job without ssh does:
        ``deepspeed --hostfile HF --no_ssh --node_rank=h --num_nodes=H
        [--num_gpus=N] --master_addr=<host 0> --master_port=P
        --enable_each_rank_log=DIR SCRIPT ARGS`` (HF lists the plan's hosts and
        their slots; ``--num_gpus`` is given when every host has N ranks). The
        launcher sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT for its
        ranks. ``launcher="direct"`` spawns the ranks itself (RANK, LOCAL_RANK,
        WORLD_SIZE, LOCAL_WORLD_SIZE, ...), as before.

        SCRIPT is OUT/train.py unless ``script`` is given; ARGS are ``--comm-only``
        (``comm_only=True``) or ``args`` when given, then ``--steps N`` and
        ``extra_args``. Every process gets GLOO_SOCKET_IFNAME, DS_ACCELERATOR=cpu, CUDA_VISIBLE_DEVICES=""
        (no GPU on an emulated host: ``backend = auto`` is gloo), OMP_NUM_THREADS=1; ``env``
        adds to them. After ``timeout`` seconds (or ``grace`` seconds after a
        launcher or rank failed) every process group is killed. With ``memory``,
        each rank's VmHWM (/proc/PID/status) is sampled while it runs.
        ``on_step(n, seconds)`` is called (from this thread, within ~50 ms) each
        time rank 0 prints the line of step ``n``, e.g. to change the link rate
        with ``set_link_mbit`` while the program runs (or to apply a fault: ``link_down``,
        ``set_loss``, ``kill_rank``).

        ``collective_timeout`` (seconds): the ranks run a copy of the output whose plan.json holds it
        (``benchmarks.variant.with_timeout``; the ranks read it from nowhere else); by default the
        plan's own ``timeout``, else the runtime's default (300 s). When the
        launch fails, ``LaunchResult.failure`` says which rank failed first and how, what every
        rank said, and the faults applied during the run.

        Start-up faults (the plan is not what runs): ``ranks_per_host`` starts that many ranks on
        each host (numbered host by host) instead of the plan's, ``host_outs`` {h: OUT2} runs
        OUT2/train.py on host h (another plan's digest). Every host's ranks run under the hostname
        ``node<h>`` (``unshare --uts``, when it works), as on separate machines. ``progress``: a bar
        of rank 0's steps on stderr (``planc.commands.ui.progress``); None: when stderr is a terminal. What
        DeepSpeed's ranks leave in /dev/shm for this launch is removed afterwards (``shm_removed``).
        ``cpus_per_rank``: each rank joins its cgroup (``<prefix>-cpu<k>/rank<r>``) through quota_exec.sh,
        then execs the command it runs without quotas (``cpu_quota``, ``cpu_stats``; docs/testbed.md).
        """
        kwargs = dict(steps=steps, timeout=timeout, comm_only=comm_only, extra_args=extra_args, args=args,
                      script=script, launcher=launcher, env=env, python=python, grace=grace, memory=memory,
                      on_step=on_step, collective_timeout=collective_timeout, ranks_per_host=ranks_per_host,
                      host_outs=host_outs, progress=progress)
        result = self._launch_once(out, **kwargs)
        if result.returncode != 0 and not result.step_times and "EADDRINUSE" in result.stdout:
            result = self._launch_once(out, **kwargs)
        return result

    def _launch_once(self, out, *, steps, timeout, comm_only, extra_args, args, script, launcher, env, python,
                     grace, memory, on_step, collective_timeout, ranks_per_host, host_outs, progress) -> LaunchResult:
        if not self.up:
            raise TestbedError("the testbed is not up (use it as a context manager)")
        if launcher not in ("deepspeed", "direct"):
            raise ValueError(f"launcher must be 'deepspeed' or 'direct', not {launcher!r}")
        out = Path(out).resolve()
        plan = json.loads((out / "plan.json").read_text())
        hosts = [sorted(int(r) for r in h) for h in plan["cluster"]["hosts"]]
        if len(hosts) > self.hosts:
            raise TestbedError(f"the plan has {len(hosts)} hosts, the testbed {self.hosts}")
        world = int(plan["cluster"]["devices"])
        if ranks_per_host is not None:
            counts = [int(n) for n in ranks_per_host]
            if len(counts) != len(hosts) or min(counts) < 1:
                raise ValueError(f"ranks_per_host must give each of the plan's {len(hosts)} hosts at least one "
                                 f"rank, not {list(ranks_per_host)}")
            hosts = [list(range(sum(counts[:h]), sum(counts[:h + 1]))) for h in range(len(counts))]
            world = sum(counts)
        if any(not (isinstance(h, int) and 0 <= h < len(hosts)) for h in (host_outs or {})):
            raise ValueError(f"host_outs: hosts must be among the plan's 0..{len(hosts) - 1}, not {sorted(host_outs)}")
        # the ranks' CPU cgroups, refused before anything starts when the quotas add up to more than the cores
        quotas = quota.for_launch(self.cpus_per_rank, world, f"{self.prefix}-cpu{next(self._quota_launches)}")
        planned = (plan.get("train") or {}).get("timeout") or (plan.get("runtime") or {}).get("timeout")
        asked, collective_timeout = collective_timeout, collective_timeout or planned or DEFAULT_TIMEOUT_S
        if collective_timeout <= 0:
            raise ValueError(f"collective_timeout must be positive, not {collective_timeout}")
        if asked is not None and collective_timeout != planned:   # the ranks read it from their plan.json only: a copy that holds it
            out = with_timeout(out, collective_timeout)
            host_outs = {h: with_timeout(o, collective_timeout) for h, o in (host_outs or {}).items()}
        script = Path(script).resolve() if script is not None else out / "train.py"
        outs = {h: Path((host_outs or {}).get(h, out)).resolve() for h in range(len(hosts))}
        scripts = {h: outs[h] / "train.py" if h in (host_outs or {}) else script for h in range(len(hosts))}
        argv = list(args) if args is not None else (["--comm-only"] if comm_only else [])
        argv += ["--steps", str(steps), *map(str, extra_args)]
        base = {k: v for k, v in os.environ.items()
                if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                             "CUDA_VISIBLE_DEVICES", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")}
        python = python or sys.executable
        # PYTHONPATH: the lab's own root, so a bench worker launched as a script imports ``benchmarks``
        # (a compiled output's train.py puts OUT first on its path: its planc/plan/ wins there).
        # CUDA_VISIBLE_DEVICES empty: the emulated hosts have no GPU, so a plan's `backend = auto`
        # resolves to gloo on any machine (a plan that insists on nccl is refused at start)
        base.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(LAB_ROOT), CUDA_VISIBLE_DEVICES="",
                    PATH=str(Path(python).parent) + os.pathsep + os.environ.get("PATH", ""),
                    GLOO_SOCKET_IFNAME=IFNAME)
        port = str(next(self._ports))
        base.update(env or {})
        logdir = Path(tempfile.mkdtemp(prefix="planc-testbed-"))
        procs: dict[str, subprocess.Popen] = {}     # "host<h>" (a launcher) or "rank<r>" -> process
        files = []
        t0 = time.monotonic()
        timed_out = False
        killed_at = None
        hwm: dict[int, int] = {}
        host_of = {r: h for h, ranks in enumerate(hosts) for r in ranks}
        tracker = RankTracker(tuple(sorted({str(x) for x in scripts.values()})), t0)
        self._tracker, self._host_of = tracker, host_of
        standing = [f"host {h}'s link drops {x * 100:g}% of its packets" for h, x in enumerate(self._loss) if x]
        standing += [f"host {h}'s link is down ({end} end)" for h, end in sorted(self._down)]
        events_from = len(self._events)
        dropped_before = self.dropped_packets()
        shm_before = set(shm_buffers(self.addresses[0], port))
        bar = StepBar(steps, f"testbed: {out.name}", progress)
        cpu_stats: dict[int, dict] = {}

        def step_seen(n: int, seconds: float) -> None:
            bar.step(n)
            if on_step is not None:
                on_step(n, seconds)
        try:
            if quotas is not None:   # each rank joins its cgroup through quota_exec.sh before it runs anything
                with self._lock:
                    self._quotas.append(quotas)
                quotas.create()
                base.update(quotas.environ())
            if launcher == "deepspeed":
                first = 0
                for h, ranks in enumerate(hosts):
                    if ranks != list(range(first, first + len(ranks))):
                        raise TestbedError(f"host {h} holds ranks {ranks}: the DeepSpeed launcher numbers each "
                                           f"host's ranks contiguously in hostfile order")
                    first += len(ranks)
                hostfile = logdir / "hostfile"
                hostfile.write_text("".join(f"node{h} slots={len(r)}\n" for h, r in enumerate(hosts)))
                uniform = len({len(r) for r in hosts}) == 1
                for h, ranks in enumerate(hosts):
                    cmd = [*deepspeed_command(python), f"--hostfile={hostfile}", "--no_ssh", f"--node_rank={h}",
                           f"--num_nodes={len(hosts)}", *([f"--num_gpus={len(ranks)}"] if uniform else []),
                           f"--master_addr={self.addresses[0]}", f"--master_port={port}",
                           f"--enable_each_rank_log={logdir / f'host{h}'}",
                           *(["--no_python", str(quota.WRAPPER), python] if quotas else []), str(scripts[h]), *argv]
                    f = open(logdir / f"host{h}.log", "w")
                    files.append(f)
                    procs[f"host{h}"] = subprocess.Popen(
                        ["ip", "netns", "exec", self.namespaces[h], *uts_wrapper(f"node{h}"), *cmd], env=base,
                        stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(outs[h]),
                        start_new_session=True)
                    with self._lock:
                        self._procs.append(procs[f"host{h}"])
            else:
                for h, ranks in enumerate(hosts):
                    for local, rank in enumerate(ranks):
                        e = dict(base, RANK=str(rank), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(len(ranks)),
                                 WORLD_SIZE=str(world), MASTER_ADDR=self.addresses[0], MASTER_PORT=port)
                        f = open(logdir / f"rank{rank}.log", "w")
                        files.append(f)
                        procs[f"rank{rank}"] = subprocess.Popen(
                            ["ip", "netns", "exec", self.namespaces[h], *uts_wrapper(f"node{h}"),
                             *quota.command(quotas, [python, str(scripts[h]), *argv])],
                            env=e, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=str(outs[h]), start_new_session=True)
                        with self._lock:
                            self._procs.append(procs[f"rank{rank}"])
            deadline = t0 + timeout
            failed_at = None
            next_sample = 0.0
            watch = _StepWatch(logdir, "host0/*_rank0.log" if launcher == "deepspeed" else "rank0.log",
                               step_seen if (on_step is not None or bar.shown) else None)
            while any(p.poll() is None for p in procs.values()):
                watch.poll()
                now = time.monotonic()
                if now >= next_sample:
                    tracker.scan(procs.values())
                    if memory:
                        sample_hwm(tracker, hwm)
                    next_sample = now + 0.25
                tracker.poll(now, {p.pid: p.returncode for p in procs.values() if p.returncode is not None})
                if failed_at is None and (any(p.returncode not in (None, 0) for p in procs.values())
                                          or any(code not in (0, None) for _, code in tracker.ended.values())
                                          or (launcher == "deepspeed" and _rank_failed(logdir))):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + grace):
                    timed_out = now > deadline
                    killed_at = now - t0
                    break
                time.sleep(0.05)
            else:
                watch.poll()   # the lines written just before the last process exited
                tracker.poll(time.monotonic(), {p.pid: p.returncode for p in procs.values()})
        finally:
            self._tracker = None
            for p in procs.values():
                if p.poll() is None:
                    _killpg(p)
            if "watch" in locals():
                watch.close()
            for p in procs.values():
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            for f in files:
                f.close()
            if quotas is not None:
                cpu_stats = quotas.stats()
                quotas.close()
            with self._lock:
                self._procs = [p for p in self._procs if p not in procs.values()]
                self._quotas = [q for q in self._quotas if q is not quotas]
            bar.close()
            # DeepSpeed's CPU ranks each map /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
            # (~69 MB) when all ranks are on one node and never unlink it: remove what this launch left
            shm_removed = remove_shm(self.addresses[0], port, keep=shm_before)
        if launcher == "deepspeed":
            logs = {}
            for r in range(world):
                found = sorted(logdir.glob(f"host*/*_rank{r}.log"))
                logs[r] = found[-1].read_text(errors="replace") if found else ""
            host_logs = {h: (logdir / f"host{h}.log").read_text(errors="replace") for h in range(len(hosts))}
            tracker.codes_from_launchers(hosts, host_logs)
        else:
            logs = {int(k[4:]): (logdir / f"{k}.log").read_text(errors="replace") for k in procs}
            host_logs = {}
        shutil.rmtree(logdir, ignore_errors=True)
        codes = [p.returncode for p in procs.values()]
        rc = 124 if timed_out else next((c for c in codes if c not in (0, None)), 0)
        if rc == 0 and launcher == "deepspeed" and any(_RANK_FAILED_RE.search(t) for t in host_logs.values()):
            rc = 1
        stdout = logs.get(0, "")
        steps_seen = [float(m.group(2)) for m in STEP_RE.finditer(stdout)]
        losses = []
        if not steps_seen:
            found = TRAIN_STEP_RE.findall(stdout)
            steps_seen = [float(t) for _, _, t in found]
            losses = [float(x) for _, x, _ in found]
        events = [(0.0, f"from the start: {what}") for what in standing]
        events += [(max(0.0, t - t0), what) for t, what in self._events[events_from:]]
        dropped_after = self.dropped_packets()
        failure = ""
        if rc != 0:
            failure = describe_failure(world=world, host_of=host_of, tracker=tracker, logs=logs, events=events,
                                       timed_out=timed_out, killed_at=killed_at, timeout=timeout,
                                       collective_timeout=float(collective_timeout))
        return LaunchResult(rc, stdout, logs, steps_seen, timed_out, time.monotonic() - t0,
                            losses=losses, peak_rss_kb=dict(sorted(hwm.items())), host_logs=host_logs,
                            launcher=launcher, failure=failure,
                            rank_exits={r: c for r, (_, c) in sorted(tracker.ended.items())},
                            rank_ended_s={r: t for r, (t, _) in sorted(tracker.ended.items())},
                            killed=killed_at is not None, events=events,
                            dropped_packets={h: n - dropped_before.get(h, 0) for h, n in dropped_after.items()},
                            collective_timeout_s=float(collective_timeout), shm_removed=shm_removed,
                            cpu_quota=quotas.quota if quotas else None, cpu_stats=cpu_stats,
                            host_exits={int(k[4:]): p.returncode for k, p in procs.items() if k.startswith("host")})


def _killpg(p: subprocess.Popen) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            p.kill()
        except ProcessLookupError:
            pass


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)
