"""`python -m benchmarks calibrate --on testbed OUT.yaml`: planc's calibration on the emulated testbed.

The ranks of ``planc/calibrate/microbench.py`` run in the emulated hosts of ``benchmarks.testbed``
(root), host links shaped to each ``--rate``; the figures are fitted and written by planc's own
calibration (``planc.calibrate``: the same fit, the same cluster file). With two hosts or more the
training runtime's own time is measured too (:func:`run_engine`: a built-in plan's steps with
one-element transfers) and fitted as ``op_overhead`` and ``step_overhead`` under the links and flops
just measured (:func:`engine_fit`; docs/calibrate.md). ``--cpus-per-rank`` runs every rank under a CPU
quota (benchmarks/testbed/quota.py): the device figures are then a quota'd rank's, and the file has no
``cores`` (the ranks do not share cores; :func:`under_quota`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from benchmarks.bench.accuracy import read_calibrated, substitute
from benchmarks.testbed import Testbed, TestbedError, available, quota
from benchmarks.variant import variant
from planc.calibrate import (DEFAULT_TIMEOUT, MATMUL, MICROBENCH, CalibrateError, check_output, cluster_doc,
                             cores_available, fit, samples_record, write_yaml)
from planc.calibrate.ranks import microbench_spec, phase_list, read_result, with_progress
from planc.output.codegen import write_output
from planc.driver.compile import compile_file
from planc.lang.errors import PlanError
from planc.pipeline.gantt import cluster_of, plan_input
from planc.pipeline.schedules import build
from planc.pipeline.simulate import predict

DEFAULT_RATE = 100.0                            # Mbit/s, testbed host links
QUOTA_SAMPLE_PERIODS = 50                       # under CPU quotas a timed compute sample lasts this many periods


def run_testbed(hosts: int, per_host: int, rates: list[float], *, repeats: int = 3,
                timeout: float = DEFAULT_TIMEOUT, matmul=MATMUL, engine: bool = True,
                cpus_per_rank: float | None = None) -> tuple[list[dict], dict | None]:
    """One testbed of ``hosts`` x ``per_host`` ranks; the microbenchmarks once per rate (Mbit/s), then
    (``engine``, two hosts or more) the training runtime's own time at the first rate (:func:`run_engine`):
    ``(raws, engine)``. ``cpus_per_rank``: every rank under that CPU quota (``Testbed(cpus_per_rank=)``)."""
    why = available()
    if why:
        raise CalibrateError(f"benchmarks calibrate --on testbed: {why}; see docs/testbed.md")
    n = hosts * per_host
    names = phase_list(hosts, per_host)
    results = []
    with tempfile.TemporaryDirectory(prefix="planc-calibrate-") as tmp:
        # a one-stage plan of the testbed's shape: Testbed.launch reads its hosts from plan.json
        src = Path(tmp) / "calibrate.plan"
        inner = ": bandwidth 3 GB/s, latency 20 us" if per_host > 1 else ""
        outer = f": bandwidth {rates[0] / 8:g} MB/s, latency 100 us" if hosts > 1 else ""
        src.write_text(f"plan calibrate {{\n  cluster {{\n    level node x {hosts} {outer}\n"
                       f"    level gpu x {per_host} {inner}\n    host = node\n  }}\n"
                       f"  stage 0 on devices 0..{n} as (data = {n})\n"
                       f"  reduce grads over data using allreduce : f32[{n}]\n}}\n")
        out = Path(tmp) / "out"
        compiled = compile_file(src, probe=False, verify=False)
        write_output(compiled.plan_json, compiled.program, out)
        try:
            with Testbed(hosts, rates[0], cpus_per_rank=cpus_per_rank) as tb:
                for rate in rates:
                    tb.set_link_mbit(rate)
                    spec = microbench_spec(hosts, per_host, rate, repeats, timeout, "gloo", matmul)
                    if cpus_per_rank is not None:   # each timed sample many periods long: the quota's sustained speed
                        spec["min_sample_s"] = QUOTA_SAMPLE_PERIODS * quota.quota_of(cpus_per_rank).period_us / 1e6

                    def work(on_phase, spec=spec):
                        return tb.launch(out, steps=1, timeout=timeout, launcher="direct",
                                         script=MICROBENCH, args=["--spec", json.dumps(spec)], memory=False,
                                         on_step=lambda i, _s: on_phase(names[i] if i < len(names) else "?"))

                    r = with_progress(work, len(names), f"calibrate {hosts}x{per_host} at {rate:g} Mbit/s")
                    if r.returncode != 0:
                        raise CalibrateError(f"benchmarks calibrate: the microbenchmarks failed at {rate:g} Mbit/s"
                                             f" ({'timed out' if r.timed_out else f'exit {r.returncode}'}):\n"
                                             f"{(r.failure or r.stdout)[-1500:]}", 1)
                    results.append(read_result(r.stdout))
                measured = None
                if engine and hosts > 1:
                    tb.set_link_mbit(rates[0])
                    try:
                        measured = run_engine(tb, Path(tmp), hosts, per_host, rates[0], timeout)
                    except CalibrateError as e:   # the links and flops stand; the file says nothing of it
                        print(f"benchmarks calibrate: warning: {e}\n  the file is written without op_overhead and "
                              f"step_overhead (the simulator then models no runtime time)", file=sys.stderr)
        except TestbedError as e:
            raise CalibrateError(f"benchmarks calibrate --on testbed: {e}", 1) from None
    return results, measured



# ---------------------------------------------------------------- the runtime's own time

ENGINE_MICRO_BATCHES = (4, 16)   # two step lengths: per instruction and per step apart
ENGINE_STEPS = 6                 # per launch; the first ENGINE_WARMUP discarded
ENGINE_WARMUP = 2
ENGINE_MODEL = '''"""planc calibrate's engine model: small dense layers, so a step is the runtime's own time."""
import torch
from torch import nn


class Dense(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def build(layers=2, width=32):
    return [Dense(width) for _ in range(layers)]


def loss(output, target):
    return nn.functional.mse_loss(output, target)


def batches(micro_batch, seed, width=32, **_):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, width, generator=g)
        yield x, torch.tanh(x)
'''


def engine_plan(hosts: int, per_host: int, micro_batches: int, rate: float) -> str:
    """The calibration's training plan: one stage per host, ``data = per_host`` inside it, a dense layer
    of 32 per stage, 1F1B over ``micro_batches``; its figures are only for the compiler's checks."""
    stages = "\n".join(f"  stage {i} : layers {i}..{i + 1}" for i in range(hosts))
    transfers = "\n".join(f"  transfer t{i} from stage {i} to stage {i + 1}" for i in range(hosts - 1))
    inner = ": bandwidth 3 GB/s, latency 20 us" if per_host > 1 else ""
    return (f"plan calibrate_engine {{\n  cluster {{\n    level node x {hosts} : bandwidth {rate / 8:g} MB/s, "
            f"latency 100 us\n    level gpu x {per_host} {inner}\n    host = node\n  }}\n"
            f"  parallel {{ pipe = {hosts}, data = {per_host}, place = [[{hosts}, 1], [1, {per_host}]] }}\n"
            f'  model "engine_model.py:build" {{ layers = {hosts}, width = 32 }}\n'
            f'  loss  "engine_model.py:loss"\n  data  "engine_model.py:batches"\n{stages}\n{transfers}\n'
            f"  reduce gradients over data\n"
            f"  train {{ micro_batch = {2 * per_host}, micro_batches = {micro_batches}, steps = {ENGINE_STEPS}, "
            f"schedule = 1f1b, optimizer = sgd(lr = 0.01), seed = 0 }}\n}}\n")


def run_engine(tb, tmp: Path, hosts: int, per_host: int, rate: float, timeout: float) -> dict:
    """The training runtime on :func:`engine_plan` with every transfer cut to one element
    (plan.json ``runtime.signal_transfers``, as the iteration bench's signal bound), once per
    :data:`ENGINE_MICRO_BATCHES`: ``{"micro_batches": [...], "step_s": [median of the steps after the
    warm-up, ...], "plans": [plan.json, ...]}``."""
    folder = tmp / "engine"
    folder.mkdir(exist_ok=True)
    (folder / "engine_model.py").write_text(ENGINE_MODEL)
    out = {"micro_batches": list(ENGINE_MICRO_BATCHES), "step_s": [], "plans": []}
    for b in ENGINE_MICRO_BATCHES:
        src = folder / f"engine{b}.plan"
        src.write_text(engine_plan(hosts, per_host, b, rate))
        try:
            compiled = compile_file(src, probe=True, verify=False)
        except PlanError as e:
            raise CalibrateError(f"benchmarks calibrate: the runtime's own time: its {hosts} x {per_host} plan does not "
                                 f"compile: {e}", 1) from None
        dest = folder / f"out{b}"
        write_output(compiled.plan_json, compiled.program, dest)
        dest = variant(dest, "signal", signal_transfers=True)

        def work(on_phase, dest=dest, b=b):
            return tb.launch(dest, steps=ENGINE_STEPS, timeout=timeout, comm_only=False, memory=False,
                             launcher="direct", on_step=lambda i, _s: on_phase(f"engine, {b} micro-batches, step {i + 1}"))

        r = with_progress(work, ENGINE_STEPS, f"calibrate the runtime's own time ({b} micro-batches)")
        steps = r.step_times[ENGINE_WARMUP:]
        if r.returncode != 0 or not steps:
            raise CalibrateError(f"benchmarks calibrate: the runtime's own time could not be measured ({b} "
                                 f"micro-batches, {'timed out' if r.timed_out else f'exit {r.returncode}'}):\n"
                                 f"{(r.failure or r.stdout)[-1500:]}", 1)
        out["step_s"].append(statistics.median(steps))
        out["plans"].append(compiled.plan_json)
    return out


def _signal_input(plan: dict, cluster):
    """The simulator's input of a compiled engine plan under ``cluster`` with every transfer task moving
    one element (as plan.json ``runtime.signal_transfers`` runs it)."""
    sim = plan_input(plan)
    one = lambda ts: tuple(dataclasses.replace(t, nbytes=4.0) for t in ts)  # noqa: E731
    # the plan was compiled before the flops were known: its layers' times at the calibrated rate
    used = float(plan["pipeline"]["predicted"]["flops"])
    f = used / cluster.flops if cluster.flops else 1.0
    compute = tuple(dataclasses.replace(c, forward=tuple(x * f for x in c.forward),
                                        backward=tuple(x * f for x in c.backward)) for c in sim.compute)
    return dataclasses.replace(sim, cluster=cluster, compute=compute, transfers=tuple(
        dataclasses.replace(t, forward=one(t.forward), backward=one(t.backward)) for t in sim.transfers))


def fit_overhead(sims: list, lists: list, measured: list[float]) -> dict:
    """``op_overhead`` and ``step_overhead`` (seconds, >= 0) that make the simulated iterations of
    ``sims`` (their 1F1B ``lists``) equal the ``measured`` step times: Newton's method on the two
    unknowns (the iteration is piecewise linear in them), least squares with more than two plans,
    each clamped at 0 (the other then fitted alone). Returns the figures, the iterations simulated
    with them and without them."""
    def sim_at(o, k):
        return [predict(dataclasses.replace(s, op_overhead=o, step_overhead=k), ls).iteration
                for s, ls in zip(sims, lists)]

    def solve(cols, rhs):
        """Least squares over the given columns (1 or 2)."""
        if len(cols) == 1:
            a = cols[0]
            den = sum(x * x for x in a)
            return [sum(x * y for x, y in zip(a, rhs)) / den if den > 0 else 0.0]
        a, b = cols
        aa, ab, bb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
        ar, br = sum(x * r for x, r in zip(a, rhs)), sum(y * r for y, r in zip(b, rhs))
        det = aa * bb - ab * ab
        if abs(det) < 1e-18 * max(aa * bb, 1e-300):
            return None
        return [(ar * bb - br * ab) / det, (br * aa - ar * ab) / det]

    base = sim_at(0.0, 0.0)
    o = k = 0.0

    def residual(ok):
        return sum((m - x) ** 2 for m, x in zip(measured, sim_at(*ok)))

    best = ((0.0, 0.0), residual((0.0, 0.0)))
    for _ in range(6):
        now = sim_at(o, k)
        h = max(1e-4, 0.01 * (o + k))
        do = [(x - y) / h for x, y in zip(sim_at(o + h, k), now)]
        dk = [(x - y) / h for x, y in zip(sim_at(o, k + h), now)]
        rhs = [m - x + do_i * o + dk_i * k for m, x, do_i, dk_i in zip(measured, now, do, dk)]
        step = solve([do, dk], rhs)
        if step is None or step[0] < 0 or step[1] < 0:
            alone = [(solve([do], rhs) or [0.0])[0], 0.0], [0.0, (solve([dk], rhs) or [0.0])[0]]
            alone = [[max(0.0, a), max(0.0, b)] for a, b in alone]
            step = min(alone, key=lambda ok: sum((m - x) ** 2 for m, x in zip(measured, sim_at(*ok))))
        converged = abs(step[0] - o) < 1e-7 and abs(step[1] - k) < 1e-7
        o, k = step
        r = residual((o, k))
        if r < best[1]:
            best = ((o, k), r)
        if converged:
            break
    o, k = best[0]
    return {"op_overhead": o, "step_overhead": k, "simulated": sim_at(o, k), "simulated_without": base}


def engine_fit(measured: dict, doc: dict) -> dict:
    """Fit the runtime's own time from :func:`run_engine`'s measurements under the calibrated
    ``doc`` (the links and flops just fitted), at the rate the engine ran at."""
    with tempfile.TemporaryDirectory(prefix="planc-calibrate-fit-") as tmp:
        path = Path(tmp) / "cal.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        cal = read_calibrated(path)
    rate = doc.get("calibration", {}).get("rate_mbit")
    sims = [_signal_input(plan, substitute(cluster_of(plan), cal, rate)) for plan in measured["plans"]]
    lists = [build("1f1b", len(plan["stages"]), plan["pipeline"]["micro_batches"], sim.transfers).actions
             for plan, sim in zip(measured["plans"], sims)]
    got = fit_overhead(sims, lists, measured["step_s"])
    return {k: (float(f"{v:.6g}") if isinstance(v, float) else [float(f"{x:.6g}") for x in v])
            for k, v in got.items()}


def _with_overhead(doc: dict, op: float, step: float) -> dict:
    """``doc`` with ``op_overhead`` and ``step_overhead`` placed before its ``calibration`` record."""
    out = {k: v for k, v in doc.items() if k != "calibration"}
    out.update(op_overhead=float(f"{op:.6g}"), step_overhead=float(f"{step:.6g}"))
    out["calibration"] = doc["calibration"]
    return out




def under_quota(doc: dict, share: quota.Quota) -> dict:
    """``doc`` measured with every rank under ``share``: the record says so, and ``cores`` goes (each rank
    is a device of fixed speed, its figures measured at that speed; no two share a core)."""
    out = {k: v for k, v in doc.items() if k not in ("cores", "cores_per")}
    out["calibration"] = dict(doc["calibration"], cpus_per_rank=float(f"{share.cpus:.6g}"),
                              cpu_quota=f"{share.quota_us} us per {share.period_us} us period, no burst")
    return out


def calibrate_testbed(out: str, *, hosts: int = 2, per_host: int = 2, rates: list[float] | None = None,
                      repeats: int = 3, timeout: float = DEFAULT_TIMEOUT,
                      command: str = "python -m benchmarks calibrate --on testbed", matmul=MATMUL,
                      engine: bool = True, cpus_per_rank: float | str | None = None) -> dict:
    """Measure on a testbed of ``hosts`` x ``per_host`` ranks at every rate, fit and write OUT.yaml;
    returns the document written (CalibrateError on a bad input or a failed run). ``cpus_per_rank``
    (a share of one core, or ``'auto'``): every rank under that CPU quota, recorded in the file."""
    path = check_output(out)
    if repeats < 1 or timeout <= 0:
        raise CalibrateError("benchmarks calibrate: --repeats must be >= 1 and --timeout positive")
    rates = list(rates or [DEFAULT_RATE])
    if any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise CalibrateError(f"benchmarks calibrate: --rate {rates}: every rate must be a positive Mbit/s")
    if not (1 <= hosts <= 250) or per_host < 1 or hosts * per_host < 2:
        raise CalibrateError(f"benchmarks calibrate: --hosts {hosts} x --ranks-per-host {per_host}: need 1..250 "
                             f"hosts, at least 1 rank each and 2 ranks in all")
    share = None
    if cpus_per_rank is not None:
        try:
            share = quota.quota_of(quota.share_for(cpus_per_rank, hosts * per_host, cores_available()))
        except quota.QuotaError as e:
            raise CalibrateError(f"benchmarks calibrate: {e}") from None
        if why := quota.available():
            raise CalibrateError(f"benchmarks calibrate: --cpus-per-rank: {why}")
    raws, measured = run_testbed(hosts, per_host, rates, repeats=repeats, timeout=timeout, matmul=matmul,
                                 engine=engine, cpus_per_rank=None if share is None else share.cpus)
    doc = cluster_doc([fit(r) for r in raws], "testbed", rates, repeats)
    if share is not None:
        doc = under_quota(doc, share)
    if measured is not None:   # the runtime's own time, fitted under the links and flops just measured
        got = engine_fit(measured, doc)
        doc = _with_overhead(doc, got["op_overhead"], got["step_overhead"])
        doc["calibration"]["engine"] = {"micro_batches": measured["micro_batches"],
                                        "measured_s": [float(f"{x:.6g}") for x in measured["step_s"]],
                                        "simulated_s": got["simulated"], "simulated_without_s": got["simulated_without"],
                                        "schedule": "1f1b", "transfers": "one element (runtime.signal_transfers)"}
    doc["calibration"]["samples"] = samples_record(rates, raws)
    write_yaml(doc, path, command)
    return doc
