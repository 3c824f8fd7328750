"""`python -m benchmarks bench startup`: where a launch's start-up goes (issue 45), side by side in one run.

For plans/gpt-2x4.plan (8 gloo ranks on this machine), each round measures, one after the other:

- **bare import**: 8 concurrent ``python -c "import torch, deepspeed"`` (the same Python and
  ``DS_ACCELERATOR=cpu`` as the ranks), from the first start to the last exit;
- **before** and **after**: ``bash OUT/launch.sh --steps 1`` (DeepSpeed's launcher, as a user runs it)
  from the start of bash to the moment rank 0 prints ``step 0`` (the step's loss is all-reduced over
  every rank, so every rank has started and finished its first step), and to the launch's exit, with
  the CPU seconds (user + system) of every process of the launch (for the bare imports: of the 8); on a
  machine shared with other work the CPU seconds are the steadier figure of the work done.
  *after* is the runtime of this checkout; *before* the same compiled output with the runtime and
  ``train.py`` of ``BASELINE`` (the commit before issue 45's start-up work, read with ``git show``;
  the row is left out outside a git checkout).

The *after* launch runs with ``--profile-startup``: its phases (median and slowest rank) are the second
table; the launcher's share is from the start of bash to the first rank's process start. Every round
is a row (``rounds``, default 3), then the medians; a round runs the three kinds one after the other,
and a ratio compares a launch only with its own round's bare imports, so that a machine whose load
changes during the run still compares like with like.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planc.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "plans" / "gpt-2x4.plan"
BASELINE = "1e64f0f"      # before issue 45: no entry.py, no --profile-startup
RANKS = 8
OLD_TRAIN = '''import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from planc_runtime.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(out_dir=HERE))
'''


def _env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH="", PYTHON=sys.executable,
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
               PLANC_MASTER_PORT=str(free_port()))
    if not env.get("TORCH_EXTENSIONS_DIR") and sys.prefix != sys.base_prefix:   # the venv's prebuilt op
        env["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    env.pop("OMP_NUM_THREADS", None)
    return env


def _cpu() -> float:
    """CPU seconds (user + system) of every child process waited for so far, their own children included."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def bare_import(n: int = RANKS) -> tuple[float, float]:
    """Seconds for ``n`` concurrent ``import torch, deepspeed``, first start to last exit, and their CPU seconds."""
    t0, c0 = time.time(), _cpu()
    procs = [subprocess.Popen([sys.executable, "-c", "import torch, deepspeed"], env=_env()) for _ in range(n)]
    for p in procs:
        if p.wait() != 0:
            raise RuntimeError("python -c 'import torch, deepspeed' failed")
    return time.time() - t0, _cpu() - c0


def launch(out: Path, *args: str) -> dict:
    """``bash OUT/launch.sh --steps 1 ARGS``: seconds to rank 0's ``step 0`` line and to the exit; rank 0's log.

    The line is looked for in rank 0's log file itself (``PLANC_LOG_DIR``, polled every 50 ms), not in
    what launch.sh's follower copies to its output, so the figure does not wait on that copy."""
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=out))
    env = dict(_env(), PLANC_LOG_DIR=str(logs))
    t0, c0 = time.time(), _cpu()
    with open(logs / "launch.out", "w") as sink:
        proc = subprocess.Popen(["bash", str(out / "launch.sh"), "--steps", "1", *args], env=env, cwd=out,
                                stdout=sink, stderr=subprocess.STDOUT)
        first = None
        while proc.poll() is None:
            if first is None:
                rank0 = next(iter(logs.glob("*_rank0.log")), None)
                if rank0 is not None and re.search(r"^step 0 ", rank0.read_text(errors="replace"), re.M):
                    first = time.time() - t0
            time.sleep(0.05)
        total, cpu = time.time() - t0, _cpu() - c0
    rank0 = next(iter(logs.glob("*_rank0.log")), None)
    text = rank0.read_text(errors="replace") if rank0 is not None else ""
    if first is None and re.search(r"^step 0 ", text, re.M):
        first = total          # ended between two looks
    if proc.returncode != 0 or first is None:
        raise RuntimeError(f"launch of {out} failed ({proc.returncode}):\n"
                           + (logs / "launch.out").read_text(errors="replace")[-3000:])
    shutil.rmtree(logs, ignore_errors=True)
    return {"t0": t0, "first": first, "total": total, "cpu": cpu, "text": text}


def _before(after: Path, folder: Path) -> Path | None:
    """A copy of the compiled output with BASELINE's runtime and train.py; None outside a git checkout."""
    try:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{BASELINE}:planc/runtime"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    out = folder / "before"
    shutil.copytree(after, out, ignore=shutil.ignore_patterns("logs"))
    shutil.rmtree(out / "planc_runtime")
    (out / "planc_runtime").mkdir()
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{BASELINE}:planc/runtime/{name}"], cwd=ROOT,
                                  capture_output=True, text=True, check=True).stdout
            (out / "planc_runtime" / name).write_text(text)
    head = [ln for ln in (after / "train.py").read_text().splitlines(keepends=True) if ln.startswith("#")]
    (out / "train.py").write_text("".join(head) + OLD_TRAIN)
    return out


def _phases(text: str) -> tuple[list[tuple[str, float, float]], float | None]:
    rows = [(m.group(1).strip(), float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^  (\S.*?)\s+([0-9.]+)\s+([0-9.]+)$", text, re.M)]
    start = re.search(r"first step's end: [0-9.]+ s .*start ([0-9.]+)\)", text)
    return rows, float(start.group(1)) if start else None


def run(rounds: int = 3) -> str:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    with tempfile.TemporaryDirectory(prefix="planc-bench-startup-") as tmp:
        folder = Path(tmp)
        compiled = compile_file(PLAN)
        after = write_output(compiled.plan_json, compiled.program, folder / "after", text=compiled.text)
        before = _before(after, folder)
        got = {"bare": [], "bare cpu": [], "before": [], "after": [], "launcher": []}
        phases: dict[str, list[tuple[float, float]]] = {}
        for _ in range(rounds):
            wall, cpu = bare_import()
            got["bare"].append(wall)
            got["bare cpu"].append(cpu)
            if before is not None:
                got["before"].append(launch(before))
            a = launch(after, "--profile-startup")
            got["after"].append(a)
            rows, start = _phases(a["text"])
            for name, med, slow in rows:
                phases.setdefault(name, []).append((med, slow))
            if start is not None:
                got["launcher"].append(start - a["t0"])
    med = statistics.median
    bare = med(got["bare"])
    lines = [f"Machine: {os.cpu_count()} core(s), Python {sys.version.split()[0]}; {rounds} round(s), "
             f"{RANKS} ranks (plans/gpt-2x4.plan, gloo), `--steps 1`; a round runs the three one after the other.", "",
             f"| round | bare import of {RANKS} concurrent ranks: s (CPU s) | before: to first step (s) | ÷ bare import | "
             "whole launch: s (CPU s) | after: to first step (s) | ÷ bare import | whole launch: s (CPU s) |",
             "|---|---|---|---|---|---|---|---|"]

    def cells(r, b):
        return ([f"{r['first']:.1f}", f"{r['first'] / b:.2f}x", f"{r['total']:.1f} ({r['cpu']:.0f})"] if r
                else ["-", "-", "-"])

    for i in range(rounds):
        b = got["bare"][i]
        before_r = got["before"][i] if got["before"] else None
        lines.append("| " + " | ".join([str(i + 1), f"{b:.1f} ({got['bare cpu'][i]:.0f})", *cells(before_r, b),
                                        *cells(got["after"][i], b)]) + " |")
    medians = ["median", f"{bare:.1f} ({med(got['bare cpu']):.0f})"]
    for key in ("before", "after"):
        if got[key]:
            first = med(r["first"] for r in got[key])
            medians += [f"{first:.1f}", f"{med(r['first'] / b for r, b in zip(got[key], got['bare'])):.2f}x",
                        f"{med(r['total'] for r in got[key]):.1f} ({med(r['cpu'] for r in got[key]):.0f})"]
        else:
            medians += ["-", "-", "-"]
    lines.append("| " + " | ".join(medians) + " |")
    phase_text = ([f"launcher (bash, DeepSpeed's launch.py: to the first rank's start) {med(got['launcher']):.2f}"]
                  if got["launcher"] else [])
    phase_text += [f"{name} {med(v[0] for v in values):.2f} / {med(v[1] for v in values):.2f}"
                   for name, values in phases.items()]
    lines += ["", f"*before*: the runtime and train.py of {BASELINE}; *after*: this checkout's. Phases of the *after* "
              "launches, s, median rank / slowest rank (`train.py --profile-startup`, median over rounds; imports: "
              "from the rank's process start): " + "; ".join(phase_text) + "."]
    return "\n".join(lines) + "\n"
