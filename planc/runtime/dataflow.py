"""A stage's dataflow, in one process: the stage graph, running layers with taps, the reference.

Stage dataflow convention: a stage's first layer receives the stage's
incoming transfers as positional arguments, in transfer declaration order
(stage 0: the batch input); a layer returning a tuple hands it to the next
layer as positional arguments; a transfer ``from stage I layer L`` sends the
output of layer ``L`` (default: the stage's last layer).

Imports only torch and the standard library (no process group is used here).
"""
from __future__ import annotations

import torch

from planc.plan import Plan
from .reshard import DTYPES

__all__ = ["EngineError", "StageGraph", "apply_layers", "build_optimizer", "run_reference", "check_stage_shapes",
           "SequenceBoundary"]


class EngineError(RuntimeError):
    """The plan cannot run here as written (shapes, groups, launch)."""


class StageGraph:
    """Stages, their layer ranges and the transfers between them, from the plan file."""

    def __init__(self, plan: Plan):
        self.stages = plan.stages
        self.num_stages = len(plan.stages)
        self.transfers = plan.transfers
        self.by_name = {t.name: t for t in plan.transfers}

    def layers(self, s: int) -> tuple[int, int]:
        lay = self.stages[s].layers
        if lay is None:
            raise EngineError(f"stage {s} has no layer range")
        return lay

    def src_layer(self, t) -> int:
        return self.layers(t.src_stage)[1] - 1 if t.src_layer is None else t.src_layer

    def incoming(self, s: int) -> list[str]:
        return [t.name for t in self.transfers if t.dst_stage == s]

    def outgoing(self, s: int) -> list[str]:
        return [t.name for t in self.transfers if t.src_stage == s]


def apply_layers(layers, first: int, inputs, taps=()):
    """Run layers ``first, first+1, ...`` on ``inputs``; return (last output, {tap: output})."""
    args = tuple(inputs)
    tapped = {}
    out = None
    for i, layer in enumerate(layers):
        out = layer(*args)
        if first + i in taps:
            tapped[first + i] = out
        args = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return out, tapped


class SequenceBoundary:
    """A sequence-parallel stage's transfers written replicated (LANGUAGE.md: an explicit replicated spec is
    honoured, the boundary gathers): such an input arrives whole and the stage keeps its part of the sequence
    (backward: the parts' gradients gathered back, the whole gradient sent); such an output is gathered
    before it is sent (backward: the rank keeps its part of the whole gradient it receives). Transfers in the
    derived layout (the sequence split over ``tensor``) pass as they are. ``tp``: the stage's sequence-parallel
    ``TensorParallel`` (its layers' ``sequence``), None: nothing to do."""

    def __init__(self, plan: Plan, rank: int, layers):
        self.tp = next((t for t in (getattr(layer, "sequence", None) for layer in layers) if t is not None), None)
        self.whole_in, self.whole_out = set(), set()
        if self.tp is None:
            return
        for t in plan.transfers:
            for side, names in (("dst", self.whole_in), ("src", self.whole_out)):
                if len(t.shape) > 1 and rank in dict(getattr(t.forward, f"{side}_regions")):
                    a, b = t.forward.region(side, rank)[1]
                    if b - a == t.shape[1] and self.tp.size > 1:
                        names.add(t.name)

    def inputs(self, names, xs) -> list:
        from .tensor_parallel import scatter_sequence
        return [scatter_sequence(x, self.tp) if n in self.whole_in else x for n, x in zip(names, xs)]

    def output(self, name: str, x):
        from .tensor_parallel import gather_sequence_whole
        return gather_sequence_whole(x, self.tp) if name in self.whole_out else x


def build_optimizer(params, ds_config: dict):
    """torch.optim from the ``optimizer`` section of ds_config.json (Adam, AdamW, SGD)."""
    opt = ds_config.get("optimizer") or {"type": "Adam", "params": {"lr": 1e-3}}
    kind = str(opt.get("type", "Adam")).lower()
    kw = dict(opt.get("params", {}))
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    table = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if kind not in table:
        raise EngineError(f"optimizer {opt.get('type')!r} is not supported (Adam, AdamW, SGD)")
    params = [q for q in params if q.requires_grad]
    if not params:   # a stage without parameters (activations, reshapes) trains too: its steps change nothing
        params = [torch.nn.Parameter(torch.zeros(0))]
    return table[kind](params, **kw)


def run_reference(layers, plan: Plan, loss_fn, data_iter, micro_batches: int, steps: int, optimizer):
    """Single-process training with the same stage dataflow; returns the loss per step."""
    graph = StageGraph(plan)
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(micro_batches):
            x, y = next(data_iter)
            sent = {}
            for s in range(graph.num_stages):
                a, b = graph.layers(s)
                inputs = [x] if s == 0 else [sent[n] for n in graph.incoming(s)]
                taps = {graph.src_layer(graph.by_name[n]) for n in graph.outgoing(s)}
                out, tapped = apply_layers(layers[a:b], a, inputs, taps)
                for n in graph.outgoing(s):
                    sent[n] = tapped[graph.src_layer(graph.by_name[n])]
            loss = loss_fn(out, y) / micro_batches
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def check_stage_shapes(plan: Plan, rank: int, layers, sample_x, device=None, stage=None) -> list[str]:
    """Start-up check: the tensors this rank's stage produces against its transfers' regions.

    Runs the stage's layers once without gradients on inputs of the planned
    shapes (stage 0: a real micro-batch slice); local to the rank, no messages.
    Runs before DeepSpeed builds anything, so every rank can fail together.
    """
    device = device or torch.device("cpu")
    graph = StageGraph(plan)
    stage = stage if stage is not None else plan.stage_of(rank)
    first, _ = graph.layers(stage.index)
    incoming, outgoing = graph.incoming(stage.index), graph.outgoing(stage.index)
    if stage.index == 0:
        inputs = [sample_x.to(device)]
    else:
        inputs = []
        for n in incoming:
            t = graph.by_name[n]
            region = t.forward.region("dst", rank)
            inputs.append(torch.zeros([b - a for a, b in region], dtype=DTYPES[t.dtype], device=device))
    boundary = SequenceBoundary(plan, rank, layers)
    if stage.index != 0:
        inputs = boundary.inputs(incoming, inputs)
    taps = {graph.src_layer(graph.by_name[n]) for n in outgoing}
    # the check's forward must leave no trace: buffers a forward updates in training mode (BatchNorm's
    # running statistics and batch count) are put back as they were
    saved = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    with torch.no_grad():
        try:
            _, tapped = apply_layers(layers, first, inputs, taps)
        except Exception as e:  # noqa: BLE001 - reported with the stage, the layer and the user's line
            from .usererrors import layer_failure
            return [f"stage {stage.index}: its layers fail on the planned inputs "
                    f"{[tuple(i.shape) for i in inputs]}: {layer_failure(e, layers, first)}"]
        finally:
            for b, v in saved:
                b.copy_(v)
    problems = []
    for n in outgoing:
        t = graph.by_name[n]
        out = tapped[graph.src_layer(t)]
        if torch.is_tensor(out):
            with torch.no_grad():
                out = boundary.output(n, out)
        if not torch.is_tensor(out):
            problems.append(f"stage {stage.index}, transfer {n!r}: layer {graph.src_layer(t)} "
                            f"returns {type(out).__name__}, not a tensor")
            continue
        want = tuple(b - a for a, b in t.forward.region("src", rank))
        if tuple(out.shape) != want:
            problems.append(f"stage {stage.index}, transfer {n!r}: the plan moves a {list(want)} shard from "
                            f"rank {rank} (of {t.dtype}{list(t.shape)}) but the stage produces {list(out.shape)}")
        elif out.dtype != DTYPES[t.dtype]:
            problems.append(f"stage {stage.index}, transfer {n!r}: the plan says {t.dtype} "
                            f"but the stage produces {out.dtype}")
    return problems
