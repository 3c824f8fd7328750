"""`python -m benchmarks bench quota`: one rank's compute time with and without CPU quotas, the others idle or busy.

Four processes ("ranks", ``OMP_NUM_THREADS=1``), each started through ``benchmarks/testbed/quota.py``'s
wrapper into a cgroup of its own before it imports anything: cgroups that only count (no quota), then
cgroups of each ``--cpus-per-rank`` share (default 0.5, the machine's 2 cores ÷ 4, and 0.25). For each
setting rank 0 times a fixed loop of matmuls twice: while the other three sleep, and while they run the
same matmuls without end. Without quotas rank 0's time depends on the others (it gets a whole core
while they sleep, a share of the cores while they compute); under a quota it is the same both ways:
the rank is a device of fixed speed (DESIGN.md, "Devices of fixed speed in the lab").

``python -m benchmarks.bench.quota --worker`` is the worker (reads ``time N`` / ``spin`` / ``stop`` /
``quit`` on stdin). ``python -m benchmarks.bench.quota --periods`` is why the period is at least one
scheduler tick (docs/testbed.md): a busy process alone in a cgroup of each quota and period, and the
share of the core given that it got.
"""

from __future__ import annotations

import os
import platform
import select
import subprocess
import sys
import time
from pathlib import Path

N, ITERS = 256, 1500          # rank 0's loop: ITERS products of two N x N fp32 matrices (~0.5 s alone here)
RANKS = 4
DEFAULT_SHARES = (0.5, 0.25)
ROOT = Path(__file__).resolve().parents[2]


def worker() -> int:
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(N, N), torch.randn(N, N)
    for _ in range(20):
        a @ b
    print("ready", flush=True)
    while line := sys.stdin.readline():
        cmd = line.split()
        if cmd[0] == "time":
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(int(cmd[1])):
                a @ b
            print(f"took {time.perf_counter() - t0:.6f} {time.process_time() - c0:.6f}", flush=True)
        elif cmd[0] == "spin":
            print("spinning", flush=True)
            while not select.select([sys.stdin], [], [], 0)[0]:
                a @ b
            sys.stdin.readline()   # stop
            print("stopped", flush=True)
        elif cmd[0] == "quit":
            break
    return 0


def _ask(p: subprocess.Popen, text: str | None, want: str) -> str:
    if text is not None:
        p.stdin.write(text + "\n")
        p.stdin.flush()
    line = p.stdout.readline()
    if not line.startswith(want):
        raise RuntimeError(f"bench quota: a worker answered {line!r}, expected {want!r}")
    return line


def measure(shares=DEFAULT_SHARES, iters: int = ITERS) -> list[dict]:
    """For no quota and each share: rank 0's loop with the others asleep, then busy."""
    from benchmarks.testbed import quota
    from planc.calibrate.clusterfile import cores_available

    cores = cores_available()
    for s in shares:
        quota.check_total(s, RANKS, cores)
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for share in (None, *shares):
        q = quota.quota_of(share)
        with quota.RankQuotas(q, range(RANKS)) as groups:
            argv = groups.command([sys.executable, "-m", "benchmarks.bench.quota", "--worker"])
            procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), **groups.environ()), cwd=ROOT, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE) for r in range(RANKS)]
            try:
                for p in procs:
                    _ask(p, None, "ready")
                for others in ("sleeping", "computing"):
                    if others == "computing":
                        for p in procs[1:]:
                            _ask(p, "spin", "spinning")
                    before = groups.stats()[0]
                    _, wall, cpu = _ask(procs[0], f"time {iters}", "took").split()
                    after = groups.stats()[0]
                    if others == "computing":
                        for p in procs[1:]:
                            _ask(p, "stop", "stopped")
                    rows.append({"cpus": share, "quota": q, "others": others, "wall_s": float(wall),
                                 "cpu_s": float(cpu), **{k: after[k] - before[k] for k in after}})
                for p in procs:
                    p.stdin.write("quit\n")
                    p.stdin.flush()
                    p.wait(timeout=30)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
    return rows


PERIODS = ((1000, 1000), (1000, 2000), (1500, 3000), (2000, 4000), (1000, 4000), (3000, 4000), (5000, 10000))


def periods(seconds: float = 2.0) -> list[dict]:
    """A busy process alone in a cgroup of each (quota, period) of :data:`PERIODS`, ``seconds`` long:
    the share of a core it got (CPU time ÷ wall, cpuacct) ÷ the share given."""
    from benchmarks.testbed import quota

    out = []
    busy = f"import time\nt = time.monotonic()\nwhile time.monotonic() - t < {seconds}:\n    pass\n"
    for quota_us, period_us in PERIODS:
        with quota.RankQuotas(quota.Quota(quota_us / period_us, period_us, quota_us), [0]) as groups:
            t0 = time.monotonic()
            subprocess.run(groups.command([sys.executable, "-S", "-c", busy]), check=True, timeout=60 + 10 * seconds,
                           env=dict(os.environ, RANK="0", **groups.environ()))
            got = groups.stats()[0]["usage_s"] / (time.monotonic() - t0)
        out.append({"quota_us": quota_us, "period_us": period_us, "got": got, "of_given": got * period_us / quota_us})
    return out


def markdown(rows: list[dict], took: float, version: int) -> str:
    import torch

    alone = next(r["wall_s"] for r in rows if r["cpus"] is None and r["others"] == "sleeping")
    settings = list(dict.fromkeys(r["cpus"] for r in rows))

    def head(cpus):
        if cpus is None:
            return "no quota"
        q = next(r["quota"] for r in rows if r["cpus"] == cpus)
        return f"{cpus:g} core each ({q.quota_us} us per {q.period_us} us)"

    def cell(r):
        return f"{r['wall_s']:.3f} s ({r['wall_s'] / alone:.2f}x; CPU {r['usage_s'] / r['wall_s']:.2f} of wall)"

    lines = [f"{RANKS} processes (`OMP_NUM_THREADS=1`), each in its own cgroup (v{version}); rank 0 times "
             f"{ITERS} products of {N}x{N} fp32 matrices while the other {RANKS - 1} sleep or run the same products; "
             f"cell: its seconds (÷ no quota, the others asleep; its CPU time ÷ wall, cpuacct). Machine: "
             f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}, torch "
             f"{torch.__version__}; 1-minute load {os.getloadavg()[0]:.1f} at the end; the bench took {took:.0f} s.",
             "",
             "| the other 3 ranks | " + " | ".join(head(c) for c in settings) + " |",
             "|---|" + "---|" * len(settings)]
    for others in ("sleeping", "computing"):
        lines.append(f"| {others} | " + " | ".join(
            cell(next(r for r in rows if r["cpus"] == c and r["others"] == others)) for c in settings) + " |")
    return "\n".join(lines) + "\n"


def run(cpus_per_rank: float | None = None) -> str:
    from benchmarks.testbed import quota

    why = quota.available()
    if why:
        return (f"_Skipped: {why}. CPU quotas need root and a cgroup hierarchy with the cpu controller; "
                "see docs/testbed.md._\n")
    t0 = time.monotonic()
    rows = measure((cpus_per_rank,) if cpus_per_rank is not None else DEFAULT_SHARES)
    return markdown(rows, time.monotonic() - t0, quota.detect().version)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        sys.exit(worker())
    if sys.argv[1:] == ["--periods"]:
        from benchmarks.testbed.quota import scheduler_tick_us
        print(f"scheduler tick {scheduler_tick_us()} us; a busy process alone in a cgroup, 2 s:")
        for r in periods():
            print(f"  {r['quota_us']} us per {r['period_us']} us: {r['got']:.3f} of a core, "
                  f"{r['of_given']:.2f} of the share given")
        sys.exit(0)
    print(run(float(sys.argv[1]) if len(sys.argv) > 1 else None), end="")
