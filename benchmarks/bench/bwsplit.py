"""`python -m benchmarks bench bwsplit`: the backward split zero-bubble schedules need (planc/runtime/bwsplit.py)
against the fused backward engine.py runs, in one process.

Three middle stages (their input activations require grad), fp32, micro-batch 8 rows x 128 tokens,
``torch.set_num_threads(1)``: 3 GPT blocks of examples/gpt.py at width 256 and at 512 (8 heads), and 3 Hugging
Face Llama decoder layers of width 256 built from a config by planc/runtime/hf.py (no download). Per stage and
repetition, each on a fresh forward (not timed): *fused*, ``torch.autograd.backward(outputs, grads)``; *B* and
*W*, ``BackwardSplit.backward_input`` and ``backward_weight`` (the forward under ``saving``); *naive W*, a
second autograd pass from the outputs to the parameters after an input-only one (what W costs without the
split); and fused and B + W again with the forward under non-reentrant ``torch.utils.checkpoint`` (recompute).
Gradients are kept allocated and zeroed in place between passes, as planc's buckets keep them. Medians of
``REPEATS`` rounds after one warm-up; a ratio is the median of the rounds' ratios (a round's passes run
back to back, under the same load). *held*: ``held_bytes`` after B against the bytes autograd saved in the forward
(distinct storages, parameters aside). Verification, outside the timed passes: B's input gradient and W's
parameter gradients equal the fused ones (fp32, relative 1e-4), else the bench fails. What is built is
frozen for the garbage collector (``gc.freeze``), as the runtime freezes its imports.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROWS, SEQ, LAYERS = 8, 128, 3
REPEATS = 7


class BenchFailed(RuntimeError):
    pass


def _gpt(width: int):
    import torch
    spec = importlib.util.spec_from_file_location("planc_bench_gpt", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    torch.manual_seed(0)
    return torch.nn.Sequential(*gpt.build(layers=LAYERS, hidden=width, heads=8, seq=SEQ)[1:-1])


def _llama(width: int):
    import torch
    from planc.runtime import hf
    config = hf.config_from_keys("LlamaForCausalLM", {
        "vocab_size": 64, "hidden_size": width, "intermediate_size": width * 8 // 3 // 16 * 16,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
        "num_hidden_layers": LAYERS})
    return torch.nn.Sequential(*hf.pipeline_layers(hf.build_model(config, 1))[1:1 + LAYERS])


STAGES = {   # label -> (builder, width)
    "GPT, 3 blocks x 256": (_gpt, 256),
    "GPT, 3 blocks x 512": (_gpt, 512),
    "HF Llama, 3 layers x 256": (_llama, 256),
}


def _saved_bytes(stage, x) -> int:
    import torch
    params = {p.untyped_storage()._cdata for p in stage.parameters()}
    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    return sum(seen.values())


def measure_stage(stage, width: int, repeats: int = REPEATS) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint
    from planc.runtime.bwsplit import BackwardSplit

    params = [p for p in stage.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(ROWS, SEQ, width, generator=g)
    dy = torch.randn(ROWS, SEQ, width, generator=g)
    bw = BackwardSplit(params)

    def zero():
        for p in params:
            if p.grad is not None:
                p.grad.zero_()

    def forward(recompute=False, m=None):
        x = x0.clone().requires_grad_(True)
        with bw.saving(m) if m is not None else contextlib.nullcontext():
            y = checkpoint(stage, x, use_reentrant=False) if recompute else stage(x)
        return x, y

    def fused(recompute=False):
        zero()
        x, y = forward(recompute)
        t = time.perf_counter()
        torch.autograd.backward(y, dy)
        return time.perf_counter() - t, x

    def split(m, recompute=False, held=None):
        zero()
        x, y = forward(recompute, m)
        t0 = time.perf_counter()
        bw.backward_input(m, [y], [dy], [x])
        t1 = time.perf_counter()
        if held is not None:
            held.append(bw.held_bytes(m))
        del y
        t2 = time.perf_counter()
        bw.backward_weight(m)
        return t1 - t0, time.perf_counter() - t2, x

    def naive():
        zero()
        x, y = forward()
        torch.autograd.backward(y, dy, inputs=[x], retain_graph=True)
        t = time.perf_counter()
        torch.autograd.backward(y, dy, inputs=params)
        return time.perf_counter() - t

    times: dict = {k: [] for k in ("fused", "B", "W", "split", "naive", "recompute")}
    held: list = []
    for r in range(repeats + 1):
        f = fused()[0]
        b, w, _ = split(r, held=held)
        n = naive()
        frc = fused(recompute=True)[0]
        brc, wrc, _ = split(10_000 + r, recompute=True)
        if r:   # the first round warms up; ratios within a round, where the machine's load is alike
            for k, v in zip(times, (f, b, w, (b + w) / f, n / f, (brc + wrc) / frc)):
                times[k].append(v)
    _verify(stage, params, fused, split)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "held": held[-1], "saved": _saved_bytes(stage, x0.clone().requires_grad_(True))}


def _verify(stage, params, fused, split) -> None:
    import torch
    for p in params:
        p.grad = None
    _, x_ref = fused()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    _, _, x = split("verify")
    pairs = [("the input gradient", x_ref.grad, x.grad)] + [
        (name, r, p.grad) for (name, p), r in zip(stage.named_parameters(), ref)]
    for name, a, b in pairs:
        if b is None or (b - a).abs().max() > 1e-4 * a.abs().max().clamp_min(1e-12):
            raise BenchFailed(f"bench bwsplit: {name} after B and W differs from the fused backward's")


def table(rows: dict, head: str) -> str:
    lines = [f"| {head} | fused ms | B ms | W ms | (B+W) ÷ fused | naive W ÷ fused | recompute: (B+W) ÷ fused | "
             "held B→W MiB (÷ saved) |", "|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['fused'] * 1e3:.1f} | {r['B'] * 1e3:.1f} | {r['W'] * 1e3:.1f} | "
                     f"{r['split']:.3f} | {r['naive']:.3f} | {r['recompute']:.3f} | {r['held'] / 2**20:.1f} "
                     f"({r['held'] / r['saved']:.2f}) |")
    return "\n".join(lines)


def run() -> str:
    import torch

    t0 = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = {}
    try:
        for label, (build, width) in STAGES.items():
            stage = build(width)
            gc.collect()
            gc.freeze()   # as the runtime does after its imports (entry.py): collections skip what is built
            rows[label] = measure_stage(stage, width)
            gc.unfreeze()
    finally:
        torch.set_num_threads(threads)
    head = (f"{ROWS} x {SEQ} tokens, fp32, 1 thread, median of {REPEATS}; torch {torch.__version__}, "
            f"load {os.getloadavg()[0]:.1f}, {time.monotonic() - t0:.0f} s")
    return table(rows, head) + "\n"


if __name__ == "__main__":   # pragma: no cover
    print(run())
