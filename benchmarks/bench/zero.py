"""`python -m benchmarks bench zero`: ZeRO-1's reduction programs measured on the emulated cluster.

One stage of a 16.8 MB-parameter MLP (examples/mlp.py, 4 layers of 1024 x 1024) on 2 hosts x 4 gloo
ranks, ``data = 8``, ``zero = 1``: each step reduce-scatters the fp32 gradients and all-gathers the
parameters. Side by side in one testbed: the programs planc synthesizes for the hierarchy (its
choice) and the flat pair (``reduce gradients over data using allreduce``: one reduce_scatter and one
all_gather over the 8 ranks), both launched with ``train.py --comm-only`` (the two programs of a
step between two barriers, every byte checked after the timed region). The physical bound: each host
must send the other the half of its partial sums the other host's ranks own (S/2), and receive back
the other half's updated parameters (S/2): S ÷ the host-link rate per direction.

Needs root and iproute2; otherwise ``run()`` returns a note saying why it was skipped.
"""
from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

from benchmarks.bench.testbed import CLUSTER, HOSTS, LINK_MBIT, PER_HOST, STEPS, _fmt, _run_cases, skipped_note

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, LAYERS = 1024, 4

PLAN = """
plan tb_zero {{{CLUSTER}
  model "{MLP}:build" {{ layers = {LAYERS}, hidden = {HIDDEN}, inputs = {HIDDEN}, outputs = {HIDDEN} }}
  loss  "{MLP}:loss"
  data  "{MLP}:batches"
  stage 0 : layers 0..{LAYERS} on devices 0..8 as (data = 8)
  reduce gradients over data{USING}
  train {{ micro_batch = 8, micro_batches = 1, steps = 1, optimizer = adamw(lr = 1e-3), zero = 1 }}
}}
"""
CASES = {"flat reduce_scatter + all_gather": " using allreduce", "synthesized (planc)": ""}


def _cases(tmp: Path) -> list[dict]:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file

    cases = []
    for label, using in CASES.items():
        out = tmp / ("flat" if using else "synth")
        out.mkdir(parents=True)
        src = out.with_suffix(".plan")
        src.write_text(PLAN.format(CLUSTER=CLUSTER.rstrip(), MLP=ROOT / "examples" / "mlp.py", LAYERS=LAYERS,
                                   HIDDEN=HIDDEN, USING=using))
        compiled = compile_file(src, probe=True)
        write_output(compiled.plan_json, compiled.program, out)
        reds = {r["target"]: r for r in compiled.plan_json["reductions"] if r.get("target")}
        rs, ag = reds["reduce_scatter"], reds["all_gather"]
        cases.append({"kind": "reduction", "case": "zero", "what": label, "hosts": HOSTS, "out": out,
                      "bytes": rs["bytes"], "text": (rs["program"]["text"], ag["program"]["text"]),
                      "predicted": rs["program"]["predicted"] + ag["program"]["predicted"],
                      "flat_predicted": rs["flat_predicted"] + ag["flat_predicted"]})
    return cases


def measure(steps: int = STEPS, timeout: float = 180) -> list[dict]:
    from benchmarks.testbed import Testbed

    with tempfile.TemporaryDirectory(prefix="planc-bench-zero-") as tmp:
        cases = _cases(Path(tmp))
        with Testbed(HOSTS, LINK_MBIT) as tb:
            _run_cases(tb, cases, iter(cases), steps, timeout, None, max(30.0, timeout))
    return cases


def table(cases: list[dict]) -> str:
    flat = next(c for c in cases if c["what"].startswith("flat"))
    nbytes = cases[0]["bytes"]
    bound = nbytes / (LINK_MBIT * 1e6 / 8)
    lines = ["| programs (reduce-scatter; all-gather) | measured s/step | flat ÷ this (measured) | predicted s | "
             "flat ÷ this (predicted) | ÷ bound (measured) |",
             "|---|---|---|---|---|---|"]
    for c in cases:
        speed = flat["measured"] / c["measured"] if c.get("measured") and flat.get("measured") else None
        pspeed = flat["predicted"] / c["predicted"] if c["predicted"] else None
        over = c["measured"] / bound if c.get("measured") else None
        lines.append(f"| {c['what']}: `{c['text'][0]}`; `{c['text'][1]}` | {c.get('error') or _fmt(c['measured'])} | "
                     f"{_fmt(speed, 2)} | {_fmt(c['predicted'])} | {_fmt(pspeed, 2)} | {_fmt(over, 2)} |")
    return (f"{nbytes / 1e6:.1f} MB of fp32 gradients and parameters per rank; physical bound "
            f"{bound:.3f} s (S ÷ the host link, per direction).\n\n" + "\n".join(lines))


def run() -> str:
    if note := skipped_note():
        return note
    import torch

    t0 = time.monotonic()
    cases = measure()
    load = os.getloadavg()[0]
    head = (f"Testbed: {HOSTS} hosts × {PER_HOST} gloo ranks, host links {LINK_MBIT:g} Mbit/s (tbf, each direction); "
            f"measured = median of steps 1–{STEPS - 1} of `train.py --comm-only` (both programs of a step between "
            f"two barriers). Machine: {os.cpu_count()} CPU cores ({platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__}; 1-minute load {load:.1f} at the end; the bench "
            f"took {time.monotonic() - t0:.0f} s.")
    return head + "\n\n" + table(cases) + "\n"
