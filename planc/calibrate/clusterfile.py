"""The cluster file ``planc calibrate`` writes: its document, the YAML, the output path's checks, a summary."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import yaml

from planc.calibrate.fit import LEVEL_NAMES, CalibrateError


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
    head = (f"# planc cluster file, written by `{command}` (docs/calibrate.md)\n"
            "# bandwidth: bytes/s per direction; latency: seconds; flops: one device's FLOP/s, measured in fp32 and\n"
            "# used for every precision (or one per precision: flops: {fp32: ..., bf16: ...}, docs/language.md)\n"
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


def samples_record(rates: list, raws: list[dict]) -> list[dict]:
    """The ``calibration.samples`` record: every rate's raw p2p, all-reduce and exchange medians."""
    return [{"rate_mbit": rate, "p2p": r["p2p"], "allreduce": r["allreduce"],
             **({"exchange": r["exchange"]} if r.get("exchange") else {})}
            for rate, r in zip(rates, raws)]


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
    flops = doc["flops"]   # a FLOP rate, or one per precision ({fp32: ..., bf16: ...}) in an edited file
    rate = (f"{flops / 1e9:.4g} GFLOP/s" if not isinstance(flops, dict) else
            ", ".join(f"{v / 1e9:.4g} GFLOP/s in {k}" for k, v in sorted(flops.items())))
    lines.append(f"  device: {rate} ({rec.get('flops_from', 'matmul')}, median over ranks, "
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
