"""Benchmark and engine: the front end under attack (``python -m benchmarks bench fuzz``).

Inputs of three kinds, drawn from one seeded ``random.Random`` (so a run is
deterministic; the test suite drives the same generators through hypothesis):

* **grammar**: plans built from the grammar's constructs (``grammar/planc.lark``):
  inline and YAML clusters, parallel axes and place, explicit stages and meshes,
  ``stages = auto(N)``, ``layers auto``, transfers with and without dtype, shape,
  layer and specs, reductions with pinned programs, settings blocks; values are
  drawn from pools that mix valid and invalid ones (:func:`generate`);
* **bytes**: byte-level mutations of every ``.plan`` in the repository (``plans/``,
  ``examples/``, ``tests/``) and of the generated plans (:func:`mutate_bytes`);
* **yaml**: a plan naming a YAML cluster file whose text is mutated.

Each input is written to a scratch folder and loaded with ``planc.lang.load``;
a plan that checks and is small is also compiled without probing
(``compile_program``), all under :data:`FUZZ_BUDGET`. Every input must end in a
checked plan or a located ``PlanError`` (each diagnostic at ``file:line:col`` of
the plan or the YAML file); anything else -- another exception, an error without
a position, an input running past :data:`LIMIT_S` -- is a failure. ``run()``
prints inputs / accepted / diagnostics / failures / slowest input and writes each
failing input under ``build/fuzz-failures/`` to become a regression file in
``tests/fuzz_regressions/``.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench.fuzzgen import (PLAN_NAME, ROOT, SEED_DIRS, YAML_NAME, YAML_PLAN, YAML_SEEDS,  # noqa: F401
                                      Draw, generate, mutate_bytes, repo_seeds)
import planc.lang
from planc import budget
from planc.commands import ui
from planc.driver.compile import compile_program
from planc.lang.errors import PlanError

N_INPUTS = 20_000
LIMIT_S = 10.0            # one input: load and (when small) compile; past it, the input is a hang
COMPILE_DEVICES = 16      # accepted plans with at most this many devices are also compiled
# bounds that keep one compiled input cheap; going over them is a located diagnostic like any other
FUZZ_BUDGET = budget.Budget((("devices", 4096), ("tasks", 2000), ("task_devices", 20_000),
                             ("micro_batches", 64), ("pipeline_ops", 2000), ("synthesis_size", 4),
                             ("trials", 64), ("dfs_seconds", 1.0)))


# ---------------------------------------------------------------- one input

@dataclass(frozen=True, slots=True)
class Outcome:
    status: str          # "accepted" | "diagnostic" | "failure"
    seconds: float
    detail: str = ""     # for a failure: what went wrong; for a diagnostic: its first line


class _Hang(BaseException):   # not an Exception: no `except Exception` in planc may swallow it
    pass


def _alarm(signum, frame):
    raise _Hang()


def run_input(plan: bytes, yaml_text: bytes | None, folder: Path, compile: bool = True,
              limit_s: float = LIMIT_S) -> Outcome:
    """Load one input from ``folder`` (and compile it when small); classify how it ended."""

    plan_path, yaml_path = folder / PLAN_NAME, folder / YAML_NAME
    plan_path.write_bytes(plan)
    if yaml_text is not None:
        yaml_path.write_bytes(yaml_text)
    elif yaml_path.exists():
        yaml_path.unlink()
    files = {str(plan_path), str(yaml_path)}
    timed = hasattr(signal, "setitimer") and _main_thread()
    if timed:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, limit_s)
    t0 = time.perf_counter()
    try:
        with budget.using(FUZZ_BUDGET):
            program = planc.lang.load(plan_path)
            if compile and program.cluster.devices <= COMPILE_DEVICES and not program.auto_stages:
                compile_program(program)
        return Outcome("accepted", time.perf_counter() - t0)
    except PlanError as e:
        took = time.perf_counter() - t0
        return _diagnosed(e, files, took)
    except _Hang:
        return Outcome("failure", time.perf_counter() - t0, f"ran past {limit_s:g} s")
    except Exception as e:   # noqa: BLE001 - a bug in planc: what the fuzzer is for
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Outcome("failure", time.perf_counter() - t0,
                       f"{type(e).__name__}: {str(e)[:200]} (at {Path(tb.filename).name}:{tb.lineno})")
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _diagnosed(e, files: set[str], took: float) -> Outcome:
    try:
        text = e.render()
    except Exception as r:   # noqa: BLE001
        return Outcome("failure", took, f"rendering the diagnostic raised {type(r).__name__}: {r}")
    bad = [d for d in e.diagnostics if d.span.line < 1 or d.span.col < 1 or d.span.file not in files]
    if not e.diagnostics or bad or "error:" not in text:
        d = bad[0] if bad else None
        where = f" at {d.span.file}:{d.span.line}:{d.span.col}" if d else ""
        return Outcome("failure", took, f"a diagnostic without a position in the input{where}: "
                                        f"{(d.message if d else text)[:200]}")
    return Outcome("diagnostic", took, " | ".join(d.message.splitlines()[0][:200] for d in e.diagnostics))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# ---------------------------------------------------------------- the input stream and the bench

def inputs(n: int, seed: int = 0):
    """``n`` inputs ``(kind, plan bytes, yaml bytes or None)``, the same for the same ``seed``."""
    rng = random.Random(seed)
    seeds = [b for _, b in repo_seeds()]
    for i in range(n):
        r = i % 10
        if r < 4:
            text, yml = generate(rng)
            yield "grammar", text.encode(), None if yml is None else yml.encode()
        elif r < 8:
            if r == 7 or not seeds:
                text, yml = generate(rng)
                base = text.encode()
            else:
                base, yml = rng.choice(seeds), None
            yield "bytes", mutate_bytes(rng, base, seeds), None if yml is None else yml.encode()
        else:
            base = rng.choice(YAML_SEEDS).encode()
            yield "yaml", YAML_PLAN.encode(), mutate_bytes(rng, base, [s.encode() for s in YAML_SEEDS])


def run(n: int | None = None, seed: int = 0, save: str | None = None) -> str:
    """Fuzz ``n`` inputs (default ``PLANC_FUZZ_INPUTS`` or 20,000); a markdown table, one row per kind."""
    n = int(os.environ.get("PLANC_FUZZ_INPUTS", N_INPUTS)) if n is None else n
    save_dir = Path(save) if save else ROOT / "build" / "fuzz-failures"
    stats: dict[str, dict] = {}
    failures = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="planc-fuzz-") as tmp:
        folder = Path(tmp)
        stream = ui.progress(inputs(n, seed), "benchmarks bench fuzz", total=n, piped="silent",
                             describe=lambda x: x[0])   # a bar on a terminal (stderr) only
        for i, (kind, plan, yml) in enumerate(stream):
            out = run_input(plan, yml, folder)
            s = stats.setdefault(kind, {"inputs": 0, "accepted": 0, "diagnostic": 0, "failure": 0,
                                        "slowest": (0.0, -1)})
            s["inputs"] += 1
            s[out.status] += 1
            s["slowest"] = max(s["slowest"], (out.seconds, i))
            if out.status == "failure":
                failures.append((i, kind, out.detail))
                save_dir.mkdir(parents=True, exist_ok=True)
                (save_dir / f"input-{i}.plan").write_bytes(plan)
                if yml is not None:
                    (save_dir / f"input-{i}.yaml").write_bytes(yml)
    total = time.perf_counter() - start
    rows = [f"Seed {seed}, {n} inputs in {total:.0f} s (one core); each input bounded to {LIMIT_S:g} s, "
            f"plans of at most {COMPILE_DEVICES} devices also compiled (`--no-probe`).", "",
            "| kind | inputs | accepted | diagnostics | failures | slowest input |", "|---|---|---|---|---|---|"]
    for kind in ("grammar", "bytes", "yaml"):
        s = stats.get(kind)
        if s:
            rows.append(f"| {kind} | {s['inputs']} | {s['accepted']} | {s['diagnostic']} | {s['failure']} | "
                        f"{s['slowest'][0]:.2f} s (#{s['slowest'][1]}) |")
    global LAST_FAILURES
    LAST_FAILURES = len(failures)
    if failures:
        rows += ["", f"Failures (inputs saved under {save_dir}):", ""]
        rows += [f"- #{i} ({kind}): {detail}" for i, kind, detail in failures[:20]]
    return "\n".join(rows) + "\n"


LAST_FAILURES = 0   # failures of the last run() (benchmarks bench fuzz exits 1 when there are any)


if __name__ == "__main__":
    print(run(), end="")
    raise SystemExit(1 if LAST_FAILURES else 0)
