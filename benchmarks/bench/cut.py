"""`python -m benchmarks bench cut`: the automatic stage cut (``stages = auto(N)``) against every hand cut, measured.

The model is the bundled MLP (``examples/mlp.py``) with a wide input: layer 0 maps ``INPUTS``
features to ``HIDDEN``, so it costs ``INPUTS / HIDDEN`` times a middle layer and the last
(``HIDDEN`` to ``OUTPUTS``) almost nothing; the even cut ``0..3 | 3..6`` (the bundled plans'
shape) leaves the first stage the slowest. (The bundled GPT is no test of the cut: planc counts
its embedding by parameters, which makes it exactly as heavy as the head.) Two pipeline stages
on one host of two CPU devices (``pipe = 2``), ``eager_1f1b``, ``MICRO_BATCHES`` micro-batches.

Every contiguous cut into two stages (``0..k | k..6``, ``k = 1..5``) and ``stages = auto(2)``
are compiled by planc (probed: FLOPs and transfer types); each distinct cut is launched once
with its own ``launch.sh`` (DeepSpeed's launcher, gloo on local CPU ranks, one thread per
rank); the auto cut is one of the hand cuts, so it shares that cut's launch. Rank 0's
``step N loss .. time T s`` lines give the step times; the first ``WARMUP`` steps are dropped and
the median of the rest is reported beside plan.json's ``pipeline.predicted_iteration`` (the
iteration simulator with the cluster's ``flops``). Wall-clock measurements on a shared machine:
a benchmark, never a test assertion.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from planc.commands.ui import progress
from planc.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LAYERS, INPUTS, HIDDEN, OUTPUTS = 6, 4096, 512, 8
MICRO_BATCH, MICRO_BATCHES, STEPS, WARMUP = 64, 4, 10, 2
STEP_RE = re.compile(r"^step (\d+) loss \S+ time ([0-9.]+) s", re.M)


def plan_text(cut: int | None) -> str:
    """The plan: ``cut`` None for ``stages = auto(2)``, else the hand cut ``0..cut | cut..LAYERS``."""
    model = ROOT / "examples" / "mlp.py"
    stages = ("  stages = auto(2)\n" if cut is None else
              f"  stage 0 : layers 0..{cut}\n  stage 1 : layers {cut}..{LAYERS}\n")
    return f"""plan gpt_cut {{
  cluster {{
    level node x 1
    level gpu  x 2 : bandwidth 3 GB/s, latency 20 us
    host = node
    flops = 20 GFLOP/s
  }}
  parallel {{ pipe = 2, place = auto }}
  model "{model}:build" {{ layers = {LAYERS}, hidden = {HIDDEN}, inputs = {INPUTS}, outputs = {OUTPUTS} }}
  loss  "{model}:loss"
  data  "{model}:batches"
{stages}  transfer hidden from stage 0 to stage 1
  train {{
    micro_batch = {MICRO_BATCH}, micro_batches = {MICRO_BATCHES}, steps = {STEPS}
    schedule = eager_1f1b, optimizer = sgd(lr = 0.01), precision = fp32, seed = 3
  }}
}}
"""


def _env() -> dict:
    py = sys.executable
    # CPU ranks on any machine: no GPU visible, so launch.sh and the plan's `backend = auto` pick gloo
    return dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH="",
                PYTHON=py, PATH=str(Path(py).parent) + os.pathsep + os.environ.get("PATH", ""),
                PLANC_MASTER_PORT=str(free_port()))


def measure(out: Path, timeout: float = 600) -> tuple[list[float], str | None]:
    """Launch ``OUT/launch.sh``; rank 0's step times, and an error line when the launch failed."""
    r = subprocess.run(["bash", str(out / "launch.sh")], env=_env(), capture_output=True, text=True,
                       timeout=timeout, cwd=out)
    times = [float(t) for _, t in sorted((int(s), t) for s, t in STEP_RE.findall(r.stdout + r.stderr))]
    if r.returncode != 0 or len(times) < STEPS:
        lines = [l for f in sorted((out / "logs").glob("*")) if f.is_file()
                 for l in f.read_text(errors="replace").splitlines() if re.search(r"Error|error:", l)]
        tail = lines[-1:] or (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return times, f"exit {r.returncode}: {tail[0].strip()[:160]}"
    return times, None


def compile_variant(cut: int | None, tmp: Path) -> tuple[dict, Path]:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    name = "auto" if cut is None else f"cut{cut}"
    path = tmp / f"{name}.plan"
    path.write_text(plan_text(cut))
    compiled = compile_file(path)
    out = tmp / name
    write_output(compiled.plan_json, compiled.program, out)
    return compiled.plan_json, out


def _ranges(plan: dict) -> str:
    return ", ".join(f"{s['layers'][0]}..{s['layers'][1]}" for s in plan["stages"])


def run(cuts: tuple[int, ...] = tuple(range(1, LAYERS))) -> str:
    rows = []
    measured: dict[str, tuple[float | None, str | None]] = {}
    with tempfile.TemporaryDirectory(prefix="planc-bench-cut-") as tmp:
        for cut in progress((None,) + tuple(cuts), "cut bench", describe=lambda c: "auto" if c is None else f"0..{c}"):
            plan, out = compile_variant(cut, Path(tmp))
            ranges = _ranges(plan)
            if ranges not in measured or cut is None:
                times, error = measure(out)
                kept = times[WARMUP:]
                measured[ranges] = (statistics.median(kept) if kept and not error else None, error)
            rows.append({"cut": cut, "ranges": ranges, "predicted": plan["pipeline"].get("predicted_iteration"),
                         "median": measured[ranges][0], "error": measured[ranges][1]})
    auto = rows[0]
    lines = [f"MLP of {LAYERS} layers ({INPUTS} → {HIDDEN} → … → {OUTPUTS}: a heavy first layer), pipe 2 on 2 CPU "
             f"ranks, eager_1f1b, {MICRO_BATCHES} micro-batches of {MICRO_BATCH}; median step of steps "
             f"{WARMUP}..{STEPS - 1}.",
             "",
             "| stages | cut | predicted iteration | measured median step | measured ÷ predicted |",
             "|---|---|---|---|---|"]
    for r in rows:
        same = r["cut"] is not None and r["ranges"] == auto["ranges"]
        label = "`stages = auto(2)`" if r["cut"] is None else ("hand" + (" (= auto)" if same else ""))
        pred = f"{r['predicted'] * 1e3:.1f} ms" if r["predicted"] else "—"
        meas = f"{r['median'] * 1e3:.1f} ms" if r["median"] else f"failed: {r['error']}".replace("|", "\\|")
        ratio = f"{r['median'] / r['predicted']:.2f}" if r["median"] and r["predicted"] else "—"
        lines.append(f"| {label} | {r['ranges']} | {pred} | {meas} | {ratio} |")
    hand = [r for r in rows[1:] if r["median"]]
    if auto["median"] and hand:
        best = min(hand, key=lambda r: r["median"])
        lines += ["", f"Auto cut {auto['ranges']}: {auto['median'] * 1e3:.1f} ms measured; best hand cut "
                      f"{best['ranges']}: {best['median'] * 1e3:.1f} ms "
                      f"(auto ÷ best hand = {auto['median'] / best['median']:.2f})."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(run(), end="")
