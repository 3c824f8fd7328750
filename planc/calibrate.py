"""`planc calibrate --on testbed|cluster OUT.yaml`: measure the links and the device, write a cluster YAML.

The microbenchmarks (``planc/runtime/microbench.py``, torch, run by every rank
in a subprocess: the compiler stays torch-free) time a ping-pong between two
ranks of one host and between two hosts, ``all_reduce`` over one host's ranks
and over one rank per host, at several message sizes, an ``n x n`` matmul and
the forward and backward of a transformer layer on every rank (on CPUs one rank
at a time: the simulator models the sharing of cores itself). :func:`fit` turns the medians into each level's
bandwidth and latency under the cost model's own formulas (docs/cost-model.md)
by weighted least squares, and the device ``flops``; :func:`write_yaml` writes
the cluster file that plans load with ``cluster "OUT.yaml"`` (docs/calibrate.md).

``--on testbed``: the ranks run in the emulated hosts of ``planc.testbed``
(root), host links shaped to each ``--rate``; ``--on cluster``: ``--ranks``
ranks spawned on this machine (NCCL when it has a GPU per rank, else gloo).
"""

from __future__ import annotations

import json
import math
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MICROBENCH = Path(__file__).resolve().parent / "runtime" / "microbench.py"
MARK = "PLANC_MICROBENCH "
INNER_SIZES = (4096, 65536, 1 << 20, 4 << 20)   # bytes, inside a host
MATMUL = (256, 512)
DEFAULT_RATE = 100.0                            # Mbit/s, testbed host links
DEFAULT_TIMEOUT = 300.0
LEVEL_NAMES = ("host", "device")


class CalibrateError(Exception):
    """A bad input or a failed measurement; ``code`` is the exit status (2: the user's input)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- fitting

def outer_sizes(rate_mbit: float | None) -> tuple[int, ...]:
    """Message sizes between hosts: the largest takes about 0.2 s at the rate (256 KiB .. 16 MiB)."""
    top = 4 << 20 if rate_mbit is None else int(min(16 << 20, max(256 << 10, rate_mbit * 1e6 / 8 * 0.2)))
    top -= top % 4
    return (4096, top // 16 - (top // 16) % 4, top // 4 - (top // 4) % 4, top)


def _lsq(pts) -> tuple[float, float]:
    """Unweighted least squares of ``t ≈ a·L + b·G``: ``(L, G)`` (G = 1/bandwidth)."""
    saa = sum(a * a for a, _, _ in pts)
    sab = sum(a * b for a, b, _ in pts)
    sbb = sum(b * b for _, b, _ in pts)
    sat = sum(a * t for a, _, t in pts)
    sbt = sum(b * t for _, b, t in pts)
    det = saa * sbb - sab * sab
    if det <= 0:
        return 0.0, (sbt / sbb if sbb else 0.0)
    return (sat * sbb - sab * sbt) / det, (saa * sbt - sab * sat) / det


def fit_line(points) -> tuple[float, float, float]:
    """``(latency, bandwidth, rms relative residual)`` of ``t ≈ a·latency + b/bandwidth`` over
    ``points = [(a, b, t)]`` (``a``: latency terms, ``b``: bytes on the bottleneck link, ``t``:
    seconds), by least squares. When the fitted latency comes out negative (a shaper's token
    bucket lets the first bytes through at line rate, so large messages look faster than
    latency + bytes/rate), the bandwidth stays the fit's and the latency is taken from the
    smallest message size alone (the median of ``(t - b/bandwidth) / a`` there, at least 0).
    ValueError when the times do not grow with size."""
    pts = [(float(a), float(b), float(t)) for a, b, t in points if t > 0]
    if len(pts) < 2 or len({b / a for a, b, _ in pts}) < 2:
        raise ValueError("needs at least two message sizes")
    lat, inv = _lsq(pts)
    if inv <= 0:
        raise ValueError("the times do not grow with the message size (no bandwidth to fit)")
    if lat < 0:
        smallest = min(b / a for a, b, _ in pts)
        lat = max(0.0, statistics.median((t - b * inv) / a for a, b, t in pts if b / a == smallest))
    rms = math.sqrt(sum(((a * lat + b * inv) / t - 1) ** 2 for a, b, t in pts) / len(pts))
    return lat, 1.0 / inv, rms


def _points(raw: dict, where: str) -> list[tuple[float, float, float]]:
    """The cost model's latency and bandwidth terms for each measured median (docs/cost-model.md):
    p2p ``1·α + S/B``; ring all-reduce over k: ``2(k-1)·α + 2(k-1)/k·S/B``."""
    pts = [(1.0, float(s), statistics.median(ts)) for s, ts in raw["p2p"].get(where) or () if ts]
    ar = raw["allreduce"].get(where) or {}
    k = int(ar.get("k", 0))
    if k > 1:
        pts += [(2.0 * (k - 1), 2.0 * (k - 1) / k * float(s), statistics.median(ts)) for s, ts in ar["samples"] if ts]
    return pts


def _by_kind(raw: dict, where: str) -> dict:
    """The p2p points and the all-reduce points fitted apart (a record of how well one line fits both)."""
    out = {}
    p2p = [(1.0, float(s), statistics.median(ts)) for s, ts in raw["p2p"].get(where) or () if ts]
    ar = _points({"p2p": {}, "allreduce": raw["allreduce"]}, where)
    for kind, pts in (("p2p", p2p), ("allreduce", ar)):
        try:
            lat, bw, rms = fit_line(pts)
        except ValueError:
            continue
        out[kind] = {"bandwidth": float(f"{bw:.6g}"), "latency": float(f"{lat:.6g}"),
                     "rms_relative": float(f"{rms:.4g}")}
    return out


def both_ways(raw: dict, one_way: float) -> float | None:
    """Bytes/s per direction of the host link while it carries data both ways, fitted (as
    :func:`fit_line`) to the ``exchange outer`` times (``1·α + S/B``: both directions move ``S`` at
    once); None when the run has no such phase or its times give no bandwidth. At most ``one_way``:
    a direction loaded both ways is never faster, and a fit above it is the measurement's noise."""
    pts = [(1.0, float(s), statistics.median(ts)) for s, ts in (raw.get("exchange") or {}).get("outer") or () if ts]
    try:
        _, bw, _ = fit_line(pts)
    except ValueError:
        return None
    return min(bw, one_way)


def _fit_kind(raw: dict, kind: str, where: str):
    """``(latency, bandwidth, rms, points)`` of the ``inner`` or ``outer`` measurements; a fit that
    cannot be made is a failed run, worded with ``where``."""
    pts = _points(raw, kind)
    try:
        lat, bw, rms = fit_line(pts)
    except ValueError as e:
        raise CalibrateError(f"{where}: {e}", 1) from None
    return lat, bw, rms, pts


def fit(raw: dict) -> dict:
    """Per level ``{bandwidth, latency, rms, points}`` and the device ``flops`` from one run's result."""
    out = {"hosts": raw["hosts"], "per_host": raw["per_host"], "levels": {}, "backend": raw.get("backend"),
           "device": raw.get("device")}
    inner_lat = 0.0
    inner_bw = math.inf
    if raw["per_host"] > 1:
        inner_lat, inner_bw, rms, pts = _fit_kind(raw, "inner", "inside a host")
        out["levels"]["device"] = {"bandwidth": inner_bw, "latency": inner_lat, "rms_relative": rms,
                                   "points": len(pts), "apart": _by_kind(raw, "inner")}
    if raw["hosts"] > 1:
        lat, bw, rms, pts = _fit_kind(raw, "outer", "between hosts")
        # a cross-host hop pays both levels' latencies and the slower link (network.py): the host
        # level's own latency is the excess over the device level's
        out["levels"]["host"] = {"bandwidth": bw, "latency": max(0.0, lat - inner_lat), "rms_relative": rms,
                                 "points": len(pts), "path_latency": lat, "apart": _by_kind(raw, "outer"),
                                 "limited_by_device_level": bw >= inner_bw}
        both = both_ways(raw, bw)
        if both is not None:
            out["levels"]["host"]["both_ways"] = both
    def best(runs):   # per rank, the best rate over the sizes
        return [max(m["flop"] / m["seconds"] for m in per_rank if m["seconds"] > 0) for per_rank in runs]

    peak = best(raw["matmul"])
    # the device's training throughput (what the compute model divides the probe's FLOPs by) is the
    # transformer layer's; a run without that phase (an older microbench) falls back to the matmul's
    rates = best(raw["block"]) if raw.get("block") else peak
    out["flops"] = statistics.median(rates)
    out["flops_per_rank"] = rates
    out["matmul_flops"] = statistics.median(peak)
    out["alone"] = bool(raw.get("alone"))
    return out


# ---------------------------------------------------------------- the cluster file

def cluster_doc(fits: list[dict], on: str, rates: list[float | None], repeats: int) -> dict:
    """The YAML document: ``levels``, ``host``, ``flops`` (plain numbers in base units) and a
    ``calibration`` record the loader ignores (how it was measured; per-rate host figures)."""
    first = fits[0]
    levels = []
    for name, fanout in zip(LEVEL_NAMES, (first["hosts"], first["per_host"])):
        level = {"name": name, "fanout": fanout}
        got = first["levels"].get(name)
        if got:
            level["bandwidth"] = float(f"{got['bandwidth']:.6g}")
            level["latency"] = float(f"{got['latency']:.6g}")
            if got.get("both_ways"):
                level["both_ways"] = float(f"{got['both_ways']:.6g}")
        levels.append(level)
    flops = statistics.median(f["flops"] for f in fits)
    record = {"measured_on": on, "rate_mbit": rates[0], "repeats": repeats,
              "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "machine": f"{os.cpu_count()} CPU cores ({platform.machine()}), Python {platform.python_version()}",
              "backend": first.get("backend"), "device": first.get("device"),
              "flops_per_rank": [float(f"{x:.6g}") for x in first["flops_per_rank"]],
              "flops_from": "transformer layer, forward and backward" if "matmul_flops" in first else "matmul",
              "matmul_flops": float(f"{first.get('matmul_flops', flops):.6g}"),
              "ranks_measured": "one at a time" if first.get("alone") else "all at once",
              "fit": {name: {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in got.items()}
                      for name, got in first["levels"].items()}}
    if first["hosts"] > 1:
        record["by_rate"] = [{"rate_mbit": r, "bandwidth": float(f"{f['levels']['host']['bandwidth']:.6g}"),
                              "latency": float(f"{f['levels']['host']['latency']:.6g}"),
                              "rms_relative": float(f"{f['levels']['host']['rms_relative']:.4g}"),
                              **({"both_ways": float(f"{f['levels']['host']['both_ways']:.6g}")}
                                 if f["levels"]["host"].get("both_ways") else {})}
                             for r, f in zip(rates, fits)]
    doc = {"levels": levels, "host": "host", "flops": float(f"{flops:.6g}")}
    if on == "testbed":   # its hosts are namespaces of this machine: every rank computes on its cores
        doc.update(cores=cores_available(), cores_per="cluster")
    doc["calibration"] = record
    return doc


def _with_overhead(doc: dict, op: float, step: float) -> dict:
    """``doc`` with ``op_overhead`` and ``step_overhead`` placed before its ``calibration`` record."""
    out = {k: v for k, v in doc.items() if k != "calibration"}
    out.update(op_overhead=float(f"{op:.6g}"), step_overhead=float(f"{step:.6g}"))
    out["calibration"] = doc["calibration"]
    return out


def cores_available() -> int:
    """The CPU cores this process may run on (its affinity mask; the machine's count where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def write_yaml(doc: dict, path: Path, command: str) -> None:
    import yaml

    head = (f"# planc cluster file, written by `{command}` (docs/calibrate.md)\n"
            "# bandwidth: bytes/s per direction; latency: seconds; flops: one device's FLOP/s\n"
            + ("# cores: the CPU cores the devices of each 'cores_per' unit share\n" if "cores" in doc else "")
            + ("# op_overhead, step_overhead: seconds of a device the training runtime spends on each instruction "
               "and each step\n" if "op_overhead" in doc else ""))
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110))


def check_output(out: str) -> Path:
    """``OUT.yaml`` must be a file path in a writable folder (CalibrateError otherwise)."""
    path = Path(out)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise CalibrateError(f"planc calibrate: {out}: the cluster file must end in .yaml or .yml")
    if path.is_dir():
        raise CalibrateError(f"planc calibrate: {out} is a folder, not a file")
    folder = path.resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise CalibrateError(f"planc calibrate: cannot write {out}: folder {folder} does not exist or is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise CalibrateError(f"planc calibrate: cannot write {out}: the file is not writable")
    return path


# ---------------------------------------------------------------- running the ranks

def _spec(hosts: int, per_host: int, rate: float | None, repeats: int, timeout: float, backend: str,
          matmul=MATMUL) -> dict:
    return {"sizes_inner": list(INNER_SIZES), "sizes_outer": list(outer_sizes(rate)), "repeats": repeats,
            "matmul": list(matmul), "timeout": timeout, "backend": backend, "per_host": per_host}


def _result(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise CalibrateError("planc calibrate: rank 0 printed no result", 1)


def _with_progress(work, total: int, label: str):
    """Run ``work(on_phase)`` in a thread while a progress bar (planc.ui.progress) follows its phases."""
    from planc.ui import progress

    q: queue.Queue = queue.Queue()
    box: dict = {}

    def target():
        try:
            box["value"] = work(lambda name: q.put(name))
        except BaseException as e:   # handed to the caller's thread
            box["error"] = e
        finally:
            q.put(None)

    def items():
        while (name := q.get()) is not None:
            yield name

    t = threading.Thread(target=target, daemon=True)
    t.start()
    for _ in progress(items(), label, total=total):
        pass
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


PHASE_NAMES = ("matmul", "block", "p2p inner", "allreduce inner", "p2p outer", "exchange outer", "allreduce outer")


def _phase_list(hosts: int, per_host: int) -> list[str]:
    return [p for p in PHASE_NAMES if not (("inner" in p and per_host < 2) or ("outer" in p and hosts < 2))]


def run_testbed(hosts: int, per_host: int, rates: list[float], *, repeats: int = 3,
                timeout: float = DEFAULT_TIMEOUT, matmul=MATMUL, engine: bool = True) -> tuple[list[dict], dict | None]:
    """One testbed of ``hosts`` x ``per_host`` ranks; the microbenchmarks once per rate (Mbit/s), then
    (``engine``, two hosts or more) the training runtime's own time at the first rate (:func:`run_engine`):
    ``(raws, engine)``."""
    from planc.codegen import write_output
    from planc.compile import compile_file
    from planc.testbed import Testbed, TestbedError, available

    why = available()
    if why:
        raise CalibrateError(f"planc calibrate --on testbed: {why}; see docs/testbed.md")
    n = hosts * per_host
    names = _phase_list(hosts, per_host)
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
            with Testbed(hosts, rates[0]) as tb:
                for rate in rates:
                    tb.set_link_mbit(rate)
                    spec = _spec(hosts, per_host, rate, repeats, timeout, "gloo", matmul)

                    def work(on_phase, spec=spec):
                        return tb.launch(out, steps=1, timeout=timeout, launcher="direct",
                                         script=MICROBENCH, args=["--spec", json.dumps(spec)], memory=False,
                                         on_step=lambda i, _s: on_phase(names[i] if i < len(names) else "?"))

                    r = _with_progress(work, len(names), f"calibrate {hosts}x{per_host} at {rate:g} Mbit/s")
                    if r.returncode != 0:
                        raise CalibrateError(f"planc calibrate: the microbenchmarks failed at {rate:g} Mbit/s"
                                             f" ({'timed out' if r.timed_out else f'exit {r.returncode}'}):\n"
                                             f"{(r.failure or r.stdout)[-1500:]}", 1)
                    results.append(_result(r.stdout))
                measured = None
                if engine and hosts > 1:
                    tb.set_link_mbit(rates[0])
                    try:
                        measured = run_engine(tb, Path(tmp), hosts, per_host, rates[0], timeout)
                    except CalibrateError as e:   # the links and flops stand; the file says nothing of it
                        print(f"planc calibrate: warning: {e}\n  the file is written without op_overhead and "
                              f"step_overhead (the simulator then models no runtime time)", file=sys.stderr)
        except TestbedError as e:
            raise CalibrateError(f"planc calibrate --on testbed: {e}", 1) from None
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
    (``PLANC_SIGNAL_TRANSFERS=1``, as the iteration bench's signal bound), once per
    :data:`ENGINE_MICRO_BATCHES`: ``{"micro_batches": [...], "step_s": [median of the steps after the
    warm-up, ...], "plans": [plan.json, ...]}``."""
    from planc.codegen import write_output
    from planc.compile import compile_file
    from planc.lang.errors import PlanError

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
            raise CalibrateError(f"planc calibrate: the runtime's own time: its {hosts} x {per_host} plan does not "
                                 f"compile: {e}", 1) from None
        dest = folder / f"out{b}"
        write_output(compiled.plan_json, compiled.program, dest)

        def work(on_phase, dest=dest, b=b):
            return tb.launch(dest, steps=ENGINE_STEPS, timeout=timeout, comm_only=False, memory=False,
                             env={"PLANC_SIGNAL_TRANSFERS": "1"},
                             on_step=lambda i, _s: on_phase(f"engine, {b} micro-batches, step {i + 1}"))

        r = _with_progress(work, ENGINE_STEPS, f"calibrate the runtime's own time ({b} micro-batches)")
        steps = r.step_times[ENGINE_WARMUP:]
        if r.returncode != 0 or not steps:
            raise CalibrateError(f"planc calibrate: the runtime's own time could not be measured ({b} "
                                 f"micro-batches, {'timed out' if r.timed_out else f'exit {r.returncode}'}):\n"
                                 f"{(r.failure or r.stdout)[-1500:]}", 1)
        out["step_s"].append(statistics.median(steps))
        out["plans"].append(compiled.plan_json)
    return out


def _signal_input(plan: dict, cluster):
    """The simulator's input of a compiled engine plan under ``cluster`` with every transfer task moving
    one element (as ``PLANC_SIGNAL_TRANSFERS=1`` runs it)."""
    import dataclasses

    from planc.pipeline.gantt import plan_input

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
    import dataclasses

    from planc.pipeline.simulate import predict

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
    import yaml

    from planc.bench.accuracy import read_calibrated, substitute
    from planc.pipeline.gantt import cluster_of
    from planc.pipeline.schedules import build

    with tempfile.TemporaryDirectory(prefix="planc-calibrate-fit-") as tmp:
        path = Path(tmp) / "cal.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        cal = read_calibrated(path)
    rate = doc.get("calibration", {}).get("rate_mbit")
    sims = [_signal_input(plan, substitute(cluster_of(plan), cal, rate)) for plan in measured["plans"]]
    lists = [build("1f1b", len(plan["stages"]), plan["pipeline"]["micro_batches"]).per_stage
             for plan in measured["plans"]]
    got = fit_overhead(sims, lists, measured["step_s"])
    return {k: (float(f"{v:.6g}") if isinstance(v, float) else [float(f"{x:.6g}") for x in v])
            for k, v in got.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cluster(ranks: int, *, backend: str = "auto", repeats: int = 3, timeout: float = DEFAULT_TIMEOUT,
                matmul=MATMUL) -> dict:
    """``ranks`` ranks of this machine (one host), spawned here; rank 0's result."""
    names = _phase_list(1, ranks)
    spec = _spec(1, ranks, None, repeats, timeout, backend, matmul)
    port = str(_free_port())
    threads = max(1, (os.cpu_count() or 1) // ranks)

    def work(on_phase):
        import re

        step_re = re.compile(r"^step (\d+) comm [0-9.]+ s \(verified")
        logs = [tempfile.TemporaryFile(mode="w+") for _ in range(ranks)]
        procs = []
        killer = None
        try:
            for r in range(ranks):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                           LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                           OMP_NUM_THREADS=str(threads), PYTHONPATH="")
                procs.append(subprocess.Popen(
                    [sys.executable, str(MICROBENCH), "--spec", json.dumps(spec)], env=env, text=True,
                    stdout=subprocess.PIPE if r == 0 else logs[r], stderr=logs[r], stdin=subprocess.DEVNULL,
                    start_new_session=True))
            expired = threading.Event()

            def kill_all():
                expired.set()
                for p in procs:
                    if p.poll() is None:
                        p.kill()

            killer = threading.Timer(timeout, kill_all)
            killer.start()
            lines = []
            for line in procs[0].stdout:
                lines.append(line)
                m = step_re.match(line)
                if m and int(m.group(1)) < len(names):
                    on_phase(names[int(m.group(1))])
            codes = [p.wait() for p in procs]
            if expired.is_set() or any(codes):
                tails = []
                for r, f in enumerate(logs):
                    f.seek(0)
                    text = f.read().strip()
                    if text:
                        tails.append(f"rank {r}: {text[-600:]}")
                why = f"timed out after {timeout:g} s" if expired.is_set() else f"exit codes {codes}"
                raise CalibrateError(f"planc calibrate --on cluster: the microbenchmarks failed ({why})"
                                     + ("\n" + "\n".join(tails) if tails else ""), 1)
            return _result("".join(lines))
        finally:
            if killer is not None:
                killer.cancel()
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()

    return _with_progress(work, len(names), f"calibrate {ranks} ranks on this machine")


def calibrate(on: str, out: str, *, hosts: int = 2, per_host: int = 2, rates: list[float] | None = None,
              ranks: int = 2, backend: str = "auto", repeats: int = 3, timeout: float = DEFAULT_TIMEOUT,
              command: str = "planc calibrate", matmul=MATMUL) -> dict:
    """Measure, fit and write OUT.yaml; returns the document written (CalibrateError on a bad input)."""
    if on not in ("testbed", "cluster"):
        raise CalibrateError(f"planc calibrate: --on {on!r}: expected 'testbed' or 'cluster'")
    path = check_output(out)
    if repeats < 1 or timeout <= 0:
        raise CalibrateError("planc calibrate: --repeats must be >= 1 and --timeout positive")
    if on == "testbed":
        rates = list(rates or [DEFAULT_RATE])
        if any(not (r > 0 and math.isfinite(r)) for r in rates):
            raise CalibrateError(f"planc calibrate: --rate {rates}: every rate must be a positive Mbit/s")
        if not (1 <= hosts <= 250) or per_host < 1 or hosts * per_host < 2:
            raise CalibrateError(f"planc calibrate: --hosts {hosts} x --ranks-per-host {per_host}: need 1..250 "
                                 f"hosts, at least 1 rank each and 2 ranks in all")
        raws, engine = run_testbed(hosts, per_host, rates, repeats=repeats, timeout=timeout, matmul=matmul)
    else:
        engine = None
        if ranks < 1:
            raise CalibrateError(f"planc calibrate: --ranks {ranks}: need at least 1")
        if backend not in ("auto", "gloo", "nccl"):
            raise CalibrateError(f"planc calibrate: --backend {backend!r}: expected auto, gloo or nccl")
        rates = [None]
        raws = [run_cluster(ranks, backend=backend, repeats=repeats, timeout=timeout, matmul=matmul)]
    fits = [fit(r) for r in raws]
    doc = cluster_doc(fits, on, rates, repeats)
    if engine is not None:   # the runtime's own time, fitted under the links and flops just measured
        got = engine_fit(engine, doc)
        doc = _with_overhead(doc, got["op_overhead"], got["step_overhead"])
        doc["calibration"]["engine"] = {"micro_batches": engine["micro_batches"],
                                        "measured_s": [float(f"{x:.6g}") for x in engine["step_s"]],
                                        "simulated_s": got["simulated"], "simulated_without_s": got["simulated_without"],
                                        "schedule": "1f1b", "transfers": "one element (PLANC_SIGNAL_TRANSFERS=1)"}
    doc["calibration"]["samples"] = [{"rate_mbit": rate, "p2p": r["p2p"], "allreduce": r["allreduce"],
                                      **({"exchange": r["exchange"]} if r.get("exchange") else {})}
                                     for rate, r in zip(rates, raws)]
    write_yaml(doc, path, command)
    return doc


def summary(doc: dict) -> str:
    """A few lines: each level's fitted figures and the device throughput."""
    lines = []
    fits = doc["calibration"]["fit"]
    for level in doc["levels"]:
        f = fits.get(level["name"])
        if f:
            lines.append(f"  {level['name']} x {level['fanout']}: bandwidth {f['bandwidth'] / 1e6:.4g} MB/s, "
                         f"latency {f['latency'] * 1e6:.4g} us (fit over {f['points']} sizes, "
                         f"rms relative residual {f['rms_relative'] * 100:.1f}%)"
                         + (f"; both ways {f['both_ways'] / 1e6:.4g} MB/s per direction" if f.get("both_ways") else ""))
        else:
            lines.append(f"  {level['name']} x {level['fanout']}: one unit, nothing to measure")
    rec = doc.get("calibration") or {}
    peak = rec.get("matmul_flops")
    lines.append(f"  device: {doc['flops'] / 1e9:.4g} GFLOP/s ({rec.get('flops_from', 'matmul')}, median over ranks, "
                 f"{rec.get('ranks_measured', 'all at once')})"
                 + (f"; matmul peak {peak / 1e9:.4g} GFLOP/s" if peak else ""))
    if doc.get("cores") is not None:
        per = doc.get("cores_per", "host")
        lines.append(f"  cores: {doc['cores']} per {per} (the devices of each {per} compute on "
                     f"{doc['cores']} shared CPU core(s))")
    if doc.get("op_overhead") is not None:
        eng = rec.get("engine") or {}
        lines.append(f"  runtime: {doc['op_overhead'] * 1e3:.3g} ms per instruction, {doc['step_overhead'] * 1e3:.3g} ms "
                     f"per step (1F1B with one-element transfers at {eng.get('micro_batches')} micro-batches: "
                     f"measured {eng.get('measured_s')} s, simulated without it {eng.get('simulated_without_s')} s)")
    return "\n".join(lines)
