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
from planc.pipeline.zero3sim import layered_ops
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

@dataclass(frozen=True, slots=True)
class StageFigures:
    stage: int
    busy: float                  # fraction of the iteration its devices compute
    bubble: float                # 1 - busy
    exposed_communication: float  # seconds its compute waits on communication (not on compute upstream)
    peak_activation_bytes: float  # one device: in-flight activations + received, not yet consumed inputs
    peak_in_flight: int

    def to_json(self) -> dict:
        return {"stage": self.stage, "busy": self.busy, "bubble": self.bubble,
                "exposed_communication": self.exposed_communication,
                "peak_activation_bytes": self.peak_activation_bytes, "peak_in_flight": self.peak_in_flight}


@dataclass(frozen=True, slots=True)
class Prediction:
    iteration: float
    free_iteration: float         # the same lists with free communication
    stages: tuple[StageFigures, ...]
    compute: tuple = ()           # (stage, device, kind, micro-batch, start, end) of every compute interval
    traffic: tuple = ()           # (link id, start, end, what) of every flow, what = (kind, name, micro-batch)
    transfers: tuple = ()         # (name, direction, micro-batch, start, end) of every transfer instance
    # the host NIC order the iteration ran under: ((host, ((sender, transfer, direction, micro-batch), ...)), ...)
    # (empty: sends share the links as they come); see :func:`predict`
    nic_order: tuple = ()
    unordered_iteration: float | None = None   # the same lists without the NIC order (None: not simulated)
    ready: tuple = ()             # (start, send key) of every cross-host send, in the order its host became ready

    @property
    def exposed_communication(self) -> float:
        return max(0.0, self.iteration - self.free_iteration)


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
    """Per stage the turns of its class's list (``planc.plan.RankClass.turns``: each compute action with
    the receives it waits for and the sends it issues after): the only order the simulator runs."""
    out: list = [None] * stages
    for c in actions:
        if len(c.stages) != 1:
            raise ValueError(f"the simulator runs one stage per rank class; pipeline.actions has a class of "
                             f"stages {list(c.stages)}")
        if c.stages[0] >= stages:
            raise ValueError(f"pipeline.actions runs stage {c.stages[0]} of {stages}")
        turns = c.turns()
        if any(t.compute.kind == "W" for t in turns):
            raise ValueError(f"stage {c.stages[0]}: the simulator does not time a split backward (W) yet")
        out[c.stages[0]] = (turns, c.tail())
    if None in out:
        raise ValueError(f"pipeline.actions runs no list for stage {out.index(None)}")
    return out


def predict_schedule(sim: SimInput, schedule, micro_batches: int, **kw) -> Prediction:
    """:func:`predict` of ``schedule``'s generated lists (``planc.pipeline.schedules.build``) for the stages
    and transfers of ``sim``."""
    return predict(sim, build(schedule, len(sim.stage_devices), micro_batches, sim.transfers, check=False).actions,
                   **kw)


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
    """One iteration of ``lists`` (per stage its class's turns and tail, :func:`_turns`)."""
    S = len(sim.stage_devices)
    if len(lists) != S or len(sim.compute) != S:
        raise ValueError(f"{len(lists)} lists and {len(sim.compute)} compute models for {S} stages")
    turns, tails = [ts for ts, _ in lists], [tail for _, tail in lists]
    net = Network(sim.cluster)
    g = events.Graph()
    per_stage = [[(t.compute.kind, t.compute.micro_batch) for t in ts] for ts in turns]
    number = {t.name: i for i, t in enumerate(sim.transfers)}
    unknown = [a for ts, tail in lists for a in [x for t in ts for x in t.before] + list(tail)
               if a.transfer not in number]
    if unknown:
        raise ValueError(f"pipeline.actions: {unknown[0].text()}: the plan has no transfer {unknown[0].transfer!r}")
    # per stage and compute action, the receives it waits for: (transfer index, direction, micro-batch)
    jobs_of = [[[(number[a.transfer], str(a.direction), a.micro_batch) for a in t.recvs] for t in ts] for ts in turns]
    # (transfer, direction, micro-batch) -> (the compute action its send follows, the receives the compute
    # thread waits for between that action and the send): the list's order, as the runtime runs it
    sent_after = {}
    for ts, tail in zip(turns, tails):
        for i, before in enumerate([t.before for t in ts[1:]] + [tail]):
            waited = []
            for a in before:
                if a.kind == "RECV":
                    waited.append((number[a.transfer], str(a.direction), a.micro_batch))
                else:
                    sent_after[a.transfer, str(a.direction), a.micro_batch] = (i, tuple(waited))
    micro_batches = max((m for ops in per_stage for _, m in ops), default=-1) + 1
    stage_of = {d: s for s, devs in enumerate(sim.stage_devices) for d in devs}

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
    for s, devs in enumerate(sim.stage_devices):
        c = sim.compute[s]
        if s in layered:
            layered_ops(g, net, comm, _program, sim, s, per_stage[s], layered[s], pool_of.get, op_cost, begin,
                        comp_end, layer_end, comp_nodes)
            continue
        last_b = max(i for i, op in enumerate(per_stage[s]) if op[0] == "B") if per_stage[s] else -1
        for d in devs:
            prev = None
            pool = pool_of.get(d)
            for i, (kind, m) in enumerate(per_stage[s]):
                b = g.add([prev], tag=("begin", s, d, i))
                begin[d, i] = b
                if kind == "F":
                    prev = g.add([b], duration=sum(c.forward) + op_cost, tag=("F", s, d, m), pool=pool)
                    comp_nodes.append((prev, s, d, "F", m))
                elif i == last_b:   # per layer, last layer first: gradient buckets are released as they fill
                    prev = b
                    if op_cost > 0:   # the instruction's own time, before its first layer
                        prev = g.add([prev], duration=op_cost, tag=("B", s, d, m, "op"), pool=pool)
                        comp_nodes.append((prev, s, d, "B", m))
                    for j in range(len(c.backward) - 1, -1, -1):
                        prev = layer_end[d, j] = g.add([prev], duration=c.backward[j], tag=("B", s, d, m, j),
                                                       pool=pool)
                        comp_nodes.append((prev, s, d, "B", m))
                else:
                    prev = g.add([b], duration=sum(c.backward) + op_cost, tag=("B", s, d, m), pool=pool)
                    comp_nodes.append((prev, s, d, "B", m))
                comp_end[d, i] = prev
    # the receive thread of every device: its receives in list order, posted at planc.plan.gates.post_gates
    posted, recv_job, recv_sources, begin_jobs = {}, {}, {}, {}
    before = {}     # the receive finished before this one on the same device (relays and gathers wait for it)
    for s, devs in enumerate(sim.stage_devices):
        gates = post_gates(per_stage[s], sim.ahead, [bool(j) for j in jobs_of[s]])
        for d in devs:
            prev = None
            for i, jobs in enumerate(jobs_of[s]):
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
                    if stage_of.get(task.sender) != src:
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
    # gradient reductions: buckets in backward order, released as the stage's last backward fills them
    red_last: dict[int, int] = {}
    for red in sim.reductions:
        if red.after_step or red.per_layer:
            continue
        c = sim.compute[red.stage]
        last = {d: comp_end[d, len(per_stage[red.stage]) - 1] for d in sim.stage_devices[red.stage]}
        if red.every_micro_batch:   # ZeRO-2: every earlier backward's gradient reduce-scattered as it ends
            ops = per_stage[red.stage]
            final = max(i for i, op in enumerate(ops) if op[0] == "B")
            for i, (kind, m) in enumerate(ops):
                if kind == "B" and i != final:
                    ready = {d: comp_end[d, i] for d in last}
                    for bi, (nbytes, _) in enumerate(_buckets(c.grad_bytes, sim.bucket_bytes)):
                        _program(g, net, comm, red, nbytes, ready, red_last, ("reduce", red.stage, m, bi))
        for bi, (nbytes, j) in enumerate(_buckets(c.grad_bytes, sim.bucket_bytes)):
            ready = {d: layer_end[d, j] if red.overlapped and (d, j) in layer_end else last[d] for d in last}
            _program(g, net, comm, red, nbytes, ready, red_last, ("reduce", red.stage, bi))
    # the host NIC order: a host's send k starts when its send k - 1 has finished (all its tasks)
    for _, keys in nic_order:
        for prev, key in zip(keys, keys[1:]):
            if key not in items or prev not in items:
                raise ValueError(f"NIC order: {key if key not in items else prev} is no cross-host send")
            for node in items[key]:
                g.nodes[node].deps.extend(items[prev])
    ends = {}
    for s, devs in enumerate(sim.stage_devices):
        for d in devs:
            last = comp_end[d, len(per_stage[s]) - 1] if per_stage[s] else None
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
        _figures(sim, per_stage, g, trace, iteration, begin, comp_end, comp_nodes, begin_jobs, recv_sources,
                 ends, marks, keep), ready=ready)


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


def _figures(sim, per_stage, g, trace, iteration, begin, comp_end, comp_nodes, begin_jobs, recv_sources, ends,
             marks, keep) -> Prediction:
    st, fin = trace.start, trace.finish
    busy: dict[int, float] = {}
    for node, s, d, kind, m in comp_nodes:
        busy[d] = busy.get(d, 0.0) + fin[node] - st[node]
    figures = []
    for s, devs in enumerate(sim.stage_devices):
        c = sim.compute[s]
        ops = per_stage[s]
        worst_busy, worst_wait, worst_mem, worst_k = 1.0, 0.0, 0.0, 0
        for d in devs:
            wait = 0.0
            events_ = []      # (time, order, bytes, in-flight delta): order 0 frees before 1 holds
            for i, (kind, m) in enumerate(ops):
                b = begin[d, i]
                prev = fin[comp_end[d, i - 1]] if i else 0.0
                ready = max([prev] + [fin[r] for j in begin_jobs.get((d, i), ()) for r in recv_sources.get(j, ())])
                wait += max(0.0, st[b] - ready)
                if kind == "F":
                    events_.append((st[b], 1, c.activation_bytes, 1))
                    for j in begin_jobs.get((d, i), ()):     # received ahead, held until consumed
                        got = _job_bytes(g, j, d)
                        events_.append((fin[j], 1, got, 0))
                        events_.append((st[b], 0, -got, 0))
                else:   # a recomputing stage holds the micro-batch's activations again while it runs backward
                    if c.recompute_bytes:
                        events_.append((st[b], 1, c.recompute_bytes, 0))
                    events_.append((fin[comp_end[d, i]], 0, -c.activation_bytes - c.recompute_bytes, -1))
            if ops:
                wait += fin[ends[d]] - fin[comp_end[d, len(ops) - 1]]
            held = k = peak = peak_k = 0.0
            for _, _, x, dk in sorted(events_, key=lambda e: (e[0], e[1])):
                held += x
                k += dk
                peak, peak_k = max(peak, held), max(peak_k, k)
            frac = busy.get(d, 0.0) / iteration if iteration > 0 else 1.0
            worst_busy = min(worst_busy, frac)
            worst_wait, worst_mem, worst_k = max(worst_wait, wait), max(worst_mem, peak), max(worst_k, int(peak_k))
        figures.append(StageFigures(s, worst_busy, 1.0 - worst_busy, worst_wait, worst_mem, worst_k))
    compute = traffic = transfers = ()
    if keep:
        compute = tuple((s, d, kind, m, st[n], fin[n]) for n, s, d, kind, m in comp_nodes)
        traffic = tuple((link, a, b, g.nodes[n].tag) for n, a, b, links, _ in trace.flows for link in links)
        transfers = tuple((sim.transfers[ti].name, direction, m, min((st[e] for e in nodes), default=0.0),
                           max((fin[e] for e in nodes), default=0.0)) for ti, direction, m, nodes in marks)
    return Prediction(iteration, iteration, tuple(figures), compute, traffic, transfers)


def _job_bytes(g, job: int, device: int) -> float:
    """Bytes a receive job delivers to ``device`` (what its tasks' flows bring it)."""
    total = 0.0
    for dep in g.nodes[job].deps:
        for a, b, x in g.nodes[dep].flows:
            if b == device:
                total += x
    return total
