"""`python -m benchmarks bench build`: what a rank holds when it starts and while it trains, measured, beside
the memory model's prediction (docs/memory.md), for Llama models of real shape on 8 CPU ranks.

Each model is one plan: ``LlamaForCausalLM`` from config keys on one host of 8 CPU devices, 4 stages of
``(tensor = 2)`` (sequence-parallel, the default), bf16 + AdamW, 4 micro-batches of 4 rows of 64 byte tokens, 1F1B. Launched with
``train.py --build-only`` (every rank builds its share and reports its resident high-water mark, VmHWM,
reset through /proc/self/clear_refs before the build) and, for the models that fit this machine's 24 GiB
when trained, ``train.py --steps 2 --memory-stats`` (each rank's parameters, gradient buckets, masters,
optimizer state and autograd's saved activations, and its VmHWM over the training, reset once the
engine is built).

Resident figures are over a baseline: the same plan shape with a tiny model of the same family (which
imports the same libraries and runs the same code), rank by rank. *Before*: what every rank did first
until this change, the whole model by seeded ``from_config`` in fp32, measured in one process (its peak
resident size over the size before, and its time; *build s*: the stage's slowest rank, from the start of
its build to its share cast to the plan's precision, 8 ranks sharing 2 cores).
"""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.bench.launching import launch_sh

ROOT = Path(__file__).resolve().parents[2]
BYTES = ROOT / "examples" / "bytes.py"
MiB = 2 ** 20

# name -> (config keys, stage layer bounds, trained here)
MODELS = {
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256}, (0, 3, 5, 7, 10), True),
    "254M": ({"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16, "num_attention_heads": 16,
              "num_key_value_heads": 8, "vocab_size": 32000}, (0, 5, 9, 13, 18), True),
    "1.2B": ({"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
              "num_key_value_heads": 4, "vocab_size": 32000}, (0, 6, 12, 18, 24), False),
}
PARTS = ("parameters", "gradients", "optimizer", "activations")


def plan_text(name: str) -> str:
    keys, bounds, _ = MODELS[name]
    config = ", ".join(f"{k} = {v}" for k, v in keys.items())
    stages = "\n".join(f"  stage {i} : layers {a}..{b} on devices {2 * i}..{2 * i + 2} as (tensor = 2)"
                       for i, (a, b) in enumerate(zip(bounds, bounds[1:])))
    return textwrap.dedent(f"""\
        plan build_{name.replace('.', '_')} {{
          cluster {{
            level node x 1 : bandwidth 1 GB/s, latency 50 us
            level cpu x 8 : bandwidth 10 GB/s, latency 2 us
            host = node
          }}
          model hf "LlamaForCausalLM" {{ {config}, max_position_embeddings = 128, tie_word_embeddings = false }}
          data "{BYTES}:batches" {{ seq = 64 }}
        """) + stages + textwrap.dedent("""
          train {
            micro_batch = 4, micro_batches = 4, steps = 2
            schedule = 1f1b, optimizer = adamw(lr = 1e-4), precision = bf16, seed = 0
          }
        }
        """)


def _compile(name: str, out: Path) -> dict:
    from planc.output.codegen import write_output
    from planc.driver.compile import compile_file
    src = out.parent / f"{out.name}.plan"
    src.write_text(plan_text(name))
    compiled = compile_file(src, probe=True)
    write_output(compiled.plan_json, compiled.program, out)
    return compiled.plan_json


def _launch(out: Path, *args: str, timeout: float = 1200) -> str:
    return launch_sh(out, *args, bench="build", timeout=timeout)


_BEFORE = textwrap.dedent("""\
    import json, sys, time, torch, transformers
    def status(k):
        for line in open("/proc/self/status"):
            if line.startswith(k + ":"):
                return int(line.split()[1]) * 1024
    cfg = transformers.LlamaConfig(**json.loads(sys.argv[1]), max_position_embeddings=128, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM   # the imports before the baseline
    import transformers.models.llama.modeling_llama
    open("/proc/self/clear_refs", "w").write("5")
    base, t0 = status("VmRSS"), time.perf_counter()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak": status("VmHWM") - base,
                      "params": sum(p.numel() for p in model.parameters())}))
    """)


def before(name: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _BEFORE, json.dumps(MODELS[name][0])], capture_output=True, text=True,
                       timeout=1200, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if r.returncode != 0:
        raise RuntimeError(f"benchmarks bench build: the whole-model build of {name} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(names=tuple(MODELS)) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="planc-bench-build-") as tmp:
        for name in names:
            folder = Path(tmp) / name
            plan = _compile(name, folder)
            t0 = time.perf_counter()
            text = _launch(folder, "--build-only")
            wall = time.perf_counter() - t0
            reports = json.loads(re.search(r"^build report: (.*)$", text, re.M)[1])
            row = {"build": reports, "launch_s": wall, "before": before(name),
                   "predicted": {int(s["stage"]): s.get("memory") or {} for s in plan["pipeline"]["stages"]}}
            if MODELS[name][2]:
                stats = Path(tmp) / f"{name}-stats"
                _launch(folder, "--steps", "2", "--memory-stats", str(stats))
                row["train"] = {int(p.stem[4:]): json.loads(p.read_text()) for p in stats.glob("rank*.json")}
            out[name] = row
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def report(data: dict) -> str:
    tiny = data.get("tiny")
    base_build = {r["rank"]: r["rss_peak"] for r in tiny["build"]} if tiny else {}
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} cores; 8 CPU ranks (gloo), 4 stages x tensor 2 "
             "(sequence-parallel), bf16 + AdamW. Command: `python -m benchmarks bench build --write docs/benchmarks.md`.", "",
             "**At start** (per stage, its largest rank; resident figures over the tiny model's, rank by rank; "
             "*before*: the whole model in fp32, which every rank built first until now):", "",
             "| model | stage | held MiB (params + masters) | build peak MiB | predicted build MiB | ratio | build s | "
             "before: whole-model peak MiB | before s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in data.items():
        if name == "tiny":
            continue
        tiny_pred = tiny["predicted"] if tiny else {}
        for stage in sorted(row["predicted"]):
            ranks = [r for r in row["build"] if r["stage"] == stage]
            r = max(ranks, key=lambda r: r["rss_peak"] - base_build.get(r["rank"], 0))
            peak = r["rss_peak"] - base_build.get(r["rank"], 0) if r["rss_peak"] is not None else None
            pred = row["predicted"][stage].get("build", 0) - tiny_pred.get(stage, {}).get("build", 0)
            secs = max(x.get("seconds", 0.0) for x in ranks)
            lines.append(f"| {name} | {stage} | {_mib(r['parameters'] + r['masters'])} | {_mib(peak)} | {_mib(pred)} | "
                         f"{_ratio(peak, pred)} | {secs:.1f} | {_mib(row['before']['peak'])} | "
                         f"{row['before']['seconds']:.1f} |")
    lines += ["", "**Training** (2 steps; per stage, its largest rank; measured by the ranks against the model's "
              "parts; resident peak over the tiny model's):", "",
              "| model | stage | " + " | ".join(f"{p} MiB meas / pred" for p in PARTS) + " | resident MiB meas / pred | ratio |",
              "|---|---|" + "---|" * (len(PARTS) + 2)]
    base_train = {k: v["rss_training_peak"] for k, v in tiny["train"].items()} if tiny and "train" in tiny else {}
    for name, row in data.items():
        if "train" not in row or name == "tiny":
            continue
        for stage in sorted(row["predicted"]):
            ranks = {k: v for k, v in row["train"].items() if v["stage"] == stage}
            k = max(ranks, key=lambda k: ranks[k]["rss_training_peak"] - base_train.get(k, 0))
            m, pred = ranks[k], row["predicted"][stage]
            meas = {"parameters": m["parameter_bytes"], "gradients": m["gradient_bytes"],
                    "optimizer": m["master_bytes"] + m["optimizer_state_bytes"],
                    "activations": m.get("peak_saved_activation_bytes", 0)}
            rss = m["rss_training_peak"] - base_train.get(k, 0)
            tiny_total = tiny["predicted"].get(stage, {}).get("total", 0) if tiny else 0
            total = pred.get("total", 0) - tiny_total
            lines.append(f"| {name} | {stage} | " + " | ".join(f"{_mib(meas[p])} / {_mib(pred.get(p))}" for p in PARTS)
                         + f" | {_mib(rss)} / {_mib(total)} | {_ratio(rss, total)} |")
    return "\n".join(lines) + "\n"


def run(**_) -> str:
    """The tables only: what they measure (this module's docstring) is said above the markers."""
    return report(measure())
