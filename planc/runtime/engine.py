"""The pipeline engine: DeepSpeed's ``PipelineEngine`` running a plan.

``PlanEngine(PipelineEngine)`` rebuilds ``_INSTRUCTION_MAP`` so that DeepSpeed's
instruction classes (``deepspeed.runtime.pipe.schedule``: LoadMicroBatch,
RecvActivation, ForwardPass, SendActivation, RecvGrad, BackwardPass, SendGrad,
ReduceGrads, OptimizerStep) run the plan: the plan's transfers (cross-mesh
resharding, skips included) in place of DeepSpeed's neighbour-only p2p, and the
plan's reduction program in place of DeepSpeed's data-parallel all-reduce.
``PlanSchedule(PipeSchedule)`` turns the plan's per-stage list into those
instructions; ``PlanPipelineModule(PipelineModule)`` holds the stage's layers
(the plan's layer ranges) on ``PlanGridTopology`` (the plan's rank mapping).
docs/runtime-engine.md lists the DeepSpeed internals this relies on.

Stage dataflow convention: a stage's first layer receives the stage's
incoming transfers as positional arguments, in transfer declaration order
(stage 0: the batch input); a layer returning a tuple hands it to the next
layer as positional arguments; a transfer ``from stage I layer L`` sends the
output of layer ``L`` (default: the stage's last layer).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule

from .plan import PlanError, mesh_position, mesh_shape, stage_layout, stage_of
from .reduce import ReductionExecutor
from .regions import parse_spec
from .reshard import DTYPES, TransferExecutor
from .topology import PlanGridTopology

__all__ = ["StageGraph", "PlanPipelineModule", "PlanSchedule", "PlanEngine", "EngineError",
           "run_reference", "build_optimizer", "check_stage_shapes", "plan_problems", "DTYPES"]



class EngineError(RuntimeError):
    """The plan cannot be trained as written (shapes, specs, stage graph)."""


# ---------------------------------------------------------------- stage graph (pure)

class StageGraph:
    """Stages, their layer ranges and the transfers between them, from plan.json."""

    def __init__(self, plan: dict):
        self.stages = sorted(plan["stages"], key=lambda s: s["index"])
        self.num_stages = len(self.stages)
        self.transfers = list(plan.get("transfers", ()))
        self.by_name = {t["name"]: t for t in self.transfers}
        for t in self.transfers:
            a, b = t["src"]["stage"], t["dst"]["stage"]
            if not a < b:
                raise EngineError(f"transfer {t['name']!r} goes from stage {a} to stage {b}; the engine "
                                  f"needs activations to flow to higher stages")

    def layers(self, s: int) -> tuple[int, int]:
        lay = stage_layout({"stages": self.stages}, s).get("layers")
        if lay is None:
            raise EngineError(f"stage {s} has no layer range")
        return int(lay[0]), int(lay[1])

    def src_layer(self, t: dict) -> int:
        layer = t["src"].get("layer")
        return self.layers(t["src"]["stage"])[1] - 1 if layer is None else int(layer)

    def incoming(self, s: int) -> list[str]:
        return [t["name"] for t in self.transfers if t["dst"]["stage"] == s]

    def outgoing(self, s: int) -> list[str]:
        return [t["name"] for t in self.transfers if t["src"]["stage"] == s]

    def edges(self) -> tuple[tuple[int, int], ...]:
        return tuple((t["src"]["stage"], t["dst"]["stage"]) for t in self.transfers)

    def check(self) -> None:
        last = self.num_stages - 1
        for s in range(self.num_stages):
            if s > 0 and not self.incoming(s):
                raise EngineError(f"stage {s} receives no transfer; declare the tensor it takes from an "
                                  f"earlier stage")
            if s < last and not self.outgoing(s):
                raise EngineError(f"stage {s} sends no transfer; only the last stage may end the model")
        for t in self.transfers:
            a, b = self.layers(t["src"]["stage"])
            if not a <= self.src_layer(t) < b:
                raise EngineError(f"transfer {t['name']!r}: layer {self.src_layer(t)} is not in stage "
                                  f"{t['src']['stage']} (layers {a}..{b})")


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
    return table[kind](params, **kw)


def run_reference(layers, plan: dict, loss_fn, data_iter, micro_batches: int, steps: int, optimizer):
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


# ---------------------------------------------------------------- schedule

class PlanSchedule(ds_schedule.PipeSchedule):
    """DeepSpeed instructions for one stage, from its plan.json ``per_stage`` list."""

    def __init__(self, ops, micro_batches, stages, stage_id, incoming, outgoing, loads_data):
        super().__init__(micro_batches, stages, stage_id)
        self.ops, self.incoming, self.outgoing, self.loads_data = list(ops), incoming, outgoing, loads_data

    def steps(self):
        for text in self.ops:
            kind, m = text[0], int(text[1:])
            cmds = []
            if kind == "F":
                if self.loads_data:
                    cmds.append(ds_schedule.LoadMicroBatch(buffer_id=m))
                cmds += [ds_schedule.RecvActivation(buffer_id=m, transfer=t) for t in self.incoming]
                cmds.append(ds_schedule.ForwardPass(buffer_id=m))
                cmds += [ds_schedule.SendActivation(buffer_id=m, transfer=t) for t in self.outgoing]
            else:
                cmds += [ds_schedule.RecvGrad(buffer_id=m, transfer=t) for t in self.outgoing]
                cmds.append(ds_schedule.BackwardPass(buffer_id=m))
                cmds += [ds_schedule.SendGrad(buffer_id=m, transfer=t) for t in self.incoming]
            yield cmds
        yield [ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]

    def num_pipe_buffers(self):
        return self.micro_batches


# ---------------------------------------------------------------- engine

def data_slice(plan: dict, stage: int, rank: int, rows: int) -> tuple[int, int, int]:
    """(start, stop, data size): the batch rows this rank's data coordinate owns."""
    st = stage_layout(plan, stage)
    axes = list(st.get("mesh_axes") or ())
    if "data" not in axes:
        return 0, rows, 1
    k = axes.index("data")
    size = mesh_shape(st["mesh"])[k]
    if rows % size:
        raise EngineError(f"micro_batch {rows} does not divide over data = {size} on stage {stage}")
    d = mesh_position(st["mesh"], rank)[k]
    return d * rows // size, (d + 1) * rows // size, size


def trainable_spec_problem(plan: dict, t: dict) -> str | None:
    """None when both ends hold the stage's data-parallel slice; else why not."""
    for end in ("src", "dst"):
        st = stage_layout(plan, t[end]["stage"])
        axes = list(st.get("mesh_axes") or ())
        entries = parse_spec(t[end]["spec"], len(t["shape"]), axes)
        data = axes.index("data") if "data" in axes else None
        dsize = mesh_shape(st["mesh"])[data] if data is not None else 1
        want_first = ((data,),) if dsize > 1 else ((), (data,)) if data is not None else ((),)
        if entries[0] not in want_first or any(entries[1:]):
            return (f"transfer {t['name']!r} is {end} spec {t[end]['spec']!r} on stage {t[end]['stage']} "
                    f"(mesh axes {axes}); training needs batch dim 0 sharded over 'data' and other "
                    f"dims R, so this plan runs only with --comm-only")
    return None


def check_stage_shapes(plan: dict, rank: int, layers, sample_x, device=None) -> list[str]:
    """Start-up check: the tensors this rank's stage produces against the declared transfer shapes.

    Runs the stage's layers once without gradients on the declared input shapes
    (stage 0: a real micro-batch slice); local to the rank, no messages. Runs
    before DeepSpeed builds anything, so every rank can fail together.
    """
    device = device or torch.device("cpu")
    graph = StageGraph(plan)
    stage = stage_of(plan, rank)
    first, _ = graph.layers(stage)
    incoming, outgoing = graph.incoming(stage), graph.outgoing(stage)
    problems = []
    if stage == 0:
        inputs = [sample_x.to(device)]
    else:
        inputs = []
        for n in incoming:
            t = graph.by_name[n]
            a, b, _ = data_slice(plan, stage, rank, t["shape"][0])
            inputs.append(torch.zeros((b - a,) + tuple(t["shape"][1:]), dtype=DTYPES[t["dtype"]], device=device))
    taps = {graph.src_layer(graph.by_name[n]) for n in outgoing}
    with torch.no_grad():
        try:
            _, tapped = apply_layers(layers, first, inputs, taps)
        except Exception as e:  # noqa: BLE001 - reported with the stage
            return [f"stage {stage}: its layers fail on the declared inputs "
                    f"{[tuple(i.shape) for i in inputs]}: {e}"]
    for n in outgoing:
        t = graph.by_name[n]
        out = tapped[graph.src_layer(t)]
        if not torch.is_tensor(out):
            problems.append(f"stage {stage}, transfer {n!r}: layer {graph.src_layer(t)} "
                            f"returns {type(out).__name__}, not a tensor")
            continue
        _, _, dsize = data_slice(plan, stage, rank, t["shape"][0])
        real = (out.shape[0] * dsize,) + tuple(out.shape[1:])
        if real != tuple(t["shape"]):
            problems.append(f"stage {stage}, transfer {n!r}: declared shape {list(t['shape'])} "
                            f"but the stage produces {list(real)}")
        elif out.dtype != DTYPES[t["dtype"]]:
            problems.append(f"stage {stage}, transfer {n!r}: declared dtype {t['dtype']} "
                            f"but the stage produces {out.dtype}")
    return problems


def plan_problems(plan: dict, ds_config: dict) -> list[str]:
    """Pure checks of a training plan against what the engine supports (same on every rank)."""
    problems = []
    try:
        StageGraph(plan).check()
        PlanGridTopology(plan)
    except (EngineError, PlanError) as e:
        problems.append(str(e))
    for t in plan.get("transfers", ()):
        p = trainable_spec_problem(plan, t)
        if p:
            problems.append(p)
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage != 0:
        problems.append(f"ZeRO stage {stage}: the planc engine reduces gradients with the plan's program "
                        f"and runs ZeRO stage 0 only")
    pipe = ds_config.get("pipeline") or {}
    if pipe.get("pipe_partitioned", False) or pipe.get("grad_partitioned", False):
        problems.append("ds_config pipeline.pipe_partitioned / grad_partitioned must be false: the plan's "
                        "transfers carry whole data-parallel slices")
    return problems


class PlanPipelineModule(PipelineModule):
    """A ``PipelineModule`` whose partition is the plan's layer ranges and whose
    grid is the plan's placement (``PlanGridTopology``).

    Parameters keep DeepSpeed's names, ``<global layer index>.<name>``.
    ``forward(*inputs, taps=())`` runs the stage with the planc dataflow
    convention and returns ``(last output, {tapped layer: output})``.
    """

    def __init__(self, plan: dict, layers, loss_fn=None, topology=None):
        graph = StageGraph(plan)
        bounds = [graph.layers(s)[0] for s in range(graph.num_stages)] + [graph.layers(graph.num_stages - 1)[1]]
        for s in range(graph.num_stages):
            a, b = graph.layers(s)
            if a != bounds[s] or (s + 1 < graph.num_stages and b != bounds[s + 1]) or b <= a:
                raise EngineError(f"stage {s} layers {a}..{b}: DeepSpeed's partition needs contiguous, "
                                  f"non-empty layer ranges in stage order")
        if bounds[0] != 0 or bounds[-1] != len(layers):
            raise EngineError(f"the stages cover layers {bounds[0]}..{bounds[-1]} but the model has "
                              f"{len(layers)} layers")
        object.__setattr__(self, "_plan_bounds", bounds)
        super().__init__(layers=list(layers), topology=topology or PlanGridTopology(plan), loss_fn=loss_fn,
                         partition_method="plan")

    def _partition_layers(self, method="plan"):
        """The plan's layer boundaries (PipelineModule.__init__ calls this)."""
        self.parts = list(self._plan_bounds)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def forward(self, *inputs, taps=()):
        return apply_layers(self.forward_funcs, self._local_start, inputs, taps)


@contextlib.contextmanager
def groups_with_timeout(timeout):
    """Make every ``dist.new_group`` DeepSpeed calls use the runtime's collective timeout."""
    original = dist.new_group

    def new_group(*args, **kwargs):
        kwargs.setdefault("timeout", timeout)
        return original(*args, **kwargs)

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = original


class PlanEngine(PipelineEngine):
    """DeepSpeed's ``PipelineEngine`` running a plan.

    ``_INSTRUCTION_MAP`` is rebuilt below the class body: DeepSpeed's
    ``_exec_schedule`` dispatches through that class attribute, so methods
    overridden by name alone would never run. Transfers (skips included) replace
    DeepSpeed's neighbour-only p2p, the plan's reduction program replaces its
    data-parallel all-reduce, and ``PlanSchedule`` (a ``PipeSchedule``) replaces
    ``TrainSchedule``.
    """

    def __init__(self, *ds_args, plan: dict, groups: dict, data_iter=None, **ds_kwargs):
        super().__init__(*ds_args, **ds_kwargs)
        rank = self.global_rank
        self.plan, self.plan_groups, self.rank = plan, groups, rank
        self.graph = StageGraph(plan)
        if stage_of(plan, rank) != self.stage_id:
            raise EngineError(f"rank {rank}: DeepSpeed puts it in stage {self.stage_id}, the plan in stage "
                              f"{stage_of(plan, rank)}")
        self.ops = plan["pipeline"]["per_stage"][self.stage_id]
        if int(plan["pipeline"]["micro_batches"]) != self.micro_batches:
            raise EngineError(f"gradient_accumulation_steps = {self.micro_batches} but the plan has "
                              f"{plan['pipeline']['micro_batches']} micro-batches")
        self.incoming = self.graph.incoming(self.stage_id)
        self.outgoing = self.graph.outgoing(self.stage_id)
        self.data_iterator = data_iter if (self.is_first_stage() or self.is_last_stage()) else None
        self.executors = {}
        for i, t in enumerate(self.graph.transfers):
            if t["name"] not in self.incoming + self.outgoing:
                continue
            for direction in ("forward", "backward"):
                self.executors[(t["name"], direction)] = TransferExecutor(
                    t, plan, groups, rank, direction, index=i, device=self.device)
        self.reduction, self.reduce_size = None, 1
        red = next((r for r in plan.get("reductions", ()) if r["name"] == "gradients"), None)
        # `using allreduce` keeps DeepSpeed's own data-parallel all-reduce, when its groups are the plan's
        self.deepspeed_reduce = red is not None and red.get("mode") == "allreduce" and (
            {tuple(g) for g in red["groups"]}
            == {tuple(sorted(g)) for g in self._topo.get_axis_comm_lists("data") if len(g) > 1})
        self.reduce_description = ("none" if red is None else "DeepSpeed's data-parallel all-reduce"
                                   if self.deepspeed_reduce else f"planc program {red['program']['text']}")
        if red is not None and any(rank in g for g in red["groups"]) and not self.deepspeed_reduce:
            self.reduction = ReductionExecutor(red, groups, rank)
            self.reduce_size = len(next(g for g in red["groups"] if rank in g))
        for key in ("grads", "losses"):   # _reserve_pipe_buffers extends every key
            self.pipe_buffers.setdefault(key, [None] * self.num_pipe_buffers)
        self.pending_sends = []

    @classmethod
    def build(cls, plan: dict, groups: dict, layers, loss_fn, data_iter, ds_config: dict, optimizer=None,
              timeout=None):
        """Construct the engine the way ``deepspeed.initialize`` does for a ``PipelineModule``
        (which always picks ``PipelineEngine``): module, mpu = module.mpu(), DeepSpeedConfig."""
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from .dist_util import collective_timeout
        timeout = timeout or collective_timeout()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, timeout=timeout)
        with groups_with_timeout(timeout):
            module = PlanPipelineModule(plan, layers, loss_fn=loss_fn)
            if optimizer is None:
                optimizer = build_optimizer(module.parameters(), ds_config)
            mpu = module.mpu()
            config_class = DeepSpeedConfig(ds_config, mpu)
            engine = cls(args=None, model=module, optimizer=optimizer, model_parameters=None,
                         training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=False,
                         collate_fn=None, config=ds_config, config_class=config_class,
                         plan=plan, groups=groups, data_iter=data_iter)
        return engine

    # ---- instructions
    def _exec_load_micro_batch(self, buffer_id):
        x, y = self._next_batch()
        a, b, _ = data_slice(self.plan, self.stage_id, self.rank, x.shape[0])
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = {"x": x[a:b].to(self.device)}
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = y[a:b].to(self.device)

    def _exec_recv_activations(self, buffer_id, transfer):
        t = self.executors[(transfer, "forward")].recv(micro_batch=buffer_id).to(self.device)
        if t.is_floating_point():
            t.requires_grad_(True)
        if self.pipe_buffers["inputs"][buffer_id] is None:
            self.pipe_buffers["inputs"][buffer_id] = {}
        self.pipe_buffers["inputs"][buffer_id][transfer] = t

    def _exec_forward_pass(self, buffer_id):
        held = self.pipe_buffers["inputs"][buffer_id]
        inputs = [held["x"]] if self.is_first_stage() else [held[n] for n in self.incoming]
        taps = {self.graph.src_layer(self.graph.by_name[n]) for n in self.outgoing}
        out, tapped = self.module(*inputs, taps=taps)
        self.pipe_buffers["outputs"][buffer_id] = {
            n: tapped[self.graph.src_layer(self.graph.by_name[n])] for n in self.outgoing}
        if self.is_last_stage():
            # unscaled, as in PipelineEngine: DeepSpeedEngine.backward divides by gradient_accumulation_steps
            self.loss = self.module.loss_fn(out, self.pipe_buffers["labels"][buffer_id])
            self.pipe_buffers["losses"][buffer_id] = self.loss   # plan lists may run F m+1 before B m
            self.total_loss = self.loss.detach() if self.total_loss is None else self.total_loss + self.loss.detach()

    def _exec_send_activations(self, buffer_id, transfer):
        out = self.pipe_buffers["outputs"][buffer_id][transfer]
        self.pending_sends.append(self.executors[(transfer, "forward")].send(out.detach(), micro_batch=buffer_id))

    def _exec_recv_grads(self, buffer_id, transfer):
        g = self.executors[(transfer, "backward")].recv(micro_batch=buffer_id).to(self.device)
        if self.pipe_buffers["grads"][buffer_id] is None:
            self.pipe_buffers["grads"][buffer_id] = {}
        self.pipe_buffers["grads"][buffer_id][transfer] = g

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            # DeepSpeedEngine.backward (PipelineEngine.backward raises): loss / gradient_accumulation_steps
            self.loss = self.pipe_buffers["losses"][buffer_id]
            DeepSpeedEngine.backward(self, self.loss)
        else:
            # one output may feed several transfers (a skip and the main path): sum its gradients
            outs, grads = self.pipe_buffers["outputs"][buffer_id], self.pipe_buffers["grads"][buffer_id]
            tensors, sums = [], []
            for n in self.outgoing:
                out, g = outs[n], grads[n]
                for i, t in enumerate(tensors):
                    if t is out:
                        sums[i] = sums[i] + g
                        break
                else:
                    tensors.append(out)
                    sums.append(g)
            self._running_engine_backward = True
            try:
                torch.autograd.backward(tensors, sums)
            finally:
                self._running_engine_backward = False
        for key in ("outputs", "grads", "losses", "labels"):
            self.pipe_buffers[key][buffer_id] = None

    def _exec_send_grads(self, buffer_id, transfer):
        t = self.pipe_buffers["inputs"][buffer_id][transfer]
        g = t.grad if t.grad is not None else torch.zeros_like(t)
        self.pending_sends.append(self.executors[(transfer, "backward")].send(g, micro_batch=buffer_id))

    def _exec_reduce_grads(self):
        """The plan's reduction program on one flat gradient buffer, then / data-parallel size."""
        self._wait_sends()
        self.pipe_buffers["inputs"] = [None] * self.num_pipe_buffers
        if self.deepspeed_reduce:
            PipelineEngine._exec_reduce_grads(self)
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.reduction is None or not params:
            return
        self._force_grad_boundary = True
        try:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat = self.reduction.run(flat) / self.reduce_size
            off = 0
            for p in params:
                n = p.numel()
                p.grad = flat[off:off + n].view_as(p).clone()
                off += n
        finally:
            self._force_grad_boundary = False

    def _wait_sends(self):
        for works in self.pending_sends:
            for item in works or ():
                work = item[0] if isinstance(item, tuple) else item
                if work is not None and hasattr(work, "wait"):
                    work.wait()
        self.pending_sends = []

    # ---- driver
    def _train_schedule(self):
        return PlanSchedule(self.ops, self.micro_batches, self.num_stages, self.stage_id,
                            self.incoming, self.outgoing, self.is_first_stage() or self.is_last_stage())

    def train_batch(self, data_iter=None):
        """One iteration of the plan's schedule; returns the batch loss (mean over micro-batches
        and data-parallel replicas) on every rank, via DeepSpeed's ``_aggregate_total_loss``."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.total_loss = None
        self.total_additional_losses = None
        self._compute_loss = True
        self._exec_schedule(self._train_schedule())
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        return self.agg_train_loss

    def plan_named_parameters(self):
        """``layers.<global index>.<name>`` -> CPU tensor (the single-process model's names)."""
        return OrderedDict((f"layers.{k}", v.detach().cpu()) for k, v in self.module.named_parameters())


PlanEngine._INSTRUCTION_MAP = {
    ds_schedule.LoadMicroBatch: PlanEngine._exec_load_micro_batch,
    ds_schedule.RecvActivation: PlanEngine._exec_recv_activations,
    ds_schedule.ForwardPass: PlanEngine._exec_forward_pass,
    ds_schedule.SendActivation: PlanEngine._exec_send_activations,
    ds_schedule.RecvGrad: PlanEngine._exec_recv_grads,
    ds_schedule.BackwardPass: PlanEngine._exec_backward_pass,
    ds_schedule.SendGrad: PlanEngine._exec_send_grads,
    ds_schedule.ReduceGrads: PlanEngine._exec_reduce_grads,
    ds_schedule.OptimizerStep: PipelineEngine._exec_optimizer_step,   # DeepSpeed's _take_model_step
}
