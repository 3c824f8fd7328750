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
  each planc program again with ``PLANC_SIGNAL_TRANSFERS=1``: the same
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

``python benchmarks/bench/compute_only.py --compute-only --out OUT`` is the
compute-only worker (launched by the bench inside the testbed; standard
library, torch and OUT's own runtime only).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.bench import compute_only as worker  # noqa: E402  (the worker the bench launches in the testbed)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PLANS = ("plans/gpt-bench-2x2.plan", "plans/unet-skip.plan")
DEFAULT_RATES = (10.0, 25.0, 100.0, 10000.0)
SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")
WARMUP, MEASURED, COMPUTE_MEASURED = 1, 5, 3
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1}


# ---------------------------------------------------------------- what to run

def compile_variants(plan_path: str | os.PathLike, tmp: Path, cluster: str | None = None,
                     rate: float | None = None, schedules=SCHEDULES) -> dict[str, dict]:
    """The plan compiled once per pipeline schedule of ``schedules`` (probed once): schedule -> {"out", "plan"}.
    ``cluster``: a `planc calibrate` file whose figures at ``rate`` replace the plan's (as `planc
    bench accuracy` substitutes them), so the compiler decides on the testbed's links and compute."""
    import dataclasses

    from planc import ir
    from planc.codegen import write_output
    from planc.compile import compile_program
    from planc.lang import load
    from planc.probe import probe_model

    program = load(plan_path)
    if program.model is None or program.train is None:
        raise ValueError(f"{plan_path}: not a training plan (no model/train block)")
    if cluster is not None:
        from benchmarks.bench.accuracy import read_calibrated, substitute
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


def link_bytes(plan: dict) -> dict:
    """Bytes per iteration through each host's link, each direction (see the module docstring).

    Transfers: each task's slice, per micro-batch, forward and backward; a task with one receiver
    counts once per receiving host out of the sender's host (exact for send_recv), a task with
    several receivers once out of the sender's host and once into each other receiving host (a
    lower bound). Gradient reductions: each program step's collective over a group spanning
    hosts, as a ring over the group in rank order: every ring edge between two hosts carries
    2(n-1)/n·S (allreduce), (n-1)/n·S (reduce_scatter), (n-1)·S (all_gather of S per rank) or S
    (reduce, broadcast), S the bytes each member holds at that step.

    Besides the totals (``out``, ``in``, the busiest), ``classes`` keeps them apart for
    :func:`pipeline_link_bound`: one micro-batch's ``forward`` and ``backward`` bytes and the
    iteration's ``reduction`` bytes, each ``{"out": [per host], "in": [per host]}``, and per host
    the ``fill`` and ``drain`` candidates (see there), each a list of ``(out, in)`` byte pairs.
    """
    hosts = plan["cluster"]["hosts"]
    host_of = {int(r): h for h, rs in enumerate(hosts) for r in rs}
    classes = {k: {"out": [0.0] * len(hosts), "in": [0.0] * len(hosts)} for k in ("forward", "backward", "reduction")}
    train = plan.get("train")
    mb = int(train["micro_batches"]) if train else 1
    # per device and host link, one micro-batch's bytes crossing that link: forward into the device,
    # backward sent by it ({device: {host: [out, in]}}), for the fill and drain of pipeline_link_bound
    into: dict[int, dict[int, list[float]]] = {}
    sent_back: dict[int, dict[int, list[float]]] = {}
    for t in plan["transfers"]:
        size = DTYPE_BYTES.get(t["dtype"], 4)
        for kind, route in (("forward", t), ("backward", t.get("backward"))):
            if not route:
                continue
            c = classes[kind]
            for task in route["tasks"]:
                n = size
                for a, b in task["slice"]:
                    n *= b - a
                hs = host_of[int(task["sender"])]
                others = {host_of[int(r)] for r in task["receivers"]} - {hs}
                out_n = n * (len(others) if len(task["receivers"]) == 1 else min(1, len(others)))
                for h in others:
                    c["in"][h] += n
                c["out"][hs] += out_n
                if kind == "forward":   # each receiving device needs the task's bytes across its link
                    for r in task["receivers"]:
                        hr = host_of[int(r)]
                        if hr != hs:
                            per = into.setdefault(int(r), {})
                            per.setdefault(hs, [0.0, 0.0])[0] += n
                            per.setdefault(hr, [0.0, 0.0])[1] += n
                elif others:            # the sender's gradients, counted as the totals count the task
                    per = sent_back.setdefault(int(task["sender"]), {})
                    per.setdefault(hs, [0.0, 0.0])[0] += out_n
                    for h in others:
                        per.setdefault(h, [0.0, 0.0])[1] += n
    # the first backward byte on host h's link is sent by a device whose backward crosses it, after
    # every forward byte into that device arrived; the last forward byte on it is received by a device
    # whose backward bytes all follow: each candidate's bytes on the link, distinct, in order
    classes["fill"] = [sorted({tuple(into.get(u, {}).get(h, (0.0, 0.0))) for u, per in sent_back.items() if h in per})
                       for h in range(len(hosts))]
    classes["drain"] = [sorted({tuple(sent_back.get(v, {}).get(h, (0.0, 0.0))) for v, per in into.items() if h in per})
                        for h in range(len(hosts))]
    stage_of = {int(d): s["index"] for s in plan["stages"] for d in s["devices"]}
    red = classes["reduction"]
    for r in plan["reductions"]:
        if train and r["name"] != "gradients":
            continue   # declared for placement only; a training run reduces its gradients
        per_stage = {e["stage"]: e["bytes"] for e in r.get("per_stage_bytes") or ()}
        cur = {}
        for g in r.get("groups") or ():
            for d in g:
                cur[int(d)] = float(per_stage.get(stage_of.get(int(d)), r["bytes"]))
        for step in (r.get("program") or {}).get("steps") or ():
            kind = step["collective"]
            for g in step["groups"]:
                g = sorted(int(d) for d in g)
                k = len(g)
                s = cur.get(g[0], float(r["bytes"]))
                per_edge = {"allreduce": 2 * (k - 1) / k * s, "reduce_scatter": (k - 1) / k * s,
                            "all_gather": (k - 1) * s}.get(kind, s)
                if len({host_of[d] for d in g}) > 1:
                    for i in range(k):
                        a, b = host_of[g[i]], host_of[g[(i + 1) % k]]
                        if a != b:
                            red["out"][a] += per_edge
                            red["in"][b] += per_edge
                for d in g:
                    cur[d] = s / k if kind == "reduce_scatter" else s * k if kind == "all_gather" else s
    out = [mb * (classes["forward"]["out"][h] + classes["backward"]["out"][h]) + red["out"][h] for h in range(len(hosts))]
    inn = [mb * (classes["forward"]["in"][h] + classes["backward"]["in"][h]) + red["in"][h] for h in range(len(hosts))]
    busiest = max(range(len(hosts)), key=lambda h: max(out[h], inn[h]))
    direction = "out" if out[busiest] >= inn[busiest] else "in"
    return {"out": out, "in": inn, "busiest_host": busiest, "busiest_direction": direction,
            "busiest_bytes": max(out[busiest], inn[busiest]), "micro_batches": mb, "classes": classes}


def _both(one_way: float, both_ways: float) -> float:
    """The most bytes/s a host link carries over both directions together: twice what a direction
    keeps while the other is busy, and never less than one direction alone."""
    return max(one_way, 2 * both_ways)


def _carry_time(o: float, i: float, one_way: float, both_ways: float) -> float:
    """The least time a host link carries ``o`` bytes out and ``i`` in: each direction at most
    ``one_way`` bytes/s, the two together at most :func:`_both`."""
    return max(o / one_way, i / one_way, (o + i) / _both(one_way, both_ways))


def _window_carry(w: float, avail_o: float, avail_i: float, one_way: float, both_ways: float) -> float:
    """The most bytes (both directions together) a host link carries in ``w`` seconds when only
    ``avail_o`` out and ``avail_i`` in may cross it then."""
    return min(_both(one_way, both_ways) * w, min(one_way * w, avail_o) + min(one_way * w, avail_i))


def pipeline_link_bound(link: dict, one_way: float, both_ways: float | None = None) -> tuple[float, int] | None:
    """A lower bound on the iteration from the host links alone, knowing what a pipeline must do
    first and last: ``(seconds, host)`` for the host whose link gives the largest, None for a
    ``link`` without ``classes`` (an older bench JSON) or a plan without micro-batches.

    Per host link, with ``X`` bytes out and ``Y`` in per iteration:

    * **fill**: the first backward byte to cross the link is sent by a device ``u`` whose backward
      crosses it, once ``u`` has run the micro-batch's forward, so after every forward byte into
      ``u`` that crosses the link has (``link_bytes``'s ``fill`` candidates, one per such ``u``: its
      bytes out and in); the first ``a = min over u of carry(u's bytes)`` seconds carry forward (and
      reduction) bytes only;
    * **drain**: symmetrically, the last forward byte to cross is received by a device ``v`` whose
      backward bytes on the link (the ``drain`` candidates) all follow it: the last ``c = min over v
      of carry(v's bytes)`` seconds carry backward (and reduction) bytes only;
    * in between, the link carries at most ``max(one_way, 2 * both_ways)`` bytes/s over both
      directions, each direction at most ``one_way``.

    Given the calibration's rates (a ``both_ways`` measured low makes the bound high), ``T >= a + c +
    (X + Y - W_a - W_c) / max(one_way, 2 * both_ways)``, ``W`` the most the fill and drain
    windows can carry of the bytes allowed in them (:func:`_window_carry`) — unless every forward
    byte crossed before the first backward byte (then the two windows may meet), where ``T >=
    carry(all forward) + carry(all backward)``: the bound is the smaller of the two, and at least
    ``carry(X, Y)``. On a two-stage pipeline with data degree ``d`` whose link carries activations
    one way and gradients the other, ``u`` and ``v`` are one data rank's devices: ``(f + g) / (d *
    one_way) + (X + Y - (f + g) / d) / (2 * both_ways)`` for one micro-batch's activations ``f``
    and gradients ``g`` — one data rank's first activations and last gradients cross alone.
    ``both_ways`` None (not calibrated): the directions are independent (``both_ways =
    one_way``). Reduction bytes are allowed anywhere (weaker, so still a bound); a multi-receiver
    task counts as :func:`link_bytes` counts it (a lower bound)."""
    classes = link.get("classes")
    mb = int(link.get("micro_batches") or 0)
    if not classes or "fill" not in classes or mb < 1:
        return None
    r1 = float(one_way)
    r2 = min(float(both_ways), r1) if both_ways else r1
    best = None
    for h in range(len(link["out"])):
        fo, fi = classes["forward"]["out"][h], classes["forward"]["in"][h]
        bo, bi = classes["backward"]["out"][h], classes["backward"]["in"][h]
        ro, ri = classes["reduction"]["out"][h], classes["reduction"]["in"][h]
        x, y = link["out"][h], link["in"][h]
        if x + y <= 0:
            continue
        a = min((_carry_time(o, i, r1, r2) for o, i in classes["fill"][h]), default=0.0)
        c = min((_carry_time(o, i, r1, r2) for o, i in classes["drain"][h]), default=0.0)
        wa = _window_carry(a, mb * fo + ro, mb * fi + ri, r1, r2)
        wc = _window_carry(c, mb * bo + ro, mb * bi + ri, r1, r2)
        overlapped = a + c + max(0.0, x + y - wa - wc) / _both(r1, r2)
        # or every forward byte crossed before the first backward byte (the windows may then meet)
        apart = _carry_time(mb * fo, mb * fi, r1, r2) + _carry_time(mb * bo, mb * bi, r1, r2)
        t = max(min(overlapped, apart), _carry_time(x, y, r1, r2))
        if best is None or t > best[0]:
            best = (t, h)
    return best


def calibrated_rates(cal, rates) -> dict:
    """A result's ``both_ways`` and ``one_way``: the calibrated host link's bytes/s per rate (Mbit/s),
    keyed as the rates print (``f"{rate:g}"``)."""
    return {"both_ways": {f"{r:g}": cal.both_ways(r) for r in rates},
            "one_way": {f"{r:g}": cal.host(r)[0] for r in rates}}


def link_seconds(nbytes: float, mbit: float) -> float:
    return nbytes / (mbit * 1e6 / 8)


# ---------------------------------------------------------------- measuring

def launch_steps(rates, measured: int) -> int:
    """Steps one ``_over_rates`` launch runs: a discarded and ``measured`` steps per rate."""
    return (WARMUP + measured) * len(rates)


def _over_rates(tb, out: Path, rates, *, measured: int, timeout: float, script=None, extra_args=(),
                env: dict | None = None, bar=None, what: str = "") -> dict:
    """One launch across every rate: returns {"per_rate": [{rate, steps, median}], "peak_rss_kb", ...}.
    ``bar`` (a ``planc.ui.Bar``): advanced by one per step, showing ``what`` and the rate."""
    import statistics

    seg = WARMUP + measured
    total = launch_steps(rates, measured)

    def at(n: int) -> str:
        return f"{what} @ {rates[min(n // seg, len(rates) - 1)]:g} Mbit/s"

    if bar is not None:
        bar.update(at(0))

    def on_step(n: int, _seconds: float) -> None:
        if (n + 1) % seg == 0 and n + 1 < total:
            tb.set_link_mbit(rates[(n + 1) // seg])
        if bar is not None:
            bar.advance(1, at(n + 1) if n + 1 < total else what)

    tb.set_link_mbit(rates[0])
    r = tb.launch(out, steps=total, timeout=timeout, comm_only=False, script=script,
                  extra_args=list(extra_args), on_step=on_step, env=env)
    if bar is not None and len(r.step_times) < total:   # a launch that stopped early: its steps count as done
        bar.advance(total - len(r.step_times), what)
    res = {"returncode": r.returncode, "launch_s": round(r.seconds, 1), "step_times": r.step_times,
           "details": [line for line in r.stdout.splitlines() if line.startswith("compute-only step")],
           "losses": r.losses, "peak_rss_kb": r.peak_rss_kb, "per_rate": []}
    for i, rate in enumerate(rates):
        times = r.step_times[i * seg + WARMUP:(i + 1) * seg]
        res["per_rate"].append({"rate": rate, "steps": times,
                                "median": statistics.median(times) if len(times) == measured else None})
    if r.returncode != 0 or len(r.step_times) < total:
        tail = next((t for _, t in sorted(r.logs.items()) if "Error" in t or "error" in t), r.stdout)
        res["error"] = ("timed out" if r.timed_out else f"exit {r.returncode}") + f": {tail.strip()[-800:]}"
    return res


def _merge_runs(runs: list[dict]) -> dict:
    """One program's launches, one per rate (``measure_plan`` under a calibrated cluster), as one run."""
    res = {"returncode": next((r["returncode"] for r in runs if r["returncode"]), 0),
           "launch_s": round(sum(r["launch_s"] for r in runs), 1),
           "step_times": [t for r in runs for t in r["step_times"]],
           "details": [d for r in runs for d in r["details"]], "losses": runs[0]["losses"],
           "peak_rss_kb": {rank: max(r["peak_rss_kb"].get(rank, 0) for r in runs)
                           for rank in sorted({k for r in runs for k in r["peak_rss_kb"]})},
           "per_rate": [p for r in runs for p in r["per_rate"]], "launches": len(runs)}
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        res["error"] = errors[0]
    return res


def _pool_rounds(runs: list[dict]) -> dict:
    """One program's runs of every round as one run: per rate (by position: every round runs the same
    rates in the same order), the steps of every round pooled and their median, each round's median in
    ``round_medians``; the rest as :func:`_merge_runs` merges launches. A round whose launch failed at
    a rate (its median is None) leaves that rate without a pooled median: the row reports the failure
    rather than a median of the rounds that happened to finish."""
    import statistics

    if len(runs) == 1:
        return runs[0]
    res = _merge_runs(runs)
    per_rate = []
    for parts in zip(*(r["per_rate"] for r in runs)):
        steps = [t for p in parts for t in p["steps"]]
        medians = [p["median"] for p in parts]
        per_rate.append({"rate": parts[0]["rate"], "steps": steps, "round_medians": medians,
                         "median": statistics.median(steps) if all(m is not None for m in medians) else None})
    res["per_rate"] = per_rate
    res["rounds"] = len(runs)
    return res


def measure_plan(plan_path: str, rates, *, measured: int = MEASURED, timeout: float = 600,
                 log=lambda *a: None, cluster: str | None = None, rounds: int = 1) -> dict:
    import tempfile

    from planc import ui
    from benchmarks.testbed import Testbed

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
        if cluster is not None:   # the calibrated rate a direction keeps while the other is busy
            from benchmarks.bench.accuracy import read_calibrated
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

        with Testbed(len(hosts), rates[0]) as tb, ui.bar(f"{plan['name']} steps", steps) as bar:
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
            # element (PLANC_SIGNAL_TRANSFERS=1: same schedule, instructions and reductions)
            result["signal"] = {}
            for sched in SCHEDULES:
                log(f"{plan['name']}: planc {sched}, signal transfers")
                result["signal"][sched] = _over_rates(tb, variants[sched]["out"], [max(rates)],
                                                      measured=COMPUTE_MEASURED, timeout=timeout,
                                                      env={"PLANC_SIGNAL_TRANSFERS": "1"}, bar=bar,
                                                      what=f"planc {sched}, signal transfers")
        done = [r for r in compute_runs if r["per_rate"][0]["median"] is not None]
        result["compute_only"] = min(done, key=lambda r: r["per_rate"][0]["median"]) if done else compute_runs[-1]
        result["compute_only_runs"] = compute_runs
    return result


# ---------------------------------------------------------------- reporting

def _f(x, digits=3, suffix=""):
    return "—" if x is None else f"{x:.{digits}f}{suffix}"


def rows(result: dict) -> list[dict]:
    """Flat rows (one per rate and program) with the ratios."""
    compute = signal_bound(result)[0]
    if compute is None:   # a result without signal runs (older JSON): the work-alone figure
        compute = ((result.get("compute_only") or {}).get("per_rate") or [{}])[0].get("median")
    out = []
    programs = list(result["programs"])
    for i, rate in enumerate(r["rate"] for r in next(iter(result["programs"].values()))["per_rate"]):
        link = link_seconds(result["link"]["busiest_bytes"], rate)
        bound = max(compute, link) if compute is not None else None
        both = (result.get("both_ways") or {}).get(f"{rate:g}")
        link_both = result["link"]["busiest_bytes"] / both if both else None
        bound_both = max(compute, link_both) if compute is not None and link_both is not None else None
        # the link bound of a pipeline's fill and drain (pipeline_link_bound), at the faster of the
        # nominal and the calibrated one-way rate (so it stays a lower bound)
        one_way = max(rate * 1e6 / 8, float((result.get("one_way") or {}).get(f"{rate:g}") or 0))
        pipe = pipeline_link_bound(result["link"], one_way, both)
        pipe_link = pipe[0] if pipe else None
        bound_pipe = max(compute, pipe_link) if compute is not None and pipe_link is not None else None
        stock = result["programs"].get("stock DeepSpeed")
        stock_t = stock["per_rate"][i]["median"] if stock else None
        for name in programs + ([] if stock else ["stock DeepSpeed"]):
            run = result["programs"].get(name)
            t = run["per_rate"][i]["median"] if run else None
            out.append({"rate": rate, "program": name, "median": t,
                        "steps": run["per_rate"][i]["steps"] if run else [],
                        "vs_stock": t / stock_t if t and stock_t else None,
                        "vs_bound": t / bound if t and bound else None,
                        "compute_only": compute, "link": link, "bound": bound,
                        "link_both_ways": link_both, "bound_both_ways": bound_both,
                        "vs_bound_both_ways": t / bound_both if t and bound_both else None,
                        "pipeline_link": pipe_link, "bound_pipeline": bound_pipe,
                        "vs_bound_pipeline": t / bound_pipe if t and bound_pipe else None,
                        "note": None if run else f"n/a: {result['stock']['reason']}",
                        "error": run.get("error") if run else None})
    return out


def signal_bound(result: dict) -> tuple[float | None, str | None]:
    """The fastest signal-transfer run over the schedules: (median s/step, schedule)."""
    best = [(r["per_rate"][0]["median"], s) for s, r in (result.get("signal") or {}).items()
            if r["per_rate"][0]["median"] is not None]
    return min(best) if best else (None, None)


def compute_parts(run: dict) -> tuple[float, float, int] | None:
    """Medians over the measured steps of (slowest rank alone, all ranks' work ÷ cores) and the cores."""
    import re
    import statistics

    rx = re.compile(r"compute-only step (\d+): slowest rank alone ([0-9.]+) s, all ranks [0-9.]+ s on (\d+) cores "
                    r"([0-9.]+) s")
    found = [m for m in map(rx.search, run.get("details") or ()) if m and int(m.group(1)) >= WARMUP]
    if not found:
        return None
    return (statistics.median(float(m.group(2)) for m in found), statistics.median(float(m.group(4)) for m in found),
            int(found[0].group(3)))


def round_ratios(result: dict) -> list[dict]:
    """Per rate and round (a result of ``rounds`` > 1): eager_1f1b ÷ 1f1b and planc's best ÷ stock DeepSpeed
    from that round's medians (None where a program has no median in that round or does not run)."""
    progs = result["programs"]
    if result.get("rounds", 1) < 2 or "planc 1f1b" not in progs:
        return []
    out = []
    for i, p in enumerate(progs["planc 1f1b"]["per_rate"]):
        def med(name, k):
            run = progs.get(name)
            return run["per_rate"][i]["round_medians"][k] if run else None
        for k in range(result["rounds"]):
            eager, one = med("planc eager_1f1b", k), med("planc 1f1b", k)
            plancs = [med(f"planc {s}", k) for s in SCHEDULES]
            stock = med("stock DeepSpeed", k)
            best = min(plancs) if all(x is not None for x in plancs) else None
            out.append({"rate": p["rate"], "round": k + 1,
                        "eager_vs_1f1b": eager / one if eager and one else None,
                        "best_vs_stock": best / stock if best and stock else None})
    return out


def _bound_line(table: list[dict], seconds: str, ratio: str, head: str) -> list[str]:
    """A paragraph (``["", text]``, or [] when no row has it) giving, per rate, the link time ``seconds``
    of :func:`rows` and planc's fastest program against max(signal, that) (``ratio``)."""
    best = {}
    for r in table:
        if r[seconds] is not None and r[ratio] is not None and r["program"].startswith("planc ") \
                and r["median"] is not None:
            if r["rate"] not in best or r["median"] < best[r["rate"]]["median"]:
                best[r["rate"]] = r
    if not best:
        return []
    return ["", head + ", ".join(f"{rate:g} Mbit/s {r[seconds]:.3f} s" for rate, r in best.items())
            + "; planc's best ÷ max(signal, that): "
            + ", ".join(f"{rate:g} Mbit/s {r[ratio]:.2f} ({r['program'][6:]})" for rate, r in best.items()) + "."]


def markdown(result: dict, rates_arg: str) -> str:
    lk = result["link"]
    parts = compute_parts(result.get("compute_only") or {})
    parts_text = (f" = max(slowest rank alone {parts[0]:.3f} s, all ranks' work ÷ {parts[2]} cores {parts[1]:.3f} s)"
                  if parts else "")
    hosts = " + ".join(str(h) for h in result["hosts"])
    lines = [f"### `{result['plan']}` ({result['name']}: {len(result['hosts'])} hosts of {hosts} ranks, "
             f"stages of {result['stages']} devices, {result['micro_batches']} micro-batches of "
             f"{result['micro_batch']} rows)", "",
             f"Reproduce: `python -m benchmarks bench iteration {result['plan']} --rates {rates_arg}` "
             f"(today: `python -m benchmarks.bench.iteration {result['plan']} --rates {rates_arg}`)", "",
             f"Link bound: {lk['busiest_bytes'] / 1e6:.2f} MB per iteration through host "
             f"{lk['busiest_host']}'s link ({lk['busiest_direction']}), ÷ the rate. Compute-only bound "
             f"(signal send/recv: each planc program with every transfer cut to one element, "
             f"`PLANC_SIGNAL_TRANSFERS=1`, median of {COMPUTE_MEASURED} steps unshaped; the fastest counts): "
             + ", ".join(f"{s} {_f(r['per_rate'][0]['median'])} s" for s, r in (result.get("signal") or {}).items())
             + f". For scale, each rank's work timed alone: "
             f"{_f((result.get('compute_only') or {}).get('per_rate', [{}])[0].get('median'))} s{parts_text} "
             f"(no bubble, no contention: below any real program). Stock DeepSpeed: "
             + (f"`PipelineModule(partition_method='{result['stock']['partition_method']}')`, default topology."
                if result["stock"]["expressible"] else f"n/a: {result['stock']['reason']}."), "",
             "| link Mbit/s | program | median s/step | ÷ stock DeepSpeed | ÷ bound | bound s (signal, link) |",
             "|---|---|---|---|---|---|"]
    table = rows(result)
    for r in table:
        t = r["note"] or (f"failed ({r['error'][:60]})" if r["error"] and r["median"] is None else _f(r["median"]))
        lines.append(f"| {r['rate']:g} | {r['program']} | {t} | {_f(r['vs_stock'], 2)} | {_f(r['vs_bound'], 2)} | "
                     f"{_f(r['bound'])} ({_f(r['compute_only'])}, {_f(r['link'])}) |")
    lines += _bound_line(table, "link_both_ways", "vs_bound_both_ways",
                         "Both ways (the cluster file's `both_ways`: the rate a direction of the host link keeps "
                         "while the other direction carries data too, as a 1F1B step's activations and gradients "
                         "do): the same bytes take ")
    lines += _bound_line(table, "pipeline_link", "vs_bound_pipeline",
                         "Fill and drain (`pipeline_link_bound`: a device's first inputs and another's last "
                         "gradients cross a host link with nothing coming the other way, the rest at most "
                         "both ways): the link needs at least ")
    lines += ["", "| program | peak RSS per rank, MB (VmHWM) | loss, first steps | run s |", "|---|---|---|---|"]
    for name, run in list(result["programs"].items()) + [
            (f"planc {s}, signal transfers", r) for s, r in (result.get("signal") or {}).items()] + [
            (f"compute-only ({r.get('when', '?')})", r) for r in result.get("compute_only_runs") or ()]:
        mem = ", ".join(f"{kb / 1024:.0f}" for _, kb in sorted(run.get("peak_rss_kb", {}).items())) or "—"
        losses = ", ".join(f"{x:.4f}" for x in run.get("losses", [])[:3]) \
            if "compute" not in name and "signal" not in name else "—"
        lines.append(f"| {name} | {mem} | {losses or '—'} | {run.get('launch_s', '—')} |")
    per_round = round_ratios(result)
    if per_round:
        lines += ["", f"Per round ({result['rounds']} interleaved rounds; each ratio from that round's medians):"]
        for rate in dict.fromkeys(r["rate"] for r in per_round):
            rs = [r for r in per_round if r["rate"] == rate]
            text = f"- {rate:g} Mbit/s: eager_1f1b ÷ 1f1b " + ", ".join(_f(r["eager_vs_1f1b"], 2) for r in rs)
            if any(r["best_vs_stock"] is not None for r in rs):
                text += "; planc's best ÷ stock DeepSpeed " + ", ".join(_f(r["best_vs_stock"], 2) for r in rs)
            lines.append(text)
    return "\n".join(lines) + "\n"


def _rich_print(results: list[dict]) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    console = Console(stderr=True)
    for res in results:
        table = Table(title=f"{res['plan']} ({res['name']})")
        for col in ("Mbit/s", "program", "median s/step", "÷ stock", "÷ bound", "bound s"):
            table.add_column(col)
        for r in rows(res):
            table.add_row(f"{r['rate']:g}", r["program"], r["note"] or _f(r["median"]), _f(r["vs_stock"], 2),
                          _f(r["vs_bound"], 2), _f(r["bound"]))
        console.print(table)
    return True


def _chart(results: list[dict], path: str) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart: not drawn, matplotlib is not installed"
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        rs = rows(res)
        rates = sorted({r["rate"] for r in rs})
        for name in dict.fromkeys(r["program"] for r in rs):
            ys = [next((r["median"] for r in rs if r["rate"] == x and r["program"] == name), None) for x in rates]
            if any(y is not None for y in ys):
                ax.plot(rates, ys, marker="o", label=name)
        ax.plot(rates, [next(r["bound"] for r in rs if r["rate"] == x) for x in rates], "k--", label="bound")
        ax.set_xscale("log")
        ax.set_xlabel("host link, Mbit/s")
        ax.set_ylabel("s per step (median)")
        ax.set_title(res["name"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return f"chart: {path}"


class ReportError(ValueError):
    """A stored run that cannot be reported (not a ``--json`` file of this bench)."""


def report(json_path: str, cluster: str | None = None) -> str:
    """The markdown of a stored run (``--json``), launching nothing: each plan's link bytes are derived
    again from the plan compiled as the run compiled it (under ``cluster`` at the run's first rate)
    where the stored run predates their per-micro-batch split, and ``cluster`` gives the calibrated
    one-way rate the fill-and-drain bound uses."""
    import tempfile

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
        from benchmarks.bench.accuracy import read_calibrated
        rated = calibrated_rates(read_calibrated(cluster), rates)
    texts = []
    for result in doc["plans"]:
        path = Path(result["plan"]) if Path(result["plan"]).exists() else ROOT / result["plan"]
        if "fill" not in (result["link"].get("classes") or {}):
            from planc.lang.errors import PlanError

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
                     + (f" --rounds {doc['rounds']}" if doc.get("rounds", 1) > 1 else ""))
        texts.append(markdown(result, rates_arg))
    return (f"Reported again from `{Path(json_path).name}` (`python -m benchmarks bench iteration --from-json "
            f"{Path(json_path).name}" + (f" --cluster {cluster}" if cluster else "") + "`; measured "
            f"{doc.get('seconds', '?')} s on {doc.get('machine', '?')}).\n\n" + "\n".join(texts))


def run(plans=None, rates=None, *, json_path: str | None = None, chart: str | None = None,
        measured: int = MEASURED, timeout: float = 600, verbose: bool = True, cluster: str | None = None,
        rounds: int = 1, from_json: str | None = None) -> str:
    """Measure ``plans`` (default: gpt-bench-2x2 and unet-skip) at ``rates`` (Mbit/s) and return markdown;
    ``cluster``: compile under that calibrated cluster file once per rate (``compile_variants``), each
    rate's programs launched on their own. ``from_json``: report that stored run instead (:func:`report`)."""
    from benchmarks.testbed import available

    if from_json is not None:
        return report(from_json, cluster)
    if rounds < 1 or measured < 1:
        raise ValueError(f"rounds and measured must be at least 1, got {rounds} and {measured}")
    why = available()
    if why:
        return f"_Skipped: {why}. The testbed needs root and iproute2 (`ip`, `tc`); see docs/testbed.md._\n"
    import platform

    import torch

    plans = [str(p) for p in (plans or DEFAULT_PLANS)]
    rates = [float(x) for x in (rates or DEFAULT_RATES)]
    rates_arg = (",".join(f"{x:g}" for x in rates) + (f" --cluster {cluster}" if cluster else "")
                 + (f" --rounds {rounds}" if rounds > 1 else "")
                 + (f" --measured {measured}" if measured != MEASURED else ""))

    def log(*a):
        if verbose:
            print("benchmarks bench iteration:", *a, file=sys.stderr, flush=True)

    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    results = []
    for p in plans:
        path = Path(p) if Path(p).exists() else ROOT / p
        results.append(measure_plan(str(path), rates, measured=measured, timeout=timeout, log=log, cluster=cluster,
                                    rounds=rounds))
        results[-1]["plan"] = p
    took = time.monotonic() - t0
    load = (load0, os.getloadavg()[0])
    import deepspeed
    machine = (f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}, "
               f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}")
    doc = {"machine": machine, "load_average": load, "rates_mbit": rates, "warmup": WARMUP, "measured": measured,
           "rounds": rounds,
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
            f"run, expect noise); the whole bench took {took:.0f} s. " + "; ".join(notes) + ".")
    return head + "\n\n" + "\n".join(markdown(r, rates_arg) for r in results)


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def main(argv=None) -> int:
    """``python -m benchmarks.bench.iteration [PLAN ...] [--rates 10,25,100,10000] [--json F] [--chart F] [--write F]``
    (the proposed ``python -m benchmarks bench iteration`` command line)."""
    import argparse

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
            from benchmarks.bench import replace_section
            replace_section(Path(args.write), "iteration", text)
        print(text, end="")
        return 0
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    if args.rounds < 1 or args.measured < 1:
        p.error(f"--rounds {args.rounds} --measured {args.measured}: each must be at least 1")
    text = run(args.plans or None, rates, json_path=args.json_path, chart=args.chart, measured=args.measured,
               cluster=args.cluster, rounds=args.rounds)
    text = text.rstrip() + "\n"
    if args.write:
        from benchmarks.bench import replace_section
        replace_section(Path(args.write), "iteration", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
