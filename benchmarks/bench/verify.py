"""``python -m benchmarks bench verify``: what verification costs a compile, per bundled plan.

Every compile verifies each pass's output with an independent checker (``planc.driver.verify``; ``planc
compile --no-verify`` skips it). This bench compiles every plan of ``plans/`` once, with the model
probe, and times the verifiers' share of the whole compile (the checkers are timed where the driver
calls them; nothing else changes). The issue's bar: under a fifth of the compile.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path

import planc.driver.compile as driver
from planc.driver.compile import compile_file

ROOT = Path(__file__).resolve().parents[2]


def measure(plans: list[Path] | None = None) -> list[dict]:
    plans = plans or sorted((ROOT / "plans").glob("*.plan"))
    spent = [0.0]
    checked = driver.verify

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return checked(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    rows = []
    driver.verify = timed
    try:
        for path in plans:
            spent[0] = 0.0
            t = time.perf_counter()
            compile_file(path, probe=True, verify=True)
            total = time.perf_counter() - t
            rows.append({"plan": path.name, "compile": total, "verify": spent[0]})
    finally:
        driver.verify = checked
    return rows


def run(**_options) -> str:
    rows = measure()
    out = [f"Machine: {platform.machine()}, Python {platform.python_version()}; one compile per plan, probe "
           "included.", "", "| plan | compile s | verification s | share |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| `{r['plan']}` | {r['compile']:.2f} | {r['verify']:.3f} | {100 * r['verify'] / r['compile']:.1f} % |")
    worst = max(rows, key=lambda r: r["verify"] / r["compile"])
    out += ["", f"Largest share: {100 * worst['verify'] / worst['compile']:.1f} % (`{worst['plan']}`)."]
    return "\n".join(out) + "\n"
