"""A rank builds only its share of the model, and can say what that costs (``train.py --build-only``).

``build_stage(builder, model_args, tp, plan, stage)`` calls the model builder with the stage's layer
range when it takes a keyword ``stage_layers`` (a Hugging Face model's builder always does: it materializes the
stage's modules only, ``hf.build_share``); a layer the rank does not hold is a :class:`NotHeld`
placeholder (or, for a Hugging Face model, the module left on the meta device), so every index of the
model keeps its place. Builders without that keyword build every layer, as before (docs/models.md).
The model's own arguments may hold ``layers`` (the bundled builders' layer count): it is theirs.

``Peak`` measures a rank's resident memory over a baseline: ``VmRSS`` when it starts, the kernel's
high-water mark ``VmHWM`` after (reset through ``/proc/self/clear_refs``, so an import's peak before the
baseline is not counted). ``build_report`` puts what the rank holds beside plan.json's prediction.
"""
from __future__ import annotations

import json
import time

import torch
from torch import nn

from .usercode import build_layers

__all__ = ["NotHeld", "build_stage", "Peak", "held_bytes", "build_report", "format_report", "build_only"]


class NotHeld(nn.Module):
    """A layer of another stage: no parameters; running it is a bug (the engine runs its stage's only)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args):
        raise RuntimeError(f"layer {self.index} is not held by this rank")


def build_stage(builder, model_args: dict, tp, plan, stage) -> list:
    """The model's layers, those of ``stage`` built (all of them for a builder without ``stage_layers``)."""
    total = plan.stages[-1].layers[1] if plan.stages[-1].layers is not None else None
    held = range(*stage.layers) if stage.layers is not None else None
    layers = build_layers(builder, model_args, tp, held, total)
    return [NotHeld(i) if layer is None else layer for i, layer in enumerate(layers)]


def _status(key: str) -> int | None:
    """A ``/proc/self/status`` figure in bytes (None where there is no procfs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Peak:
    """Resident bytes over the baseline taken at construction: ``peak()`` since then (or since ``reset``)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        try:   # "5": reset the peak resident size to the current one (proc(5), clear_refs)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.resettable = True
        except OSError:
            self.resettable = False
        self.base = _status("VmRSS") or 0
        self.started = time.perf_counter()

    def hwm(self) -> int | None:
        """The resident high-water mark since the reset (None where it cannot be reset)."""
        return _status("VmHWM") if self.resettable else None

    def peak(self) -> int | None:
        hwm = self.hwm()
        return None if hwm is None else max(hwm - self.base, 0)

    def report(self) -> dict:
        return {"rss_before": self.base, "rss_peak": self.hwm(), "peak_over_before": self.peak(),
                "seconds": time.perf_counter() - self.started}


def held_bytes(layers, initial=None) -> dict:
    """What a stage's built layers hold: parameters and buffers in their dtypes, and the fp32 copies kept
    for the masters (``cast_stage``'s, bf16/fp16 plans)."""
    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts if not t.is_meta)
    seen: dict[int, torch.Tensor] = {}
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            seen[id(t)] = t
    params = [t for t in seen.values() if isinstance(t, nn.Parameter)]
    return {"parameters": nbytes(params), "buffers": nbytes(t for t in seen.values() if not isinstance(t, nn.Parameter)),
            "masters": nbytes((initial or {}).values())}


def predicted(plan, stage: int) -> dict:
    """plan.json's ``pipeline.stages[stage].memory`` (bytes by part) from the bytes the runtime loaded, {}
    where the plan has none."""
    try:
        raw = json.loads(plan.raw)
        return next((dict(s.get("memory") or {}) for s in raw["pipeline"].get("stages", [])
                     if int(s.get("stage", -1)) == stage), {})
    except (TypeError, ValueError, KeyError):
        return {}


def build_report(rank: int, stage: int, layers, initial, stats: dict, plan) -> dict:
    held = held_bytes(layers, initial)
    return {"rank": rank, "stage": stage, **held, "build_peak": stats["peak_over_before"], **stats,
            "predicted": predicted(plan, stage)}


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def format_report(reports: list[dict]) -> str:
    """Rank 0's table of every stage rank's ``build_report`` (MiB)."""
    rows = [f"{'rank':>4} {'stage':>5} {'params MiB':>11} {'predicted':>10} {'masters MiB':>12} "
            f"{'build peak MiB':>15} {'predicted':>10}"]
    for r in sorted(reports, key=lambda r: r["rank"]):
        p = r["predicted"]
        rows.append(f"{r['rank']:>4} {r['stage']:>5} {_mib(r['parameters']):>11} {_mib(p.get('parameters')):>10} "
                    f"{_mib(r['masters']):>12} {_mib(r['build_peak']):>15} {_mib(p.get('build')):>10}")
    return "\n".join(rows)


def build_only(rank: int, stage, layers, initial, stats, plan) -> None:
    """``--build-only``: every stage rank's report gathered; rank 0 prints the table."""
    import torch.distributed as dist
    mine = None
    if stage is not None:
        lo, hi = stage.layers if stage.layers is not None else (0, len(layers))
        mine = build_report(rank, stage.index, layers[lo:hi], initial, stats, plan)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        print("built each rank's share (bytes held; build peak = resident high-water mark over the rank's "
              "resident size before the build):\n" + format_report([r for r in gathered if r is not None]), flush=True)
        print("build report: " + json.dumps([r for r in gathered if r is not None], sort_keys=True), flush=True)
