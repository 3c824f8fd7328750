"""planc command line: compile | check | explain | simulate | trace | calibrate | checkpoint.

The lab (benches, the emulated testbed, its calibration) is outside the product: ``python -m benchmarks``.

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
from planc.diagnostics import PlanError

EXIT_USER = 2
EXIT_BUG = 3


def _cmd_check(args) -> int:
    from planc.commands import ui
    from planc.commands.explain import check_summary
    from planc.lang import load
    from planc.lang.format import summary, to_json

    from planc.commands.summaries import plan_idle_warning

    errors: list[PlanError] = []
    warnings: list[str] = []
    shown = 0
    for f in args.files:
        try:
            program = load(f)
            if not args.no_probe:   # all that compile runs but the writing (planc.commands.checkcmd)
                from planc.commands.checkcmd import check_compiles
                compiled = check_compiles(f, cache=not args.no_cache)
                if compiled.untrainable:
                    errors.append(PlanError(list(compiled.untrainable), {str(f): Path(f).read_text()}))
                    continue
                warnings += [f"{f}: {w}" for w in plan_idle_warning(compiled.plan)]
        except PlanError as e:
            errors.append(e)
            continue
        if args.json:
            print(to_json(program))
        else:
            ui.emit(([""] if shown else []) + check_summary(summary(program), tty=ui.is_tty()))
        shown += 1
    for w in warnings:
        print(w, file=sys.stderr)
    for e in errors:
        print(e.render(), file=sys.stderr)
    if errors:
        n = sum(len(e.diagnostics) for e in errors)
        print(f"{n} error{'s' if n != 1 else ''} in {len(errors)} file{'s' if len(errors) != 1 else ''}", file=sys.stderr)
        return EXIT_USER
    return 0


def _cmd_compile(args) -> int:
    from planc.driver.compile import compile_file
    from planc.output.codegen import write_output
    from planc.commands import ui

    import contextlib
    from planc.commands.profile import Profile

    src = Path(args.plan)
    profile = Profile() if args.profile else None
    with ui.status(f"planc compile {src.name}") as progress:   # a spinner on a terminal only
        compiled = compile_file(src, probe=not args.no_probe, verify=not args.no_verify,
                                progress=progress, cache=not args.no_cache, profile=profile)
    out = Path(args.output) if args.output else Path("build") / compiled.program.name
    with profile.section("write output") if profile else contextlib.nullcontext():
        write_output(compiled.plan, compiled.program, out, text=compiled.text)
    from planc.commands.explain import compile_summary

    print(f"wrote {out}/ ({compiled.describe()})", flush=True)
    ui.emit(compile_summary(compiled.plan, tty=ui.is_tty()))
    from planc.commands.summaries import plan_idle_warning
    for w in plan_idle_warning(compiled.plan):
        print(f"{src}: {w}", file=sys.stderr)
    if profile is not None:
        ui.emit(["", profile.table()])
    if compiled.untrainable:
        print(PlanError(list(compiled.untrainable), {str(src): src.read_text()}).render(), file=sys.stderr)
        print(f"planc: this plan cannot train yet; {out}/ runs its communication only: "
              f"bash {out}/launch.sh --comm-only", file=sys.stderr)
        return EXIT_USER
    print(f"launch: bash {out}/launch.sh    (or: deepspeed {out}/train.py, see {out}/README.md)")
    return 0


def _cmd_explain(args) -> int:
    import json

    from planc.commands import ui
    from planc.driver.compile import compile_file
    from planc.commands.explain import explain_data, explain_renderables

    if args.draw:                      # fail before compiling: a wrong suffix or no matplotlib
        from planc.commands.draw import DrawError, check_drawable
        try:
            check_drawable(args.draw)
        except DrawError as e:
            return _fail(f"planc explain --draw: {e}")
    with ui.status(f"planc explain {Path(args.plan).name}") as progress:   # a spinner on a terminal only
        compiled = compile_file(Path(args.plan), probe=not args.no_probe, progress=progress,
                                cache=not args.no_cache)
    plan = compiled.plan   # the typed plan file (planc.plan.Plan) the compiler wrote
    if args.schedule_csv:
        from planc.commands.schedule_csv import ScheduleCsvError, schedule_csv
        try:
            text = schedule_csv(plan)
        except ScheduleCsvError as e:
            return _fail(f"planc explain --schedule-csv: {args.plan}: {e}")
        Path(args.schedule_csv).write_text(text, newline="")
        print(f"wrote {args.schedule_csv} ({text.count(chr(10))} pipeline ranks; torch: "
              "PipelineScheduleMulti._load_csv)", file=sys.stderr)
    if args.as_:
        from planc.commands.explain_as import ExplainAsError, explain_as_data, explain_as_renderables
        try:
            data = explain_as_data(plan, args.as_)
        except ExplainAsError as e:
            return _fail(f"planc explain: {e}")
        render = explain_as_renderables
    else:
        data = explain_data(plan)
        render = explain_renderables
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        ui.emit(render(data, tty=ui.is_tty()))
    if args.draw:
        from planc.commands.draw import draw
        n = draw(plan, args.draw)
        print(f"wrote {args.draw} ({n} devices)", file=sys.stderr if args.json else sys.stdout)
    return 0


def _overhead_line(sim) -> str:
    """Whether the figures count the runtime's own time (the cluster file's op_overhead, step_overhead)."""
    if sim.op_overhead or sim.step_overhead:
        return (f"runtime overhead included: {sim.op_overhead * 1e3:.3g} ms per instruction, "
                f"{sim.step_overhead * 1e3:.3g} ms per step (the cluster's op_overhead, step_overhead)")
    return ("runtime overhead excluded: the cluster gives no op_overhead or step_overhead, so these times are the "
            "layers' FLOPs and the communication only; the runtime's own time per instruction and per step is "
            "not modelled, and a small model's real step is many times longer (docs/calibrate.md, \"The runtime's "
            "own time\")")


SIMULATED = ("gpipe", "1f1b", "eager_1f1b", "zb_h1")   # the schedules of one stage per mesh


def _fail(message: str) -> int:
    print(message, file=sys.stderr)
    return EXIT_USER


def _cmd_simulate(args) -> int:
    import json

    from planc.pipeline.gantt import draw, plan_input, table
    from planc.pipeline.schedules import build
    from planc.pipeline.simulate import predict
    from planc.plan import stages_per_class

    src = Path(args.plan)
    if args.output and Path(args.output).suffix.lower() not in (".png", ".svg"):
        return _fail(f"planc simulate: -o {args.output}: the timeline is written as .png or .svg")
    if src.is_dir() or src.suffix == ".json":   # a compiled output folder, or its plan.json
        path = src / "plan.json" if src.is_dir() else src
        try:
            plan = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            return _fail(f"planc simulate: cannot read {path}: {getattr(e, 'strerror', None) or e}")
    else:
        from planc.driver.compile import compile_file
        plan = compile_file(src).plan_json
    if plan.get("pipeline") is None:
        return _fail(f"planc simulate: {src} is not a training plan (it has no pipeline to simulate)")
    try:
        sim = plan_input(plan)
    except ValueError as e:
        return _fail(f"planc simulate: {src}: {e}")
    pipe = plan["pipeline"]
    if pipe.get("predicted") is not None and not pipe["predicted"].get("flops_given"):   # rows of bubble only
        return _fail(f"planc simulate: {src}: the cluster gives no device throughput, so no stage's compute can "
                     "be predicted (every schedule would be all bubble); add 'flops = 312 TFLOP/s' (your devices' "
                     "rate) to the plan's cluster block, or measure it: planc calibrate --on cluster OUT.yaml, then "
                     "cluster \"OUT.yaml\" (docs/calibrate.md), and compile again")
    shown = args.schedule or pipe["schedule"]
    virtual = pipe.get("virtual", 1)   # several stages per mesh: only the plan's own schedule can run them
    runs = (pipe["schedule"],) if stages_per_class(pipe["schedule"], virtual) > 1 else SIMULATED
    if shown not in runs:
        return _fail(f"planc simulate: {src}: the plan's stages run {' or '.join(runs)}, not {shown}")
    rows, chart = [], None
    for name in runs:
        lists = build(name, len(plan["stages"]), pipe["micro_batches"], sim.transfers, check=False,
                      virtual=virtual).actions
        p = predict(sim, lists, timeline=name == shown)
        rows.append((name, p))
        chart = p if name == shown else chart
    rate = pipe["predicted"]["flops"]
    given = "" if pipe["predicted"].get("flops_given") else " (the default: the cluster gives no flops)"
    lines = [f"{plan['name']}: {len(plan['stages'])} stages, {pipe['micro_batches']} micro-batches, "
             f"device throughput {rate / 1e12:g} TFLOP/s{given}", table(rows, chosen=pipe["schedule"])]
    lines.append(_overhead_line(sim))
    for f in chart.stages:
        lines.append(f"  {shown} stage {f.stage}: busy {f.busy:.1%}, bubble {f.bubble:.1%}, exposed "
                     f"communication {f.exposed_communication * 1e6:.4g} us, peak activations "
                     f"{f.peak_activation_bytes:.0f} B ({f.peak_in_flight} micro-batch(es) in flight)")
    try:
        from planc.commands import ui
        ui.emit(lines)
    except ImportError:
        print("\n".join(map(str, lines)))
    if args.output:
        try:
            info = draw(chart, sim, args.output, title=f"{plan['name']} ({shown})")
        except ValueError as e:
            return _fail(f"planc simulate: {e}")
        except ImportError:
            return _fail("planc simulate: -o needs matplotlib (pip install 'planc[plot]')")
        print(f"wrote {args.output} ({shown}: {info['compute_bars']} compute bars, {info['traffic_bars']} "
              f"host-link flows, {info['transfer_marks']} transfer arrivals)")
    return 0


def _trace_predicted(path: str) -> tuple[float | None, dict[int, float]]:
    """(predicted iteration, {stage: predicted busy fraction}) from a compiled output or its plan.json."""
    import json
    p = Path(path)
    p = p / "plan.json" if p.is_dir() else p
    pipe = json.loads(p.read_text()).get("pipeline") or {}
    stages = ((pipe.get("predicted") or {}).get("stages")) or []
    return pipe.get("predicted_iteration"), {int(st["stage"]): float(st["busy"]) for st in stages}


def _trace_read(directory: str, read):
    """``read()`` of a trace folder; an unreadable folder or file, or a bad option, is printed as
    ``planc trace: ...`` and gives None (the caller exits 2)."""
    try:
        return read()
    except OSError as e:
        print(f"planc trace: {directory}: {e.strerror or e}", file=sys.stderr)
    except ValueError as e:
        print(f"planc trace: {e}", file=sys.stderr)
    return None


def _cmd_trace(args) -> int:
    import json
    from planc.commands import ui
    from planc.runtime.trace import summarise

    if args.stalls is not None:
        if args.plan:
            print("planc trace: --stalls and --plan do not combine (the prediction is of a mean step; "
                  "--stalls lists single slow steps): give one", file=sys.stderr)
            return EXIT_USER
        return _trace_stalls(args)
    rows = _trace_read(args.directory, lambda: summarise(args.directory, skip_steps=args.skip))
    if rows is None:
        return EXIT_USER
    if not rows:
        print(f"planc trace: {args.directory}: the traces hold no training step", file=sys.stderr)
        return EXIT_USER
    iteration, busy = None, {}
    if args.plan:
        try:
            iteration, busy = _trace_predicted(args.plan)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"planc trace: --plan {args.plan}: not a compiled output or plan.json "
                  f"({getattr(e, 'strerror', None) or e})", file=sys.stderr)
            return EXIT_USER
        for r in rows:
            r["predicted_step_s"] = iteration
            r["predicted_compute"] = busy.get(r["stage"]) if r["stage"] is not None else None
    if args.json:
        print(json.dumps(rows, indent=1, sort_keys=True))
        return 0
    pct = lambda x: "—" if x is None else f"{100 * x:.0f}%"   # noqa: E731
    cols = ["rank", "stage", "steps", ui.Col("s/step", justify="right"), ui.Col("compute", justify="right"),
            ui.Col("recv wait", justify="right"), ui.Col("send", justify="right"),
            ui.Col("reduce", justify="right"), ui.Col("other", justify="right")]
    table_rows = [[r["rank"], "idle" if r["stage"] is None else r["stage"], r["steps"], f"{r['step_s']:.4f}",
                   pct(r["compute"]), pct(r["wait"]), pct(r["send"]), pct(r["reduce"]), pct(r["other"])]
                  for r in rows]
    title = (f"{args.directory}: the compute thread's time per step (first {args.skip} step(s) left out; "
             "recv wait: for data the receive thread had not finished; reduce: the tail after the last backward)")
    out = [ui.table(cols, table_rows, title=title)]
    if args.plan:
        out += ["", f"predicted by plan.json (`planc simulate`, for the cluster it was compiled with): "
                    f"{'no prediction' if iteration is None else f'{iteration:.4f} s per step'}"
                    + ("; compute busy per stage: " + ", ".join(f"stage {k} {pct(v)}" for k, v in sorted(busy.items()))
                       if busy else "")]
    ui.emit(out)
    return 0


def _trace_stalls(args) -> int:
    """planc trace DIR --stalls [F]: the steps slower than F x the median, and what held them up."""
    import json
    from planc.commands import ui
    from planc.runtime.trace import stalls

    found = _trace_read(args.directory, lambda: stalls(args.directory, skip_steps=args.skip, factor=args.stalls))
    if found is None:
        return EXIT_USER
    if not found["steps"]:
        print(f"planc trace: {args.directory}: the traces hold no training step after the first {args.skip}",
              file=sys.stderr)
        return EXIT_USER
    if args.json:
        print(json.dumps(found, indent=1, sort_keys=True))
        return 0
    median, f = found["median_step_s"], found["factor"]
    head = (f"{args.directory}: {len(found['slow'])} of {found['steps']} step(s) took more than {f:g} x the "
            f"median {median:.4f} s (first {args.skip} step(s) left out)")
    if not found["slow"]:
        ui.emit([head])
        return 0
    out = [head + "; what held each up (the longest compute-thread instructions of any rank that were not "
                  "its own computation):"]
    for s in found["slow"]:
        out.append(f"step {s['step']}: {s['step_s']:.4f} s ({s['step_s'] / median:.2f} x the median)")
        for h in s["holdups"]:
            stage = "idle" if h["stage"] is None else f"stage {h['stage']}"
            what = " ".join(str(x) for x in (h["instruction"], None if h["micro_batch"] is None else
                                             f"m{h['micro_batch']}", h["transfer"]) if x is not None)
            out.append(f"  rank {h['rank']} ({stage}) {what}: {1000 * h['dur_s']:.0f} ms, "
                       f"from {1000 * h['at_s']:.0f} ms into the step")
    ui.emit(out)
    return 0


def _cmd_calibrate(args) -> int:
    from planc.calibrate import CalibrateError, calibrate, summary

    try:
        doc = calibrate(args.out, ranks=args.ranks, backend=args.backend, repeats=args.repeats, timeout=args.timeout,
                        command=f"planc calibrate --on {args.on} {args.out}")
    except CalibrateError as e:
        print(e, file=sys.stderr)
        return e.code
    print(f"wrote {args.out}:\n{summary(doc)}")
    return 0


def _cmd_checkpoint(args) -> int:
    from planc.checkpoint.command import run
    return run(args)


def _budget_argument(c: argparse.ArgumentParser) -> None:
    """--budget NAME=N,...: raise (or lower) the compiler's resource bounds (planc.budget, docs/limits.md)."""
    from planc import budget

    def parse(text: str):
        try:
            return budget.parse(text)
        except budget.BudgetSyntaxError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    c.add_argument("--budget", type=parse, default=None, metavar="NAME=N,...",
                   help="resource bounds, e.g. devices=20000,tasks=100000 (bounds and defaults: docs/limits.md)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="planc", description="Compile distributed training plans (.plan) into launchable DeepSpeed programs.")
    p.add_argument("--version", action="version", version=f"planc {__version__}")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for internal errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("check", help="check plans as compile does (the model probe included), print a summary")
    c.add_argument("files", nargs="+", metavar="FILE")
    c.add_argument("--json", action="store_true", help="print the checked IR as JSON")
    c.add_argument("--no-probe", action="store_true",
                   help="check the plan text only: do not build the model, run the user's code or compile")
    c.add_argument("--no-cache", action="store_true",
                   help="probe the model even when ~/.cache/planc/probe/ holds its answer (docs/limits.md)")
    _budget_argument(c)
    c.set_defaults(func=_cmd_check)

    c = sub.add_parser("compile", help="compile a plan into a launchable output folder")
    c.add_argument("plan")
    c.add_argument("-o", "--output", help="output folder (default build/<plan name>/)")
    c.add_argument("--no-probe", action="store_true",
                   help="do not run the model in a subprocess to size gradients and check transfer shapes")
    c.add_argument("--no-verify", action="store_true",
                   help="skip checking every pass's output with an independent checker (on by default: it names "
                        "the pass whose output failed)")
    c.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)   # the default now; kept for old scripts
    c.add_argument("--no-cache", action="store_true",
                   help="probe the model even when ~/.cache/planc/probe/ holds its answer (docs/limits.md)")
    c.add_argument("--profile", action="store_true",
                   help="after compiling, print each pass's seconds and peak memory")
    _budget_argument(c)
    c.set_defaults(func=_cmd_compile)

    c = sub.add_parser("explain", help="show the placement, reduction programs and transfers planc chose, and why")
    c.add_argument("plan")
    c.add_argument("--no-probe", action="store_true")
    c.add_argument("--no-cache", action="store_true", help="probe the model even when its answer is cached")
    _budget_argument(c)
    c.add_argument("--json", action="store_true", help="print the same content as JSON (seconds, bytes)")
    c.add_argument("--as", dest="as_", choices=["megatron", "deepspeed", "torch"],
                   help="the chosen placement as a Megatron order, a DeepSpeed ProcessTopology or a torch DeviceMesh")
    c.add_argument("--draw", metavar="FILE", help="draw the cluster tree with each stage's mesh (.png or .svg; matplotlib)")
    c.add_argument("--schedule-csv", metavar="FILE",
                   help="write the schedule as torch pipelining's compute-only CSV (a uniform plan: equal stage "
                        "meshes, stage i feeding stage i + 1)")
    c.set_defaults(func=_cmd_explain)

    c = sub.add_parser("simulate", help="predict one iteration of every schedule; draw the plan's as a Gantt chart")
    c.add_argument("plan", help="a .plan file, a compiled output folder or its plan.json")
    c.add_argument("-o", "--output", metavar="TIMELINE", help="write the Gantt chart (.png or .svg)")
    c.add_argument("--schedule", choices=[*SIMULATED, "interleaved_1f1b", "zbv"],
                   help="the schedule to draw (default: the plan's)")
    c.set_defaults(func=_cmd_simulate)

    c = sub.add_parser("trace", help="summarise the timelines `train.py --trace DIR` recorded (docs/runtime.md)")
    c.add_argument("directory", help="the folder given to train.py --trace")
    c.add_argument("--skip", type=int, default=1, metavar="N", help="leave out the first N steps (default 1: warm-up)")
    c.add_argument("--json", action="store_true", help="print the per-rank figures (or the stalls) as JSON")
    c.add_argument("--stalls", type=float, nargs="?", const=1.25, default=None, metavar="F",
                   help="list the steps slower than F x the median step (default 1.25) and the compute-thread "
                        "waits that held each up")
    c.add_argument("--plan", metavar="OUT", help="a compiled output (or its plan.json): show its predicted "
                                                 "iteration and stage busy fractions beside the measured ones")
    c.set_defaults(func=_cmd_trace)

    c = sub.add_parser("calibrate", help="measure links and device throughput; write a cluster YAML (docs/calibrate.md)")
    c.add_argument("--on", required=True, choices=["cluster"],
                   help="cluster: ranks spawned on this machine (the emulated testbed's calibration is the lab's: "
                        "python -m benchmarks calibrate --on testbed)")
    c.add_argument("out", metavar="OUT.yaml", help="the cluster file to write (plans load it: cluster \"OUT.yaml\")")
    c.add_argument("--ranks", type=int, default=2, help="ranks on this machine (default 2)")
    c.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="auto = NCCL when there is a GPU per rank, else gloo")
    c.add_argument("--repeats", type=int, default=3, help="timed repeats per message size (median)")
    c.add_argument("--timeout", type=float, default=300.0, help="seconds before every rank is killed")
    c.set_defaults(func=_cmd_calibrate)

    c = sub.add_parser("checkpoint", help="show what a training checkpoint holds; export it to torch or HF",
                       description="Read a checkpoint that train.py --save (or save_every) wrote: a folder step<N>/ "
                                   "or the run folder whose 'latest' names one (docs/reliability.md, docs/runtime.md).")
    acts = c.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = acts.add_parser("info", help="step, plan, regime, sizes and sharding of a checkpoint (every file checked)")
    a.add_argument("directory", metavar="DIR", help="a checkpoint folder step<N>/ or the run folder with 'latest'")
    a.add_argument("--parameters", action="store_true",
                   help="also list every parameter: global name, shape, dtype, stored chunks, optimizer state")
    a.set_defaults(func=_cmd_checkpoint)
    a = acts.add_parser("export", help="write the weights as one torch state dict or a Hugging Face folder")
    a.add_argument("directory", metavar="DIR", help="a checkpoint folder step<N>/ or the run folder with 'latest'")
    to = a.add_mutually_exclusive_group(required=True)
    to.add_argument("--torch", metavar="OUT.pt", help="torch.save one state dict {global name: fp32 tensor}")
    to.add_argument("--hf", metavar="OUT", help="a Hugging Face model's checkpoint as OUT/config.json and "
                                                "OUT/model.safetensors (AutoModelForCausalLM.from_pretrained(OUT))")
    a.add_argument("--optimizer", action="store_true",
                   help="with --torch: add each parameter's optimizer state as optim.<name>.<state>")
    a.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="with --hf: the weights' dtype (default: the run's precision)")
    a.set_defaults(func=_cmd_checkpoint)

    return p


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None, prog: str) -> int:
    """Parse ``argv`` and run the chosen command's ``func``: a user error (``PlanError``) is its located
    message and exit 2, Ctrl-C 130, anything else a bug of ``prog``: one line and exit 3 (the traceback
    with ``--debug``). The lab's entry point (``python -m benchmarks``) runs through it too."""
    args = parser.parse_args(argv)
    try:
        from planc import budget
        with budget.using(getattr(args, "budget", None)):   # --budget: the bounds every pass checks
            return args.func(args)
    except PlanError as e:
        print(e.render(), file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug, not the user's fault
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: internal error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_BUG


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv, "planc")


if __name__ == "__main__":
    raise SystemExit(main())
