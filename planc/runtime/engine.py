"""The pipeline engine: DeepSpeed's ``PipelineEngine`` executing a compiled plan.

``PlanEngine(PipelineEngine)`` rebuilds ``_INSTRUCTION_MAP`` so that DeepSpeed's
instruction classes (``deepspeed.runtime.pipe.schedule``: LoadMicroBatch,
RecvActivation, ForwardPass, SendActivation, RecvGrad, BackwardPass, SendGrad,
ReduceGrads, OptimizerStep) run the plan: the plan's transfers (cross-mesh
resharding, skips included) in place of DeepSpeed's neighbour-only p2p, and the
plan's reduction program in place of DeepSpeed's data-parallel all-reduce.
``PlanSchedule(PipeSchedule)`` turns the plan's per-stage list into those
instructions; ``PlanPipelineModule(PipelineModule)`` holds the stage's layers. Stages may sit on meshes of any size and shape: DeepSpeed's grid is answered
per rank from its own stage (``topology.PlanGrid``), so a stage of 1 device can
feed a (2, 2) mesh, and devices outside every stage build no engine at all.
docs/runtime-engine.md lists the DeepSpeed internals this relies on.

Scaling: every gradient is the gradient of the global mean loss. A last-stage
device computes the loss of its rows and weights it by its share of the
micro-batch's rows (DeepSpeed divides by the micro-batch count), so the
activation gradients it sends back and the parameter gradients each device
holds are exact partial sums; reductions then *sum* over the data axis.

The stage dataflow convention (what a stage's first layer receives, which
layer's output a transfer sends) is in ``dataflow``, with the stage graph and
the single-process reference; send completion is in ``sends``.
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

from .dataflow import (EngineError, SequenceBoundary, StageGraph, apply_layers, build_optimizer, check_stage_shapes,  # noqa: F401
                       run_reference)
from planc.plan import Direction, Plan, Precision, Stage
from .reduce import ReductionExecutor
from .regime import Regime, make_optimizer, param_dtype
from .stage_regime import build_regime
from .zero3 import zero3_for
from .reshard import DTYPES, TransferExecutor
from .comm import RecvAhead
from .classrun import local_routes
from .dsplan import BeginOp, PlanSchedule, WeightPass, check_ds_config, deepspeed_on_plan, named_instruction as _named
from .bwsplit import BackwardSplit, distinct_outputs
from .grads import GroupAllReduce
from .grads_zero2 import make_buckets
from .tied import TiedGradients
from .sends import SendReaper
from .topology import StageTopology, reduce_groups

__all__ = ["StageGraph", "PlanPipelineModule", "PlanSchedule", "PlanEngine", "EngineError",
           "run_reference", "build_optimizer", "check_stage_shapes", "apply_layers", "SendReaper", "DTYPES"]


# ---------------------------------------------------------------- module and construction

class PlanPipelineModule(PipelineModule):
    """A ``PipelineModule`` holding this rank's stage: the plan's layer range, the plan's grid.

    Parameters keep DeepSpeed's names, ``<global layer index>.<name>``.
    ``forward(*inputs, taps=())`` runs the stage with the planc dataflow
    convention and returns ``(last output, {tapped layer: output})``.
    """

    def __init__(self, plan: Plan, layers, loss_fn=None, stage=None):
        graph = StageGraph(plan)
        bounds = [graph.layers(s)[0] for s in range(graph.num_stages)] + [graph.layers(graph.num_stages - 1)[1]]
        if bounds[0] != 0 or bounds[-1] != len(layers):
            raise EngineError(f"the stages cover layers {bounds[0]}..{bounds[-1]} but the model has "
                              f"{len(layers)} layers")
        object.__setattr__(self, "_plan_bounds", bounds)
        super().__init__(layers=list(layers), topology=StageTopology(plan, stage), loss_fn=loss_fn, partition_method="plan",
                         base_seed=plan.train.seed)   # the plan's seed (DeepSpeed prints it: BASE_SEED)

    def _partition_layers(self, method="plan"):
        """The plan's layer boundaries (PipelineModule.__init__ calls this)."""
        self.parts = list(self._plan_bounds)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def forward(self, *inputs, taps=()):
        return apply_layers(self.forward_funcs, self._local_start, inputs, taps)


# ---------------------------------------------------------------- engine

class PlanEngine(PipelineEngine):
    """DeepSpeed's ``PipelineEngine`` running a plan.

    ``_INSTRUCTION_MAP`` is rebuilt below the class body: DeepSpeed's
    ``_exec_schedule`` dispatches through that class attribute, so methods
    overridden by name alone would never run.

    Buffers: each micro-batch's saved input, output, labels, loss and received
    gradient live in dicts keyed by micro-batch and are dropped as soon as its
    backward (and the gradient sends that read its input) are done; a send's
    buffer is dropped when the send completes (``SendReaper``). ``stats``
    records the most micro-batches held at once and the most micro-batches
    with sends in flight.
    """

    def __init__(self, *ds_args, plan: Plan, groups: dict, data_iter=None, tracer=None, initial=None, stage=None,
                 **ds_kwargs):
        super().__init__(*ds_args, **ds_kwargs)
        self.tracer = tracer
        rank = self.global_rank
        self.plan, self.plan_groups, self.rank = plan, groups, rank
        self.graph = StageGraph(plan)
        self.stage: Stage = stage if stage is not None else plan.stage_of(rank)
        self.rank_class = plan.pipeline.class_of(self.stage_id)   # plan.json pipeline.actions: the order
        self.turns = self.rank_class.turns()
        if plan.pipeline.micro_batches != self.micro_batches:
            raise EngineError(f"gradient_accumulation_steps = {self.micro_batches} but the plan has "
                              f"{plan.pipeline.micro_batches} micro-batches")
        self.incoming = self.graph.incoming(self.stage_id)
        self.outgoing = self.graph.outgoing(self.stage_id)
        self.boundary = SequenceBoundary(plan, rank, self.module.forward_funcs)   # written-replicated transfers
        self.rows = self.stage.rows_of(rank)
        self.loss_weight = (self.rows[1] - self.rows[0]) / plan.train.micro_batch
        self.counts_loss = rank in plan.train.loss_devices
        self.data_iterator = data_iter if (self.is_first_stage() or self.is_last_stage()) else None
        tags = plan.tag_layout()
        self.executors = {}
        self.local = local_routes(plan)   # (transfer, direction) handed over on the rank (classrun.py)
        for i, t in enumerate(plan.transfers):
            if t.name in self.incoming + self.outgoing:
                for direction in Direction:
                    if (t.name, direction) in self.local:
                        continue
                    self.executors[(t.name, direction)] = TransferExecutor(
                        t, direction, rank, groups, tags, index=i, device=self.device,
                        signal=plan.runtime.signal_transfers)
        red = plan.gradient_reduction(rank, self.stage_id)
        self.reduction = None
        self.dtype = param_dtype(plan.train.precision)
        low = self.dtype != torch.float32
        self.tied = TiedGradients.build(self.module, plan, rank, groups, self.device, tracer)   # tied.py
        self.deepspeed_reduce = red is not None and str(red.mode) == "allreduce" and not low and not self.tied.params
        if red is None:
            self.reduce_description = "none (no data-parallel peers)"
        elif self.deepspeed_reduce:
            self.reduce_description = "DeepSpeed's data-parallel all-reduce"
        elif str(red.mode) == "allreduce":   # bf16/fp16: the fp32 buckets, on the same group
            self.reduction = GroupAllReduce(self.grid.get_data_parallel_group())
            self.reduce_description = "data-parallel all-reduce of the fp32 gradient buckets"
        else:
            self.reduce_description = f"planc program {red.text}, bucketed, overlapped with the last backward"
            self.reduction = ReductionExecutor.for_plan(plan, red, reduce_groups(groups, self.stage_id), rank)
            if self.reduction.shm_groups:
                self.reduce_description += "; in-host steps through shared memory"
            elif self.reduction.shm_fallback:
                self.reduce_description += ("; in-host steps over gloo ("
                                            + next(iter(self.reduction.shm_fallback.values())) + ")")
        self.reduce_size = len(red.group_of(rank)) if red is not None else 1
        if red is not None and tuple(self.grid.get_data_parallel_group_ranks()) != red.group_of(rank):
            raise EngineError(f"rank {rank}: its gradient reduction group {list(red.group_of(rank))} is not its "
                              f"stage's data group {self.grid.get_data_parallel_group_ranks()}")
        self.held = {k: {} for k in ("inputs", "outputs", "labels", "losses", "grads", "grads_sent")}
        # zero-bubble lists split the backward: B the input gradients, W the weight gradients (bwsplit.py)
        mine = [t.compute for t in self.turns if t.compute.stage == self.stage_id]
        splits = any(a.kind == "W" for a in mine)
        self.split = BackwardSplit(self.module.parameters()) if splits else None
        # the action whose backward produces the step's last parameter gradients: buckets released as they fill
        self.last_backward = next(a.micro_batch for a in reversed(mine) if a.kind == ("W" if splits else "B"))
        self.grads = make_buckets(plan, self.stage_id, self.tied.others(self.module.parameters()), self.reduction,
                                  self.device, tracer=tracer, layers=self.module.forward_funcs)   # grads_zero2.py
        self.regime = self._regime(plan, groups, red, initial)
        self.zero3 = zero3_for(self)   # zero = 3: parameters freed, gathered per layer (zero3.py)
        self.optimizer = self.regime.optimizer   # DeepSpeed was built with a placeholder (see build)
        self.recompute = plan.train.recomputes(self.stage_id)
        self.step_report: dict = {}
        self.sends = SendReaper(tracer=tracer)
        self.nic = None   # the host NIC order (nicorder.py): attach_nic, when the plan has one for this host
        self.nic_bytes: dict = {}   # (transfer, direction) -> bytes this rank sends off its host per micro-batch
        # a rank of several stages: one receive thread for all of them, and stage-to-stage handovers on the
        # rank itself (classrun.py sets both); else this stage's own
        self.local_box: dict | None = None
        self.recvs = None if len(self.rank_class.stages) > 1 else RecvAhead.for_class(
            self.executors, self.rank_class, ahead=plan.runtime.recv_ahead, tracer=tracer)
        self.stats = {"stage": self.stage_id, "peak_live_micro_batches": 0, "peak_pending_sends": 0}
        self.saved = None   # --memory-stats: per micro-batch in flight, the bytes autograd saved in its forward

    @classmethod
    def build(cls, plan: Plan, groups: dict, layers, loss_fn, data_iter, ds_config: dict, timeout=None, tracer=None,
              initial=None, stage=None):
        """Construct the engine the way ``deepspeed.initialize`` does for a ``PipelineModule``
        (module, mpu = module.mpu(), DeepSpeedConfig), on the plan's grid and groups. ``initial``: the
        stage's fp32 weights from before ``regime.cast_stage`` (bf16/fp16 plans), the masters' start."""
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig
        from .dist_util import collective_timeout
        timeout = timeout or collective_timeout(plan)
        rank = dist.get_rank()
        stage = stage if stage is not None else plan.stage_of(rank)
        a, b = stage.rows_of(rank)
        cfg = dict(ds_config, train_micro_batch_size_per_gpu=b - a, gradient_accumulation_steps=plan.pipeline.micro_batches,
                   train_batch_size=(b - a) * plan.pipeline.micro_batches * len(stage.group_of("data", rank)))
        check_ds_config(cfg)
        cfg.pop("optimizer", None)   # the optimizer is plan.json's (regime.py), never ds_config's
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False, timeout=timeout)
        with deepspeed_on_plan(plan, rank, groups, timeout, stage):
            module = PlanPipelineModule(plan, layers, loss_fn=loss_fn, stage=stage)
            # a placeholder: DeepSpeed needs an optimizer to build the engine; the engine's own (over the
            # master weights, regime.py) replaces it once the gradient buckets exist
            optimizer = make_optimizer(plan.train.optimizer, [])
            mpu = module.mpu()
            config_class = DeepSpeedConfig(cfg, mpu)
            engine = cls(args=None, model=module, optimizer=optimizer, model_parameters=None,
                         training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=False,
                         collate_fn=None, config=cfg, config_class=config_class,
                         plan=plan, groups=groups, data_iter=data_iter, tracer=tracer, initial=initial, stage=stage)
        return engine

    def _regime(self, plan: Plan, groups: dict, red, initial) -> Regime:
        """The optimizer step as plan.json train says (regime.py), on this rank's buckets and groups."""
        return build_regime(self, plan, groups, red, initial)

    # ---- buffer bookkeeping
    def _note(self) -> None:
        live = set(self.recvs.posted_micro_batches())   # receive buffers posted ahead count too
        for d in self.held.values():
            live.update(d)
        s = self.stats
        s["peak_live_micro_batches"] = max(s["peak_live_micro_batches"], len(live))
        s["peak_pending_sends"] = max(s["peak_pending_sends"], self.sends.in_flight())

    def _drop(self, m: int, *keys: str) -> None:
        for k in keys:
            self.held[k].pop(m, None)

    # ---- instructions
    def _exec_load_micro_batch(self, buffer_id):
        x, y = self._next_batch()
        a, b = self.rows
        if self.is_first_stage():
            x = x[a:b].to(self.device)
            self.held["inputs"][buffer_id] = {"x": x.to(self.dtype) if x.is_floating_point() else x}
        if self.is_last_stage():
            self.held["labels"][buffer_id] = y[a:b].to(self.device)
        self._note()

    def _exec_begin_op(self, index):
        self.recvs.advance(index)

    def _take(self, transfer: str, direction: Direction, m: int):
        """What the receive thread received, or, for a transfer between two stages of this rank's mesh that
        moves nothing (plan.json ``local``), this rank's region of what its other stage handed over."""
        if (transfer, direction) in self.local:
            return self.local_box.take(transfer, direction, m)
        return self.recvs.take(transfer, direction, m)

    def _exec_recv_activations(self, buffer_id, transfer):
        t = self._take(transfer, Direction.FORWARD, buffer_id)
        if t.is_floating_point():
            t.requires_grad_(True)
        self.held["inputs"].setdefault(buffer_id, {})[transfer] = t
        self._note()

    def _exec_forward_pass(self, buffer_id):
        held = self.held["inputs"][buffer_id]
        inputs = [held["x"]] if self.is_first_stage() else self.boundary.inputs(self.incoming, [held[n] for n in self.incoming])
        taps = {self.graph.src_layer(self.graph.by_name[n]) for n in self.outgoing}
        with self.split.saving(buffer_id) if self.split else contextlib.nullcontext(), self._saved_bytes(buffer_id):
            if self.recompute:   # keeps only the inputs; the forward reruns in backward
                order = sorted(taps)

                def run(*xs):
                    last, got = self.module(*xs, taps=taps)
                    return last, tuple(got[t] for t in order)
                out, values = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=False)
                tapped = dict(zip(order, values))
            else:
                out, tapped = self.module(*inputs, taps=taps)
        self.held["outputs"][buffer_id] = {n: self.boundary.output(n, tapped[self.graph.src_layer(self.graph.by_name[n])])
                                           for n in self.outgoing}
        if self.is_last_stage():
            # this device's rows' share of the micro-batch loss, in fp32 from the upcast output;
            # DeepSpeedEngine.backward divides by gradient_accumulation_steps, so gradients are those of
            # the global mean loss
            if self.dtype != torch.float32:
                out = tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()
            loss = self.module.loss_fn(out, self.held["labels"][buffer_id]) * self.loss_weight
            self.held["losses"][buffer_id] = loss
            self.total_loss = loss.detach() if self.total_loss is None else self.total_loss + loss.detach()
        self._note()

    def _saved_bytes(self, m: int):
        """--memory-stats only (a measurement): the bytes of the distinct tensors autograd saves for micro-batch
        ``m``'s backward, the parameters' storages left out (a recomputing stage's checkpoint saves none of
        its own: it keeps the inputs, which the engine holds in every mode, and reruns the forward)."""
        if self.saved is None:
            return contextlib.nullcontext()
        seen: dict = {}
        # not activations: the parameters' storages, by identity (zero 3 frees and reallocates their memory,
        # so its address changes; the storage object stays)
        params = {p.untyped_storage()._cdata for p in self.module.parameters()}

        def pack(t):
            if t.device.type != "meta" and (st := t.untyped_storage())._cdata not in params:
                seen[(st.data_ptr(), t.dtype)] = st.nbytes()
            return t

        self.saved[m] = seen
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def memory_report(self) -> dict:
        """``stats`` with what this rank holds (for --memory-stats): its parameters, gradient buckets, fp32
        masters kept apart from the parameters, optimizer state, and the peak of autograd's saved bytes
        over the micro-batches in flight."""
        def nbytes(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        opt = [v for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        self.stats.update(
            parameter_bytes=nbytes(p for p in self.module.parameters()),
            gradient_bytes=self.grads.held_bytes(),
            master_bytes=nbytes(f.master for f in self.regime.separate),
            optimizer_state_bytes=nbytes(opt))
        self.stats.update(self.zero3.report())   # zero = 3: the most parameter bytes held, gathers per layer
        return self.stats

    def _note_saved(self, m: int) -> None:
        if self.saved is not None:
            live = sum(sum(d.values()) for d in self.saved.values())
            self.stats["peak_saved_activation_bytes"] = max(self.stats.get("peak_saved_activation_bytes", 0), live)
            self.saved.pop(m, None)

    def attach_nic(self, nic) -> None:
        """Run the sends the host's NIC order lists through ``nic`` (a ``nicorder.NicOrder``); what each
        transfer direction puts on the host link per micro-batch is worked out once, here."""
        self.nic = nic
        self.nic_bytes = {key: ex.wire_bytes(self.plan.cluster.host_of) for key, ex in self.executors.items()
                          if ex.is_sender}

    def _send(self, transfer: str, direction: Direction, m: int, tensor) -> None:
        """Start one transfer direction's sends of micro-batch ``m``: at once, or, when the host's NIC
        order lists it, by the NIC thread at its turn (the compute thread never waits for either)."""
        if (transfer, direction) in self.local:   # to this rank's other stage: nothing leaves the rank
            self.local_box.put(transfer, direction, m, tensor)
            return
        ex = self.executors[(transfer, direction)]
        what = f"send {transfer} {direction} m{m}"
        if self.nic is not None and self.nic.gated(transfer, str(direction), m):
            self.sends.add(m, [self.nic.submit(transfer, str(direction), m, lambda: ex.send(tensor, micro_batch=m),
                                               self.nic_bytes[(transfer, direction)])], what)
        else:
            self.sends.add(m, ex.send(tensor, micro_batch=m), what)

    def _exec_send_activations(self, buffer_id, transfer):
        out = self.held["outputs"][buffer_id][transfer]
        self._send(transfer, Direction.FORWARD, buffer_id, out.detach())
        self._note()

    def _exec_recv_grads(self, buffer_id, transfer):
        g = self._take(transfer, Direction.BACKWARD, buffer_id)
        self.held["grads"].setdefault(buffer_id, {})[transfer] = g
        self._note()

    def _exec_backward_pass(self, buffer_id):
        if self.split is None:
            self.grads.arm(last=buffer_id == self.last_backward)   # last: reduce buckets as they fill (zero 2: each)
        if self.is_last_stage():
            # DeepSpeedEngine.backward (PipelineEngine.backward raises): loss / gradient_accumulation_steps
            self.loss = self.held["losses"][buffer_id]
            scale = self.regime.loss_scale    # fp16's dynamic loss scale (1 otherwise)
            loss = self.loss * scale if scale != 1.0 else self.loss
            if self.split is None:
                DeepSpeedEngine.backward(self, loss)
                tensors = None
            else:
                tensors, sums = [loss / self.gradient_accumulation_steps()], None
        else:
            # one output may feed several transfers (a skip and the main path): its gradients summed; an output
            # that needs no gradient (the stage's input sent on as a skip) skipped
            outs, grads = self.held["outputs"][buffer_id], self.held["grads"][buffer_id]
            tensors, sums = distinct_outputs([outs[n] for n in self.outgoing], [grads[n] for n in self.outgoing])
        if tensors is not None:
            self._running_engine_backward = True
            try:
                if self.split is not None:   # B: the input gradients only, what W needs kept
                    inputs = [t for t in self.held["inputs"][buffer_id].values() if t.requires_grad]
                    self.split.backward_input(buffer_id, tensors, sums, inputs)
                elif tensors:
                    torch.autograd.backward(tensors, sums)
            finally:
                self._running_engine_backward = False
        self._note_saved(buffer_id)   # (--memory-stats) the peak counted before this micro-batch's is freed
        self._drop(buffer_id, "outputs", "grads", "losses", "labels")
        if self.is_first_stage():
            self._drop(buffer_id, "inputs")
        self._note()

    def _exec_weight_pass(self, buffer_id):
        """W: the weight gradients of micro-batch ``buffer_id`` from what its B kept (bwsplit.py)."""
        self.grads.arm(last=buffer_id == self.last_backward)   # the parameters' gradients arrive now
        self._running_engine_backward = True
        try:
            self.split.backward_weight(buffer_id)
        finally:
            self._running_engine_backward = False

    def _exec_send_grads(self, buffer_id, transfer):
        t = self.held["inputs"][buffer_id][transfer]
        g = t.grad if t.grad is not None else torch.zeros_like(t)
        self._send(transfer, Direction.BACKWARD, buffer_id, g)
        sent = self.held["grads_sent"].setdefault(buffer_id, set())
        sent.add(transfer)
        if len(sent) == len(self.incoming):   # every input's gradient sent (in the list's order)
            self._drop(buffer_id, "inputs", "grads_sent")
        self._note()

    def _exec_reduce_grads(self):
        """Every gradient bucket reduced by the plan's program (most already while the last backward
        ran, see grads.py); a sum: gradients are already those of the global mean loss."""
        self.sends.drain()
        self.zero3.end_step()   # zero = 3: every gather done, every layer freed before the optimizer step
        if any(self.held.values()):
            left = {k: sorted(v) for k, v in self.held.items() if v}
            raise EngineError(f"rank {self.rank}: micro-batch buffers still held after the schedule: {left}")
        params = [p for p in self.module.parameters() if p.requires_grad]
        # buckets released in the last backward, the rest now, all waited for (zero = 1: flags summed over data)
        self.grads.finish(flags_group=self.grid.get_data_parallel_group() if self.regime.sharded else None)
        self.tied.reduce()   # every tied gradient summed over the stages holding it (their planned programs)
        if self.deepspeed_reduce:
            # DeepSpeed averages over the data group; our gradients are partial sums
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.reduce_size)
            PipelineEngine._exec_reduce_grads(self)

    def _exec_optimizer_step(self):
        """The plan's optimizer step (regime.py), and DeepSpeed's step counters (kept in checkpoints)."""
        self.step_report = self.regime.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.skipped_steps += int(self.step_report["skipped"])

    def _peers(self, instruction: str, transfer: str | None) -> list[int]:
        """The ranks an instruction exchanges data with: where a failure came from."""
        if transfer is not None:
            direction = Direction.BACKWARD if instruction in ("RecvGrad", "SendGrad") else Direction.FORWARD
            ex = self.executors.get((transfer, direction))
            return ex.peers() if ex is not None else []
        if instruction == "ReduceGrads":
            red = self.plan.gradient_reduction(self.rank, self.stage_id)
            return [d for d in (red.group_of(self.rank) if red else ()) if d != self.rank]
        return []

    # ---- driver
    def _train_schedule(self):
        return PlanSchedule(self.rank_class, self.micro_batches, self.num_stages, self.stage_id,
                            {self.stage_id} if self.is_first_stage() or self.is_last_stage() else set())

    def train_batch(self, data_iter=None) -> float:
        """One iteration of the plan's schedule; this rank's share of the step's mean loss (``loss_share``)."""
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.begin_step()
        self.recvs.start_step()
        if self.nic is not None:
            self.nic.begin_step()
        self._exec_schedule(self._train_schedule())
        return self.loss_share()

    def begin_step(self) -> None:
        """This stage's part of a step's start: training mode, no loss yet, gradient buckets attached."""
        self.module.train()
        self.total_loss = None
        self.grads.attach()
        self.tied.attach()

    def loss_share(self) -> float:
        """This stage's share of the step's mean loss, non-zero on ``train.loss_devices`` (summed over the world)."""
        counted = self.counts_loss and self.total_loss is not None
        return float(self.total_loss) / self.micro_batches if counted else 0.0

    def plan_named_parameters(self):
        """``layers.<global index>.<name>`` -> CPU tensor (the single-process model's names): the fp32 master
        in bf16/fp16 plans (zero = 1: all-gathered, so collective over the data group), else the parameter."""
        masters = self.regime.whole_masters()
        return OrderedDict((f"layers.{k}", masters.get(id(v), v).detach().cpu())
                           for k, v in self.module.named_parameters(remove_duplicate=False))


PlanEngine._INSTRUCTION_MAP = {cls: _named(cls.__name__, fn) for cls, fn in {
    BeginOp: PlanEngine._exec_begin_op,
    ds_schedule.LoadMicroBatch: PlanEngine._exec_load_micro_batch,
    ds_schedule.RecvActivation: PlanEngine._exec_recv_activations,
    ds_schedule.ForwardPass: PlanEngine._exec_forward_pass,
    ds_schedule.SendActivation: PlanEngine._exec_send_activations,
    ds_schedule.RecvGrad: PlanEngine._exec_recv_grads,
    ds_schedule.BackwardPass: PlanEngine._exec_backward_pass,
    WeightPass: PlanEngine._exec_weight_pass,
    ds_schedule.SendGrad: PlanEngine._exec_send_grads,
    ds_schedule.ReduceGrads: PlanEngine._exec_reduce_grads,
    ds_schedule.OptimizerStep: PlanEngine._exec_optimizer_step,
}.items()}
