"""`python -m benchmarks bench checkpoint`: save and load time and bytes of format-2 checkpoints (DCP,
global names, docs/runtime.md "Checkpoints") against the per-rank torch files planc wrote before
(``checkpoint_legacy.py``), for the bundled GPT (examples/gpt.py, Adam, fp32) at two sizes.

Each size is compiled under two plans of 4 local CPU ranks (gloo): ``2 stages x data 2`` and
``1 stage x data 4``. Launches, each rank started by hand as a per-host launcher does (``train.py``):
save after 1 step under the first plan; load it under the same plan and under the second (resharded: each
rank reads other rectangles than were written); the same save and same-plan load with the legacy writer
(it cannot load under another plan). The times are rank 0's, printed by the runtime (``checkpoint step N
saved to DIR in T s``: the whole collective save, hashing included; ``resumed from … in T s``: the restore
from when every rank is in it, the sha256 check before the process group left out); bytes are the
checkpoint folder's files.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planc.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SIZES = {   # label -> gpt.py build arguments
    "GPT 4 x 256": {"layers": 4, "hidden": 256, "heads": 4, "seq": 64, "vocab": 256},
    "GPT 8 x 512": {"layers": 8, "hidden": 512, "heads": 8, "seq": 64, "vocab": 256},
}
MICRO_BATCH = 4

PLAN = """
plan ckpt_bench_NAME {
  cluster {
    level node x 1 : bandwidth 12.5 GB/s, latency 20 us
    level gpu  x 4 : bandwidth 150 GB/s, latency 2 us
  }
  model "EXAMPLES/gpt.py:build" { ARGS }
  loss  "EXAMPLES/gpt.py:loss"
  data  "EXAMPLES/gpt.py:batches"
BODY
  reduce gradients over data
  train {
    micro_batch = MB, micro_batches = 2, steps = 1, timeout = 300 s
    schedule = 1f1b, optimizer = adam(lr = 1e-3), precision = fp32, seed = 1
  }
}
"""


def _bodies(args: dict) -> dict:
    n = args["layers"] + 2
    shape = f"f32[{MICRO_BATCH}, {args['seq']}, {args['hidden']}]"
    return {
        "pipe2_data2": f"""  stage 0 : layers 0..{n // 2} on devices 0..2 as (data = 2)
  stage 1 : layers {n // 2}..{n} on devices 2..4 as (data = 2)
  transfer h : {shape} from stage 0 as S0 R R to stage 1 as S0 R R""",
        "pipe1_data4": f"  stage 0 : layers 0..{n} on devices 0..4 as (data = 4)",
    }


def _compile(name: str, text: str, folder: Path) -> Path:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    src = folder / f"{name}.plan"
    src.write_text(text)
    compiled = compile_file(src)
    out = folder / name
    write_output(compiled.plan_json, compiled.program, out)
    return out


def _launch(out: Path, args: list, legacy: bool = False, world: int = 4, timeout: float = 900) -> str:
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)
    base = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH="", PYTHON=sys.executable,
                PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    if sys.prefix != sys.base_prefix and not os.environ.get("TORCH_EXTENSIONS_DIR"):
        base["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")   # as tests/e2e_util.py
    args = [str(a) for a in args]
    if legacy:
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                f"from benchmarks.bench.checkpoint_legacy import rank_main; "
                f"sys.exit(rank_main({str(out)!r}, {args!r}))")
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, str(out / "train.py"), *args]
    procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), cwd=out,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    texts = [p.communicate(timeout=timeout)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"benchmarks bench checkpoint: a launch of {out.name} {' '.join(args)} failed:\n"
                           + "\n".join(t[-1500:] for t in texts))
    return texts[0]


def _seconds(text: str, what: str) -> float:
    pattern = r"^checkpoint step \d+ saved to \S+ in ([0-9.]+) s" if what == "save" else \
        r"^resumed from .* in ([0-9.]+) s$"
    m = re.search(pattern, text, re.M)
    if m is None:
        raise RuntimeError(f"benchmarks bench checkpoint: no {what} time in:\n{text[-2000:]}")
    return float(m.group(1))


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def measure() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="planc-bench-ckpt-") as tmp:
        tmp = Path(tmp)
        for label, args in SIZES.items():
            argtext = ", ".join(f"{k} = {v}" for k, v in args.items())
            outs = {}
            for name, body in _bodies(args).items():
                text = (PLAN.replace("NAME", name).replace("EXAMPLES", str(EXAMPLES)).replace("ARGS", argtext)
                        .replace("BODY", body).replace("MB", str(MICRO_BATCH)))
                outs[name] = _compile(f"{name}_{args['hidden']}", text, tmp)
            a, b = outs["pipe2_data2"], outs["pipe1_data4"]
            params = None
            for legacy in (False, True):
                ck = tmp / f"ck_{args['hidden']}_{int(legacy)}"
                save = _seconds(_launch(a, ["--steps", 1, "--save", ck], legacy), "save")
                same = _seconds(_launch(a, ["--steps", 1, "--resume", ck], legacy), "load")
                resharded = None if legacy else _seconds(_launch(b, ["--steps", 1, "--resume", ck]), "load")
                if not legacy:
                    manifest = json.loads((ck / "step1" / "planc.json").read_text())
                    params = sum(math.prod(p["shape"]) for p in manifest["parameters"])
                rows.append({"model": label, "params": params, "format": "per-rank torch files (before)" if legacy
                             else "format 2 (DCP)", "save_s": save, "load_same_s": same,
                             "load_resharded_s": resharded, "bytes": _bytes(ck / "step1")})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | parameters | format | save s | load s, same plan | load s, 2 x data 2 → 1 x data 4 | "
             "bytes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        resharded = "— (refused: another plan)" if r["load_resharded_s"] is None else f"{r['load_resharded_s']:.3f}"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f} M | {r['format']} | {r['save_s']:.3f} | "
                     f"{r['load_same_s']:.3f} | {resharded} | {r['bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines)


def run() -> str:
    import torch

    t0 = time.monotonic()
    rows = measure()
    head = (f"4 local CPU ranks (gloo), Adam, fp32; a checkpoint of step 1 saved under `2 stages x data 2`, "
            f"loaded under the same plan and (format 2 only) under `1 stage x data 4`. Rank 0's wall time of the "
            f"collective save / restore. Machine: {os.cpu_count()} CPU cores ({platform.machine()}), Python "
            f"{platform.python_version()}, torch {torch.__version__}; 1-minute load {os.getloadavg()[0]:.1f} at the "
            f"end; the bench took {time.monotonic() - t0:.0f} s.")
    return head + "\n\n" + table(rows) + "\n"
