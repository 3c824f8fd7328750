"""`planc explain` on a zero-3 stage: how its parameters' all-gather program runs per layer, its price per
micro-batch, and ``zero_keep_gathered`` priced both ways (memory and iteration), from plan.json's
``pipeline.stages[i].zero3`` (``planc.pipeline.zero3price.zero3_notes``; docs/explain.md)."""

from __future__ import annotations

from planc.commands import ui

__all__ = ["gather_lines", "memory_note"]


_t = ui.human_seconds


def _way(name: str, w: dict, stage: int, chosen: bool) -> str:
    per = "per step" if w["per"] == "step" else "per micro-batch"
    gathers = f"{w['gathers']} gathers {per}" if w.get("gathers") is not None else "gathers not counted"
    price = f", {_t(w['gather_seconds'])} of gathers {per} alone" if w.get("gather_seconds") is not None else ""
    it = f", predicted iteration {_t(w['iteration'])}" if w.get("iteration") is not None else ""
    return (f"    zero_keep_gathered = {name}{' (the plan)' if chosen else ''}: {gathers}{price}{it}; stage {stage} "
            f"needs {ui.human_bytes(w['total'])} per device")


def gather_lines(z: dict, stage: int) -> list[str]:
    """The lines under a zero-3 stage's ``parameters`` all-gather: how it runs, and both settings priced."""
    if z["keep_gathered"]:
        how = ("each layer's parameters gathered by this program once a step, before its first forward, and "
               "kept through the step's micro-batches")
    else:
        how = ("each layer's parameters gathered by this program before its forward and again before its "
               "backward" + (" and its recomputed forward" if z.get("recompute") else "") + ", freed after each")
    fetch = ("prefetched: the next layer's gather runs while this one computes" if z["prefetch"] else
             "not prefetched (zero_prefetch = false): each gather is on the critical path")
    out = [f"  zero 3: {how}; {fetch}"]
    mine = z["kept"] if z["keep_gathered"] else z["freed"]
    if mine.get("gather_seconds") is not None:
        per = "step" if z["keep_gathered"] else "micro-batch"
        out.append(f"  price per {per}: {mine['gathers']} gathers, {_t(mine['gather_seconds'])} alone (the "
                   "simulator overlaps them with compute where prefetched)")
    out.append("  zero_keep_gathered both ways (memory model and simulator):")
    out.append(_way("false", z["freed"], stage, not z["keep_gathered"]))
    out.append(_way("true", z["kept"], stage, z["keep_gathered"]))
    return out


def memory_note(z: dict) -> str:
    """What a zero-3 stage's parameter bytes are made of."""
    if z["keep_gathered"]:
        what = "the whole stage, kept gathered through the step"
    else:
        layers = (4 if z["prefetch"] else 2) if z["recompute"] else (2 if z["prefetch"] else 1)
        what = {1: "the largest layer's", 2: "at most two layers'", 4: "at most four layers'"}[layers] + (
            " (recompute: the layer in backward and the recomputed one" + (", each with its prefetched next)"
                                                                          if z["prefetch"] else ")")
            if z["recompute"] else ": the current and the prefetched next" if z["prefetch"] else "")
    whole = f" + {ui.human_bytes(z['whole'])} tied, whole" if z["whole"] else ""
    return f"gathered {ui.human_bytes(z['gathered'])}{whole}, {what}; the shard's values are the fp32 masters"
