"""The iteration simulator.

(The abstract simulation of the lists that the schedules use for their deadlock check,
:func:`simulate`, lives with them in ``planc.pipeline.schedules``; it is named here too.)

:func:`predict` is the iteration simulator (docs/simulator.md): every device
of every stage runs its stage's list as the runtime engine does, with the
plan's real transfers (unit tasks per route) and gradient reductions moving
bytes over the cost model's links (``planc.cost.events``), and per-layer
compute times from the model probe (:func:`stage_compute`). It gives the
iteration time, each stage's busy and bubble fractions, the exposed
communication and the peak activation memory per stage. A ``zero 3`` stage runs layer by layer with its
parameters' all-gathers (``planc.pipeline.zero3sim``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planc import ir
from planc.cost import events
from planc.cost.collectives import held_after, ring_flows, step_coefficients
from planc.cost.network import Network
from planc.plan.gates import post_gates
from planc.pipeline.schedules import DeadlockError, Timeline, build, simulate
from planc.pipeline.simfigures import Prediction, StageFigures, figures
from planc.pipeline.zero3sim import layered_op
from planc.pipeline.siminput import (
    BUCKET_BYTES, DEFAULT_FLOPS, RECV_AHEAD, SimInput, SimReduction, SimTask, SimTransfer, StageCompute,
    sim_input, stage_compute,
)

__all__ = [   # the input types (planc.pipeline.siminput) and the lists' check (schedules) are named here too
    "DeadlockError", "Timeline", "simulate", "Prediction", "StageFigures", "predict", "predict_schedule",
    "BUCKET_BYTES", "DEFAULT_FLOPS", "RECV_AHEAD", "SimInput", "SimReduction", "SimTask", "SimTransfer",
    "StageCompute", "sim_input", "stage_compute",
]

Op = tuple[str, int]
NIC_ORDER_GAIN = 0.02   # the predicted gain below which the compiler keeps no host NIC order


# ---------------------------------------------------------------- the iteration simulator

def predict(sim: SimInput, actions, timeline: bool = False, nic: bool = False) -> Prediction:
    """Simulate one iteration of ``actions`` (plan.json ``pipeline.actions``: the rank classes' lists,
    ``planc.plan.RankClass``; ``planc.pipeline.schedules.build(...).actions``) on ``sim``; also with free communication, so the exposed communication is the difference.
    ``timeline``: keep every compute interval and flow (for ``planc.pipeline.gantt``).

    ``nic``: also try a host NIC order (docs/simulator.md, "The host NIC order"): every host's
    cross-host sends (one per sender, transfer, direction and micro-batch) one at a time, in the order
    they became ready in the unordered simulation. Kept, as ``nic_order``, only when it simulates to
    completion (the order cannot hang the lists under the runtime's rules) and predicts an iteration
    at least :data:`NIC_ORDER_GAIN` shorter than sharing the links as the sends come (a smaller gain is
    within what the model misses); ``unordered_iteration`` is the latter."""
    per_stage = _turns(actions, len(sim.stage_devices))
    full = _simulate(sim, per_stage, free=False, keep=timeline)
    free = _simulate(sim, per_stage, free=True, keep=False)
    if nic:
        order = nic_order_from(full.ready, sim)
        if order:
            try:
                ordered = _simulate(sim, per_stage, free=False, keep=timeline, nic_order=order)
            except ValueError:   # the order would hang the lists: keep none
                ordered = None
            if ordered is not None and ordered.iteration <= full.iteration * (1 - NIC_ORDER_GAIN):
                return dataclasses.replace(ordered, free_iteration=free.iteration, nic_order=order,
                                           unordered_iteration=full.iteration)
        full = dataclasses.replace(full, unordered_iteration=full.iteration)
    return dataclasses.replace(full, free_iteration=free.iteration)


def _turns(actions, stages: int) -> list:
    """Per rank class ``(stages, turns, tail)``: its list's turns (``planc.plan.RankClass.turns``: each compute
    action with the receives it waits for and the sends it issues after) and the sends after its last
    compute action: the only order the simulator runs. The devices of a class compute every stage of it on
    one compute stream, in list order."""
    out, seen = [], set()
    for c in actions:
        for s in c.stages:
            if s >= stages:
                raise ValueError(f"pipeline.actions runs stage {s} of {stages}")
            seen.add(s)
        out.append((tuple(c.stages), c.turns(), c.tail()))
    missing = sorted(set(range(stages)) - seen)
    if missing:
        raise ValueError(f"pipeline.actions runs no list for stage {missing[0]}")
    return out


def predict_schedule(sim: SimInput, schedule, micro_batches: int, virtual: int = 1, **kw) -> Prediction:
    """:func:`predict` of ``schedule``'s generated lists (``planc.pipeline.schedules.build``) for the stages
    and transfers of ``sim`` (``virtual``: interleaved_1f1b's V)."""
    return predict(sim, build(schedule, len(sim.stage_devices), micro_batches, sim.transfers, check=False,
                              virtual=virtual).actions, **kw)


def nic_order_from(ready, sim: SimInput) -> tuple:
    """Per host, its cross-host send keys in the order they became ready (start time, then key)."""
    by_host: dict[int, list] = {}
    for t, key in sorted(ready):
        by_host.setdefault(sim.cluster.host_of(key[0]), []).append(key)
    return tuple((h, tuple(keys)) for h, keys in sorted(by_host.items()) if len(keys) > 1)


def ingress_order_from(ready, sim: SimInput) -> tuple:
    """Per *receiving* host, the cross-host send keys that enter it, in the order they became ready:
    the chains of an order on each host's incoming link (an experiment, docs/benchmarks.md, "An order
    on the receiving host's link, simulated"; the compiler keeps none). Chains of this shape can be
    given to :func:`_simulate` as ``nic_order``, alone or after the sending hosts' ones."""
    host_of = sim.cluster.host_of
    enters: dict[tuple, set] = {}
    for t in sim.transfers:
        for direction, tasks in (("forward", t.forward), ("backward", t.backward)):
            for task in tasks or ():
                enters.setdefault((task.sender, t.name, direction), set()).update(
                    host_of(r) for r in task.receivers if host_of(r) != host_of(task.sender))
    by_host: dict[int, list] = {}
    for _, key in sorted(ready):
        for h in sorted(enters.get(key[:3], ())):
            by_host.setdefault(h, []).append(key)
    return tuple((h, tuple(keys)) for h, keys in sorted(by_host.items()) if len(keys) > 1)


def _simulate(sim: SimInput, lists, free: bool, keep: bool, nic_order: tuple = ()) -> Prediction:
    """One iteration of ``lists`` (per rank class its stages, turns and tail, :func:`_turns`)."""
    S = len(sim.stage_devices)
    if len(sim.compute) != S:
        raise ValueError(f"{len(sim.compute)} compute models for {S} stages")
    net = Network(sim.cluster)
    g = events.Graph()
    # per class its compute actions (kind, stage, micro-batch) in list order, and its devices
    ops_of = [[(t.compute.kind, t.compute.stage, t.compute.micro_batch) for t in ts] for _, ts, _ in lists]
    devs_of = [sim.stage_devices[stages[0]] for stages, _, _ in lists]
    owner: dict[int, tuple] = {}
    for (stages, _, _), devs in zip(lists, devs_of):
        if any(sim.stage_devices[x] != devs for x in stages):
            raise ValueError(f"the stages {list(stages)} of one rank class are on different devices")
        for d in devs:
            if owner.setdefault(d, stages) != stages:
                raise ValueError(f"rank classes {list(owner[d])} and {list(stages)} run on the same devices "
                                 f"(device {d}): one list per device")
    number = {t.name: i for i, t in enumerate(sim.transfers)}
    unknown = [a for _, ts, tail in lists for a in [x for t in ts for x in t.before] + list(tail)
               if a.transfer not in number]
    if unknown:
        raise ValueError(f"pipeline.actions: {unknown[0].text()}: the plan has no transfer {unknown[0].transfer!r}")
    local = {t.name for t in sim.transfers if t.local}   # between stages of one class: nothing moves
    # per class and compute action, the receives it waits for: (transfer index, direction, micro-batch)
    jobs_of = [[[(number[a.transfer], str(a.direction), a.micro_batch) for a in t.recvs if a.transfer not in local]
                for t in ts] for _, ts, _ in lists]
    # (transfer, direction, micro-batch) -> (the compute action its send follows, the receives the compute
    # thread waits for between that action and the send): the list's order, as the runtime runs it
    sent_after = {}
    for _, ts, tail in lists:
        for i, before in enumerate([t.before for t in ts[1:]] + [tail]):
            waited = []
            for a in before:
                if a.kind == "RECV":
                    if a.transfer not in local:
                        waited.append((number[a.transfer], str(a.direction), a.micro_batch))
                else:
                    sent_after[a.transfer, str(a.direction), a.micro_batch] = (i, tuple(waited))
    micro_batches = max((m for ops in ops_of for _, _, m in ops), default=-1) + 1
    stage_of = {d: s for s, devs in enumerate(sim.stage_devices) for d in devs}   # (a class: its first stage)
    split = {s for ops in ops_of for k, s, _ in ops if k == "W"}   # stages whose backward is split

    def comm(deps, tag, fl, lat):
        """A node moving ``fl`` (free: nothing, at once)."""
        return g.add(deps, flows=() if free else tuple(fl), latency=0.0 if free else lat, tag=tag)

    # cluster { cores = N per ... }: the devices of a pool compute on its N shared cores
    pool_of: dict[int, int] = {}
    for devs in sim.cluster.core_pools():
        p = g.add_pool(sim.cluster.cores)
        pool_of.update((d, p) for d in devs)
    begin, comp_end, layer_end = {}, {}, {}
    comp_nodes = []            # (node, stage, device, kind, m)
    op_cost = sim.op_overhead   # the runtime's own time per instruction (cluster op_overhead), on the compute stream
    layered = {r.stage: r for r in sim.reductions if r.per_layer}   # ZeRO-3: gathered layer by layer
    # per stage, the position in its class's list of its last gradient action (the last W where it splits
    # the backward, else the last B): it runs layer by layer, releasing the gradient buckets as they fill
    grads_done = {s: max(i for i, (k, t, _) in enumerate(ops) if t == s and k == ("W" if s in split else "B"))
                  for ops in ops_of for s in {t for _, t, _ in ops}}
    for c, ops in enumerate(ops_of):
        devs = devs_of[c]
        prev = dict.fromkeys(devs)
        stream: dict = {}          # ZeRO-3: each device's last gather (one stream)
        for i, (kind, s, m) in enumerate(ops):
            cm = sim.compute[s]
            if s in layered:
                layered_op(g, net, comm, _program, sim, s, i, (kind, m), layered[s], pool_of.get, op_cost, begin,
                           comp_end, layer_end, comp_nodes, prev, stream, first=i == min(
                               j for j, (k, t, _) in enumerate(ops) if t == s and k == "F"),
                           last=i == grads_done[s], split=s in split)
                continue
            weight = sum(cm.weights()) if s in split else 0.0
            for d in devs:
                pool = pool_of.get(d)
                b = begin[d, i] = g.add([prev[d]], tag=("begin", s, d, i))
                if i == grads_done[s]:   # per layer, last layer first: gradient buckets are released as they fill
                    node = b
                    if op_cost > 0:   # the instruction's own time, before its first layer
                        node = g.add([node], duration=op_cost, tag=(kind, s, d, m, "op"), pool=pool)
                        comp_nodes.append((node, s, d, kind, m))
                    times = cm.weights() if kind == "W" else cm.backward
                    for j in range(len(times) - 1, -1, -1):
                        node = layer_end[d, s, j] = g.add([node], duration=times[j], tag=(kind, s, d, m, j), pool=pool)
                        comp_nodes.append((node, s, d, kind, m))
                else:
                    cost = sum(cm.forward) if kind == "F" else weight if kind == "W" else sum(cm.backward) - weight
                    node = g.add([b], duration=cost + op_cost, tag=(kind, s, d, m), pool=pool)
                    comp_nodes.append((node, s, d, kind, m))
                comp_end[d, i] = prev[d] = node
    # the receive thread of every device: its receives in list order, posted at planc.plan.gates.post_gates
    posted, recv_job, recv_sources, begin_jobs = {}, {}, {}, {}
    before = {}     # the receive finished before this one on the same device (relays and gathers wait for it)
    for c, ops in enumerate(ops_of):
        gates = post_gates(ops, sim.ahead, [bool(j) for j in jobs_of[c]])
        for d in devs_of[c]:
            prev = None
            for i, jobs in enumerate(jobs_of[c]):
                s = ops[i][1]
                for t, direction, m in jobs:   # posted when queued (never blocks), finished in queue order
                    post = g.add([begin[d, gates[i]] if gates[i] > 0 else None],
                                 tag=("post", s, d, t, direction, m))
                    posted[d, t, direction, m] = post
                    before[d, t, direction, m] = prev
                    prev = recv_job[d, t, direction, m] = g.add([post, prev], tag=("recv", s, d, t, direction, m))
                    g.nodes[begin[d, i]].deps.append(prev)
                    begin_jobs.setdefault((d, i), []).append(prev)
    # the transfers: each unit task starts when its sender computed the data and its receivers posted
    sends: dict[int, list[int]] = {}
    marks = []
    items: dict[tuple, list[int]] = {}   # cross-host send key (sender, transfer, direction, m) -> its nodes
    host_of = sim.cluster.host_of
    for ti, tr in enumerate(sim.transfers):
        for direction, tasks, src in (("forward", tr.forward, tr.src_stage), ("backward", tr.backward, tr.dst_stage)):
            if not tasks:
                continue
            for m in range(micro_batches):
                gather_prev: dict[int, int] = {}
                ends = []
                for task in tasks:
                    if task.sender not in sim.stage_devices[src]:
                        raise ValueError(f"transfer {tr.name!r} ({direction}): sender {task.sender} is not in "
                                         f"stage {src}")
                    at = sent_after.get((tr.name, direction, m))
                    if at is None:
                        raise ValueError(f"pipeline.actions: stage {src} never sends {tr.name} {direction} {m}")
                    ready = comp_end[task.sender, at[0]]
                    if at[1]:   # the list has the compute thread wait for receives before it sends
                        ready = g.add([ready] + [recv_job[(task.sender,) + k] for k in at[1]],
                                      tag=("sent", src, task.sender, tr.name, direction, m))
                    deps = [ready] + [posted[r, ti, direction, m] for r in task.receivers]
                    tag = ("transfer", tr.name, direction, m)
                    done = {}
                    if task.strategy == "broadcast":
                        chain = (task.sender,) + tuple(sorted(task.receivers))
                        hops = list(zip(chain, chain[1:]))
                        bw = net.bottleneck_bandwidth(chain)
                        fill = (len(hops) - 1) * task.nbytes / max(task.chunks, 1) / bw if math.isfinite(bw) else 0.0
                        relays = [before[r, ti, direction, m] for r in chain[1:-1]]
                        node = comm(deps + relays, tag, [(a, b, task.nbytes) for a, b in hops],
                                    sum(net.latency(a, b) for a, b in hops) + fill)
                        done = {r: node for r in task.receivers}
                        send_nodes = [node]
                    elif task.parts:
                        fl = [(task.sender, r, task.nbytes / len(p)) for p in task.parts for r in p]
                        lat = max(net.latency(task.sender, r) for r in task.receivers)
                        first = comm(deps, tag, fl, lat)
                        send_nodes = [first]
                        for p in task.parts:
                            node = first
                            if len(p) > 1:
                                ring = ring_flows(ir.Collective.ALL_GATHER, p, task.nbytes / len(p))
                                lat = step_coefficients(net, ir.Collective.ALL_GATHER, [p])[1]
                                node = comm([first] + [gather_prev[r] for r in p if r in gather_prev] +
                                            [before[r, ti, direction, m] for r in p], tag, ring, lat)
                            for r in p:
                                done[r] = gather_prev[r] = node
                    else:   # send_recv: the whole slice to every receiver
                        fl = [(task.sender, r, task.nbytes) for r in task.receivers]
                        lat = max(net.latency(task.sender, r) for r in task.receivers)
                        node = comm(deps, tag, fl, lat)
                        done = {r: node for r in task.receivers}
                        send_nodes = [node]
                    sends.setdefault(task.sender, []).extend(send_nodes)
                    if any(host_of(r) != host_of(task.sender) for r in task.receivers):
                        items.setdefault((task.sender, tr.name, direction, m), []).extend(send_nodes)
                    for r, node in done.items():
                        job = recv_job.get((r, ti, direction, m))
                        if job is None:
                            raise ValueError(f"transfer {tr.name!r} ({direction}): receiver {r} is not in the "
                                             "receiving stage")
                        g.nodes[job].deps.append(node)
                        recv_sources.setdefault(job, []).append(ready)
                    ends.extend(done.values())
                marks.append((ti, direction, m, ends))
    # gradient reductions: buckets in backward order, released as the stage's last gradient action (its
    # last W where it splits the backward, else its last B) fills them
    red_last: dict[int, int] = {}
    class_of = {s: c for c, (stages, _, _) in enumerate(lists) for s in stages}
    for red in sim.reductions:
        if red.after_step or red.per_layer:
            continue
        c, s = sim.compute[red.stage], red.stage
        ops = ops_of[class_of[s]]
        final = grads_done[s]
        last = {d: comp_end[d, max(i for i, op in enumerate(ops) if op[1] == s)] for d in sim.stage_devices[s]}
        if red.every_micro_batch:   # ZeRO-2: every earlier gradient of the stage reduce-scattered as it ends
            for i, (kind, t, m) in enumerate(ops):
                if t == s and kind == ops[final][0] and i != final:
                    ready = {d: comp_end[d, i] for d in last}
                    for bi, (nbytes, _) in enumerate(_buckets(c.grad_bytes, sim.bucket_bytes)):
                        _program(g, net, comm, red, nbytes, ready, red_last, ("reduce", s, m, bi))
        for bi, (nbytes, j) in enumerate(_buckets(c.grad_bytes, sim.bucket_bytes)):
            ready = {d: layer_end[d, s, j] if red.overlapped and (d, s, j) in layer_end else last[d] for d in last}
            _program(g, net, comm, red, nbytes, ready, red_last, ("reduce", s, bi))
    # the host NIC order: a host's send k starts when its send k - 1 has finished (all its tasks)
    for _, keys in nic_order:
        for prev, key in zip(keys, keys[1:]):
            if key not in items or prev not in items:
                raise ValueError(f"NIC order: {key if key not in items else prev} is no cross-host send")
            for node in items[key]:
                g.nodes[node].deps.extend(items[prev])
    ends = {}
    for c, ((stages, _, _), devs) in enumerate(zip(lists, devs_of)):
        s = stages[0]
        for d in devs:
            last = comp_end[d, len(ops_of[c]) - 1] if ops_of[c] else None
            ends[d] = g.add([last, red_last.get(d)] + sends.get(d, []), tag=("end", s, d))
            if sim.step_overhead > 0:   # the optimizer and the step's own time, after the reductions
                ends[d] = g.add([ends[d]], duration=sim.step_overhead, tag=("step", s, d), pool=pool_of.get(d))
    # ZeRO-1: each owner's updated parameters all-gathered after the step, in buckets
    gathered: dict[int, int] = {}
    for red in sim.reductions:
        if not red.after_step:
            continue
        c = sim.compute[red.stage]
        ready = {d: ends[d] for d in sim.stage_devices[red.stage]}
        for bi, (nbytes, _) in enumerate(_buckets(c.param_bytes or c.grad_bytes, sim.bucket_bytes)):
            _program(g, net, comm, red, nbytes, ready, gathered, ("gather", red.stage, bi))
    for d, node in gathered.items():
        ends[d] = g.add([ends[d], node], tag=("end", stage_of[d], d, "gathered"))
    trace = events.run(g, net)
    ready = tuple(sorted((min(trace.start[n] for n in nodes), key) for key, nodes in items.items()))
    iteration = max((trace.finish[e] for e in ends.values()), default=0.0)
    return dataclasses.replace(
        figures(sim, lists, ops_of, devs_of, g, trace, iteration, begin, comp_end, comp_nodes, begin_jobs,
                recv_sources, ends, marks, keep), ready=ready)


def _buckets(layer_bytes, bucket: float) -> list[tuple[float, int]]:
    """``(bytes, layer)`` buckets of ``layer_bytes`` filled last layer first, each with the layer whose
    backward completes it (the runtime's gradient buckets)."""
    out = []
    fill, last_j = 0.0, 0
    for j in range(len(layer_bytes) - 1, -1, -1):
        left = layer_bytes[j]
        while left > 0:
            take = min(left, bucket - fill)
            fill, left, last_j = fill + take, left - take, j
            if fill >= bucket:
                out.append((fill, j))
                fill = 0.0
    if fill > 0:
        out.append((fill, last_j))
    return out


def _program(g, net, comm, red: SimReduction, nbytes: float, ready: dict, last: dict, tag) -> None:
    """One bucket of ``nbytes`` through ``red``'s steps: each group's step after its members are
    ``ready`` and done with their previous one (``last``, updated)."""
    held = nbytes
    for k, (collective, groups) in enumerate(red.steps):
        coll = ir.Collective(collective)
        if red.held:
            held = nbytes * red.held[k]
        for grp in groups:
            if len(grp) < 2:
                continue
            fl = ring_flows(coll, sorted(grp), held)
            lat = step_coefficients(net, coll, [grp])[1]
            node = comm([ready[d] for d in grp] + [last.get(d) for d in grp], tag + (collective,), fl, lat)
            for d in grp:
                last[d] = node
        if not red.held:
            held = held_after(coll, max(len(x) for x in groups), held)
