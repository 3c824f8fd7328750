"""`python -m benchmarks bench schedules`: planc's pipeline schedules on devices of fixed speed, beside the
simulator and beside torch's own (issue 48).

A compute-bound GPT (examples/gpt.py, 8 blocks of width 256, vocabulary 64) on pipe 4 over 2 testbed
hosts of 2 ranks (host links 1000 Mbit/s), every rank under a CPU quota of 0.4 core (``Testbed(
cpus_per_rank=)``: a bubble costs time, as on a GPU), 8 micro-batches of 8 rows, SGD, fp32. One plan
text per schedule (:func:`plan_text`): ``1f1b`` and ``zb_h1`` on 4 stages of 2 blocks, ``interleaved_1f1b
(virtual = 2)`` and ``zbv`` on 8 stages of 1 block (the embedding on the first stage, the head on the
last, besides). The plans are compiled against a cluster file calibrated on the same testbed under the
same quota (``benchmarks.calibrate.calibrate_testbed(cpus_per_rank=)``, run first; ``cluster=`` gives
one instead), so the simulator's ``pipeline.predicted_iteration`` prices a quota'd rank's compute and the
runtime's own time per instruction.

torch's baselines on the same layers, cut, micro-batches, loss and optimizer, gloo, the same quota:
``ScheduleInterleaved1F1B`` and ``ScheduleZBVZeroBubble`` (``benchmarks/bench/torch_pp_schedules.py``,
on the interleaved and the zbv plan's outputs). Every program is launched ``rounds`` times, round-robin
in one testbed (a drift of the machine's load falls on all alike); reported: the median step of steps
1..N-1 pooled over the rounds, the speedup over planc's 1f1b measured and predicted, and whether each
run's losses equal planc 1f1b's (rtol 1e-4, checked after the runs).

Needs root and iproute2; otherwise ``run()`` returns a note saying why it was skipped.
"""
from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "benchmarks" / "bench" / "torch_pp_schedules.py"
HOSTS, PER_HOST, LINK_MBIT = 2, 2, 1000.0
CPUS_PER_RANK = 0.4
BLOCKS, HIDDEN, SEQ, VOCAB = 8, 256, 64, 64
MICRO_BATCH, MICRO_BATCHES = 8, 8
STEPS = 6            # step 0 warms up
ROUNDS = 3
PIPE = HOSTS * PER_HOST
BUBBLE = (PIPE - 1) / (MICRO_BATCHES + PIPE - 1)   # 1F1B's idle share of a step: (S - 1) / (B + S - 1)

SCHEDULES = {   # label -> (the plan's schedule, stages)
    "1f1b": ("1f1b", PIPE),
    "zb_h1": ("zb_h1", PIPE),
    "interleaved": ("interleaved_1f1b(virtual = 2)", 2 * PIPE),
    "zbv": ("zbv", 2 * PIPE),
}
TORCH = {"interleaved": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble"}   # beside planc's twin

PLAN = """
plan gpt_schedules {{
  cluster "{CLUSTER}"
  parallel {{ pipe = {PIPE} }}
  model "{GPT}:build" {{ layers = {BLOCKS}, hidden = {HIDDEN}, heads = 4, seq = {SEQ}, vocab = {VOCAB} }}
  loss  "{GPT}:loss"
  data  "{GPT}:batches"
{STAGES}
  train {{ micro_batch = {MICRO_BATCH}, micro_batches = {MICRO_BATCHES}, steps = {STEPS}, schedule = {SCHEDULE},
          optimizer = sgd(lr = 0.05), precision = fp32, seed = 1234 }}
}}
"""


def plan_text(schedule: str, stages: int, cluster: str | os.PathLike) -> str:
    """The bench's GPT under ``schedule`` on ``stages`` stages of equal blocks (the embedding with the
    first, the head with the last), compiled against the cluster file ``cluster``."""
    per = BLOCKS // stages
    cut = [0] + [1 + i * per for i in range(1, stages)] + [BLOCKS + 2]
    lines = "\n".join(f"  stage {i} : layers {cut[i]}..{cut[i + 1]}" for i in range(stages))
    return PLAN.format(CLUSTER=cluster, PIPE=PIPE, GPT=ROOT / "examples" / "gpt.py", BLOCKS=BLOCKS, HIDDEN=HIDDEN,
                       SEQ=SEQ, VOCAB=VOCAB, STAGES=lines, MICRO_BATCH=MICRO_BATCH, MICRO_BATCHES=MICRO_BATCHES,
                       STEPS=STEPS, SCHEDULE=schedule)


def calibrated(tmp: Path, cluster: str | None, cpus: float) -> tuple[Path, dict]:
    """The cluster file the plans compile against and its document: ``cluster``, which must have been
    measured under the bench's quota, else one calibrated now on the bench's testbed."""
    import yaml

    from benchmarks.calibrate import calibrate_testbed
    from planc.calibrate import CalibrateError

    if cluster is None:
        path = tmp / "cal.yaml"
        calibrate_testbed(str(path), hosts=HOSTS, per_host=PER_HOST, rates=[LINK_MBIT], cpus_per_rank=cpus,
                          command=f"python -m benchmarks bench schedules (calibrated under {cpus:g} core a rank)")
    else:
        path = Path(cluster).resolve()
        if not path.is_file():
            raise CalibrateError(f"benchmarks bench schedules: --cluster {cluster}: no such file")
    doc = yaml.safe_load(path.read_text()) or {}
    doc = doc.get("cluster", doc) or {}
    record = doc.get("calibration") or {}
    if record.get("cpus_per_rank") is None or abs(float(record["cpus_per_rank"]) - cpus) > 1e-6:
        raise CalibrateError(f"benchmarks bench schedules: --cluster {cluster}: calibrated under "
                             f"{record.get('cpus_per_rank')} core a rank, the bench runs under {cpus:g} "
                             f"(`python -m benchmarks calibrate --on testbed ... --cpus-per-rank {cpus:g}`)")
    return path, doc


def _compile(tmp: Path, label: str, cluster: Path) -> tuple[Path, dict]:
    from planc.driver.compile import compile_file
    from planc.output.codegen import write_output

    schedule, stages = SCHEDULES[label]
    src = tmp / f"{label}.plan"
    src.write_text(plan_text(schedule, stages, cluster))
    compiled = compile_file(src, probe=True)
    out = tmp / label
    write_output(compiled.plan_json, compiled.program, out)
    return out, compiled.plan_json


def measure(cluster: str | None = None, rounds: int = ROUNDS, cpus: float = CPUS_PER_RANK,
            timeout: float = 600) -> tuple[list[dict], dict]:
    """Every program ``rounds`` times, round-robin: ``(rows, the cluster file's document)``."""
    from benchmarks.bench.zero3 import losses_equal
    from benchmarks.testbed import Testbed

    with tempfile.TemporaryDirectory(prefix="planc-bench-schedules-") as tmp:
        tmp = Path(tmp)
        cal, doc = calibrated(tmp, cluster, cpus)
        built = {label: _compile(tmp, label, cal) for label in SCHEDULES}
        rows = [{"what": f"planc {SCHEDULES[label][0]}", "schedule": label, "out": out, "launch": {},
                 "predicted": plan["pipeline"].get("predicted_iteration")} for label, (out, plan) in built.items()]
        rows += [{"what": f"torch {kind}", "schedule": label, "out": built[label][0], "predicted": None,
                  "launch": {"script": WORKER, "args": ("--out", str(built[label][0]), "--schedule", label)}}
                 for label, kind in TORCH.items()]
        for row in rows:
            row.update(steps=[], round_medians=[], losses=[], error=None)
        with Testbed(HOSTS, LINK_MBIT, cpus_per_rank=cpus) as tb:
            for _ in range(rounds):
                for row in rows:
                    if row["error"]:
                        continue
                    r = tb.launch(row["out"], steps=STEPS, timeout=timeout, comm_only=False, launcher="direct",
                                  memory=False, **row["launch"])
                    if r.returncode != 0 or len(r.step_times) != STEPS:
                        row["error"] = (r.failure or r.stdout or f"exit {r.returncode}")[-600:]
                        continue
                    row["steps"] += r.step_times[1:]
                    row["round_medians"].append(statistics.median(r.step_times[1:]))
                    row["losses"].append(r.losses)
    base = rows[0]
    for row in rows:
        row["ok"] = row["error"] is None and bool(row["steps"])
        row["measured"] = statistics.median(row["steps"]) if row["ok"] else None
        row["same_losses"] = row["ok"] and base["ok"] and all(
            losses_equal(mine, theirs) for mine, theirs in zip(row["losses"], base["losses"]))
    return rows, doc


def _gain_share(measured: float | None, predicted: float | None) -> float | None:
    """The measured speedup's gain as a share of the predicted one's: (m − 1) ÷ (p − 1)."""
    if measured is None or predicted is None or abs(predicted - 1) < 1e-9:
        return None
    return (measured - 1) / (predicted - 1)


def summary(rows: list[dict]) -> dict:
    """Per row label: measured and predicted speedup over planc's 1f1b, the gain share, the simulator's
    error (p − m) ÷ m, and planc ÷ torch for planc rows with a torch twin."""
    base = rows[0]
    torch_of = {row["schedule"]: row for row in rows if row["what"].startswith("torch ")}
    out = {}
    for row in rows:
        m, p = row.get("measured"), row.get("predicted")
        speed = base["measured"] / m if m and base.get("measured") else None
        speed_p = base["predicted"] / p if p and base.get("predicted") else None
        twin = torch_of.get(row["schedule"]) if row["what"].startswith("planc ") else None
        out[row["what"]] = {"speedup": speed, "speedup_predicted": speed_p,
                            "gain_share": _gain_share(speed, speed_p), "error": (p - m) / m if m and p else None,
                            "vs_torch": m / twin["measured"] if twin and m and twin.get("measured") else None}
    return out


def table(rows: list[dict]) -> str:
    def f(x, d=3):
        return "—" if x is None else f"{x:.{d}f}"

    def pct(x, signed=False):
        return "—" if x is None else (f"{x * 100:+.1f} %" if signed and round(x * 1000) else
                                      f"{x * 100:.1f} %" if signed else f"{x * 100:.0f} %")
    s = summary(rows)
    lines = ["| run | step s (median) | ÷ 1f1b: speedup | predicted s | predicted speedup | measured gain ÷ "
             "predicted gain | predicted ÷ measured − 1 | planc ÷ torch | losses = 1f1b's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r = s[row["what"]]
        share = None if row is rows[0] else r["gain_share"]
        lines.append(f"| {row['what']} | {f(row['measured']) if row['ok'] else 'failed'} | {f(r['speedup'], 2)} | "
                     f"{f(row['predicted'])} | {f(r['speedup_predicted'], 2)} | {pct(share)} | "
                     f"{pct(r['error'], signed=True)} | {f(r['vs_torch'], 2)} | "
                     f"{'yes' if row['same_losses'] else 'no'} |")
    failed = [f"{row['what']}: {row['error']}" for row in rows if not row["ok"]]
    return "\n".join(lines) + ("\n\nFailed:\n\n```\n" + "\n".join(failed) + "\n```" if failed else "")


def targets(rows: list[dict]) -> str:
    """Issue 48's targets, each with its figure and met or not (— where a run it needs failed)."""
    s = summary(rows)
    by = {row["schedule"]: s[row["what"]] for row in rows if row["what"].startswith("planc ")}
    zb, inter, zbv = (by.get(k, {}) for k in ("zb_h1", "interleaved", "zbv"))
    errors = [abs(v["error"]) for v in s.values() if v["error"] is not None]
    vs_torch = (inter.get("vs_torch"), zbv.get("vs_torch"))

    def times(v):
        return "—" if v is None else f"{v:.2f}x"

    def percent(v, d=0):
        return "—" if v is None else f"{v * 100:.{d}f} %"

    def judged(what, shown, value, passes):
        return f"{what}: {shown}, " + ("—" if value is None else "met" if passes(value) else "**not met**")
    parts = [
        judged("zb_h1 ≥ 1.1x 1f1b", times(zb.get("speedup")), zb.get("speedup"), lambda v: v >= 1.1),
        judged("zb_h1 ≥ 70 % of its predicted gain", percent(zb.get("gain_share")), zb.get("gain_share"),
               lambda v: v >= 0.7),
        judged("interleaved(2) faster than 1f1b", times(inter.get("speedup")), inter.get("speedup"), lambda v: v > 1),
        judged("interleaved(2) ≥ 50 % of its predicted gain", percent(inter.get("gain_share")),
               inter.get("gain_share"), lambda v: v >= 0.5),
        judged("the simulator within 10 % of every measured figure", f"worst {percent(max(errors, default=None), 1)}",
               max(errors, default=None), lambda v: v <= 0.10),
        judged("planc ≤ 1.0x torch's step", f"interleaved {times(vs_torch[0])}, zbv {times(vs_torch[1])}",
               None if None in vs_torch else max(vs_torch), lambda v: v <= 1.0),
    ]
    return "Targets (issue 48): " + "; ".join(parts) + "."


def _cluster_line(doc: dict) -> str:
    """The calibrated figures the simulator prices the plans with."""
    def num(key, scale):
        return "?" if doc.get(key) is None else f"{float(doc[key]) * scale:.3g}"
    return (f"flops {num('flops', 1e-9)} GFLOP/s a rank, the runtime's own time {num('op_overhead', 1e3)} ms an "
            f"instruction and {num('step_overhead', 1e3)} ms a step")


def run(cluster: str | None = None, rounds: int = ROUNDS, cpus_per_rank: float | None = None) -> str:
    from benchmarks.bench.testbed import skipped_note
    if note := skipped_note():
        return note
    import torch

    cpus = CPUS_PER_RANK if cpus_per_rank is None else float(cpus_per_rank)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    rows, cal = measure(cluster, rounds, cpus)
    load1 = os.getloadavg()[0]
    spread = "; ".join(f"{row['what']} " + "/".join(f"{m:.3f}" for m in row["round_medians"])
                       for row in rows if row["round_medians"])
    head = (f"Testbed: {HOSTS} hosts × {PER_HOST} gloo ranks, host links {LINK_MBIT:g} Mbit/s, every rank under a "
            f"CPU quota of {cpus:g} core ({cal['calibration'].get('cpu_quota', '?')}); GPT {BLOCKS} blocks of width "
            f"{HIDDEN}, seq {SEQ}, vocabulary {VOCAB}, pipe {PIPE}, {MICRO_BATCHES} micro-batches of {MICRO_BATCH} "
            f"rows, SGD, fp32; 1f1b and zb_h1 on {PIPE} stages, interleaved(2) and zbv on {2 * PIPE}. Median of steps "
            f"1–{STEPS - 1} over {rounds} rounds, round-robin. Predicted: plan.json `pipeline.predicted_iteration`, "
            f"each plan compiled against `cluster \"cal.yaml\"` calibrated first on this testbed under the same quota "
            f"({'given' if cluster else 'in this run'}: {_cluster_line(cal)}). Machine: {os.cpu_count()} CPU "
            f"cores ({platform.machine()}), Python {platform.python_version()}, torch {torch.__version__}; 1-minute "
            f"load {load0:.1f} at the start, {load1:.1f} at the end (other jobs share the cores: a quota is a "
            f"ceiling); the bench took {time.monotonic() - t0:.0f} s.")
    bubble = (f"1F1B's bubble: (S − 1) ÷ (B + S − 1) = {PIPE - 1}/{MICRO_BATCHES + PIPE - 1} = {BUBBLE:.0%} of "
              f"its step (a schedule without bubbles at most {1 / (1 - BUBBLE):.3f}x faster). Per-round medians (s): "
              f"{spread}.")
    return head + "\n\n" + table(rows) + "\n\n" + bubble + " " + targets(rows) + "\n"


if __name__ == "__main__":
    print(run())
