"""`python -m benchmarks bench nic PLAN... --cluster CAL.yaml [--rates 25]`: the host NIC order, measured side by side.

For each plan and rate the plan is compiled under the calibrated cluster at that rate (the host
link's figures from the file, as `python -m benchmarks bench accuracy` does), once per schedule (1f1b,
eager_1f1b), with the model probe, so the compiler decides on a host NIC order itself
(docs/simulator.md). Every compiled output whose plan.json has an order is then launched on the
testbed at that rate twice per repetition, interleaved: with the order (the default) and with
a copy of the output without ``pipeline.nic_order`` (the same plan, sends as they come). Per launch the first ``WARMUP`` steps are
discarded; the table gives the median step time of the rest over all repetitions, the ratio, the
simulator's two predictions, and the link bound (the busiest host link's bytes ÷ the rate). The
losses of the two runs are compared after the runs (outside every timed step): they must be equal.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.variant import variant

WARMUP, MEASURED, REPEATS = 2, 4, 2
SCHEDULES = ("1f1b", "eager_1f1b")
DEFAULT_PLANS = ("plans/gpt-bench-2x2.plan",)


class NicBenchError(ValueError):
    pass


def measure(plans, cal_path: str, rates) -> list[dict]:
    from benchmarks.bench.accuracy import read_calibrated
    from benchmarks.bench.iteration import compile_variants, link_bytes
    from benchmarks.testbed import Testbed

    read_calibrated(cal_path)   # a bad file fails before anything is compiled
    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-bench-nic-") as tmp:
        for k, plan_path in enumerate(plans):
            for rate in rates:
                folder = Path(tmp) / f"{k}-{rate:g}"
                folder.mkdir()
                variants = compile_variants(plan_path, folder, cal_path, rate, schedules=SCHEDULES)
                first = next(iter(variants.values()))["plan"]
                link = link_bytes(first)
                bound = link["busiest_bytes"] / (rate * 1e6 / 8)
                times: dict = {}
                losses: dict = {}
                with Testbed(len(first["cluster"]["hosts"]), rate) as tb:
                    for _ in range(REPEATS):
                        for s, v in variants.items():
                            if not v["plan"]["pipeline"].get("nic_order"):
                                continue
                            unordered = variant(v["out"], "unordered", drop_nic_order=True)
                            for nic, out in (("1", v["out"]), ("0", unordered)):
                                r = tb.launch(out, steps=WARMUP + MEASURED, timeout=900, comm_only=False)
                                if r.returncode != 0:
                                    raise NicBenchError(f"{plan_path} {s} at {rate:g} Mbit/s ("
                                                        f"{'with' if nic == '1' else 'without'} the NIC order) "
                                                        f"failed:\n{r.failure}")
                                times.setdefault((s, nic), []).extend(r.step_times[WARMUP:])
                                losses.setdefault((s, nic), r.losses)
                for s, v in variants.items():
                    pred = v["plan"]["pipeline"]["predicted"]["schedules"][s]
                    row = {"plan": plan_path, "name": first["name"], "rate": rate, "schedule": s,
                           "nic_order": bool(v["plan"]["pipeline"].get("nic_order")),
                           "predicted_ordered": pred["iteration"] if pred.get("nic_ordered") else None,
                           "predicted_unordered": pred.get("unordered_iteration"), "link_bound": bound}
                    if (s, "1") in times:
                        row["ordered"] = statistics.median(times[(s, "1")])
                        row["unordered"] = statistics.median(times[(s, "0")])
                        row["ordered_steps"], row["unordered_steps"] = times[(s, "1")], times[(s, "0")]
                        row["losses_equal"] = losses[(s, "1")] == losses[(s, "0")]
                        if not row["losses_equal"]:
                            raise NicBenchError(f"{plan_path} {s}: the losses differ with and without the NIC "
                                                f"order: {losses[(s, '1')]} against {losses[(s, '0')]}")
                    rows.append(row)
    return rows


def _f(x, fmt="{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def markdown(rows: list[dict], command: str) -> str:
    lines = ["### The host NIC order, measured side by side", "",
             f"Command: `{command}` (docs/benchmarks.md; {REPEATS} launches of {WARMUP} + {MEASURED} steps per "
             "variant, interleaved, the first steps of each discarded). Seconds per step, medians; predicted: "
             "the compiler's simulator under the same cluster file.", "",
             "| plan | Mbit/s | schedule | order kept | predicted ordered | predicted unordered | measured ordered "
             "| measured unordered | ordered ÷ unordered | ordered ÷ link bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["ordered"] / r["unordered"] if r.get("ordered") else None
        vs_bound = r["ordered"] / r["link_bound"] if r.get("ordered") and r["link_bound"] else None
        lines.append(f"| {r['name']} | {r['rate']:g} | {r['schedule']} | {'yes' if r['nic_order'] else 'no'} | "
                     f"{_f(r['predicted_ordered'])} | {_f(r['predicted_unordered'])} | {_f(r.get('ordered'))} | "
                     f"{_f(r.get('unordered'))} | {_f(ratio)} | {_f(vs_bound)} |")
    lines.append("")
    lines.append("Losses with and without the order: identical in every run (checked after the runs).")
    return "\n".join(lines)


def run(plans=None, cluster: str | None = None, rates=None, json_path: str | None = None) -> str:
    if not cluster:
        return ("_Skipped: `python -m benchmarks bench nic` needs `--cluster CALIBRATED.yaml` (from `python -m benchmarks calibrate --on "
                "testbed`): the order is decided on the calibrated link and compute figures._\n")
    from benchmarks.testbed.netns import available
    why = available()
    if why:
        return f"_Skipped: the testbed cannot be built here: {why} (docs/testbed.md)._\n"
    plans = list(plans or DEFAULT_PLANS)
    rates = list(rates or [25.0])
    rows = measure(plans, cluster, rates)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1, default=str))
    command = (f"python -m benchmarks bench nic {' '.join(plans)} --cluster {cluster} --rates {','.join(f'{r:g}' for r in rates)}")
    return markdown(rows, command)
