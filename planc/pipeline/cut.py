"""Cutting a model's layers into pipeline stages: ``stages = auto(N)`` and ``layers auto``.

:func:`cut_layers` is the exact optimiser: contiguous, non-empty stages that
minimise the slowest stage's cost (its layers' cost divided by the stage's
speed), ties broken towards the earliest cut. :func:`apply_auto_stages` gives
it the model's real costs, measured by the model probe (``planc.model.probe``):

* a layer's cost is its forward + backward FLOPs for one whole micro-batch,
  counted with ``torch.utils.flop_counter.FlopCounterMode`` on the real CPU
  model. A layer that reports 0 FLOPs (or whose count failed) but holds
  parameters counts ``6 x parameters x rows`` (rows: its output's elements over
  the last dimension), as if its parameters were one dense layer run forward
  and backward; one with neither FLOPs nor parameters counts 0. The reason
  string names every such layer.
* a stage's speed is the number of devices that share its work: its data
  degree times, when the model's builder takes ``tensor_parallel``, its tensor
  degree (without that opt-in a ``tensor`` axis replicates the layers).
  Stages may differ (explicit meshes).

The pipeline's steady state runs at the pace of its slowest stage, so
minimising the slowest stage's compute minimises the predicted iteration
under the compute model (transfers between stages are not part of the cost).
A transfer written ``from stage I layer L`` pins layer ``L`` into stage ``I``.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Iterable, Sequence

from planc import ir
from planc.diagnostics import Diagnostic, PlanError
from planc.pipeline.memory import (StageMemory, grad_bucket, layer_bytes, optimizer_states, recomputes,
                                   whole_tied, zero3_settings, zero_of)
from planc.pipeline.schedules import peak_in_flight
from planc.plan import stages_per_class

__all__ = ["cut_layers", "layer_costs", "stage_speeds", "apply_auto_stages", "memory_allowed", "cut_memory",
           "more_stages_fit"]


def _integers(values: Sequence[Fraction]) -> list[int]:
    """The values scaled by one common factor to integers (exact; ratios kept)."""
    den = 1
    for v in values:
        den = den * v.denominator // math.gcd(den, v.denominator)
    return [int(v * den) for v in values]


def cut_layers(layer_costs: Sequence[float], n: int, *, speeds: Sequence[float] | None = None,
               holds: Iterable[tuple[int, int]] = (), allowed=None) -> list[tuple[int, int]]:
    """Cut ``len(layer_costs)`` layers into ``n`` contiguous, non-empty half-open ranges ``(a, b)``.

    Minimises ``max_s sum(layer_costs[a_s:b_s]) / speeds[s]`` (``speeds`` default all 1) exactly
    (rational arithmetic, no rounding); among the optimal cuts, the one whose boundaries are
    lexicographically smallest (the earliest cut). ``holds``: ``(stage, layer)`` pairs, each
    requiring that stage to contain that layer. Dynamic programming over (stage, first layer),
    O(n · L²) at worst. ``ValueError`` when no cut exists (``n`` outside ``1..L``, a negative or
    non-finite cost or speed, unsatisfiable ``holds``). ``allowed(s, a, b)``: whether stage ``s`` may
    hold layers ``a..b`` (the memory limit, :func:`memory_allowed`); the cut is optimal among those
    whose every stage is allowed.
    """
    L = len(layer_costs)
    if n < 1 or n > L:
        raise ValueError(f"cannot cut {L} layers into {n} non-empty stages")
    speeds = [1] * n if speeds is None else list(speeds)
    if len(speeds) != n:
        raise ValueError(f"{len(speeds)} speeds for {n} stages")
    for v in list(layer_costs) + speeds:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"costs and speeds must be finite and non-negative, got {v!r}")
    if any(v == 0 for v in speeds):
        raise ValueError("speeds must be positive")
    costs = _integers([Fraction(c) for c in layer_costs])
    sp = [Fraction(s) for s in speeds]
    # time of stage s over cost C = C / sp[s] = C * weight[s] / common  (all integers)
    nums = [s.numerator for s in sp]
    common = 1
    for p in nums:
        common = common * p // math.gcd(common, p)
    weight = [s.denominator * (common // s.numerator) for s in sp]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    # per stage s: lo_a <= a <= hi_a and lo_b <= b <= hi_b, from the holds and non-empty neighbours
    lo_a = [s for s in range(n)]
    hi_a = [L - (n - s) for s in range(n)]
    lo_b = [s + 1 for s in range(n)]
    hi_b = [L - (n - 1 - s) for s in range(n)]
    for t, layer in holds:
        if not (0 <= t < n and 0 <= layer < L):
            raise ValueError(f"stage {t} cannot hold layer {layer} ({n} stages, {L} layers)")
        for s in range(n):
            if s == t:
                hi_a[s] = min(hi_a[s], layer)
                lo_b[s] = max(lo_b[s], layer + 1)
            elif s > t:
                lo_a[s] = max(lo_a[s], layer + 1)
            else:
                hi_b[s] = min(hi_b[s], layer)
    hi_a[0] = min(hi_a[0], 0)
    lo_b[n - 1] = max(lo_b[n - 1], L)

    inf = None   # unreachable
    # suf[s][a]: the smallest slowest-stage time (scaled) of layers a..L over stages s..n-1
    suf: list[list[int | None]] = [[inf] * (L + 1) for _ in range(n + 1)]
    suf[n][L] = 0
    for s in range(n - 1, -1, -1):
        w = weight[s]
        nxt = suf[s + 1]
        row = suf[s]
        for a in range(max(lo_a[s], 0), min(hi_a[s], L - 1) + 1):
            best = inf
            for b in range(max(a + 1, lo_b[s]), hi_b[s] + 1):
                t = (prefix[b] - prefix[a]) * w
                if best is not None and t > best:
                    break   # a stage only grows with b
                rest = nxt[b]
                if rest is None or (allowed is not None and not allowed(s, a, b)):
                    continue
                v = t if t > rest else rest
                if best is None or v < best:
                    best = v
            row[a] = best
    target = suf[0][0]
    if target is None:
        raise ValueError("no cut satisfies the pinned layers " + ", ".join(f"(stage {t}, layer {l})"
                                                                          for t, l in holds)
                         + (" within the memory limit" if allowed is not None else ""))
    out, a = [], 0
    for s in range(n):
        w = weight[s]
        for b in range(max(a + 1, lo_b[s]), hi_b[s] + 1):
            rest = suf[s + 1][b]
            if (rest is not None and rest <= target and (prefix[b] - prefix[a]) * w <= target
                    and (allowed is None or allowed(s, a, b))):
                out.append((a, b))
                a = b
                break
        else:   # unreachable: suf says a cut exists
            raise AssertionError("cut reconstruction failed")
    return out


# ---------------------------------------------------------------- the model's costs

def _rows(shape) -> int | None:
    return math.prod(shape[:-1]) if shape else None


def layer_costs(probe, micro_batch: int) -> tuple[list[int], list[int], list[int]]:
    """``(costs, by_params, free)``: per layer, forward + backward FLOPs for one micro-batch; the layers
    whose cost falls back to ``6 x parameters x rows`` (0 FLOPs reported or the count failed) and the
    layers counted 0 (no FLOPs, no parameters)."""
    costs, by_params, free = [], [], []
    for i, params in enumerate(probe.layer_params):
        f = probe.layer_flops[i] if i < len(probe.layer_flops) else None
        total = (f[0] + f[1]) if f is not None else 0
        if total > 0:
            costs.append(total)
        elif params > 0:
            shape = probe.layer_shapes[i] if i < len(probe.layer_shapes) else None
            costs.append(6 * params * (_rows(shape) or micro_batch))
            by_params.append(i)
        else:
            costs.append(0)
            free.append(i)
    return costs, by_params, free


def stage_speeds(program: ir.Program, probe) -> list[int]:
    """Per stage (index order), the devices sharing its work: data degree x tensor degree (the tensor
    degree only when the model splits over it, ``probe.tensor_parallel``)."""
    out = []
    for s in sorted(program.stages, key=lambda s: s.index):
        mesh = program.stage_mesh(s.index)
        k = ir.axis_size(mesh, ir.MeshAxis.DATA)
        if probe is not None and probe.tensor_parallel:
            k *= ir.axis_size(mesh, ir.MeshAxis.TENSOR)
        out.append(k)
    return out


def _flop_text(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def _time_text(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def _layers_text(idx: list[int]) -> str:
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(map(str, idx))


# ---------------------------------------------------------------- the memory limit

def cut_memory(program: ir.Program, probe, cut, meshes=None) -> list[StageMemory]:
    """The memory model (``planc.pipeline.memory``) of each stage of ``cut`` (``(a, b)`` per stage, index
    order), as the compiled plan will have it for a chain: a stage's received input is the previous
    layer's output. ``meshes``: per stage its mesh (default the program's stages')."""
    stages = sorted(program.stages, key=lambda s: s.index)
    meshes = meshes or [program.stage_mesh(s.index) for s in stages]
    t = program.train
    prefetch, keep = zero3_settings(program)
    out = []
    for i, (a, b) in enumerate(cut):
        tensor, data = ir.axis_size(meshes[i], ir.MeshAxis.TENSOR), ir.axis_size(meshes[i], ir.MeshAxis.DATA)
        try:
            counts = probe.params_per_device(tensor)
        except KeyError:
            counts = probe.layer_params
        index = stages[i].index if i < len(stages) else i
        out.append(StageMemory(index, sum(counts[a:b]), data, t.micro_batch,
                               sum(layer_bytes(probe, j, t.precision) for j in range(a, b)),
                               layer_bytes(probe, a - 1, t.precision) if a > 0 else 0, t.precision,
                               optimizer_states(t.optimizer), zero_of(program, index) if i < len(stages) else t.zero,
                               recomputes(program, index) if i < len(stages) else t.recompute is ir.Recompute.FULL,
                               tied=whole_tied(probe, a, b), bucket=grad_bucket(program),
                               largest=max(counts[a:b], default=0),
                               prefetch=prefetch, keep_gathered=keep))
    return out


def _in_flight_schedule(program: ir.Program) -> ir.PipeSchedule:
    """The schedule a cut must fit under: the pinned one, for ``auto`` the fewest in flight (1f1b)."""
    s = program.train.schedule
    return ir.PipeSchedule.ONE_F_ONE_B if s is ir.PipeSchedule.AUTO else s


def memory_allowed(program: ir.Program, probe, n: int, meshes=None):
    """``allowed(s, a, b)`` for :func:`cut_layers`: stage ``s`` of ``n`` holding layers ``a..b`` fits
    ``cluster.memory`` under the schedule (:func:`_in_flight_schedule`) by the memory model; None
    without a limit or a training plan."""
    limit = program.cluster.memory
    if limit is None or program.train is None or program.model is None:
        return None
    schedule, B = _in_flight_schedule(program), program.train.micro_batches
    cache: dict = {}

    def allowed(s: int, a: int, b: int) -> bool:
        key = (s, a, b)
        if key not in cache:
            stages = [(0, 0)] * s + [(a, b)]
            m = cut_memory(program, probe, stages, meshes)[s] if meshes else _one(program, probe, s, a, b)
            cache[key] = m.total(peak_in_flight(schedule, n, s, B, program.train.virtual)) <= limit
        return cache[key]
    return allowed


def _one(program, probe, s, a, b) -> StageMemory:
    stages = sorted(program.stages, key=lambda x: x.index)
    cut = [(0, 0)] * s + [(a, b)]
    return cut_memory(program, probe, cut, [program.stage_mesh(x.index) for x in stages[:s + 1]])[s]


def more_stages_fit(program: ir.Program, probe):
    """For a plan whose stages planc cuts (``stages = auto(N)``, every stage on one mesh with a ``data``
    axis) and a memory limit: ``more(ok)``, ``(N', data')``: the smallest ``N' > N`` for which the same
    devices, ``data`` scaled to ``data x N / N'`` (a whole number), hold a cut that fits the limit and
    that ``ok`` (a predicate on the cut's memory, ``planc.pipeline.fit``) accepts; None otherwise."""
    if (probe is None or program.cluster.memory is None or program.train is None
            or not program.stages or not all(s.auto_layers for s in program.stages)
            or stages_per_class(str(program.train.schedule), program.train.virtual) > 1):   # counts fixed by P
        return None
    meshes = [program.stage_mesh(s.index) for s in program.stages]
    if meshes[0] is None or len(set(meshes)) != 1 or ir.MeshAxis.DATA not in meshes[0][1]:
        return None
    shape, axes = meshes[0]
    at = axes.index(ir.MeshAxis.DATA)
    L, n = len(probe.layer_params), len(program.stages)
    costs = layer_costs(probe, program.train.micro_batch)[0]

    def more(ok):
        for k in range(n + 1, L + 1):
            if (shape[at] * n) % k:
                continue
            data = shape[at] * n // k
            if program.train.micro_batch % data:
                continue
            mesh = (shape[:at] + (data,) + shape[at + 1:], axes)
            allowed = memory_allowed(program, probe, k, [mesh] * k)
            try:
                cut = cut_layers(costs, k, allowed=allowed)
            except ValueError:
                continue
            if ok(cut_memory(program, probe, cut, [mesh] * k)):
                return k, data
        return None
    return more


def apply_auto_stages(program: ir.Program, probe) -> tuple[ir.Program, str]:
    """The program with every ``auto`` stage's layer range cut (``ir.Stage.auto_layers`` stays set),
    and the reason, for ``planc explain``. A program without auto stages comes back unchanged with
    reason ``""``. ``probe``: the chain probe of the uncut program (``planc.model.probe.probe_model``; it
    counts FLOPs for such a program). User errors are located ``PlanError``s: no probe, layers that
    do not run as a chain, fewer layers than stages, pinned layers no cut can honour."""
    if not program.auto_stages:
        return program, ""
    stages = sorted(program.stages, key=lambda s: s.index)
    at = stages[0].span
    n = len(stages)
    if probe is None:
        raise PlanError(Diagnostic("planc cuts the stages by the FLOPs of each layer, which the model probe "
                                   "counts; compile without --no-probe, or write each stage's layers "
                                   "('stage 0 : layers 0..4')", at))
    if probe.graph_errors:
        why = probe.graph_errors[0].removeprefix("stage 0 ")
        raise PlanError(Diagnostic(
            f"planc cannot cut this model into stages: it cuts by running the layers as a chain (each on the "
            f"previous layer's output), but {why}; a layer that needs skip inputs must start the stage its "
            "transfers arrive at, so write each stage's layers ('stage I : layers A..B')", at))
    if not probe.layer_flops:
        raise PlanError(Diagnostic("the model probe did not count the layers' FLOPs (planc.model.probe.probe_model("
                                   "program, flops=True)), so the stages cannot be cut", at))
    L = len(probe.layer_params)
    if n > L:
        raise PlanError(Diagnostic(f"cannot cut {L} layer{'s' if L != 1 else ''} into {n} stages: every stage "
                                   f"needs at least one layer (the model has {L})", at))
    holds = []
    for t in program.transfers:
        if t.src_layer is None:
            continue
        if t.src_layer >= L:
            raise PlanError(Diagnostic(f"transfer '{t.name}' is sent from layer {t.src_layer}, but the model has "
                                       f"{L} layers (0..{L})", t.span))
        holds.append((t.src_stage, t.src_layer))
    costs, by_params, free = layer_costs(probe, program.train.micro_batch)
    speeds = stage_speeds(program, probe)
    try:
        fastest = cut_layers(costs, n, speeds=speeds, holds=holds)
    except ValueError:
        pins = ", ".join(f"layer {l} in stage {s}" for s, l in holds)
        raise PlanError(Diagnostic(f"no cut of the model's {L} layers into {n} stages keeps what the transfers pin "
                                   f"({pins})", at)) from None
    allowed = memory_allowed(program, probe, n) if program.train is not None else None
    cut, memory_note = fastest, None
    if allowed is not None and not all(allowed(i, a, b) for i, (a, b) in enumerate(fastest)):
        try:   # the fastest cut does not fit the memory: the fastest of those that do
            cut = cut_layers(costs, n, speeds=speeds, holds=holds, allowed=allowed)
            memory_note = (f"memory = {program.cluster.memory:g} B shaped the cut: the fastest, "
                           f"{' | '.join(f'{a}..{b}' for a, b in fastest)}, does not fit")
        except ValueError:   # none fits: the fastest, and the schedule pass says what would fit
            memory_note = "no cut into this many stages fits memory: cut by compute alone"
    new = tuple(dataclasses.replace(s, layers=cut[i]) for i, s in enumerate(stages))
    per_device = [sum(costs[a:b]) / speeds[i] for i, (a, b) in enumerate(cut)]
    slowest = max(range(n), key=lambda i: per_device[i])
    worst = per_device[slowest]
    balance = (sum(per_device) / n / worst) if worst > 0 else 1.0
    parts = [f"cut {' | '.join(f'{a}..{b}' for a, b in cut)} into {n} stage{'s' if n != 1 else ''}: "
             f"slowest stage {slowest} with {_flop_text(worst)} per device per micro-batch (forward + backward)"]
    if program.cluster.flops:
        parts[0] += f", {_time_text(worst / program.cluster.flops)} at {program.cluster.flops / 1e12:g} TFLOP/s"
    parts.append(f"balance {balance:.2f} (mean stage / slowest)")
    if len(set(speeds)) > 1 or speeds[0] > 1:
        parts.append("devices sharing each stage's work: " + ", ".join(map(str, speeds)))
    if by_params:
        parts.append(f"{_layers_text(by_params)} report{'s' if len(by_params) == 1 else ''} 0 FLOPs: counted as "
                     "6 x parameters x rows")
    if free:
        parts.append(f"{_layers_text(free)} report{'s' if len(free) == 1 else ''} 0 FLOPs and hold no "
                     "parameters: counted as free")
    if probe.flop_errors:
        parts.append(f"FLOPs not counted for {probe.flop_errors[0]}")
    if holds:
        parts.append("pinned by transfers: " + ", ".join(f"layer {l} in stage {s}" for s, l in sorted(set(holds))))
    if memory_note:
        parts.append(memory_note)
    return dataclasses.replace(program, stages=new), "; ".join(parts)
