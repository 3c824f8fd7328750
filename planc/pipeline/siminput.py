"""The iteration simulator's input: the per-stage compute model and the plan's transfers and reductions.

:func:`stage_compute` turns the model probe's per-layer FLOPs and bytes into seconds per micro-batch
for one device of each stage; :func:`sim_input` reads plan.json's ``stages``, ``transfers`` and
``reductions`` records into a :class:`SimInput`, what :func:`planc.pipeline.simulate.predict` runs;
:func:`compiled_input` builds the same from the compiler's records (before plan.json exists).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planc import ir
from planc.cost.collectives import collective_time
from planc.cost.network import Network
from planc.pipeline.memory import PRECISION_BYTES, degree, stage_memory
from planc.plan import DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_RECV_AHEAD

DEFAULT_FLOPS = 100e12   # FLOP/s of one device when the cluster gives no `flops` (docs/simulator.md)
RECV_AHEAD = DEFAULT_RECV_AHEAD                 # plan.json runtime.recv_ahead's default
BUCKET_BYTES = DEFAULT_GRAD_BUCKET_BYTES        # plan.json runtime.grad_bucket_bytes's default


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
    rate = float(program.cluster.flops or DEFAULT_FLOPS)
    net = Network(program.cluster)
    traffic = {t.stage: (t.forward, t.backward) for t in getattr(probe, "tensor_traffic", ())
               if t.forward or t.backward}
    memory = {i: act for i, _, act in stage_memory(program, stages, probe)}
    n = len(probe.layer_params)
    out = []
    for st in sorted(stages, key=lambda s: s.index):
        a, b = st.layers if st.layers is not None else (0, n)
        tensor = degree(program, st, ir.MeshAxis.TENSOR)
        share = degree(program, st, ir.MeshAxis.DATA) * (tensor if probe.tensor_parallel else 1)
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
    op_overhead: float = 0.0      # device seconds the runtime spends on each F and B beyond the layers
    step_overhead: float = 0.0    # device seconds each device spends on a step beyond its list (optimizer)


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
              compute, runtime: dict | None = None) -> SimInput:
    """The simulator's input from plan.json's ``stages``, ``transfers``, ``reductions`` and ``runtime``
    records (each as in docs/plan-format.md; no ``runtime``: its defaults) and the per-stage compute model."""
    runtime = runtime or {}
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
    return SimInput(cluster, devices, tuple(compute), tuple(trs), tuple(reds),
                    bucket_bytes=float(runtime.get("grad_bucket_bytes", BUCKET_BYTES)),
                    ahead=int(runtime.get("recv_ahead", RECV_AHEAD)),
                    op_overhead=float(cluster.op_overhead or 0.0), step_overhead=float(cluster.step_overhead or 0.0))


def compiled_input(program: ir.Program, stages, probe, reductions, routes):
    """The iteration simulator's input from the compiler's records (``reductions``: the reductions
    pass's plans; ``routes``: the transfers pass's ``(forward, backward)`` plans), and the FLOP/s used;
    ``(None, None)`` without a probe (no compute model)."""
    if probe is None:
        return None, None
    compute, rate = stage_compute(program, stages, probe)
    forward, backward = routes
    transfers = []
    for i, (t, fwd) in enumerate(zip(program.transfers, forward)):
        transfers.append(dict(fwd.to_json(), name=t.name, dtype=t.dtype, src={"stage": t.src_stage},
                              dst={"stage": t.dst_stage}, backward=backward[i].to_json() if backward else None))
    modes = {r.name: str(r.mode) for r in program.reductions}
    reds = [dict(r.to_json(), mode=modes.get(r.name)) for r in reductions]
    st = [{"index": s.index, "devices": sorted(s.devices)} for s in stages]
    return sim_input(program.cluster, st, transfers, reds, compute, program.train.runtime.to_json()), rate
