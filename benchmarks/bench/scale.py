"""`python -m benchmarks bench scale`: a whole `planc compile` of a GPT plan at cluster scale.

The plan (issue 36): ``pipe 8 x data D x tensor 8`` over ``pod 4 x node N x gpu 8`` (``N = devices /
32``, ``D = devices / 64``), ``stages = auto(8)`` with 7 transfers between consecutive stages, 32
micro-batches, ``1f1b``, the bundled GPT (``examples/gpt.py``: 8 blocks, hidden 64, 8 heads), gradients
reduced over ``data``. Each compile is one ``python -m planc compile PLAN --profile`` process timed from
outside: per size ``tries`` cold ones (the probe runs: a miss that fills a fresh probe cache, then
``--no-cache``) and ``tries`` with the probe cached, the best of each reported; the best cold run's
``--profile`` table gives the compiler process's peak memory, the probe subprocess's, and the passes.
The machine's load average is printed with every row (a shared machine: a benchmark, never a test
assertion).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planc.commands.ui import progress

ROOT = Path(__file__).resolve().parents[2]
SIZES = (1024, 4096, 16384, 65536)


def plan_text(devices: int, verify: bool = True) -> str:
    gpt = ROOT / "examples" / "gpt.py"
    nodes, data = devices // 32, devices // 64
    transfers = "".join(f"  transfer h{i} from stage {i} to stage {i + 1}\n" for i in range(7))
    return f"""plan gpt_scale_{devices} {{
  cluster {{
    level pod  x 4 : bandwidth 2.5 GB/s, latency 50 us
    level node x {nodes} : bandwidth 12.5 GB/s, latency 20 us
    level gpu  x 8 : bandwidth 150 GB/s, latency 2 us
    host = node
    flops = 100 TFLOP/s
  }}
  parallel {{ pipe = 8, data = {data}, tensor = 8, place = auto }}
  model "{gpt}:build" {{ layers = 8, hidden = 64, heads = 8, seq = 16, vocab = 256 }}
  loss  "{gpt}:loss"
  data  "{gpt}:batches"
  stages = auto(8)
{transfers}
  reduce gradients over data
  train {{
    micro_batch = {max(data, 64)}, micro_batches = 32, steps = 10
    schedule = 1f1b, optimizer = sgd(lr = 0.01), precision = fp32, seed = 1
  }}
}}
"""


ROW = re.compile(r"^(\S[^\n]*?)\s{2,}(\d+)?\s+([0-9.]+)\s+(\d+%)\s+(\d+)(?: \((\d+) child\))?\s*$", re.M)


def compile_once(devices: int, folder: Path, verify: bool = True, cache: bool = False) -> dict:
    """One ``planc compile`` process; ``cache``: with the probe cache (under ``folder``'s own home: the
    first such compile of a size misses, probes and fills it; the next ones are answered from it)."""
    plan = folder / f"gpt-{devices}.plan"
    plan.write_text(plan_text(devices))
    cmd = [sys.executable, "-m", "planc", "compile", str(plan), "-o", str(folder / f"out-{devices}"), "--profile",
           "--budget", f"devices={max(devices, 65536)}"] + ([] if cache else ["--no-cache"]) + \
        ([] if verify else ["--no-verify"])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), HOME=str(folder / "home")))
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        return {"devices": devices, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:160], "load": load}
    passes = {m.group(1).strip(): (float(m.group(3)), int(m.group(5)), m.group(6)) for m in ROW.finditer(r.stdout)}
    total = passes.pop("total", (seconds, 0, None))
    child = max((int(c) for _, _, c in passes.values() if c), default=0)
    slowest = sorted(((s, n) for n, (s, _, _) in passes.items()), reverse=True)[:3]
    size = (folder / f"out-{devices}" / "plan.json").stat().st_size
    return {"devices": devices, "seconds": seconds, "peak_mb": total[1], "probe_mb": child, "load": load,
            "plan_mb": size / 1e6, "slowest": slowest, "verify": verify,
            "passes": {n: s for n, (s, _, _) in passes.items()}}


def best(runs: list[dict]) -> dict:
    """The fastest run that compiled (a shared machine: the others waited for someone else's work)."""
    done = [r for r in runs if "error" not in r]
    return min(done, key=lambda r: r["seconds"]) if done else runs[0]


def run(sizes=SIZES, verify: bool = True, tries: int = 3) -> str:
    """Per size, ``tries`` cold compiles (probe included: the first fills a fresh probe cache, the others
    run with ``--no-cache``) and ``tries`` with the probe cached; the best of each is reported."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-scale-") as tmp:
        for devices in progress(sizes, "compiling"):
            cold = [compile_once(devices, Path(tmp), verify, cache=i == 0) for i in range(tries)]
            warm = [compile_once(devices, Path(tmp), verify, cache=True) for _ in range(tries)]
            row = dict(best(cold))
            row["cached"] = best(warm).get("seconds")
            row["loads"] = [r["load"] for r in cold + warm]
            rows.append(row)
    lines = ["| devices | wall s, cold (probe included) | wall s, probe cached | compiler peak MB | probe peak MB "
             "| plan.json MB | slowest passes, cold (s) | load avg (1 min) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        loads = f"{min(r['loads']):.1f}–{max(r['loads']):.1f}"
        if "error" in r:
            lines.append(f"| {r['devices']:,} | failed: {r['error']} | | | | | | {loads} |")
            continue
        slow = ", ".join(f"{n} {s:.2f}" for s, n in r["slowest"])
        cached = f"{r['cached']:.2f}" if r.get("cached") is not None else "failed"
        lines.append(f"| {r['devices']:,} | {r['seconds']:.2f} | {cached} | {r['peak_mb']} | {r['probe_mb']} | "
                     f"{r['plan_mb']:.1f} | {slow} | {loads} |")
    head = (f"`python -m benchmarks bench scale` on this machine ({os.cpu_count()} cores), "
            f"{'with' if verify else 'without'} the independent checkers (`--no-verify`: {not verify}); "
            f"each figure the best of {tries} `python -m planc compile PLAN --profile` processes (cold: the probe "
            "runs, `--no-cache` or a cache miss; cached: its answer from the probe cache). Passes per size: the "
            "best cold run's `--profile` (`warm place` runs while the probe's subprocess does; `probe` is what "
            "was left to wait for).")
    return "\n".join([head, ""] + lines + ["", *pass_table(rows)])


def pass_table(rows: list[dict]) -> list[str]:
    """Seconds per pass (``--profile``) at every size, and the growth of the last step (the devices
    grow 4x a step: a linear pass grows about 4x, more is super-linear, noise aside): one paragraph
    (docs/benchmarks.md holds one table per benchmark)."""
    done = [r for r in rows if "passes" in r]
    if not done:
        return []
    names = [n for n in done[0]["passes"] if any(r["passes"].get(n, 0.0) >= 0.1 for r in done)]
    sizes = " / ".join(f"{r['devices']:,}" for r in done)
    last = f"; in parentheses the growth of the last step ({done[-1]['devices'] // done[-2]['devices']}x devices)" \
        if len(done) > 1 else ""
    parts = []
    for n in names:
        t = [r["passes"].get(n, 0.0) for r in done]
        growth = f" ({t[-1] / t[-2]:.1f})" if len(t) > 1 and t[-2] > 0 else ""
        parts.append(f"{n} {' / '.join(f'{x:.2f}' for x in t)}{growth}")
    return [f"Seconds per pass at {sizes} devices (`--profile`; passes under 0.1 s at every size left out{last}): "
            + "; ".join(parts) + "."]
