"""The pipeline engine: runs a plan's per-stage instruction lists.

It executes DeepSpeed's pipeline instruction classes
(``deepspeed.runtime.pipe.schedule``: LoadMicroBatch, RecvActivation,
ForwardPass, SendActivation, RecvGrad, BackwardPass, SendGrad, ReduceGrads,
OptimizerStep) through its own ``_INSTRUCTION_MAP``, with the plan's
transfers (cross-mesh resharding, skips included) in place of DeepSpeed's
neighbour-only p2p and the plan's reduction program in place of DeepSpeed's
data-parallel all-reduce. Why this is not a ``PipelineEngine`` subclass is
written down in docs/runtime-engine.md.

Stage dataflow convention: a stage's first layer receives the stage's
incoming transfers as positional arguments, in transfer declaration order
(stage 0: the batch input); a layer returning a tuple hands it to the next
layer as positional arguments; a transfer ``from stage I layer L`` sends the
output of layer ``L`` (default: the stage's last layer).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from types import MethodType

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from .plan import PlanError, mesh_devices, mesh_position, mesh_shape, stage_layout, stage_of
from .regions import Layout, intersect, parse_spec, to_local

__all__ = ["StageGraph", "StageModule", "PlanSchedule", "PlanEngine", "EngineError",
           "run_reference", "build_optimizer", "DTYPES"]

DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
          "u8": torch.uint8, "bool": torch.bool}


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


class StageModule(torch.nn.Module):
    """The layers of one stage; parameters are named ``layers.<global index>.<name>``."""

    def __init__(self, layers, first: int):
        super().__init__()
        self.first = first
        self.layers = torch.nn.ModuleDict({str(first + i): l for i, l in enumerate(layers)})

    def forward(self, *inputs, taps=()):
        return apply_layers(list(self.layers.values()), self.first, inputs, taps)


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


# ---------------------------------------------------------------- transfers

def _executor_classes():
    """The planned executors (reshard.py, reduce.py) when present; else the built-in ones."""
    if os.environ.get("PLANC_EXECUTORS") == "builtin":
        return None, None
    try:
        from .reshard import TransferExecutor
    except ImportError:
        TransferExecutor = None
    try:
        from .reduce import ReductionExecutor
    except ImportError:
        ReductionExecutor = None
    return TransferExecutor, ReductionExecutor


class _RegionTransfer:
    """Built-in cross-mesh transfer by point-to-point messages.

    Every receiver gets each piece of its region from one holder, chosen round
    robin over the holders of that piece; sends are isend (buffered), receives
    block. ``direction="backward"`` moves gradients from the destination
    layout back to every source holder.
    """

    def __init__(self, transfer: dict, plan: dict, rank: int, direction: str, tag: int):
        src = stage_layout(plan, transfer["src"]["stage"])
        dst = stage_layout(plan, transfer["dst"]["stage"])
        shape = transfer["shape"]
        a = Layout(shape, src["mesh"], transfer["src"]["spec"], src.get("mesh_axes"))
        b = Layout(shape, dst["mesh"], transfer["dst"]["spec"], dst.get("mesh_axes"))
        if direction == "backward":
            a, b = b, a
        self.rank, self.tag, self.dtype = rank, tag, DTYPES[transfer["dtype"]]
        self.mine_src, self.mine_dst = a.region(rank), b.region(rank)
        self.sends, self.recvs = [], []
        holders: dict = {}
        for d in a.devices:
            holders.setdefault(a.region(d), []).append(d)
        for r in b.devices:
            want = b.region(r)
            for reg, hs in holders.items():
                piece = intersect(reg, want)
                if piece is None:
                    continue
                k = sorted(x for x in b.devices if b.region(x) == want).index(r)
                sender = hs[k % len(hs)]
                if sender == rank:
                    self.sends.append((r, piece))
                if r == rank:
                    self.recvs.append((sender, piece))
        self.local_shape = None if self.mine_dst is None else tuple(y - x for x, y in self.mine_dst)

    def send(self, local, micro_batch=0):
        works = []
        for r, piece in self.sends:
            buf = local[to_local(piece, self.mine_src)].contiguous()
            works.append((dist.isend(buf, r, tag=self.tag), buf))
        return works

    def recv(self, micro_batch=0):
        out = torch.empty(self.local_shape, dtype=self.dtype)
        pending = []
        for sender, piece in self.recvs:
            buf = torch.empty(tuple(y - x for x, y in piece), dtype=self.dtype)
            pending.append((dist.irecv(buf, sender, tag=self.tag), buf, piece))
        for work, buf, piece in pending:
            work.wait()
            out[to_local(piece, self.mine_dst)] = buf
        return out


class _ProgramReduction:
    """Built-in executor of a lowered reduction program (DESIGN.md semantics), by all_reduce.

    Each device tracks the interval of the flat buffer it holds; reduce_scatter
    and all_gather are realized with all_reduce on the interval, which gloo
    supports everywhere.
    """

    def __init__(self, reduction: dict, groups: dict, rank: int):
        self.steps = []
        for step in reduction["program"]["steps"]:
            for members in step["groups"]:
                if rank in members:
                    key = tuple(sorted(members))
                    self.steps.append((step["collective"], key, groups[key]))

    def run(self, flat):
        lo, hi = 0, flat.numel()
        for coll, members, pg in self.steps:
            k, r = len(members), members.index(dist.get_rank())
            if coll == "allreduce":
                dist.all_reduce(flat[lo:hi], group=pg)
            elif coll == "reduce_scatter":
                dist.all_reduce(flat[lo:hi], group=pg)
                bounds = [lo + (hi - lo) * i // k for i in range(k + 1)]
                lo, hi = bounds[r], bounds[r + 1]
            elif coll == "all_gather":
                n = (hi - lo) * k
                start = lo - r * (hi - lo)
                piece = flat[lo:hi].clone()
                flat[start:start + n] = 0
                flat[lo:hi] = piece
                dist.all_reduce(flat[start:start + n], group=pg)
                lo, hi = start, start + n
            elif coll == "reduce":
                dist.reduce(flat[lo:hi], dst=members[0], group=pg)
            elif coll == "broadcast":
                dist.broadcast(flat[lo:hi], src=members[0], group=pg)
            else:
                raise EngineError(f"unknown collective {coll!r}")
        return flat


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


class PlanEngine:
    """One rank's share of a pipeline: its stage's layers, transfers and reduction."""

    def __init__(self, plan, groups, rank, layers, loss_fn, data_iter, ds_config, device=None):
        self.plan, self.groups, self.rank = plan, groups, rank
        self.device = device or torch.device("cpu")
        self.graph = StageGraph(plan)
        self.graph.check()
        self.stage_id = stage_of(plan, rank)
        if self.stage_id is None:
            raise EngineError(f"rank {rank} is in no stage")
        self.num_stages = self.graph.num_stages
        pipe = plan["pipeline"]
        self.micro_batches = int(pipe["micro_batches"])
        self.ops = pipe["per_stage"][self.stage_id]
        self.first, self.stop = self.graph.layers(self.stage_id)
        self.module = StageModule(layers, self.first).to(self.device)
        self.loss_fn, self.data_iter = loss_fn, data_iter
        self.incoming = self.graph.incoming(self.stage_id)
        self.outgoing = self.graph.outgoing(self.stage_id)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.num_stages - 1
        for t in self.graph.transfers:
            problem = trainable_spec_problem(plan, t)
            if problem:
                raise EngineError(problem)
        TE, RE = _executor_classes()
        self.executors = {}
        for i, t in enumerate(self.graph.transfers):
            for direction in ("forward", "backward"):
                if t["name"] in self.incoming + self.outgoing:
                    ex = (TE(t, plan, groups, rank, direction, index=i, device=self.device) if TE
                          else _RegionTransfer(t, plan, rank, direction, tag=2 * i + (direction == "backward")))
                    self.executors[(t["name"], direction)] = ex
        self.reduction = None
        self.dp_size = 1
        red = next((r for r in plan.get("reductions", ()) if r["name"] == "gradients"), None)
        if red is not None and any(rank in g for g in red["groups"]):
            self.reduction = RE(red, groups, rank) if RE else _ProgramReduction(red, groups, rank)
            self.dp_size = len(next(g for g in red["groups"] if rank in g))
        self.optimizer = build_optimizer(self.module.parameters(), ds_config)
        self.buffers = {}
        self.pending_sends = []
        self.total_loss = 0.0

    _INSTRUCTION_MAP = {}   # filled below the class body: instruction type -> method

    # ---- instructions
    def _exec_load_micro_batch(self, buffer_id):
        x, y = next(self.data_iter)
        a, b, _ = data_slice(self.plan, self.stage_id, self.rank, x.shape[0])
        buf = self.buffers.setdefault(buffer_id, {})
        buf["x"], buf["y"] = x[a:b].to(self.device), y[a:b].to(self.device)

    def _exec_recv_activations(self, buffer_id, transfer):
        t = self.executors[(transfer, "forward")].recv(micro_batch=buffer_id).to(self.device)
        if t.is_floating_point():
            t.requires_grad_(True)
        self.buffers.setdefault(buffer_id, {}).setdefault("in", {})[transfer] = t

    def _exec_forward_pass(self, buffer_id):
        buf = self.buffers.setdefault(buffer_id, {})
        inputs = [buf["x"]] if self.is_first_stage else [buf["in"][n] for n in self.incoming]
        taps = {self.graph.src_layer(self.graph.by_name[n]) for n in self.outgoing}
        out, tapped = self.module(*inputs, taps=taps)
        buf["out"] = {n: tapped[self.graph.src_layer(self.graph.by_name[n])] for n in self.outgoing}
        if self.is_last_stage:
            buf["loss"] = self.loss_fn(out, buf["y"]) / self.micro_batches
            self.total_loss += float(buf["loss"].detach())

    def _exec_send_activations(self, buffer_id, transfer):
        out = self.buffers[buffer_id]["out"][transfer]
        self.pending_sends.append(self.executors[(transfer, "forward")].send(out.detach(), micro_batch=buffer_id))

    def _exec_recv_grads(self, buffer_id, transfer):
        g = self.executors[(transfer, "backward")].recv(micro_batch=buffer_id).to(self.device)
        self.buffers[buffer_id].setdefault("grad", {})[transfer] = g

    def _exec_backward_pass(self, buffer_id):
        buf = self.buffers[buffer_id]
        if self.is_last_stage:
            buf["loss"].backward()
        else:
            # one output may feed several transfers (a skip and the main path): sum its gradients
            tensors, grads = [], []
            for n in self.outgoing:
                out, g = buf["out"][n], buf["grad"][n]
                for i, t in enumerate(tensors):
                    if t is out:
                        grads[i] = grads[i] + g
                        break
                else:
                    tensors.append(out)
                    grads.append(g)
            torch.autograd.backward(tensors, grads)
        buf.pop("out", None)
        buf.pop("grad", None)
        buf.pop("loss", None)

    def _exec_send_grads(self, buffer_id, transfer):
        t = self.buffers[buffer_id]["in"][transfer]
        g = t.grad if t.grad is not None else torch.zeros_like(t)
        self.pending_sends.append(self.executors[(transfer, "backward")].send(g, micro_batch=buffer_id))

    def _exec_reduce_grads(self):
        self._wait_sends()
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.reduction is None or not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = self.reduction.run(flat) / self.dp_size
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p).clone()
            off += n

    def _exec_optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _wait_sends(self):
        for works in self.pending_sends:
            for item in works or ():
                work = item[0] if isinstance(item, tuple) else item
                if work is not None and hasattr(work, "wait"):
                    work.wait()
        self.pending_sends = []

    # ---- driver
    def schedule(self):
        return PlanSchedule(self.ops, self.micro_batches, self.num_stages, self.stage_id,
                            self.incoming, self.outgoing, self.is_first_stage or self.is_last_stage)

    def train_batch(self) -> float:
        """One iteration; returns this rank's loss (the last stage's; 0.0 elsewhere)."""
        self.module.train()
        self.total_loss = 0.0
        self.buffers = {}
        for step_cmds in self.schedule():
            for cmd in step_cmds:
                if type(cmd) not in self._INSTRUCTION_MAP:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
                MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)
        self.buffers = {}
        return self.total_loss

    def check_shapes(self, sample_x) -> list[str]:
        """Start-up check: the tensors this stage produces against the declared transfer shapes.

        Runs the stage once without gradients on the declared input shapes
        (stage 0: a real micro-batch slice); local to the rank, no messages.
        """
        problems = []
        if self.is_first_stage:
            inputs = [sample_x.to(self.device)]
        else:
            inputs = []
            for n in self.incoming:
                t = self.graph.by_name[n]
                a, b, _ = data_slice(self.plan, self.stage_id, self.rank, t["shape"][0])
                inputs.append(torch.zeros((b - a,) + tuple(t["shape"][1:]), dtype=DTYPES[t["dtype"]],
                                          device=self.device))
        taps = {self.graph.src_layer(self.graph.by_name[n]) for n in self.outgoing}
        with torch.no_grad():
            try:
                _, tapped = self.module(*inputs, taps=taps)
            except Exception as e:  # noqa: BLE001 - reported with the stage
                return [f"stage {self.stage_id}: its layers fail on the declared inputs "
                        f"{[tuple(i.shape) for i in inputs]}: {e}"]
        for n in self.outgoing:
            t = self.graph.by_name[n]
            out = tapped[self.graph.src_layer(t)]
            if not torch.is_tensor(out):
                problems.append(f"stage {self.stage_id}, transfer {n!r}: layer {self.graph.src_layer(t)} "
                                f"returns {type(out).__name__}, not a tensor")
                continue
            _, _, dsize = data_slice(self.plan, self.stage_id, self.rank, t["shape"][0])
            real = (out.shape[0] * dsize,) + tuple(out.shape[1:])
            if real != tuple(t["shape"]):
                problems.append(f"stage {self.stage_id}, transfer {n!r}: declared shape {list(t['shape'])} "
                                f"but the stage produces {list(real)}")
            elif out.dtype != DTYPES[t["dtype"]]:
                problems.append(f"stage {self.stage_id}, transfer {n!r}: declared dtype {t['dtype']} "
                                f"but the stage produces {out.dtype}")
        return problems

    def named_parameters(self):
        return OrderedDict((k, v.detach().cpu()) for k, v in self.module.named_parameters())


PlanEngine._INSTRUCTION_MAP = {
    ds_schedule.LoadMicroBatch: PlanEngine._exec_load_micro_batch,
    ds_schedule.RecvActivation: PlanEngine._exec_recv_activations,
    ds_schedule.ForwardPass: PlanEngine._exec_forward_pass,
    ds_schedule.SendActivation: PlanEngine._exec_send_activations,
    ds_schedule.RecvGrad: PlanEngine._exec_recv_grads,
    ds_schedule.BackwardPass: PlanEngine._exec_backward_pass,
    ds_schedule.SendGrad: PlanEngine._exec_send_grads,
    ds_schedule.ReduceGrads: PlanEngine._exec_reduce_grads,
    ds_schedule.OptimizerStep: PlanEngine._exec_optimizer_step,
}
