"""ZeRO-3 in the iteration simulator: a stage whose parameters are sharded runs each operation layer by
layer, each layer's compute after the all-gather of its parameters (docs/simulator.md, "ZeRO-3").

Per layer ``j`` of a ``zero 3`` stage, the plan's ``parameters`` program (its steps over the stage's data
groups, ``planc.pipeline.simulate._program``) moves the layer's parameter bytes in the plan's precision:

* before each forward and each backward (a recomputing stage's backward: twice, its recomputed forward
  gathers too, but for the layer whose backward starts the recompute: the runtime recomputes the stage
  as one region from that layer's first saved tensor, gathered already), so 2 gathers a layer per
  micro-batch (3 with recompute, 3L - 1 for L layers);
* with ``keep_gathered`` only before the stage's first forward of the step: once a layer per step;
* with ``prefetch`` layer ``j + 1``'s gather (in backward ``j - 1``'s) is issued when layer ``j``'s compute
  starts, and an operation's first gather when the device's previous operation ends, so it overlaps
  compute and is exposed only beyond it; without, a gather is issued when the previous layer's compute
  ends and the layer waits for it (on the critical path).

A device's gathers run one after another (one stream), beside the gradients' reduce-scatters, sharing
the links with everything else by the cost model. ``planc.pipeline.zero3price`` prices one micro-batch's
gathers alone and both ``zero_keep_gathered`` settings: what ``planc explain`` shows.
"""

from __future__ import annotations


__all__ = ["layered_op", "gathers_per_micro_batch", "layer_param_bytes"]


def gathers_per_micro_batch(layers: int, recompute: bool, keep_gathered: bool) -> int:
    """All-gathers of one micro-batch on a zero-3 stage of ``layers`` layers (keep_gathered: per step)."""
    if keep_gathered:
        return layers
    return 3 * layers - 1 if recompute and layers else 2 * layers


def layer_param_bytes(c) -> tuple[float, ...]:
    """A stage compute model's parameter bytes per layer in the precision (older inputs: its gradient bytes)."""
    return c.param_bytes or c.grad_bytes


def layered_op(g, net, comm, program, sim, s: int, i: int, op, red, pool, op_cost: float, begin: dict,
               comp_end: dict, layer_end: dict, comp_nodes: list, prev: dict, stream: dict, first: bool, last: bool,
               split: bool = False) -> None:
    """Compute action ``i`` (``op`` = ``(kind, m)``) of zero-3 stage ``s``'s class list on all the stage's devices,
    layer by layer with ZeRO-3's gathers (module docstring); fills ``begin``, ``comp_end``, ``layer_end`` (the
    stage's last gradient action's layers, keyed ``(device, stage, layer)``) and ``comp_nodes`` as
    ``planc.pipeline.simulate._simulate`` does for the other stages. ``prev``: each device's compute chain
    (the class's, updated), ``stream``: each device's last gather (one stream); ``first``: the stage's first
    forward (``keep_gathered`` gathers there only); ``last``: its last gradient action; ``split``: the stage's
    backward is split, ``B`` running the input gradients and ``W`` the weight gradients (``W`` gathers
    nothing: ``X^T dY`` needs no parameter). ``program`` runs one gather:
    ``program(g, net, comm, red, nbytes, ready, last, tag)``; ``pool(d)``: device ``d``'s core pool."""
    kind, m = op
    c = sim.compute[s]
    devs = sim.stage_devices[s]
    nbytes = layer_param_bytes(c)
    L = len(c.forward)
    cur = {}
    for d in devs:
        begin[d, i] = cur[d] = g.add([prev[d]], tag=("begin", s, d, i))
        if op_cost > 0:   # the instruction's own time, before its first layer
            cur[d] = g.add([cur[d]], duration=op_cost, tag=(kind, s, d, m, "op"), pool=pool(d))
            comp_nodes.append((cur[d], s, d, kind, m))
    gathers = kind != "W" and (not sim.keep_gathered or first)
    weights = c.weights()
    times = (c.forward if kind == "F" else weights if kind == "W" else
             tuple(b - w for b, w in zip(c.backward, weights)) if split else c.backward)
    again = kind == "B" and red.recompute and not sim.keep_gathered   # the recompute's gathers
    issue = {d: (prev[d] if sim.prefetch else cur[d]) for d in devs}
    for j in (range(L) if kind == "F" else range(L - 1, -1, -1)):
        got = {}
        if gathers:
            for r in range(2 if again and j != L - 1 else 1):
                program(g, net, comm, red, nbytes[j], issue, stream, ("gather", s, m, j, kind, r))
            got = dict(stream)
        for d in devs:
            start = g.add([cur[d], got.get(d)], tag=(kind, s, d, m, j, "start"))
            node = g.add([start], duration=times[j], tag=(kind, s, d, m, j), pool=pool(d))
            comp_nodes.append((node, s, d, kind, m))
            issue[d] = start if sim.prefetch else node
            cur[d] = node
            if last:
                layer_end[d, s, j] = node
    for d in devs:
        comp_end[d, i] = prev[d] = cur[d]
