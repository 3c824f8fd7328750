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
from planc.pipeline.memory import GRADIENT_BYTES, PRECISION_BYTES, degree, recomputes, stage_memory, zero_of
from planc.plan import DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_RECV_AHEAD

DEFAULT_FLOPS = 100e12   # FLOP/s of one device when the cluster gives no `flops` (docs/simulator.md)
RECV_AHEAD = DEFAULT_RECV_AHEAD                 # plan.json runtime.recv_ahead's default
BUCKET_BYTES = DEFAULT_GRAD_BUCKET_BYTES        # plan.json runtime.grad_bucket_bytes's default


@dataclass(frozen=True, slots=True)
class StageCompute:
    """One device of a stage, per micro-batch: each layer's forward and backward seconds (a recomputing
    stage's backward includes its forward once more) and gradient bytes (fp32: the runtime reduces in
    fp32), in layer order; the activation bytes one micro-batch holds from its forward until its backward
    ends (a recomputing stage: only its inputs), the bytes its backward holds on top while it recomputes
    (``recompute_bytes``), and each layer's parameter bytes in the plan's precision (what ZeRO-1's
    all-gather moves; empty: as ``grad_bytes``). ``weight``: per layer the part of its backward seconds that
    computes the weight gradients (a split backward's ``W``; its ``B`` runs the rest); empty: half of each
    layer's backward (dX and dW of a matmul are equal FLOPs)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    grad_bytes: tuple[float, ...]
    activation_bytes: float = 0.0
    recompute_bytes: float = 0.0
    param_bytes: tuple[float, ...] = ()
    weight: tuple[float, ...] = ()

    def weights(self) -> tuple[float, ...]:
        """Per layer its ``W`` seconds (``weight``, or half of its backward)."""
        return self.weight or tuple(b / 2 for b in self.backward)

    def to_json(self) -> dict:
        return {"layer_forward": list(self.forward), "layer_backward": list(self.backward),
                "layer_grad_bytes": list(self.grad_bytes), "activation_bytes": self.activation_bytes,
                "recompute_bytes": self.recompute_bytes, "layer_param_bytes": list(self.param_bytes),
                "layer_weight": list(self.weights())}

    @staticmethod
    def from_json(d: dict) -> "StageCompute":
        return StageCompute(tuple(map(float, d["layer_forward"])), tuple(map(float, d["layer_backward"])),
                            tuple(map(float, d["layer_grad_bytes"])), float(d.get("activation_bytes", 0.0)),
                            float(d.get("recompute_bytes", 0.0)), tuple(map(float, d.get("layer_param_bytes", ()))),
                            tuple(map(float, d.get("layer_weight", ()))))


def stage_compute(program: ir.Program, stages, probe) -> tuple[tuple[StageCompute, ...], float]:
    """Per stage (index order) the compute model of one of its devices, and the FLOP/s used.

    A layer's FLOPs for the whole micro-batch are the probe's count (forward, backward; backward 2 x
    forward when the count gives none); a layer the probe counted 0 for (or did not count: the cluster
    gives no ``flops``) but that holds parameters costs ``2 x parameters x rows`` forward (rows: its
    output's elements over the last dimension), as in ``planc.pipeline.cut``. One device does
    1 / (data degree x tensor degree) of it (the tensor degree only for models that split over it), at
    the cluster's FLOP/s for the plan's precision (``ir.Cluster.flops_for``). A recomputing stage
    (``recompute``) runs each layer's forward again in its backward.
    A tensor-parallel stage whose all-reduces the probe measured (``probe.tensor_traffic``) adds their
    ring all-reduce times over its tensor groups (``planc.cost.collectives``), spread over its layers
    in proportion to their compute.

    The weight-gradient part of a layer's backward (``StageCompute.weight``, what a split backward's ``W``
    computes): half of its backward FLOPs (without the recompute) when the layer has parameters (for a
    matmul ``Y = XW`` the input gradient ``dY W^T`` and the weight gradient ``X^T dY`` are the same FLOPs),
    none when it has none; the tensor-parallel all-reduces stay with ``B`` (docs/simulator.md).
    """
    precision = program.train.precision
    rate = float(program.cluster.flops_for(precision) or DEFAULT_FLOPS)
    net = Network(program.cluster)
    from planc.model.tensor_traffic import tensor_traffic_by_stage   # sequence-parallel stages as all-reduce equivalents
    traffic = {st: fb for st, fb in tensor_traffic_by_stage(probe, program).items() if fb[0] or fb[1]}
    memory = {m.stage: m for m in stage_memory(program, stages, probe)}
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
        mem = memory[st.index]
        fwd, bwd, grads, pbytes, wgt = [], [], [], [], []
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
            bwd.append((bf + (ff if mem.recompute else 0)) / share / rate)
            wgt.append(bf / 2 / share / rate if params[i] else 0.0)
            grads.append(float(params[i] * GRADIENT_BYTES))
            pbytes.append(float(params[i] * PRECISION_BYTES[precision]))
        tp = traffic.get(st.index)
        if tp is not None and tensor > 1 and hasattr(st, "position"):   # Megatron's all-reduces block compute
            groups = _tensor_groups(st)
            extra = [sum(collective_time(net, ir.Collective.ALLREDUCE, groups, x) for x in side) for side in tp]
            fwd, bwd = _spread(fwd, extra[0]), _spread(bwd, extra[1] + (extra[0] if mem.recompute else 0.0))
        held = mem.slice_inputs + (0 if mem.recompute else mem.slice_outputs)
        out.append(StageCompute(tuple(fwd), tuple(bwd), tuple(grads), float(held),
                                float(mem.slice_outputs if mem.recompute else 0), tuple(pbytes), tuple(wgt)))
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
    """``local``: between two stages of one mesh whose regions need no exchange (plan.json ``local``):
    nothing moves, its receive takes the sender's output on the same device."""
    name: str
    src_stage: int
    dst_stage: int
    forward: tuple[SimTask, ...]
    backward: tuple[SimTask, ...]
    local: bool = False


@dataclass(frozen=True, slots=True)
class SimReduction:
    """One stage's reduction program: ``steps`` (collective, groups of the stage's devices). The
    gradients' (target allreduce or, with ``zero = 1``, reduce_scatter) run in buckets as the last
    backward fills them (``every_micro_batch``, ZeRO-2: also after each earlier backward, the whole
    gradient in buckets); ``after_step``: ZeRO-1's all-gather of the parameters, after the optimizer
    step, over the stage's parameter bytes. ``held``: per step, the fraction of the buffer each member
    holds before it (from the program's regions; empty: the whole buffer, then ``held_after``)."""

    stage: int
    steps: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    overlapped: bool = True     # False: DeepSpeed's all-reduce, after the last backward
    after_step: bool = False
    held: tuple[float, ...] = ()
    every_micro_batch: bool = False   # ZeRO-2: each backward's gradient reduce-scattered, not the last only
    per_layer: bool = False     # ZeRO-3's all-gather: each layer's parameters before its forward and backward
    recompute: bool = False     # ZeRO-3 on a recomputing stage: the recomputed forward gathers too


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
    prefetch: bool = True         # zero = 3: the next layer's gather starts while this one computes
    keep_gathered: bool = False   # zero = 3: each layer gathered once a step (at its first forward)


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
              compute, runtime: dict | None = None, zero: int = 0, zero3: dict | None = None,
              recompute=()) -> SimInput:
    """The simulator's input from plan.json's ``stages``, ``transfers``, ``reductions`` and ``runtime``
    records (each as in docs/plan-format.md; no ``runtime``: its defaults) and the per-stage compute model;
    ``zero``: plan.json's ``train.zero`` (a stage's own ``zero`` overrides it; 2: gradients reduce-scattered
    every micro-batch; 3: also the parameters all-gathered per layer, as ``zero3``, plan.json's
    ``train.zero3``, says; ``recompute``: plan.json's ``train.recompute``, per stage)."""
    runtime = runtime or {}
    zero3 = zero3 or {}
    order = sorted(stages, key=lambda s: s["index"])
    devices = tuple(tuple(sorted(s["devices"])) for s in order)
    trs = []
    for t in transfers:
        size = ir.DTYPE_BYTES.get(t.get("dtype"), 4)
        trs.append(SimTransfer(t["name"], t["src"]["stage"], t["dst"]["stage"], _tasks(t, size, cluster),
                               _tasks(t.get("backward"), size, cluster), bool(t.get("local", False))))
    reds = []
    for r in reductions:
        gather = str(r.get("target", "allreduce")) == "all_gather"
        if r["name"] != "gradients" and not gather:
            continue
        for k, devs in enumerate(devices):
            if r.get("stage") is not None and r["stage"] != k:
                continue
            mine = set(devs)
            if str(r.get("mode")) == "allreduce" and not gather:
                steps = (("allreduce", tuple(tuple(g) for g in r["groups"] if set(g) <= mine and len(g) > 1)),)
                held, overlapped = (1.0,), False
            else:
                prog = r["program"]
                steps = tuple((st["collective"], tuple(tuple(g) for g in st["groups"] if set(g) <= mine)) for
                              st in prog["steps"])
                held, overlapped = _held(prog), True
            keep = [i for i, (c, gs) in enumerate(steps) if any(len(g) > 1 for g in gs)]
            own = order[k].get("zero")
            degree = own if own is not None else zero
            every = degree >= 2 and not gather and str(r.get("target")) == "reduce_scatter"
            layered = gather and degree >= 3
            if keep:
                reds.append(SimReduction(k, tuple(steps[i] for i in keep), overlapped, gather and not layered,
                                         tuple(held[i] for i in keep) if held else (), every, layered,
                                         layered and k < len(recompute) and bool(recompute[k])))
    return SimInput(cluster, devices, tuple(compute), tuple(trs), tuple(reds),
                    bucket_bytes=float(runtime.get("grad_bucket_bytes", BUCKET_BYTES)),
                    ahead=int(runtime.get("recv_ahead", RECV_AHEAD)),
                    op_overhead=float(cluster.op_overhead or 0.0), step_overhead=float(cluster.step_overhead or 0.0),
                    prefetch=bool(zero3.get("prefetch", True)), keep_gathered=bool(zero3.get("keep_gathered", False)))


def _held(program: dict) -> tuple[float, ...]:
    """Per step of a plan.json reduction program, the fraction of the buffer each member holds before it:
    its region's share of the buffer (an all-gather's region is what it gathers: each member holds one
    piece of it). Empty when a step has no regions (older plan files)."""
    unit = program.get("unit", 1)
    out = []
    for st in program["steps"]:
        regions = st.get("regions")
        if not regions or not st["groups"]:
            return ()
        a, b = regions[0]
        frac = (b - a) / unit
        out.append(frac / len(st["groups"][0]) if st["collective"] == "all_gather" else frac)
    return tuple(out)


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
    for r, d in zip(reductions, reds):   # ZeRO-1's reduce-scatter and all-gather programs say what they leave
        if getattr(r, "target", None) is not None:
            d.setdefault("target", str(r.target))
    st = [{"index": s.index, "devices": sorted(s.devices), "zero": zero_of(program, s.index)} for s in stages]
    zero3 = {"prefetch": program.train.zero_prefetch, "keep_gathered": program.train.zero_keep_gathered}
    rc = [recomputes(program, s.index) for s in sorted(stages, key=lambda s: s.index)]
    return sim_input(program.cluster, st, transfers, reds, compute, program.train.runtime.to_json(), 0, zero3,
                     rc), rate
