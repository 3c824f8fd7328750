"""ZeRO-3's prices for ``planc explain``: one micro-batch's gathers alone (:func:`gather_seconds`) and both
``zero_keep_gathered`` settings priced by the memory model and the simulator (:func:`zero3_notes`, plan.json's
``pipeline.stages[i].zero3``; docs/plan-format.md). How the simulator runs the gathers:
``planc.pipeline.zero3sim``."""

from __future__ import annotations

import dataclasses

from planc.cost import events
from planc.cost.network import Network
from planc.pipeline.memory import PRECISION_BYTES
from planc.pipeline.simulate import _program, predict
from planc.pipeline.zero3sim import layer_param_bytes, gathers_per_micro_batch

__all__ = ["gather_seconds", "zero3_notes"]


def gather_seconds(sim, s: int) -> float:
    """Seconds of one micro-batch's gathers on zero-3 stage ``s`` alone, back to back (a step's with
    ``keep_gathered``); 0 when the stage gathers nothing (no zero 3, or one data member)."""
    red = next((r for r in sim.reductions if r.stage == s and r.per_layer), None)
    if red is None:
        return 0.0
    c = sim.compute[s]
    g, net = events.Graph(), Network(sim.cluster)

    def comm(deps, tag, fl, lat):
        return g.add(deps, flows=tuple(fl), latency=lat, tag=tag)

    stream: dict = {}
    ready = {d: None for d in sim.stage_devices[s]}
    per = layer_param_bytes(c)
    for j, nbytes in enumerate(per):   # the last layer's backward starts the recompute: gathered already
        count = 1 if sim.keep_gathered else 3 if red.recompute and j != len(per) - 1 else 2
        for r in range(count):
            _program(g, net, comm, red, nbytes, ready, stream, ("gather", s, j, r))
    if not stream:
        return 0.0
    trace = events.run(g, net)
    return max(trace.finish[n] for n in stream.values())


def zero3_notes(memory, flights, sim=None, actions=None) -> list[dict | None]:
    """Per stage (index order) plan.json's ``pipeline.stages[i].zero3`` (docs/plan-format.md), None where the
    stage does not shard its parameters: the stage's ``prefetch``, ``keep_gathered`` and ``recompute``;
    ``whole`` and ``gathered``, the parameter bytes kept whole (tied across stages) and of the
    gathered buffers (no shard in the parameters' dtype is kept: the fp32 masters are its values); ``freed`` and ``kept``, the stage under ``zero_keep_gathered = false`` and
    ``true``: ``total`` bytes by the memory model (``flights`` micro-batches in flight), ``gathers`` per
    micro-batch (``per``: ``micro_batch``, or ``step`` when kept), ``gather_seconds`` (their price alone,
    :func:`gather_seconds`) and ``iteration``, the schedule's ``actions`` simulated on ``sim`` with
    that setting and no host NIC order (None without a simulation)."""
    out: list[dict | None] = []
    runs: dict = {}
    for m, k in zip(memory, flights):
        if not m.shards_parameters:
            out.append(None)
            continue
        p = PRECISION_BYTES[m.precision]
        entry = {"prefetch": m.prefetch, "keep_gathered": m.keep_gathered, "recompute": m.recompute,
                 "whole": m.tied * p,
                 "gathered": m.gathered * p}
        layers = len(sim.compute[m.stage].forward) if sim is not None else None
        red = next((r for r in sim.reductions if r.stage == m.stage and r.per_layer), None) if sim else None
        for name, keep in (("freed", False), ("kept", True)):
            run = dataclasses.replace(sim, keep_gathered=keep) if sim is not None else None
            if run is not None and actions is not None and keep not in runs:
                runs[keep] = predict(run, actions).iteration
            entry[name] = {"total": m.with_(keep_gathered=keep).total(k),
                           "gathers": (gathers_per_micro_batch(layers, m.recompute, keep) if layers is not None
                                       else None), "per": "step" if keep else "micro_batch",
                           "gather_seconds": gather_seconds(run, m.stage) if red is not None else None,
                           "iteration": runs.get(keep)}
        out.append(entry)
    return out
