"""The iteration bench's launches: one program over every rate in one launch (the link rate changed
between segments, :func:`_over_rates`), and the pooling of launches and rounds."""

from __future__ import annotations

import statistics
from pathlib import Path

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b")
WARMUP, MEASURED, COMPUTE_MEASURED = 1, 5, 3


def launch_steps(rates, measured: int) -> int:
    """Steps one ``_over_rates`` launch runs: a discarded and ``measured`` steps per rate."""
    return (WARMUP + measured) * len(rates)


def _over_rates(tb, out: Path, rates, *, measured: int, timeout: float, script=None, extra_args=(),
                env: dict | None = None, bar=None, what: str = "") -> dict:
    """One launch across every rate: returns {"per_rate": [{rate, steps, median}], "peak_rss_kb", ...}.
    ``bar`` (a ``planc.commands.ui.Bar``): advanced by one per step, showing ``what`` and the rate."""
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
