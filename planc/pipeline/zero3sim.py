"""ZeRO-3 in the iteration simulator: a stage whose parameters are sharded runs each operation layer by
layer, each layer's compute after the all-gather of its parameters (docs/simulator.md, "ZeRO-3").

Per layer ``j`` of a ``zero 3`` stage, the plan's ``parameters`` program (its steps over the stage's data
groups, ``planc.pipeline.simulate._program``) moves the layer's parameter bytes in the plan's precision:

* before each forward and each backward (a recomputing stage's backward: twice, its recomputed forward
  gathers too), so 2 gathers a layer per micro-batch (3 with recompute);
* with ``keep_gathered`` only before the stage's first forward of the step: once a layer per step;
* with ``prefetch`` layer ``j + 1``'s gather (in backward ``j - 1``'s) is issued when layer ``j``'s compute
  starts, and an operation's first gather when the device's previous operation ends, so it overlaps
  compute and is exposed only beyond it; without, a gather is issued when the previous layer's compute
  ends and the layer waits for it (on the critical path).

A device's gathers run one after another (one stream), beside the gradients' reduce-scatters, sharing
the links with everything else by the cost model. :func:`gather_seconds` prices one micro-batch's gathers
alone (no compute, nothing else on the links): what ``planc explain`` shows per micro-batch.
"""

from __future__ import annotations

from planc.cost import events
from planc.cost.network import Network
from planc.pipeline.memory import PRECISION_BYTES

__all__ = ["layered_ops", "gathers_per_micro_batch", "gather_seconds", "zero3_notes"]


def gathers_per_micro_batch(layers: int, recompute: bool, keep_gathered: bool) -> int:
    """All-gathers of one micro-batch on a zero-3 stage of ``layers`` layers (keep_gathered: per step)."""
    return layers if keep_gathered else layers * (3 if recompute else 2)


def _layer_bytes(c) -> tuple[float, ...]:
    return c.param_bytes or c.grad_bytes


def layered_ops(g, net, comm, program, sim, s: int, ops, red, pool, op_cost: float, begin: dict, comp_end: dict,
                layer_end: dict, comp_nodes: list) -> None:
    """Stage ``s``'s operations ``ops`` on all its devices, layer by layer with ZeRO-3's gathers (module
    docstring); fills ``begin``, ``comp_end``, ``layer_end`` (the last backward's layers) and ``comp_nodes``
    as ``planc.pipeline.simulate._simulate`` does for the other stages. ``program`` runs one gather:
    ``program(g, net, comm, red, nbytes, ready, last, tag)``; ``pool(d)``: device ``d``'s core pool."""
    c = sim.compute[s]
    devs = sim.stage_devices[s]
    nbytes = _layer_bytes(c)
    L = len(c.forward)
    last_b = max((i for i, op in enumerate(ops) if op[0] == "B"), default=-1)
    first_f = min((i for i, op in enumerate(ops) if op[0] == "F"), default=-1)
    prev: dict = {d: None for d in devs}      # each device's compute chain
    stream: dict = {}                         # each device's last gather (one stream)
    for i, (kind, m) in enumerate(ops):
        cur = {}
        for d in devs:
            begin[d, i] = cur[d] = g.add([prev[d]], tag=("begin", s, d, i))
            if op_cost > 0:   # the instruction's own time, before its first layer
                cur[d] = g.add([cur[d]], duration=op_cost, tag=(kind, s, d, m, "op"), pool=pool(d))
                comp_nodes.append((cur[d], s, d, kind, m))
        gathers = not sim.keep_gathered or i == first_f
        times = c.forward if kind == "F" else c.backward
        repeat = 2 if kind == "B" and red.recompute and not sim.keep_gathered else 1
        issue = {d: (prev[d] if sim.prefetch else cur[d]) for d in devs}
        for j in (range(L) if kind == "F" else range(L - 1, -1, -1)):
            got = {}
            if gathers:
                for r in range(repeat):
                    program(g, net, comm, red, nbytes[j], issue, stream, ("gather", s, m, j, kind, r))
                got = dict(stream)
            for d in devs:
                start = g.add([cur[d], got.get(d)], tag=(kind, s, d, m, j, "start"))
                node = g.add([start], duration=times[j], tag=(kind, s, d, m, j), pool=pool(d))
                comp_nodes.append((node, s, d, kind, m))
                issue[d] = start if sim.prefetch else node
                cur[d] = node
                if i == last_b:
                    layer_end[d, j] = node
        for d in devs:
            comp_end[d, i] = prev[d] = cur[d]


def gather_seconds(sim, s: int) -> float:
    """Seconds of one micro-batch's gathers on zero-3 stage ``s`` alone, back to back (a step's with
    ``keep_gathered``); 0 when the stage gathers nothing (no zero 3, or one data member)."""
    from planc.pipeline.simulate import _program
    red = next((r for r in sim.reductions if r.stage == s and r.per_layer), None)
    if red is None:
        return 0.0
    c = sim.compute[s]
    g, net = events.Graph(), Network(sim.cluster)

    def comm(deps, tag, fl, lat):
        return g.add(deps, flows=tuple(fl), latency=lat, tag=tag)

    stream: dict = {}
    ready = {d: None for d in sim.stage_devices[s]}
    count = gathers_per_micro_batch(1, red.recompute, sim.keep_gathered)
    for j, nbytes in enumerate(_layer_bytes(c)):
        for r in range(count):
            _program(g, net, comm, red, nbytes, ready, stream, ("gather", s, j, r))
    if not stream:
        return 0.0
    trace = events.run(g, net)
    return max(trace.finish[n] for n in stream.values())


def zero3_notes(memory, flights, sim=None, per_stage=None) -> list[dict | None]:
    """Per stage (index order) plan.json's ``pipeline.stages[i].zero3`` (docs/plan-format.md), None where the
    stage does not shard its parameters: the stage's ``prefetch``, ``keep_gathered`` and ``recompute``;
    ``shard`` and ``gathered``, the parameter bytes of the owned shard
    and of the gathered buffers; ``freed`` and ``kept``, the stage under ``zero_keep_gathered = false`` and
    ``true``: ``total`` bytes by the memory model (``flights`` micro-batches in flight), ``gathers`` per
    micro-batch (``per``: ``micro_batch``, or ``step`` when kept), ``gather_seconds`` (their price alone,
    :func:`gather_seconds`) and ``iteration``, the schedule's ``per_stage`` lists simulated on ``sim`` with
    that setting and no host NIC order (None without a simulation)."""
    import dataclasses
    from planc.pipeline.simulate import predict
    out: list[dict | None] = []
    runs: dict = {}
    for m, k in zip(memory, flights):
        if not m.shards_parameters:
            out.append(None)
            continue
        p = PRECISION_BYTES[m.precision]
        entry = {"prefetch": m.prefetch, "keep_gathered": m.keep_gathered, "recompute": m.recompute,
                 "shard": m.sharded * p,
                 "gathered": m.gathered * p}
        layers = len(sim.compute[m.stage].forward) if sim is not None else None
        red = next((r for r in sim.reductions if r.stage == m.stage and r.per_layer), None) if sim else None
        for name, keep in (("freed", False), ("kept", True)):
            run = dataclasses.replace(sim, keep_gathered=keep) if sim is not None else None
            if run is not None and per_stage is not None and keep not in runs:
                runs[keep] = predict(run, per_stage).iteration
            entry[name] = {"total": m.with_(keep_gathered=keep).total(k),
                           "gathers": (gathers_per_micro_batch(layers, m.recompute, keep) if layers is not None
                                       else None), "per": "step" if keep else "micro_batch",
                           "gather_seconds": gather_seconds(run, m.stage) if red is not None else None,
                           "iteration": runs.get(keep)}
        out.append(entry)
    return out
