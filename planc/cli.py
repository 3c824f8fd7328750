"""planc command line: compile | check | explain | bench | testbed.

User errors (PlanError) print as file:line:col with the source line and a caret
run, and exit 2. Anything else is a bug in planc: one line and exit 3, the
traceback only with --debug.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from planc import __version__
from planc.lang.errors import PlanError

EXIT_USER = 2
EXIT_BUG = 3


def _cmd_check(args) -> int:
    from planc.lang import load
    from planc.lang.format import summary, to_json

    errors: list[PlanError] = []
    for f in args.files:
        try:
            program = load(f)
        except PlanError as e:
            errors.append(e)
            continue
        print(to_json(program) if args.json else summary(program))
    for e in errors:
        print(e.render(), file=sys.stderr)
    if errors:
        n = sum(len(e.diagnostics) for e in errors)
        print(f"{n} error{'s' if n != 1 else ''} in {len(errors)} file{'s' if len(errors) != 1 else ''}", file=sys.stderr)
        return EXIT_USER
    return 0


def _cmd_compile(args) -> int:
    from planc.compile import compile_file
    from planc.codegen import write_output

    src = Path(args.plan)
    compiled = compile_file(src, probe=not args.no_probe, verify=True if args.verify else None)
    out = Path(args.output) if args.output else Path("build") / compiled.program.name
    write_output(compiled.plan_json, compiled.program, out)
    print(f"wrote {out}/ ({compiled.describe()})")
    if compiled.untrainable:
        print(PlanError(list(compiled.untrainable), {str(src): src.read_text()}).render(), file=sys.stderr)
        print(f"planc: this plan cannot train yet; {out}/ runs its communication only: "
              f"bash {out}/launch.sh --comm-only", file=sys.stderr)
        return EXIT_USER
    print(f"launch: bash {out}/launch.sh    (or: deepspeed {out}/train.py, see {out}/README.md)")
    return 0


def _cmd_explain(args) -> int:
    from planc.compile import compile_file
    from planc.explain import explain

    compiled = compile_file(Path(args.plan), probe=not args.no_probe)
    print(explain(compiled.plan_json))
    return 0


def _cmd_bench(args) -> int:
    import os

    from planc.bench import run_bench

    if args.write:
        folder = Path(args.write).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            print(f"planc bench: cannot write {args.write}: folder {folder} does not exist or is not writable",
                  file=sys.stderr)
            return EXIT_USER
    options = {}
    if args.what == "iteration":
        try:
            rates = [float(x) for x in args.rates.split(",") if x.strip()] if args.rates else None
        except ValueError:
            print(f"planc bench iteration: --rates {args.rates!r} is not a comma-separated list of Mbit/s",
                  file=sys.stderr)
            return EXIT_USER
        options = dict(plans=args.plans or None, json_path=args.json_path, chart=args.chart, rates=rates)
    elif args.plans or args.rates or args.json_path or args.chart:
        print(f"planc bench {args.what}: takes no PLAN, --rates, --json or --chart", file=sys.stderr)
        return EXIT_USER
    text = run_bench(args.what, write=args.write, **options)
    print(text)
    return 0


def _cmd_testbed(args) -> int:
    import json
    import signal

    from planc.testbed import Testbed, available, cleanup_stale, scaled_link_mbit

    if args.action == "down":
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale testbed namespace(s)" + (": " + " ".join(removed) if removed else ""))
        return 0
    if not args.target:
        print(f"planc testbed {args.action}: needs {'a PLAN' if args.action == 'up' else 'a compiled output folder'}",
              file=sys.stderr)
        return EXIT_USER
    why = available()
    if why:
        print(f"planc testbed: {why}", file=sys.stderr)
        return EXIT_USER
    if args.action == "up":
        from planc.compile import compile_file

        plan = compile_file(Path(args.target), probe=False).plan_json
        hosts = len(plan["cluster"]["hosts"])
    else:
        path = Path(args.target) / "plan.json"
        try:
            plan = json.loads(path.read_text())
            hosts = len(plan["cluster"]["hosts"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"planc testbed run: {args.target} is not a compiled output folder (its plan.json: "
                  f"{getattr(e, 'strerror', None) or e})", file=sys.stderr)
            return EXIT_USER
    mbit = args.link_mbit or scaled_link_mbit(plan)
    with Testbed(hosts, mbit) as tb:
        print(f"testbed: {hosts} host namespace(s) {' '.join(tb.namespaces)} on bridge {tb.bridge_ns}, "
              f"{tb.subnet}, host links {mbit:g} Mbit/s")
        if args.action == "up":
            print("run a command in host h: ip netns exec NAMESPACE ...; Ctrl-C removes everything", flush=True)
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass
            return 0
        r = tb.launch(args.target, steps=args.steps, timeout=args.timeout)
        print(r.stdout, end="")
        if r.returncode:
            bad = next((k for k, v in sorted(r.logs.items()) if k and v.strip() and "Error" in v), None)
            if bad is not None:
                print(f"--- rank {bad} ---\n{r.logs[bad][-3000:]}", file=sys.stderr)
            print(f"planc testbed: launch {'timed out' if r.timed_out else f'failed ({r.returncode})'}",
                  file=sys.stderr)
        return r.returncode


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="planc", description="Compile distributed training plans (.plan) into launchable DeepSpeed programs.")
    p.add_argument("--version", action="version", version=f"planc {__version__}")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for internal errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="parse and check plans, print a summary")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--json", action="store_true", help="print the checked IR as JSON")
    c.set_defaults(func=_cmd_check)

    c = sub.add_parser("compile", help="compile a plan into a launchable output folder")
    c.add_argument("plan")
    c.add_argument("-o", "--output", help="output folder (default build/<plan name>/)")
    c.add_argument("--no-probe", action="store_true",
                   help="do not run the model in a subprocess to size gradients and check transfer shapes")
    c.add_argument("--verify", action="store_true",
                   help="check every pass's output with an independent checker and name the pass that failed")
    c.set_defaults(func=_cmd_compile)

    c = sub.add_parser("explain", help="show the placement, reduction programs and transfers planc chose, and why")
    c.add_argument("plan")
    c.add_argument("--no-probe", action="store_true")
    c.set_defaults(func=_cmd_explain)

    c = sub.add_parser("bench", help="run a benchmark and print its table")
    from planc.bench import BENCHES
    c.add_argument("what", choices=list(BENCHES))
    c.add_argument("plans", nargs="*", metavar="PLAN",
                   help="iteration: plans to measure (default: plans/gpt-bench-2x2.plan plans/unet-skip.plan)")
    c.add_argument("--rates", default=None,
                   help="iteration: host link rates, Mbit/s, comma-separated (default 10,25,100,10000; 10000 ≈ unshaped)")
    c.add_argument("--json", dest="json_path", metavar="FILE", help="iteration: also write every measurement as JSON")
    c.add_argument("--chart", metavar="FILE", help="iteration: step time against link rate (needs matplotlib)")
    c.add_argument("--write", metavar="FILE", help="also write the table into FILE (e.g. docs/benchmarks.md)")
    c.set_defaults(func=_cmd_bench)

    c = sub.add_parser("testbed", help="emulated cluster: network namespaces + tc shaping (root; docs/testbed.md)")
    c.add_argument("action", choices=["up", "run", "down"],
                   help="up PLAN: build and hold until Ctrl-C; run OUT: launch a compiled output's ranks "
                        "(--comm-only) inside; down: remove namespaces left by dead testbeds")
    c.add_argument("target", nargs="?", help="PLAN (up) or compiled output folder (run)")
    c.add_argument("--link-mbit", type=float, default=None,
                   help="host link rate (default: the plan's host/in-host bandwidth ratio scaled to 3 GB/s)")
    c.add_argument("--steps", type=int, default=3)
    c.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is killed")
    c.set_defaults(func=_cmd_testbed)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except PlanError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in planc, not the user's fault
        if args.debug:
            traceback.print_exc()
        print(f"planc: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_BUG


if __name__ == "__main__":
    raise SystemExit(main())
