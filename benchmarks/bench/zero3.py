"""`python -m benchmarks bench zero3`: ZeRO-3's step time on the testbed against ZeRO-1 and against torch.

GPT (examples/gpt.py, 6 blocks of width 256) on 2 hosts x 4 gloo ranks, pipe 2 across the hosts and
data 4 inside each (stage s on host s: the layout a torch or DeepSpeed user writes), 1F1B, 4
micro-batches of 8 rows, Adam, host links shaped to 400 Mbit/s. Side by side in one testbed, each
launched the same way (one process per rank, ``launcher="direct"``):

- planc ``zero = 1`` (parameters whole on every rank: the reference point);
- planc ``zero = 3`` with prefetch (the default), without (``zero_prefetch = false``: every gather on
  the critical path), and ``zero_keep_gathered = true`` (one gather per layer and step);
- torch's own ``fully_shard`` (FSDP2, every layer) + ``torch.distributed.pipelining``'s
  ``Schedule1F1B`` on the same model, cut, data and optimizer (``benchmarks/bench/torch_fsdp_pp.py``),
  configured both ways planc runs: gathered per micro-batch (beside planc's default) and kept for the
  step (beside ``zero_keep_gathered = true``).

Reported: the median step time of steps 1..N-1, its ratio to planc's zero 1, the simulator's
prediction for planc's variants (plan.json ``pipeline.predicted_iteration``), and whether each run's
losses equal zero 1's (rtol 1e-4; checked after the runs, outside any timed region).

Needs root and iproute2; otherwise ``run()`` returns a note saying why it was skipped.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOSTS, PER_HOST, LINK_MBIT = 2, 4, 400.0
STEPS = 5            # step 0 warms up
BLOCKS, HIDDEN = 6, 256

PLAN = """
plan gpt_zero3 {{
  cluster {{
    level node x 2 : bandwidth 50 MB/s, latency 100 us
    level gpu  x 4 : bandwidth 3 GB/s,  latency 20 us
    host = node
    flops = 20 GFLOP/s
  }}
  model "{GPT}:build" {{ layers = {BLOCKS}, hidden = {HIDDEN}, heads = 4, seq = 64, vocab = 256 }}
  loss  "{GPT}:loss"
  data  "{GPT}:batches"
  stage 0 : layers 0..{CUT} on devices 0..4 as (data = 4)
  stage 1 : layers {CUT}..{END} on devices 4..8 as (data = 4)
  reduce gradients over data
  train {{ micro_batch = 8, micro_batches = 4, steps = {STEPS}, schedule = 1f1b, optimizer = adam(lr = 1e-3),
          seed = 1234{SETTINGS} }}
}}
"""
VARIANTS = {   # label -> train settings
    "planc zero = 1": ", zero = 1",
    "planc zero = 3": ", zero = 3",
    "planc zero = 3, zero_prefetch = false": ", zero = 3, zero_prefetch = false",
    "planc zero = 3, zero_keep_gathered = true": ", zero = 3, zero_keep_gathered = true",
}
TORCH = {   # label -> the worker's arguments (torch_fsdp_pp.py), each beside the planc run configured the same way
    "torch fully_shard + Schedule1F1B, per micro-batch": ("--per-micro-batch",),
    "torch fully_shard + Schedule1F1B, kept for the step": (),
}
SAME_WAY = {"planc zero = 3": "torch fully_shard + Schedule1F1B, per micro-batch",
            "planc zero = 3, zero_keep_gathered = true": "torch fully_shard + Schedule1F1B, kept for the step"}


def _compile(tmp: Path, label: str, settings: str) -> tuple[Path, dict]:
    from planc.driver.compile import compile_file
    from planc.output.codegen import write_output

    name = f"v{len(list(tmp.glob('v*.plan')))}"
    src = tmp / f"{name}.plan"
    src.write_text(PLAN.format(GPT=ROOT / "examples" / "gpt.py", BLOCKS=BLOCKS, HIDDEN=HIDDEN, CUT=1 + BLOCKS // 2,
                               END=BLOCKS + 2, STEPS=STEPS, SETTINGS=settings))
    compiled = compile_file(src, probe=True)
    out = tmp / name
    write_output(compiled.plan_json, compiled.program, out)
    return out, compiled.plan_json


def losses_equal(a: list[float], b: list[float], rtol: float = 1e-4) -> bool:
    import math
    return len(a) == len(b) > 0 and all(math.isclose(x, y, rel_tol=rtol, abs_tol=1e-6) for x, y in zip(a, b))


def measure(timeout: float = 600) -> list[dict]:
    from benchmarks.testbed import Testbed

    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-bench-zero3-") as tmp:
        tmp = Path(tmp)
        built = [(label, *_compile(tmp, label, settings)) for label, settings in VARIANTS.items()]
        with Testbed(HOSTS, LINK_MBIT) as tb:
            for label, out, plan in built:
                r = tb.launch(out, steps=STEPS, timeout=timeout, comm_only=False, launcher="direct", memory=True)
                rows.append({"what": label, "result": r, "predicted": plan["pipeline"].get("predicted_iteration")})
            out = built[0][1]
            for label, extra in TORCH.items():
                r = tb.launch(out, steps=STEPS, timeout=timeout, comm_only=False, launcher="direct", memory=True,
                              script=ROOT / "benchmarks" / "bench" / "torch_fsdp_pp.py", args=("--out", str(out), *extra))
                rows.append({"what": label, "result": r, "predicted": None})
    base = rows[0]["result"]
    for row in rows:
        r = row["result"]
        row["ok"] = r.returncode == 0 and len(r.step_times) == STEPS
        row["error"] = None if row["ok"] else (r.failure or r.stdout)[-600:]
        row["measured"] = statistics.median(r.step_times[1:]) if row["ok"] else None
        row["same_losses"] = row["ok"] and losses_equal(r.losses, base.losses)
        row["peak_rss_mb"] = max(r.peak_rss_kb.values()) / 1024 if r.peak_rss_kb else None
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]["measured"]

    def f(x, d=3):
        return "—" if x is None else f"{x:.{d}f}"
    by = {row["what"]: row for row in rows}
    lines = ["| run | step s (median) | ÷ zero 1 | ÷ torch configured the same way | predicted s | losses = zero 1's | "
             "peak RSS of a rank MB |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        ratio = row["measured"] / base if row["measured"] and base else None
        twin = by.get(SAME_WAY.get(row["what"], ""), {})
        vs = row["measured"] / twin["measured"] if row["measured"] and twin.get("measured") else None
        lines.append(f"| {row['what']} | {f(row['measured']) if row['ok'] else 'failed'} | {f(ratio, 2)} | "
                     f"{f(vs, 2)} | {f(row['predicted'])} | {'yes' if row['same_losses'] else 'no'} | "
                     f"{f(row['peak_rss_mb'], 0)} |")
    failed = [f"{row['what']}: {row['error']}" for row in rows if not row["ok"]]
    return "\n".join(lines) + ("\n\nFailed:\n\n```\n" + "\n".join(failed) + "\n```" if failed else "")


def run() -> str:
    from benchmarks.bench.testbed import skipped_note
    if note := skipped_note():
        return note
    import torch

    t0 = time.monotonic()
    rows = measure()
    load = os.getloadavg()[0]
    head = (f"Testbed: {HOSTS} hosts × {PER_HOST} gloo ranks, host links {LINK_MBIT:g} Mbit/s; GPT {BLOCKS} blocks of "
            f"width {HIDDEN}, pipe 2 (one stage a host) × data 4, 1F1B, 4 micro-batches of 8 rows, Adam; median of steps "
            f"1–{STEPS - 1}. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__}; 1-minute load {load:.1f} at the end; the bench took "
            f"{time.monotonic() - t0:.0f} s.")
    return head + "\n\n" + table(rows) + "\n"


if __name__ == "__main__":
    print(json.dumps([{k: v for k, v in r.items() if k != "result"} for r in measure()], indent=1))
