"""`python -m benchmarks bench iteration`: training step time on the testbed, planc against stock DeepSpeed, against bounds.

For each plan, in one testbed (docs/testbed.md) whose hosts are the plan's
hosts, launched per host with DeepSpeed's own launcher (``deepspeed --no_ssh
--node_rank=h ...``, one per namespace, as a multi-node job without ssh):

- **planc**: the plan compiled three times, with ``train { schedule = gpipe }``,
  ``1f1b`` and ``eager_1f1b`` (the same placement, transfers and reduction
  programs; only the per-stage lists differ), each run as ``OUT/train.py``;
- **stock DeepSpeed**: ``benchmarks/bench/stock_deepspeed.py`` — ``PipelineModule``
  with the same layers, cut, loss, micro-batch and micro-batch count, its
  default ``PipeDataParallelTopology``, its own schedule, p2p and data-parallel
  all-reduce — when stock DeepSpeed can express the plan (a chain of equal
  stages whose transfers go from each stage's last layer to the next stage,
  no tensor axis, planc's stage placement equal to DeepSpeed's rank order, a
  cut that ``partition_method='uniform'`` or ``'parameters'`` reproduces);
  otherwise the row says why not;
- **signal send/recv** (the compute bound, AlpaComm's "Signal Send/Recv"):
  each planc program again with plan.json ``runtime.signal_transfers``: the same
  schedule, instructions, dependencies and gradient reductions, but every
  transfer task moves one element (the receiver's region is zeros); unshaped.
  The fastest schedule's median is the bound: no program that moves the data
  can be faster than itself without it;
- **work alone** (for scale, not a bound on a real program): every rank runs
  its stage's part of the plan's list with no transfer and no reduction, one
  rank at a time (``benchmarks/bench/compute_only.py``): max(the slowest rank's
  work, all ranks' work ÷ the cores they share); it has no bubble and no
  contention;
- **link** (a bound): bytes per iteration through the busiest host link
  direction (forward and backward transfer tasks × micro-batches from
  plan.json, plus the gradient reduction's cross-host bytes, ring estimate)
  ÷ the link rate;
- **fill and drain** (a tighter lower bound, :func:`pipeline_link_bound`): the same
  bytes, knowing that a device's first inputs and another's last gradients cross a host link
  with nothing coming the other way (no gradient exists before some device has its inputs) and
  that a direction keeps only the calibration's ``both_ways`` rate while the other carries data.

``rounds`` (``--rounds K``, default 1): the programs (the schedules and stock
DeepSpeed) are launched K times, round-robin (gpipe, 1f1b, eager_1f1b, stock,
gpipe, ...), so a drift in the machine's load falls on every program alike;
each program's steps of every round are pooled and the median taken over all
of them, and each round's median is kept (``round_medians``) for the spread (a
round that failed at a rate leaves that rate without a pooled median).

Each program runs once per plan (per round) over every rate: the link rate is changed
(``tc qdisc change``) while the program runs, after the step that ends each
rate's segment; each segment's first step (it straddles the change; for the
first segment, the program's first step) is discarded and the median of the
next ``measured`` steps is reported. Peak memory is each rank's VmHWM read from
/proc by the testbed while it runs (over the whole run, all rates).

``cpus_per_rank`` (``--cpus-per-rank CORES|auto``): every launch's ranks run under that CPU quota
(``Testbed(cpus_per_rank=)``, docs/testbed.md): a rank's idle time is not another rank's compute, so
bubbles cost time; the quota is in the section's header and the JSON (``cpus_per_rank``, ``cpu_quota``).
Without it (default) nothing changes.

``python benchmarks/bench/compute_only.py --compute-only --out OUT`` is the
compute-only worker (launched by the bench inside the testbed; standard
library, torch and OUT's own runtime only).
"""


from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import benchmarks.testbed
from benchmarks.testbed import quota
from benchmarks.bench import compute_only as worker  # the worker the bench launches in the testbed
from benchmarks.bench import replace_section
from benchmarks.bench.accuracy import read_calibrated, substitute
from benchmarks.bench.iteration_report import (_bound_line, _chart, _f, _rich_print, compute_parts,  # noqa: F401
                                               markdown, round_ratios, rows, signal_bound)
from benchmarks.bench.iteration_runs import (COMPUTE_MEASURED, MEASURED, SCHEDULES, WARMUP,  # noqa: F401
                                             _merge_runs, _over_rates, _pool_rounds, launch_steps)
from benchmarks.variant import variant
from benchmarks.bench.linkbound import (DTYPE_BYTES, _both, _carry_time, _window_carry,  # noqa: F401
                                        calibrated_rates, link_bytes, link_seconds, pipeline_link_bound)
from planc import ir
from planc.calibrate.clusterfile import cores_available
from planc.commands import ui
from planc.output.codegen import write_output
from planc.driver.compile import compile_program
from planc.lang import load
from planc.lang.errors import PlanError
from planc.model.probe import probe_model

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PLANS = ("plans/gpt-bench-2x2.plan", "plans/unet-skip.plan")
DEFAULT_RATES = (10.0, 25.0, 100.0, 10000.0)


# ---------------------------------------------------------------- what to run

def compile_variants(plan_path: str | os.PathLike, tmp: Path, cluster: str | None = None,
                     rate: float | None = None, schedules=SCHEDULES) -> dict[str, dict]:
    """The plan compiled once per pipeline schedule of ``schedules`` (probed once): schedule -> {"out", "plan"}.
    ``cluster``: a `planc calibrate` file whose figures at ``rate`` replace the plan's (as `planc
    bench accuracy` substitutes them), so the compiler decides on the testbed's links and compute."""

    program = load(plan_path)
    if program.model is None or program.train is None:
        raise ValueError(f"{plan_path}: not a training plan (no model/train block)")
    if cluster is not None:
        program = dataclasses.replace(program, cluster=substitute(program.cluster, read_calibrated(cluster), rate))
    probe = probe_model(program)
    variants = {}
    for sched in schedules:
        p = dataclasses.replace(program, train=dataclasses.replace(program.train, schedule=ir.PipeSchedule(sched)))
        compiled = compile_program(p, probe)
        if compiled.untrainable:
            raise ValueError(f"{plan_path} ({sched}): planc says it cannot train: "
                             + "; ".join(d.message for d in compiled.untrainable))
        out = tmp / f"{program.name}-{sched}"
        write_output(compiled.plan_json, compiled.program, out)
        variants[sched] = {"out": out, "plan": compiled.plan_json}
    return variants


def stock_partition(plan: dict) -> str | None:
    """The ``partition_method`` that makes DeepSpeed cut the layers where the plan does, or None."""
    from deepspeed.runtime import utils as ds_utils

    stages = plan["stages"]
    bounds = [s["layers"][0] for s in stages] + [stages[-1]["layers"][1]]
    params = list(plan["train"].get("layer_params") or [])
    n, k = bounds[-1], len(stages)
    if list(ds_utils.partition_uniform(num_items=n, num_parts=k)) == bounds:
        return "uniform"
    if len(params) == n and list(ds_utils.partition_balanced(weights=params, num_parts=k)) == bounds:
        return "parameters"
    return None


def stock_reason(plan: dict) -> str | None:
    """Why stock DeepSpeed's PipelineModule cannot run this plan as planc does (None: it can)."""
    if not plan.get("train"):
        return "a communication-only plan"
    stages = plan["stages"]
    if len(stages) < 2:
        return "a single stage (no pipeline)"
    for s in stages:
        for axis, size in zip(s["mesh_axes"], s["mesh_shape"]):
            if axis != "data" and size > 1:
                return (f"stage {s['index']} has a `{axis}` axis of {size} (a stock PipelineModule has no "
                        f"tensor parallelism without a Megatron mpu)")
    sizes = [len(s["devices"]) for s in stages]
    if len(set(sizes)) > 1:
        return f"stages of unequal size {sizes} (PipeDataParallelTopology gives every stage the same data degree)"
    for t in plan["transfers"]:
        a, b = t["src"]["stage"], t["dst"]["stage"]
        if b != a + 1:
            return f"skips to non-adjacent stages (transfer `{t['name']}`: stage {a} → stage {b})"
        layer = t["src"].get("layer")
        if layer is not None and layer != stages[a]["layers"][1] - 1:
            return (f"transfer `{t['name']}` sends layer {layer}'s output, not stage {a}'s last "
                    f"(DeepSpeed sends only a stage's last output)")
    for s in range(len(stages) - 1):
        n = sum(1 for t in plan["transfers"] if t["src"]["stage"] == s)
        if n != 1:
            return f"{n} transfers from stage {s} (DeepSpeed sends one activation per stage boundary)"
    dp = sizes[0]
    for i, s in enumerate(stages):
        want = list(range(i * dp, (i + 1) * dp))
        if s["devices"] != want or s.get("mesh_devices", want) != want:
            return (f"planc placed stage {i} on devices {s['devices']}; PipeDataParallelTopology puts it on "
                    f"{want}")
    if plan["train"]["micro_batch"] % dp:
        return f"micro_batch {plan['train']['micro_batch']} does not divide over data {dp}"
    if stock_partition(plan) is None:
        bounds = [s["layers"][0] for s in stages] + [stages[-1]["layers"][1]]
        return f"the layer cut {bounds} is neither partition_method 'uniform' nor 'parameters'"
    return None


# ---------------------------------------------------------------- measuring

def measure_plan(plan_path: str, rates, *, measured: int = MEASURED, timeout: float = 600,
                 log=lambda *a: None, cluster: str | None = None, rounds: int = 1,
                 cpus_per_rank: float | str | None = None) -> dict:

    rates = [float(x) for x in rates]
    with tempfile.TemporaryDirectory(prefix="planc-bench-iteration-") as tmp:
        t0 = time.monotonic()
        with ui.status(f"benchmarks bench iteration {Path(plan_path).name}") as say:   # on a terminal only
            say(f"compiling (the model probed once, {len(SCHEDULES)} schedules)")
            variants = compile_variants(plan_path, Path(tmp), cluster, rates[0])
            # under a calibrated cluster the decisions (the host NIC order and its hold above all) are
            # for one link rate: each further rate gets its own compile and its own launches
            by_rate = {rates[0]: variants}
            for i, rate in enumerate(rates[1:] if cluster is not None else (), 1):
                say(f"compiling for {rate:g} Mbit/s")
                by_rate[rate] = compile_variants(plan_path, Path(tmp) / f"rate{i}", cluster, rate)
        plan = variants["eager_1f1b"]["plan"]
        hosts = plan["cluster"]["hosts"]
        result = {"plan": str(plan_path), "name": plan["name"], "hosts": [len(h) for h in hosts],
                  "stages": [len(s["devices"]) for s in plan["stages"]],
                  "micro_batch": plan["train"]["micro_batch"], "micro_batches": plan["train"]["micro_batches"],
                  "link": link_bytes(plan), "compile_s": round(time.monotonic() - t0, 1), "programs": {}}
        share = None
        if cpus_per_rank is not None:   # refused here, before any launch, when the quotas exceed the cores
            share = quota.quota_of(quota.share_for(cpus_per_rank, int(plan["cluster"]["devices"]), cores_available()))
            result.update(cpus_per_rank=share.cpus, cpu_quota=share.describe())
        if cluster is not None:   # the calibrated rate a direction keeps while the other is busy
            cal = read_calibrated(cluster)
            result.update(calibrated_rates(cal, rates))
        reason = stock_reason(plan)
        result["stock"] = {"expressible": reason is None, "reason": reason,
                           "partition_method": stock_partition(plan) if reason is None else None}
        compute_runs = []
        # every step of every launch below: the progress bar's total (a terminal only; piped, the log lines)
        steps = (launch_steps([max(rates)], COMPUTE_MEASURED) * (1 + len(SCHEDULES))
                 + launch_steps(rates, measured) * (len(SCHEDULES) + (reason is None)) * rounds)

        def compute_only(tb, when, bar):
            log(f"{plan['name']}: compute-only ({when})")
            out = variants["eager_1f1b"]["out"]
            run = _over_rates(tb, out, [max(rates)], measured=COMPUTE_MEASURED, timeout=timeout,
                              script=Path(worker.__file__).resolve(), extra_args=["--compute-only", "--out", str(out)],
                              bar=bar, what=f"compute-only ({when})")
            run["when"] = when
            compute_runs.append(run)

        cpus = None if share is None else share.cpus
        with benchmarks.testbed.Testbed(len(hosts), rates[0], cpus_per_rank=cpus) as tb, \
                ui.bar(f"{plan['name']} steps", steps) as bar:
            compute_only(tb, "before", bar)
            runs: dict[str, list[dict]] = {}
            for k in range(rounds):
                tag = f", round {k + 1} of {rounds}" if rounds > 1 else ""
                for sched in SCHEDULES:
                    log(f"{plan['name']}: planc {sched}{tag}")
                    if len(by_rate) == 1:
                        run = _over_rates(tb, variants[sched]["out"], rates, measured=measured, timeout=timeout,
                                          bar=bar, what=f"planc {sched}{tag}")
                    else:
                        run = _merge_runs([_over_rates(
                            tb, by_rate[rate][sched]["out"], [rate], measured=measured, timeout=timeout, bar=bar,
                            what=f"planc {sched} (compiled for {rate:g} Mbit/s){tag}") for rate in rates])
                    runs.setdefault(f"planc {sched}", []).append(run)
                if reason is None:
                    log(f"{plan['name']}: stock DeepSpeed{tag}")
                    out = variants["eager_1f1b"]["out"]
                    runs.setdefault("stock DeepSpeed", []).append(_over_rates(
                        tb, out, rates, measured=measured, timeout=timeout,
                        script=ROOT / "benchmarks/bench/stock_deepspeed.py",
                        extra_args=["--out", str(out), "--partition", result["stock"]["partition_method"]],
                        bar=bar, what=f"stock DeepSpeed{tag}"))
            result["rounds"] = rounds
            result["programs"] = {name: _pool_rounds(rs) for name, rs in runs.items()}
            # AlpaComm's "signal send/recv" bound: each planc program again, every transfer cut to one
            # element (plan.json runtime.signal_transfers: same schedule, instructions and reductions)
            result["signal"] = {}
            for sched in SCHEDULES:
                log(f"{plan['name']}: planc {sched}, signal transfers")
                signal = variant(variants[sched]["out"], "signal", signal_transfers=True)
                result["signal"][sched] = _over_rates(tb, signal, [max(rates)],
                                                      measured=COMPUTE_MEASURED, timeout=timeout, bar=bar,
                                                      what=f"planc {sched}, signal transfers")
        done = [r for r in compute_runs if r["per_rate"][0]["median"] is not None]
        result["compute_only"] = min(done, key=lambda r: r["per_rate"][0]["median"]) if done else compute_runs[-1]
        result["compute_only_runs"] = compute_runs
    return result


class ReportError(ValueError):
    """A stored run that cannot be reported (not a ``--json`` file of this bench)."""


def report(json_path: str, cluster: str | None = None) -> str:
    """The markdown of a stored run (``--json``), launching nothing: each plan's link bytes are derived
    again from the plan compiled as the run compiled it (under ``cluster`` at the run's first rate)
    where the stored run predates their per-micro-batch split, and ``cluster`` gives the calibrated
    one-way rate the fill-and-drain bound uses."""
    try:
        doc = json.loads(Path(json_path).read_text())
        rates = [float(x) for x in doc["rates_mbit"]]
        int(doc.get("rounds") or 1)
        if not isinstance(doc["plans"], list) or not all(
                isinstance(r, dict) and isinstance(r.get("link"), dict) and isinstance(r.get("plan"), str)
                and isinstance(r.get("programs"), dict) and r["programs"]
                and all(isinstance(p.get("per_rate"), list) for p in r["programs"].values())
                and all(k in r for k in ("name", "hosts", "stages", "micro_batch", "micro_batches", "stock"))
                for r in doc["plans"]):
            raise KeyError("plans")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ReportError(f"benchmarks bench iteration --from-json {json_path}: not a stored run of `python -m benchmarks bench "
                          f"iteration --json` ({type(e).__name__}: {e})") from None
    rated = None
    if cluster is not None:
        rated = calibrated_rates(read_calibrated(cluster), rates)
    texts = []
    for result in doc["plans"]:
        path = Path(result["plan"]) if Path(result["plan"]).exists() else ROOT / result["plan"]
        if "fill" not in (result["link"].get("classes") or {}):
            try:
                with tempfile.TemporaryDirectory(prefix="planc-report-") as tmp:
                    plan = compile_variants(path, Path(tmp), cluster, rates[0], schedules=("1f1b",))["1f1b"]["plan"]
            except (OSError, ValueError, PlanError) as e:
                raise ReportError(f"benchmarks bench iteration --from-json {json_path}: plan {result['plan']} cannot be "
                                  f"compiled again to derive its link bytes: {e}") from None
            again = link_bytes(plan)
            if (again["out"], again["in"]) != (result["link"].get("out"), result["link"].get("in")):
                raise ReportError(f"benchmarks bench iteration --from-json {json_path}: plan {result['plan']} compiles "
                                  f"now to other link bytes than the run measured (give the run's --cluster)")
            result["link"] = again
        if rated is not None and "one_way" not in result:
            result["one_way"] = rated["one_way"]
            result.setdefault("both_ways", rated["both_ways"])
        rates_arg = (",".join(f"{x:g}" for x in rates) + (f" --cluster {cluster}" if cluster else "")
                     + (f" --rounds {doc['rounds']}" if doc.get("rounds", 1) > 1 else "")
                     + (f" --cpus-per-rank {doc['cpus_per_rank']}" if doc.get("cpus_per_rank") is not None else ""))
        texts.append(markdown(result, rates_arg))
    return (f"Reported again from `{Path(json_path).name}` (`python -m benchmarks bench iteration --from-json "
            f"{Path(json_path).name}" + (f" --cluster {cluster}" if cluster else "") + "`; measured "
            f"{doc.get('seconds', '?')} s on {doc.get('machine', '?')}).{quota_note(doc['plans'])}\n\n"
            + "\n".join(texts))


def run(plans=None, rates=None, *, json_path: str | None = None, chart: str | None = None,
        measured: int = MEASURED, timeout: float = 600, verbose: bool = True, cluster: str | None = None,
        rounds: int = 1, from_json: str | None = None, cpus_per_rank: float | str | None = None) -> str:
    """Measure ``plans`` (default: gpt-bench-2x2 and unet-skip) at ``rates`` (Mbit/s) and return markdown;
    ``cluster``: compile under that calibrated cluster file once per rate (``compile_variants``), each
    rate's programs launched on their own. ``from_json``: report that stored run instead (:func:`report`).
    ``cpus_per_rank``: every rank under that CPU quota (module docstring)."""
    if from_json is not None:
        return report(from_json, cluster)
    if rounds < 1 or measured < 1:
        raise ValueError(f"rounds and measured must be at least 1, got {rounds} and {measured}")
    from benchmarks.bench.testbed import skipped_note
    if note := skipped_note():
        return note
    import torch

    plans = [str(p) for p in (plans or DEFAULT_PLANS)]
    rates = [float(x) for x in (rates or DEFAULT_RATES)]
    rates_arg = (",".join(f"{x:g}" for x in rates) + (f" --cluster {cluster}" if cluster else "")
                 + (f" --rounds {rounds}" if rounds > 1 else "")
                 + (f" --measured {measured}" if measured != MEASURED else "")
                 + (f" --cpus-per-rank {cpus_per_rank}" if cpus_per_rank is not None else ""))

    def log(*a):
        if verbose:
            print("benchmarks bench iteration:", *a, file=sys.stderr, flush=True)

    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    results = []
    for p in plans:
        path = Path(p) if Path(p).exists() else ROOT / p
        results.append(measure_plan(str(path), rates, measured=measured, timeout=timeout, log=log, cluster=cluster,
                                    rounds=rounds, cpus_per_rank=cpus_per_rank))
        results[-1]["plan"] = p
    took = time.monotonic() - t0
    load = (load0, os.getloadavg()[0])
    import deepspeed
    machine = (f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}, "
               f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")
    doc = {"machine": machine, "load_average": load, "rates_mbit": rates, "warmup": WARMUP, "measured": measured,
           "rounds": rounds, **({"cpus_per_rank": cpus_per_rank} if cpus_per_rank is not None else {}),
           "seconds": round(took, 1), "plans": results}
    notes = []
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        log(f"wrote {json_path}")
    notes.append(_chart(results, chart) if chart else
                 ("chart: not drawn (matplotlib is not installed)" if not _has("matplotlib") else
                  "chart: pass `--chart FILE`"))
    _rich_print(results)
    head = (f"Testbed, gloo over tbf-shaped host links, each plan's ranks launched per host by "
            f"`deepspeed --no_ssh --node_rank=h` in that host's namespace. Median of {measured} steps per rate "
            + (f"in each of {rounds} rounds, pooled ({rounds * measured} steps; the programs launched round-robin) "
               if rounds > 1 else "")
            + f"after {WARMUP} discarded (the rate changes while a program runs; see benchmarks/bench/iteration.py); "
            f"bound = max(signal send/recv, link); ratios > 1 are slower. Machine: {machine}; 1-minute load average "
            f"{load[0]:.1f} at the start, {load[1]:.1f} at the end (other jobs share the CPUs: compare within a "
            f"run, expect noise); the whole bench took {took:.0f} s. " + "; ".join(notes) + "." + quota_note(results))
    return head + "\n\n" + "\n".join(markdown(r, rates_arg) for r in results)


def quota_note(results: list[dict]) -> str:
    """The header's sentence on CPU quotas ('' without them)."""
    return "".join(f" Ranks of `{r['name']}` under CPU quotas: {r['cpu_quota']} (docs/testbed.md: a rank's idle "
                   f"time is not another's compute, so bubbles cost time; the quota also charges a rank's host-side "
                   f"communication work)." for r in results if r.get("cpu_quota"))


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def main(argv=None) -> int:
    """``python -m benchmarks.bench.iteration [PLAN ...] [--rates 10,25,100,10000] [--json F] [--chart F] [--write F]``
    (the proposed ``python -m benchmarks bench iteration`` command line)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--compute-only" in argv:
        return worker.compute_worker(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench.iteration")
    p.add_argument("plans", nargs="*", metavar="PLAN")
    p.add_argument("--rates", default=",".join(f"{x:g}" for x in DEFAULT_RATES),
                   help="host link rates, Mbit/s, comma-separated (10000 ≈ unshaped)")
    p.add_argument("--json", dest="json_path", metavar="FILE")
    p.add_argument("--chart", metavar="FILE", help="step time against link rate (needs matplotlib)")
    p.add_argument("--measured", type=int, default=MEASURED, help="measured steps per rate")
    p.add_argument("--rounds", type=int, default=1, help="launch the programs this many times, round-robin")
    p.add_argument("--write", metavar="FILE", help="also write the section into FILE (e.g. docs/benchmarks.md)")
    p.add_argument("--cluster", metavar="YAML", help="compile under this `planc calibrate` file, once per rate (each rate's programs launched on their own)")
    p.add_argument("--from-json", metavar="FILE", help="report a stored run (--json) again; launches nothing")
    p.add_argument("--cpus-per-rank", default=None, type=quota.cpus_option, metavar="CORES|auto",
                   help="run every rank under this CPU quota (docs/testbed.md)")
    args = p.parse_args(argv)
    if args.from_json:
        if args.plans or args.json_path or args.chart or args.rounds != 1 or args.measured != MEASURED \
                or args.rates != p.get_default("rates"):
            p.error("--from-json reports a stored run again: it takes only --cluster and --write")
        try:
            text = report(args.from_json, args.cluster).rstrip() + "\n"
        except ReportError as e:
            print(e, file=sys.stderr)
            return 2
        if args.write:
                replace_section(Path(args.write), "iteration", text)
        print(text, end="")
        return 0
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if args.rounds < 1 or args.measured < 1:
        p.error(f"--rounds {args.rounds} --measured {args.measured}: each must be at least 1")
    text = run(args.plans or None, rates, json_path=args.json_path, chart=args.chart, measured=args.measured,
               cluster=args.cluster, rounds=args.rounds, cpus_per_rank=args.cpus_per_rank)
    text = text.rstrip() + "\n"
    if args.write:
        replace_section(Path(args.write), "iteration", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
