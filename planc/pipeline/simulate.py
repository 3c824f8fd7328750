"""The iteration simulator, and the event simulation of per-stage instruction lists.

Two simulations live here.

:func:`simulate` is the abstract one the schedules use for their deadlock
check (``planc.pipeline.schedules.build``): each stage runs its list in order;
sends are buffered (a stage never waits for its receiver); receives block.
``F(s, m)`` needs ``F(src, m)`` for every transfer ``src -> s``;
``B(s, m)`` needs ``B(dst, m)`` for every transfer ``s -> dst`` (the gradient
of each output comes back over the same transfer). Skip transfers to
non-adjacent stages are ordinary edges. Lists that can never finish raise
:class:`DeadlockError` naming the blocked instructions.

:func:`predict` is the iteration simulator (docs/simulator.md): every device
of every stage runs its stage's list as the runtime engine does, with the
plan's real transfers (unit tasks per route) and gradient reductions moving
bytes over the cost model's links (``planc.cost.events``), and per-layer
compute times from the model probe (:func:`stage_compute`). It gives the
iteration time, each stage's busy and bubble fractions, the exposed
communication and the peak activation memory per stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from planc import ir
from planc.cost import events
from planc.cost.collectives import _edge_bytes_and_rounds, _edges, collective_time, held_after, step_coefficients
from planc.cost.network import Network

Op = tuple[str, int]


class DeadlockError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Timeline:
    start: dict            # (stage, op) -> start time
    finish: dict           # (stage, op) -> finish time
    makespan: float
    peak_in_flight: tuple[int, ...]   # per stage


def simulate(per_stage, edges, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Timeline:
    """Run every stage's list; times are in units of ``forward``."""
    n = len(per_stage)
    inputs = {s: sorted({a for a, b in edges if b == s}) for s in range(n)}
    outputs = {s: sorted({b for a, b in edges if a == s}) for s in range(n)}
    for a, b in edges:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"bad transfer edge {a} -> {b} for {n} stages")
    pos = [0] * n
    clock = [0.0] * n
    start: dict = {}
    finish: dict = {}
    total = sum(len(ops) for ops in per_stage)
    while len(finish) < total:
        progressed = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                kind, m = per_stage[s][pos[s]]
                if kind == "F":
                    deps = [(src, ("F", m)) for src in inputs[s]]
                    cost = forward
                else:
                    deps = [(dst, ("B", m)) for dst in outputs[s]] + [(s, ("F", m))]
                    cost = backward
                if any(d not in finish for d in deps):
                    break
                ready = max([clock[s]] + [finish[d] + (comm if d[0] != s else 0.0) for d in deps])
                start[(s, (kind, m))] = ready
                finish[(s, (kind, m))] = clock[s] = ready + cost
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"stage {s}: {k}{m}" for s in range(n) if pos[s] < len(per_stage[s])
                                for k, m in [per_stage[s][pos[s]]])
            raise DeadlockError(f"pipeline lists deadlock; blocked at {blocked}")
    peaks = []
    for ops in per_stage:
        live = peak = 0
        for kind, _ in ops:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(start, finish, max(finish.values(), default=0.0), tuple(peaks))


# ---------------------------------------------------------------- the compute model

DEFAULT_FLOPS = 100e12   # FLOP/s of one device when the cluster gives no `flops` (docs/simulator.md)
RECV_AHEAD = 4           # operations the receive thread posts ahead (planc.runtime.comm.DEFAULT_AHEAD)
BUCKET_BYTES = 8 << 20   # gradient bucket size (planc.runtime.grads.DEFAULT_BUCKET_BYTES)


@dataclass(frozen=True, slots=True)
class StageCompute:
    """One device of a stage, per micro-batch: each layer's forward and backward seconds and gradient
    bytes (layer order), and the activation bytes the micro-batch leaves until its backward."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    grad_bytes: tuple[float, ...]
    activation_bytes: float = 0.0

    def to_json(self) -> dict:
        return {"layer_forward": list(self.forward), "layer_backward": list(self.backward),
                "layer_grad_bytes": list(self.grad_bytes), "activation_bytes": self.activation_bytes}

    @staticmethod
    def from_json(d: dict) -> "StageCompute":
        return StageCompute(tuple(map(float, d["layer_forward"])), tuple(map(float, d["layer_backward"])),
                            tuple(map(float, d["layer_grad_bytes"])), float(d.get("activation_bytes", 0.0)))


def stage_compute(program: ir.Program, stages, probe) -> tuple[tuple[StageCompute, ...], float]:
    """Per stage (index order) the compute model of one of its devices, and the FLOP/s used.

    A layer's FLOPs for the whole micro-batch are the probe's count (forward, backward; backward 2 x
    forward when the count gives none); a layer the probe counted 0 for (or did not count: the cluster
    gives no ``flops``) but that holds parameters costs ``2 x parameters x rows`` forward (rows: its
    output's elements over the last dimension), as in ``planc.pipeline.cut``. One device does
    1 / (data degree x tensor degree) of it (the tensor degree only for models that split over it).
    A tensor-parallel stage whose all-reduces the probe measured (``probe.tensor_traffic``) adds their
    ring all-reduce times over its tensor groups (``planc.cost.collectives``), spread over its layers
    in proportion to their compute.
    """
    from planc.pipeline.choose import PRECISION_BYTES, _degree, stage_memory

    rate = float(program.cluster.flops or DEFAULT_FLOPS)
    net = Network(program.cluster)
    traffic = {t.stage: (t.forward, t.backward) for t in getattr(probe, "tensor_traffic", ())
               if t.forward or t.backward}
    memory = {i: act for i, _, act in stage_memory(program, stages, probe)}
    n = len(probe.layer_params)
    out = []
    for st in sorted(stages, key=lambda s: s.index):
        a, b = st.layers if st.layers is not None else (0, n)
        tensor = _degree(program, st, ir.MeshAxis.TENSOR)
        share = _degree(program, st, ir.MeshAxis.DATA) * (tensor if probe.tensor_parallel else 1)
        try:
            params = probe.params_per_device(tensor)
        except KeyError:
            params = probe.layer_params
        fwd, bwd, grads = [], [], []
        for i in range(a, min(b, n)):
            f = probe.layer_flops[i] if i < len(probe.layer_flops) else None
            if f is not None and f[0] > 0:
                ff, bf = f[0], (f[1] if f[1] > 0 else 2 * f[0])
            else:
                shape = probe.layer_shapes[i] if i < len(probe.layer_shapes) else None
                rows = math.prod(shape[:-1]) if shape else program.train.micro_batch
                ff = 2 * probe.layer_params[i] * rows
                bf = 2 * ff
            fwd.append(ff / share / rate)
            bwd.append(bf / share / rate)
            grads.append(float(params[i] * PRECISION_BYTES[program.train.precision]))
        tp = traffic.get(st.index)
        if tp is not None and tensor > 1 and hasattr(st, "position"):   # Megatron's all-reduces block compute
            groups = _tensor_groups(st)
            extra = [sum(collective_time(net, ir.Collective.ALLREDUCE, groups, x) for x in side) for side in tp]
            fwd, bwd = _spread(fwd, extra[0]), _spread(bwd, extra[1])
        out.append(StageCompute(tuple(fwd), tuple(bwd), tuple(grads), memory.get(st.index, 0.0)))
    return tuple(out), rate


def _tensor_groups(st) -> list[tuple[int, ...]]:
    """A placed stage's tensor groups: its devices equal on every mesh dimension but ``tensor``."""
    k = st.axes.index(ir.MeshAxis.TENSOR)
    groups: dict[tuple, list[int]] = {}
    for d in st.devices:
        pos = st.position(d)
        groups.setdefault(pos[:k] + pos[k + 1:], []).append(d)
    return [tuple(sorted(g)) for g in groups.values()]


def _spread(times: list[float], extra: float) -> list[float]:
    """``times`` with ``extra`` seconds added in proportion (evenly when all are 0)."""
    if extra <= 0 or not times:
        return times
    total = sum(times)
    return [t + extra * (t / total if total > 0 else 1 / len(times)) for t in times]


# ---------------------------------------------------------------- the simulator's input

@dataclass(frozen=True, slots=True)
class SimTask:
    sender: int
    receivers: tuple[int, ...]
    nbytes: float
    strategy: str
    chunks: int = 1
    parts: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class SimTransfer:
    name: str
    src_stage: int
    dst_stage: int
    forward: tuple[SimTask, ...]
    backward: tuple[SimTask, ...]


@dataclass(frozen=True, slots=True)
class SimReduction:
    """One stage's gradient program: ``steps`` (collective, groups of the stage's devices)."""

    stage: int
    steps: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    overlapped: bool = True     # False: DeepSpeed's all-reduce, after the last backward


@dataclass(frozen=True, slots=True)
class SimInput:
    cluster: ir.Cluster
    stage_devices: tuple[tuple[int, ...], ...]      # per stage (index order)
    compute: tuple[StageCompute, ...]
    transfers: tuple[SimTransfer, ...] = ()
    reductions: tuple[SimReduction, ...] = ()
    bucket_bytes: float = BUCKET_BYTES
    ahead: int = RECV_AHEAD


def _tasks(route: dict | None, itemsize: int, cluster: ir.Cluster) -> tuple[SimTask, ...]:
    if route is None:
        return ()
    out = []
    ordered = sorted(enumerate(route["tasks"]), key=lambda it: (it[1].get("start", 0.0), it[0]))
    for _, t in ordered:
        numel = math.prod(b - a for a, b in t["slice"])
        parts = tuple(tuple(p) for p in t.get("parts", ()))
        if not parts and route["strategy"] in ("local_allgather", "global_allgather"):
            by_host: dict[int, list[int]] = {}
            for r in t["receivers"]:
                by_host.setdefault(cluster.host_of(r) if route["strategy"] == "local_allgather" else 0, []).append(r)
            parts = tuple(tuple(sorted(v)) for _, v in sorted(by_host.items()))
        out.append(SimTask(t["sender"], tuple(t["receivers"]), float(numel * itemsize), route["strategy"],
                           int(route.get("chunks", 1)), parts))
    return tuple(out)


def sim_input(cluster: ir.Cluster, stages: list[dict], transfers: list[dict], reductions: list[dict],
              compute) -> SimInput:
    """The simulator's input from plan.json's ``stages``, ``transfers`` and ``reductions`` records
    (each as in docs/plan-format.md) and the per-stage compute model."""
    order = sorted(stages, key=lambda s: s["index"])
    devices = tuple(tuple(sorted(s["devices"])) for s in order)
    trs = []
    for t in transfers:
        size = ir.DTYPE_BYTES.get(t.get("dtype"), 4)
        trs.append(SimTransfer(t["name"], t["src"]["stage"], t["dst"]["stage"], _tasks(t, size, cluster),
                               _tasks(t.get("backward"), size, cluster)))
    reds = []
    for r in reductions:
        if r["name"] != "gradients":
            continue
        for k, devs in enumerate(devices):
            if r.get("stage") is not None and r["stage"] != k:
                continue
            mine = set(devs)
            if str(r.get("mode")) == "allreduce":
                steps = (("allreduce", tuple(tuple(g) for g in r["groups"] if set(g) <= mine and len(g) > 1)),)
                overlapped = False
            else:
                steps = tuple((st["collective"], tuple(tuple(g) for g in st["groups"] if set(g) <= mine)) for
                              st in r["program"]["steps"])
                overlapped = True
            steps = tuple((c, gs) for c, gs in steps if any(len(g) > 1 for g in gs))
            if steps:
                reds.append(SimReduction(k, steps, overlapped))
    return SimInput(cluster, devices, tuple(compute), tuple(trs), tuple(reds))


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

    @property
    def exposed_communication(self) -> float:
        return max(0.0, self.iteration - self.free_iteration)


def predict(sim: SimInput, per_stage, timeline: bool = False) -> Prediction:
    """Simulate one iteration of ``per_stage`` (the schedule's lists, ``(kind, micro-batch)`` ops) on
    ``sim``; also with free communication, so the exposed communication is the difference.
    ``timeline``: keep every compute interval and flow (for ``planc.pipeline.gantt``)."""
    per_stage = [[(k, int(m)) for k, m in ops] for ops in per_stage]
    full = _simulate(sim, per_stage, free=False, keep=timeline)
    free = _simulate(sim, per_stage, free=True, keep=False)
    return dataclasses.replace(full, free_iteration=free.iteration)


def _simulate(sim: SimInput, per_stage, free: bool, keep: bool) -> Prediction:
    S = len(sim.stage_devices)
    if len(per_stage) != S or len(sim.compute) != S:
        raise ValueError(f"{len(per_stage)} lists and {len(sim.compute)} compute models for {S} stages")
    net = Network(sim.cluster)
    g = events.Graph()
    incoming = [[i for i, t in enumerate(sim.transfers) if t.dst_stage == s] for s in range(S)]
    outgoing = [[i for i, t in enumerate(sim.transfers) if t.src_stage == s] for s in range(S)]
    stage_of = {d: s for s, devs in enumerate(sim.stage_devices) for d in devs}
    index = [{op: i for i, op in enumerate(ops)} for ops in per_stage]

    def comm(deps, tag, fl, lat):
        """A node moving ``fl`` (free: nothing, at once)."""
        return g.add(deps, flows=() if free else tuple(fl), latency=0.0 if free else lat, tag=tag)

    begin, comp_end, layer_end = {}, {}, {}
    comp_nodes = []            # (node, stage, device, kind, m)
    for s, devs in enumerate(sim.stage_devices):
        c = sim.compute[s]
        last_b = max(i for i, op in enumerate(per_stage[s]) if op[0] == "B") if per_stage[s] else -1
        for d in devs:
            prev = None
            for i, (kind, m) in enumerate(per_stage[s]):
                b = g.add([prev], tag=("begin", s, d, i))
                begin[d, i] = b
                if kind == "F":
                    prev = g.add([b], duration=sum(c.forward), tag=("F", s, d, m))
                    comp_nodes.append((prev, s, d, "F", m))
                elif i == last_b:   # per layer, last layer first: gradient buckets are released as they fill
                    prev = b
                    for j in range(len(c.backward) - 1, -1, -1):
                        prev = layer_end[d, j] = g.add([prev], duration=c.backward[j], tag=("B", s, d, m, j))
                        comp_nodes.append((prev, s, d, "B", m))
                else:
                    prev = g.add([b], duration=sum(c.backward), tag=("B", s, d, m))
                    comp_nodes.append((prev, s, d, "B", m))
                comp_end[d, i] = prev
    # the receive thread of every device: its receives in list order, posted `ahead` operations early
    posted, recv_job, recv_sources, begin_jobs = {}, {}, {}, {}
    before = {}     # the receive finished before this one on the same device (relays and gathers wait for it)
    for s, devs in enumerate(sim.stage_devices):
        for d in devs:
            prev = None
            for i, (kind, m) in enumerate(per_stage[s]):
                jobs = ([(t, "forward") for t in incoming[s]] if kind == "F" else
                        [(t, "backward") for t in outgoing[s]])
                for t, direction in jobs:   # posted when queued (never blocks), finished in queue order
                    post = g.add([begin[d, i - sim.ahead] if i - sim.ahead > 0 else None],
                                 tag=("post", s, d, t, direction, m))
                    posted[d, t, direction, m] = post
                    before[d, t, direction, m] = prev
                    prev = recv_job[d, t, direction, m] = g.add([post, prev], tag=("recv", s, d, t, direction, m))
                    g.nodes[begin[d, i]].deps.append(prev)
                    begin_jobs.setdefault((d, i), []).append(prev)
    # the transfers: each unit task starts when its sender computed the data and its receivers posted
    sends: dict[int, list[int]] = {}
    marks = []
    for ti, tr in enumerate(sim.transfers):
        for direction, tasks, src in (("forward", tr.forward, tr.src_stage), ("backward", tr.backward, tr.dst_stage)):
            if not tasks:
                continue
            kind = "F" if direction == "forward" else "B"
            for m in range(len(per_stage[src]) // 2):
                gather_prev: dict[int, int] = {}
                ends = []
                for task in tasks:
                    if stage_of.get(task.sender) != src:
                        raise ValueError(f"transfer {tr.name!r} ({direction}): sender {task.sender} is not in "
                                         f"stage {src}")
                    ready = comp_end[task.sender, index[src][(kind, m)]]
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
                                per_edge, _ = _edge_bytes_and_rounds(ir.Collective.ALL_GATHER, len(p),
                                                                     task.nbytes / len(p))
                                ring = [(a, b, per_edge) for a, b in _edges(ir.Collective.ALL_GATHER, p)]
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
        c = sim.compute[red.stage]
        devs = sim.stage_devices[red.stage]
        buckets = []      # (bytes, layer whose backward completes it)
        fill, last_j = 0.0, 0
        for j in range(len(c.grad_bytes) - 1, -1, -1):
            left = c.grad_bytes[j]
            while left > 0:
                take = min(left, sim.bucket_bytes - fill)
                fill, left, last_j = fill + take, left - take, j
                if fill >= sim.bucket_bytes:
                    buckets.append((fill, j))
                    fill = 0.0
        if fill > 0:
            buckets.append((fill, last_j))
        last = {d: comp_end[d, len(per_stage[red.stage]) - 1] for d in devs}
        for bi, (nbytes, j) in enumerate(buckets):
            held = nbytes
            for collective, groups in red.steps:
                coll = ir.Collective(collective)
                for grp in groups:
                    if len(grp) < 2:
                        continue
                    ready = [(layer_end[d, j] if red.overlapped and (d, j) in layer_end else last[d]) for d in grp]
                    per_edge, _ = _edge_bytes_and_rounds(coll, len(grp), held)
                    fl = [(a, b, per_edge) for a, b in _edges(coll, sorted(grp))]
                    lat = step_coefficients(net, coll, [grp])[1]
                    node = comm(ready + [red_last.get(d) for d in grp], ("reduce", red.stage, bi, collective), fl, lat)
                    for d in grp:
                        red_last[d] = node
                held = held_after(coll, max(len(x) for x in groups), held)
    ends = {}
    for s, devs in enumerate(sim.stage_devices):
        for d in devs:
            last = comp_end[d, len(per_stage[s]) - 1] if per_stage[s] else None
            ends[d] = g.add([last, red_last.get(d)] + sends.get(d, []), tag=("end", s, d))
    trace = events.run(g, net)
    iteration = max((trace.finish[e] for e in ends.values()), default=0.0)
    return _figures(sim, per_stage, g, trace, iteration, begin, comp_end, comp_nodes, begin_jobs, recv_sources,
                    ends, marks, keep)


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
                else:
                    events_.append((fin[comp_end[d, i]], 0, -c.activation_bytes, -1))
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
