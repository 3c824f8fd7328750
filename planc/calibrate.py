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
            + ("# cores: the CPU cores the devices of each 'cores_per' unit share\n" if "cores" in doc else ""))
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
                timeout: float = DEFAULT_TIMEOUT, matmul=MATMUL) -> list[dict]:
    """One testbed of ``hosts`` x ``per_host`` ranks; the microbenchmarks once per rate (Mbit/s)."""
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
        except TestbedError as e:
            raise CalibrateError(f"planc calibrate --on testbed: {e}", 1) from None
    return results


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
        raws = run_testbed(hosts, per_host, rates, repeats=repeats, timeout=timeout, matmul=matmul)
    else:
        if ranks < 1:
            raise CalibrateError(f"planc calibrate: --ranks {ranks}: need at least 1")
        if backend not in ("auto", "gloo", "nccl"):
            raise CalibrateError(f"planc calibrate: --backend {backend!r}: expected auto, gloo or nccl")
        rates = [None]
        raws = [run_cluster(ranks, backend=backend, repeats=repeats, timeout=timeout, matmul=matmul)]
    fits = [fit(r) for r in raws]
    doc = cluster_doc(fits, on, rates, repeats)
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
    return "\n".join(lines)
