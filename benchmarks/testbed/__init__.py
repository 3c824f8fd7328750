"""An emulated cluster on one machine: network namespaces joined by a bridge, host links shaped by ``tc``.

Public API::

    Testbed(hosts, link_mbit, *, subnet=None, burst_kb=None, latency_ms=50, prefix=None, loss=0.0,
            cpus_per_rank=None)
        context manager (root only).  cpus_per_rank (a share of one core, or 'auto'): every rank of a
        launch in its own CPU cgroup with that quota (benchmarks/testbed/quota.py; refused when the
        quotas add up to more than the machine's cores). ``__enter__`` creates, ``__exit__`` removes
        everything it created, also when the body raises or is interrupted.
        .namespaces     host namespace names, host h → namespaces[h]
        .bridge_ns      the namespace holding the bridge
        .addresses      host h's address (on its veth ``IFNAME`` only)
        .ifname         the veth inside every host namespace (GLOO_SOCKET_IFNAME)
        .exec(h, argv, **subprocess kwargs)    run a command inside host h's namespace
        .launch(out, steps=..., timeout=..., comm_only=True, extra_args=(), script=None,
                launcher="deepspeed", on_step=None, ranks_per_host=None, host_outs=None,
                progress=None) -> LaunchResult
                        run a compiled output: in namespace h, DeepSpeed's launcher for node h
                        (``deepspeed --no_ssh --node_rank=h ...``) starts host h's ranks of
                        ``train.py [--comm-only]`` (or ``script``); every process is killed on timeout;
                        each host's ranks run under the hostname ``node<h>``; ranks_per_host /
                        host_outs start a job that is not the plan (start-up faults); progress: a bar
                        of rank 0's steps on stderr (default: on a terminal); afterwards the launch's
                        DeepSpeed /dev/shm buffers are removed (LaunchResult.shm_removed)
        .set_link_mbit(x)   change every host link's rate (``tc qdisc change``), also mid-run
        faults (benchmarks/testbed/faults.py), also mid-run (e.g. from on_step):
        .set_loss(fraction, host=None)    drop that share of a host link's packets, each direction
                                          (``loss=`` of the constructor: from the start); .loss
        .link_down(host, end="bridge") / .link_up(host, end="bridge")   ``ip link set ... down/up``
        .kill_rank(rank, sig=SIGKILL)     signal a rank of the running launch
        .dropped_packets() -> {host: packets the loss fault dropped into it}
    LaunchResult        returncode, stdout (rank 0), logs (per rank), host_logs (per launcher),
                        step_times, losses, peak_rss_kb (VmHWM per rank), timed_out,
                        failure (which rank failed first and how, every rank's last words, the faults),
                        rank_exits, rank_ended_s, host_exits, killed, events, dropped_packets,
                        collective_timeout_s, shm_removed, cpu_quota (Quota or None), cpu_stats (rank ->
                        usage_s, nr_periods, nr_throttled, throttled_s)
    available() -> str | None      why a testbed cannot be built here (None: it can)
    cleanup_stale() -> list[str]   remove testbed namespaces and rank cgroups left by processes that died
    scaled_link_mbit(plan, intra_bytes_per_s=3e9) -> float
                        the host-link rate that keeps the plan's host/in-host bandwidth ratio

See docs/testbed.md.
"""

from benchmarks.testbed import namespaces, quota
from benchmarks.testbed.netns import IFNAME, Testbed, available, scaled_link_mbit
from benchmarks.testbed.result import LaunchResult, TestbedError


def cleanup_stale() -> list[str]:
    """Remove what testbeds whose process died left: their namespaces (``planc<pid>t<n>h<i>``, ``...br``,
    and what still runs inside) and their ranks' CPU cgroups (``planc<pid>t<n>-cpu<k>``, quota.py)."""
    return namespaces.cleanup_stale() + quota.cleanup_stale()


__all__ = ["Testbed", "TestbedError", "LaunchResult", "IFNAME", "available", "cleanup_stale",
           "scaled_link_mbit"]
