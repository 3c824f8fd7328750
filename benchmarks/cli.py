"""`python -m benchmarks`: the lab that measures planc, outside the product.

    python -m benchmarks bench WHAT [PLAN...] [--rates ...] [--write docs/benchmarks.md] ...
    python -m benchmarks testbed up|run|down|check [TARGET] [--link-mbit ...] ...
    python -m benchmarks calibrate --on testbed OUT.yaml [--rate ...] [--hosts N] [--ranks-per-host N]

The same commands, flags and outputs ``planc bench``, ``planc testbed`` and ``planc calibrate --on
testbed`` had. User errors print one located line and exit 2; anything else is a bug: one line and
exit 3, the traceback only with --debug (planc's own CLI style).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import threading
from pathlib import Path

from benchmarks import bench
from benchmarks.bench import BENCHES
from benchmarks.bench import fuzz as bench_fuzz
from benchmarks.bench import plot as bench_plot
from benchmarks.bench.accuracy import AccuracyError
from benchmarks.bench.iteration import ReportError
from benchmarks.bench.nic import NicBenchError
from benchmarks.calibrate import DEFAULT_RATE, calibrate_testbed
from benchmarks.testbed import Testbed, available, cleanup_stale, quota, scaled_link_mbit
from benchmarks.testbed.linkcheck import gloo_rates, tcp_rates
from planc import __version__
from planc.commands import ui
from planc.calibrate import CalibrateError, cores_available, summary
from planc.commands.cli import EXIT_USER, run_command
from planc.driver.compile import compile_file


def _cpus_per_rank(value: str | None, ranks: int | None = None) -> tuple[float | str | None, str | None]:
    """``--cpus-per-rank`` as given (None, ``'auto'`` or a share of one core) and None, or None and why it
    is refused: not a share, or (``ranks`` given) quotas adding up to more than this machine's cores."""
    try:
        cpus = quota.cpus_option(value)
        if cpus is not None and ranks is not None:
            quota.share_for(cpus, ranks, cores_available())
    except quota.QuotaError as e:
        return None, str(e)
    return cpus, None


def _cmd_bench(args) -> int:
    if args.write:
        folder = Path(args.write).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            print(f"benchmarks bench: cannot write {args.write}: folder {folder} does not exist or is not writable",
                  file=sys.stderr)
            return EXIT_USER
    options = {}

    def parsed_rates():   # --rates as Mbit/s (None: not given); ValueError for a word that is no number
        return [float(x) for x in args.rates.split(",") if x.strip()] if args.rates else None

    for flag, value, takers in (("--rounds", args.rounds, ("iteration", "schedules")),
                                ("--measured", args.measured, ("iteration",))):
        if value is not None and args.what not in takers:
            print(f"benchmarks bench {args.what}: takes no {flag} (only {' and '.join(takers)} do"
                  f"{'es' if len(takers) == 1 else ''})", file=sys.stderr)
            return EXIT_USER
        if value is not None and value < 1:
            print(f"benchmarks bench {args.what}: {flag} {value}: must be at least 1", file=sys.stderr)
            return EXIT_USER
    cpus = None
    if args.cpus_per_rank is not None:
        if args.what not in ("iteration", "quota", "schedules"):
            print(f"benchmarks bench {args.what}: takes no --cpus-per-rank (only iteration, quota and schedules do)",
                  file=sys.stderr)
            return EXIT_USER
        cpus, bad = _cpus_per_rank(args.cpus_per_rank)
        if bad:
            print(f"benchmarks bench {args.what}: {bad}", file=sys.stderr)
            return EXIT_USER
        if args.what in ("quota", "schedules") and cpus == "auto":
            print(f"benchmarks bench {args.what}: --cpus-per-rank takes a share of one core here (its 4 ranks: at "
                  "most the cores ÷ 4)", file=sys.stderr)
            return EXIT_USER
        if args.what == "schedules":
            cpus, bad = _cpus_per_rank(args.cpus_per_rank, 4)
            if bad:
                print(f"benchmarks bench schedules: {bad}", file=sys.stderr)
                return EXIT_USER
    if args.from_json and args.what != "iteration":
        print(f"benchmarks bench {args.what}: takes no --from-json (only iteration does)", file=sys.stderr)
        return EXIT_USER
    clusters = args.cluster or []
    if len(clusters) > 1 and args.what != "accuracy":
        print(f"benchmarks bench {args.what}: --cluster given {len(clusters)} times; it takes one cluster file "
              "(only accuracy takes one per measured file)", file=sys.stderr)
        return EXIT_USER
    if args.what != "accuracy":
        args.cluster = clusters[0] if clusters else None
    if args.what == "iteration":
        try:
            rates = parsed_rates()
        except ValueError:
            print(f"benchmarks bench iteration: --rates {args.rates!r} is not a comma-separated list of Mbit/s",
                  file=sys.stderr)
            return EXIT_USER
        options = dict(plans=args.plans or None, json_path=args.json_path, chart=args.chart, rates=rates,
                       cluster=args.cluster, rounds=args.rounds, measured=args.measured, cpus_per_rank=cpus)
        if args.from_json:
            if (args.plans or args.rates or args.json_path or args.chart or args.rounds or args.measured or args.plot
                    or cpus is not None):
                print("benchmarks bench iteration: --from-json reports a stored run again: it takes only --cluster "
                      "and --write", file=sys.stderr)
                return EXIT_USER
            if not Path(args.from_json).is_file():
                print(f"benchmarks bench iteration: --from-json {args.from_json}: no such file", file=sys.stderr)
                return EXIT_USER
            options = dict(from_json=args.from_json, cluster=args.cluster)
    elif args.what == "accuracy":
        if not args.cluster or not args.plans:
            print("benchmarks bench accuracy: needs --cluster CALIBRATED.yaml and the measured JSON files "
                  "(bench iteration --json, bench testbed cases)", file=sys.stderr)
            return EXIT_USER
        if len(clusters) not in (1, len(args.plans)):
            print(f"benchmarks bench accuracy: --cluster given {len(clusters)} times for {len(args.plans)} measured "
                  "file(s): give it once (every file) or once per file, in the files' order", file=sys.stderr)
            return EXIT_USER
        options = dict(measured=args.plans, cluster=clusters if len(clusters) > 1 else clusters[0],
                       json_path=args.json_path)
    elif args.what == "nic":
        try:
            rates = parsed_rates()
        except ValueError:
            rates = [-1.0]
        if rates is not None and (not rates or any(not r > 0 for r in rates)):
            print(f"benchmarks bench nic: --rates {args.rates!r} is not a comma-separated list of positive Mbit/s",
                  file=sys.stderr)
            return EXIT_USER
        if not args.cluster:
            print("benchmarks bench nic: needs --cluster CALIBRATED.yaml (python -m benchmarks calibrate --on testbed): the compiler "
                  "decides the order on the calibrated figures", file=sys.stderr)
            return EXIT_USER
        if args.chart:
            print("benchmarks bench nic: takes no --chart", file=sys.stderr)
            return EXIT_USER
        options = dict(plans=args.plans or None, cluster=args.cluster, rates=rates, json_path=args.json_path)
    elif args.plans or args.rates or args.json_path or args.chart:
        print(f"benchmarks bench {args.what}: takes no PLAN, --rates, --json or --chart", file=sys.stderr)
        return EXIT_USER
    elif args.what == "quota":
        options = dict(cpus_per_rank=cpus)
    elif args.what == "schedules":   # --cluster: a calibration under the same quota (else it calibrates first)
        options = dict(cpus_per_rank=cpus, cluster=args.cluster, rounds=args.rounds)
    if args.cluster and args.what not in ("accuracy", "nic", "iteration", "schedules"):
        print(f"benchmarks bench {args.what}: takes no --cluster (only iteration, accuracy, nic and schedules do)",
              file=sys.stderr)
        return EXIT_USER
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg"):
        print(f"benchmarks bench: --plot {args.plot}: the picture must be a .png or .svg file", file=sys.stderr)
        return EXIT_USER
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("benchmarks bench: --plot needs matplotlib (pip install 'planc[plot]')", file=sys.stderr)
            return EXIT_USER
        if args.what == "iteration":
            options["chart"] = options.get("chart") or args.plot   # step time against link rate
    try:
        text = bench.run_bench(args.what, write=args.write, section=args.section, **options)
    except (AccuracyError, NicBenchError, ReportError) as e:
        print(e, file=sys.stderr)
        return EXIT_USER
    except quota.QuotaError as e:
        print(f"benchmarks bench {args.what}: {e}", file=sys.stderr)
        return EXIT_USER
    except CalibrateError as e:   # schedules: a cluster file of another quota, or its calibration failed
        print(e, file=sys.stderr)
        return EXIT_USER
    print(text)
    if args.plot and args.what != "iteration":
        n = bench_plot.plot_tables(text, args.plot, f"benchmarks bench {args.what}")
        print(f"plot: {args.plot} ({n} bars)", file=sys.stderr)
    if args.what == "fuzz":
        if bench_fuzz.LAST_FAILURES:
            print(f"benchmarks bench fuzz: {bench_fuzz.LAST_FAILURES} input(s) failed (listed above)", file=sys.stderr)
            return 1
    return 0


def _testbed_check(args) -> int:
    """benchmarks testbed check: plain TCP through two shaped hosts, the ceiling of the training figures."""
    why = available()
    if why:
        print(f"benchmarks testbed: {why}", file=sys.stderr)
        return EXIT_USER
    if args.target:
        print("benchmarks testbed check: takes no target (it measures the links of a 2-host testbed)", file=sys.stderr)
        return EXIT_USER
    mbit = 25.0 if args.link_mbit is None else args.link_mbit
    mbytes = max(1, round(mbit / 8))              # about 1 s per flow on its own
    with Testbed(2, mbit) as tb:
        rows = tcp_rates(tb, mbytes=mbytes)
        try:
            rows += gloo_rates(tb, messages=max(4, round(mbytes * 2)), mib=0.5)
        except RuntimeError as e:
            print(f"benchmarks testbed check: {e}", file=sys.stderr)
            return 1
    ui.emit([ui.table(
        ["traffic", ui.Col("flows", justify="right"), ui.Col("s", justify="right"),
         ui.Col("MB/s busiest direction", justify="right"), ui.Col("of the rate", justify="right")],
        [[r["pattern"], r["flows"], f"{r['seconds']:.2f}", f"{r['rate'] / 1e6:.3f}", f"{r['fraction']:.0%}"]
         for r in rows],
        title=f"2 hosts, links shaped to {mbit:g} Mbit/s ({mbit / 8:g} MB/s) each way; plain TCP: {mbytes} MiB per "
              f"flow; gloo: 2 ranks per host, 0.5 MiB messages, every receive posted first")])
    return 0


def _cmd_testbed(args) -> int:
    if args.action == "down":
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale testbed namespace(s) and CPU cgroup(s)"
              + (": " + " ".join(removed) if removed else ""))
        return 0
    if args.link_mbit is not None and not args.link_mbit > 0:
        print(f"benchmarks testbed: --link-mbit must be positive, not {args.link_mbit:g}", file=sys.stderr)
        return EXIT_USER
    if args.action == "check":
        return _testbed_check(args)
    if not args.target:
        print(f"benchmarks testbed {args.action}: needs {'a PLAN' if args.action == 'up' else 'a compiled output folder'}",
              file=sys.stderr)
        return EXIT_USER
    why = available()
    if why:
        print(f"benchmarks testbed: {why}", file=sys.stderr)
        return EXIT_USER
    if args.action == "up":
        plan = compile_file(Path(args.target)).plan_json   # probed: bundled plans leave transfer types to it
        hosts = len(plan["cluster"]["hosts"])
    else:
        path = Path(args.target) / "plan.json"
        try:
            plan = json.loads(path.read_text())
            hosts = len(plan["cluster"]["hosts"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"benchmarks testbed run: {args.target} is not a compiled output folder (its plan.json: "
                  f"{getattr(e, 'strerror', None) or e})", file=sys.stderr)
            return EXIT_USER
    problem = ("--loss must be a fraction of packets in [0, 1] (0.05 is 5%)" if not 0 <= args.loss <= 1 else
               "--trace needs --train (it records training steps)" if args.trace and not args.train else
               "--link-down-after must be >= 0 seconds" if (args.link_down_after or 0) < 0 else
               f"--link-down-host must be one of the plan's hosts 0..{hosts - 1}"
               if args.link_down_host is not None and not 0 <= args.link_down_host < hosts else None)
    if problem:
        print(f"benchmarks testbed: {problem}", file=sys.stderr)
        return EXIT_USER
    cpus, bad = _cpus_per_rank(args.cpus_per_rank, sum(len(h) for h in plan["cluster"]["hosts"]))   # before building
    if bad:
        print(f"benchmarks testbed: {bad}", file=sys.stderr)
        return EXIT_USER
    mbit = args.link_mbit or scaled_link_mbit(plan)
    with Testbed(hosts, mbit, loss=args.loss, cpus_per_rank=cpus) as tb:
        print(f"testbed: {hosts} host namespace(s) {' '.join(tb.namespaces)} on bridge {tb.bridge_ns}, "
              f"{tb.subnet}, host links {mbit:g} Mbit/s"
              + (f", dropping {args.loss * 100:g}% of each host link's packets" if args.loss else "")
              + (f", each rank under a CPU quota ({cpus} core)" if cpus is not None else ""), flush=True)
        if args.action == "up":
            print("run a command in host h: ip netns exec NAMESPACE ...; Ctrl-C removes everything", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        timers = []   # --link-down-after: counted from rank 0's first step line

        def on_step(n, seconds):
            if args.link_down_after is not None and not timers:
                down = hosts - 1 if args.link_down_host is None else args.link_down_host
                timers.append(threading.Timer(args.link_down_after, tb.link_down, args=(down,)))
                timers[0].daemon = True
                timers[0].start()
        try:
            r = tb.launch(args.target, steps=args.steps, timeout=args.timeout, comm_only=not args.train,
                          on_step=on_step if args.link_down_after is not None else None,
                          extra_args=("--trace", str(Path(args.trace).resolve())) if args.trace else ())
        except KeyboardInterrupt:
            print("benchmarks testbed: interrupted; the testbed's processes and namespaces are removed", file=sys.stderr)
            return 130
        finally:
            for t in timers:
                t.cancel()
        print(r.stdout, end="")
        if r.dropped_packets:
            print(f"testbed: the loss fault dropped {sum(r.dropped_packets.values())} packet(s) "
                  f"({', '.join(f'into host {h}: {n}' for h, n in sorted(r.dropped_packets.items()))})")
        if r.returncode:
            bad = next((k for k, v in sorted(r.logs.items()) if k and v.strip() and "Error" in v), None)
            if r.failure:
                print(r.failure, file=sys.stderr)
            elif bad is not None:
                print(f"--- rank {bad} ---\n{r.logs[bad][-3000:]}", file=sys.stderr)
            print(f"benchmarks testbed: launch {'timed out' if r.timed_out else f'failed ({r.returncode})'}",
                  file=sys.stderr)
        return r.returncode


def _cmd_calibrate(args) -> int:
    try:
        rates = [float(x) for x in args.rate.split(",") if x.strip()] if args.rate else None
    except ValueError:
        print(f"benchmarks calibrate: --rate {args.rate!r} is not a comma-separated list of Mbit/s", file=sys.stderr)
        return EXIT_USER
    cpus, bad = _cpus_per_rank(args.cpus_per_rank)
    if bad:
        print(f"benchmarks calibrate: {bad}", file=sys.stderr)
        return EXIT_USER
    try:
        doc = calibrate_testbed(args.out, hosts=2 if args.hosts is None else args.hosts,
                                per_host=2 if args.ranks_per_host is None else args.ranks_per_host, rates=rates,
                                repeats=args.repeats, timeout=args.timeout,
                                command=f"python -m benchmarks calibrate --on testbed {args.out}"
                                + "".join(f" --{k.replace('_', '-')} {v}" for k, v in (
                                    ("rate", args.rate), ("hosts", args.hosts),
                                    ("ranks_per_host", args.ranks_per_host), ("cpus_per_rank", args.cpus_per_rank))
                                    if v is not None), cpus_per_rank=cpus)
    except CalibrateError as e:
        print(e, file=sys.stderr)
        return e.code
    rec = doc["calibration"]
    print(f"wrote {args.out}:\n{summary(doc)}" + (f"\n  ranks: each under a CPU quota of {rec['cpus_per_rank']:g} core "
                                                  f"({rec['cpu_quota']})" if "cpus_per_rank" in rec else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="planc's lab: benchmarks, the emulated testbed, testbed calibration.")
    p.add_argument("--version", action="version", version=f"planc {__version__} (benchmarks)")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for internal errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("bench", help="run a benchmark and print its table")
    c.add_argument("what", choices=list(BENCHES))
    c.add_argument("plans", nargs="*", metavar="PLAN",
                   help="iteration: plans to measure (default: plans/gpt-bench-2x2.plan plans/unet-skip.plan)")
    c.add_argument("--rates", default=None,
                   help="iteration: host link rates, Mbit/s, comma-separated (default 10,25,100,10000; 10000 ≈ unshaped)")
    c.add_argument("--json", dest="json_path", metavar="FILE", help="iteration: also write every measurement as JSON")
    c.add_argument("--chart", metavar="FILE", help="iteration: step time against link rate (needs matplotlib)")
    c.add_argument("--cluster", metavar="YAML", action="append",
                   help="iteration, accuracy, nic: the cluster file `planc calibrate` wrote (accuracy's PLAN "
                        "arguments: the measured JSON files; give --cluster once for all of them or once per "
                        "file, in order, e.g. the 2 x 4 calibration for the testbed cases); schedules: one "
                        "calibrated under the bench's quota (default: it calibrates first)")
    c.add_argument("--from-json", metavar="FILE",
                   help="iteration: report a stored run (--json) again, with today's bounds; launches nothing")
    c.add_argument("--rounds", type=int, default=None, metavar="K",
                   help="iteration, schedules: launch every program K times, round-robin, and pool their steps "
                        "(default 1; schedules 3)")
    c.add_argument("--measured", type=int, default=None, metavar="N",
                   help="iteration: measured steps per rate and launch, after one discarded (default 5)")
    c.add_argument("--cpus-per-rank", default=None, metavar="CORES|auto",
                   help="iteration: run every rank in its own CPU cgroup with this share of one core (docs/testbed.md, "
                        "\"Devices of fixed speed\"; auto: the cores split over the plan's ranks; default no quota); "
                        "quota: the one share to compare with no quota (default 0.5 and 0.25); schedules: every "
                        "rank's share (default 0.4)")
    c.add_argument("--write", metavar="FILE", help="also write the table into FILE (e.g. docs/benchmarks.md)")
    c.add_argument("--section", metavar="NAME", help="--write between the markers of NAME, not the bench's own "
                                                     "(a second run of one bench, e.g. iteration-bf16)")
    c.add_argument("--plot", metavar="FILE", help="draw the table (.png or .svg): ratios against the bound or the "
                                                  "baseline as bars; iteration: step time against link rate")
    c.set_defaults(func=_cmd_bench)

    c = sub.add_parser("calibrate", help="planc calibrate on the emulated testbed: measure links and device "
                                         "throughput, write a cluster YAML (docs/calibrate.md)")
    c.add_argument("--on", default="testbed", choices=["testbed"],
                   help="testbed: emulated hosts (root, docs/testbed.md); a real cluster is `planc calibrate --on "
                        "cluster`")
    c.add_argument("out", metavar="OUT.yaml", help="the cluster file to write (plans load it: cluster \"OUT.yaml\")")
    c.add_argument("--rate", default=None, metavar="MBIT[,MBIT...]",
                   help=f"host link rates to measure at, Mbit/s (default {DEFAULT_RATE:g}; the first one's figures "
                        "are the file's levels)")
    c.add_argument("--hosts", type=int, default=None, help="emulated hosts (default 2)")
    c.add_argument("--ranks-per-host", type=int, default=None, help="ranks per host (default 2)")
    c.add_argument("--repeats", type=int, default=3, help="timed repeats per message size (median)")
    c.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is killed")
    c.add_argument("--cpus-per-rank", default=None, metavar="CORES|auto",
                   help="run every rank in its own CPU cgroup with this share of one core (docs/testbed.md, "
                        "\"Devices of fixed speed\"; auto: the cores split over the ranks); default: no quota")
    c.set_defaults(func=_cmd_calibrate)

    c = sub.add_parser("testbed", help="emulated cluster: network namespaces + tc shaping (root; docs/testbed.md)")
    c.add_argument("action", choices=["up", "run", "down", "check"],
                   help="up PLAN: build and hold until Ctrl-C; run OUT: launch a compiled output's ranks "
                        "(--comm-only) inside; down: remove namespaces left by dead testbeds; check: what the "
                        "shaped links give plain TCP one way and both ways (--link-mbit, default 25)")
    c.add_argument("target", nargs="?", help="PLAN (up) or compiled output folder (run)")
    c.add_argument("--link-mbit", type=float, default=None,
                   help="host link rate (default: the plan's host/in-host bandwidth ratio scaled to 3 GB/s)")
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is killed")
    c.add_argument("--train", action="store_true", help="run: train (OUT/train.py) instead of --comm-only")
    c.add_argument("--loss", type=float, default=0.0, metavar="FRACTION",
                   help="drop this fraction of every host link's packets, each direction (0.05 = 5%%)")
    c.add_argument("--link-down-after", type=float, default=None, metavar="SECONDS",
                   help="run: take a host's link down this long after rank 0's first step")
    c.add_argument("--link-down-host", type=int, default=None, metavar="H",
                   help="the host whose link --link-down-after takes down (default: the last)")
    c.add_argument("--cpus-per-rank", default=None, metavar="CORES|auto",
                   help="run: every rank in its own CPU cgroup with this share of one core (docs/testbed.md)")
    c.add_argument("--trace", metavar="DIR", default=None,
                   help="run --train: every rank records its timeline into DIR (train.py --trace; `planc trace DIR`)")
    c.set_defaults(func=_cmd_testbed)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, "benchmarks")


if __name__ == "__main__":
    raise SystemExit(main())
