"""`python -m benchmarks bench regime`: what ZeRO-1, recompute and bf16 cost and save, measured by the runtime.

`plans/gpt-bench-2x2.plan` (GPT, 4 layers of width 256; stages of [2, 2] devices, data 2 each; 8
micro-batches of 8 rows, eager 1F1B, Adam) launched on this machine's CPU ranks (gloo, no shaped
links: the cost of the settings, not of the network) under five training regimes, each with
``train.py --memory-stats``: every stage rank writes the bytes it holds (parameters, gradient
buckets, fp32 masters kept apart from the parameters, optimizer state) and the peak of the bytes
autograd saved for backward over its micro-batches in flight. Side by side: the per-rank figures
(the largest rank), the memory model's prediction for the same parts (plan.json
``pipeline.stages[].memory``, docs/memory.md) and the median step time. Shows: optimizer state
per rank with ``zero = 1`` is 1/d of ``zero = 0`` (d = 2), recompute keeps no saved activations
(the stage inputs the engine holds in every mode aside) for one more forward per micro-batch,
bf16's masters double the fp32 bytes a rank holds for its parameters.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.bench.launching import launch_sh

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "plans" / "gpt-bench-2x2.plan"
STEPS = 5          # step 0 warms up
VARIANTS = {       # label -> train settings added to the plan's
    "fp32": "",
    "fp32, zero = 1": "zero = 1",
    "fp32, recompute": "recompute = full",
    "bf16": "precision = bf16",
    "bf16, zero = 1, recompute": "precision = bf16, zero = 1, recompute = full",
    "fp32, zero = 2": "zero = 2",
    "fp32, zero = 3": "zero = 3",
    "fp32, zero = 3, no prefetch": "zero = 3, zero_prefetch = false",
    "fp32, zero = 3, keep gathered": "zero = 3, zero_keep_gathered = true",
}


def _compile(text: str, out: Path) -> dict:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    src = PLAN.parent / f".bench-regime-{out.name}.plan"   # beside the bundled plan: its model path is relative
    try:
        src.write_text(text)
        compiled = compile_file(src, probe=True)
    finally:
        src.unlink(missing_ok=True)
    write_output(compiled.plan_json, compiled.program, out)
    return compiled.plan_json


def _launch(out: Path, stats: Path, timeout: float = 600) -> list[float]:
    text = launch_sh(out, "--steps", STEPS, "--memory-stats", stats, bench="regime", timeout=timeout)
    return [float(t) for t in re.findall(r"^step \d+ loss \S+ time ([0-9.]+) s", text, re.M)]


def measure() -> list[dict]:
    base = PLAN.read_text()
    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-bench-regime-") as tmp:
        for i, (label, settings) in enumerate(VARIANTS.items()):
            text = base.replace("precision = fp32", "") if "precision" in settings else base
            text = text.replace("train {", "train {\n    " + settings, 1) if settings else text
            out = Path(tmp) / f"v{i}"
            plan = _compile(text, out)
            stats = Path(tmp) / f"stats{i}"
            times = _launch(out, stats)
            ranks = [json.loads(p.read_text()) for p in sorted(stats.glob("rank*.json"))]
            predicted = [st.get("memory") or {} for st in plan["pipeline"].get("stages", [])]
            rows.append({"what": label, "step_s": statistics.median(times[1:]) if len(times) > 1 else None,
                         "measured": {k: max(r.get(k, 0) for r in ranks) for k in
                                      ("parameter_bytes", "gradient_bytes", "master_bytes", "optimizer_state_bytes",
                                       "peak_saved_activation_bytes")},
                         "predicted": {k: max(p.get(k, 0) for p in predicted) for k in
                                       ("parameters", "gradients", "optimizer", "activations")}})
    return rows


def _mb(x) -> str:
    return "—" if x is None else f"{x / 2**20:.2f}"


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| regime | parameters MiB | gradients MiB | masters + optimizer state MiB (model) | "
             "÷ fp32's | saved activations MiB (model: activations) | step s | ÷ fp32's |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m, p = r["measured"], r["predicted"]
        opt = m["master_bytes"] + m["optimizer_state_bytes"]
        base_opt = base["measured"]["master_bytes"] + base["measured"]["optimizer_state_bytes"]
        step, base_step = r["step_s"], base["step_s"]
        ratio = "—" if step is None or not base_step else f"{step / base_step:.2f}"
        lines.append(f"| {r['what']} | {_mb(m['parameter_bytes'])} ({_mb(p['parameters'])}) | "
                     f"{_mb(m['gradient_bytes'])} ({_mb(p['gradients'])}) | {_mb(opt)} ({_mb(p['optimizer'])}) | "
                     f"{opt / base_opt:.2f} | {_mb(m['peak_saved_activation_bytes'])} ({_mb(p['activations'])}) | "
                     f"{'—' if step is None else f'{step:.3f}'} | "
                     f"{ratio} |")
    return "\n".join(lines)


def run() -> str:
    import torch

    t0 = time.monotonic()
    rows = measure()
    head = (f"`{PLAN.relative_to(ROOT)}` on 4 local CPU ranks (gloo), {STEPS} steps, median of steps 1–{STEPS - 1}; "
            f"each figure the largest stage rank's, the memory model's in parentheses. Machine: {os.cpu_count()} CPU "
            f"cores ({platform.machine()}), Python {platform.python_version()}, torch {torch.__version__}; 1-minute "
            f"load {os.getloadavg()[0]:.1f} at the end; the bench took {time.monotonic() - t0:.0f} s.")
    return head + "\n\n" + table(rows) + "\n"
