"""Fitting the microbenchmarks' medians: each level's bandwidth and latency under the cost model's own
formulas (docs/cost-model.md) by least squares, and the device ``flops``."""

from __future__ import annotations

import math
import statistics

INNER_SIZES = (4096, 65536, 1 << 20, 4 << 20)   # bytes, inside a host
MATMUL = (256, 512)
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
