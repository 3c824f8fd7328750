"""A training run after start-up, in the parts ``main._main`` calls in order (the trainer / checkpoint
manager split of torchtitan; checkpoints: ``ckpt_manager``):

    build(plan, out_dir, groups, rank, clock) -> StageModel
        collective: DeepSpeed's communication backend (every rank), then this rank's stage of the model
        from the user's code, its shapes checked; every rank's problems gathered, all stop together
    Trainer(plan, model, groups, rank, out_dir, args)
        .build_engine(ds_config)      the PlanEngine (stage ranks), the host NIC order, the tracer
        .announce(threads_line)       collective: every stage's gradient reduction and device; rank 0 prints
        .train(first, steps, checkpoints, clock)   the steps: one world all-reduce each, rank 0's step lines,
                                      the checkpoint manager's saves
        .finish(clock)                --dump-params, --trace, --memory-stats, --profile-startup

The order of every collective is the one ``main`` always had; each function says which are collective.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import lazydynamo, nicorder
from .checkpoint import CountingIterator
from .dist_util import backend_device, collective_timeout, devices_line
from .dsops import preload_built_op
from .classrun import ClassRun, several_stages_unsupported
from .engine import EngineError, PlanEngine, check_stage_shapes
from .hf_vocab import loss_for as vocab_loss
from .regime import cast_stage, param_dtype
from .share import Peak, build_stage
from .tensor_parallel import context_from_plan, shard_info
from .trace import Tracer
from .usercode import (MissingFunction, accepts_tensor_parallel, builtin_function, data_arguments, hf_builder, is_hf,
                       load_callable)
from .usererrors import CheckedLoss, ids_in_vocabulary, non_finite_loss, user_step, vocabulary_of


def load_function(out_dir: str, ref, what: str = "function"):
    """A code reference of plan.json ``train`` (``planfile.CodeRef``), from the output folder; a missing
    file or function is an EngineError that names it (``what``: the plan's word for it, e.g. ``loss``)."""
    try:   # a builtin: one of the runtime's own (plan.json {"builtin": NAME})
        return (builtin_function(ref.function) if getattr(ref, "builtin", False)
                else load_callable(os.path.join(out_dir, ref.file), ref.function))
    except (FileNotFoundError, MissingFunction) as e:
        raise EngineError(f"the plan's {what} {ref.file}:{ref.function}: {e}") from None


def fail_together(problems: list[str], headline: str = "the plan cannot train") -> None:
    """All ranks learn every rank's problems and stop with the same message (collective)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    every = [p for ps in gathered for p in ps]
    if every:
        error = EngineError(f"{headline}:\n  " + "\n  ".join(dict.fromkeys(every)))
        error.same_on_every_rank = True   # gathered from all ranks: rank 0 says it for everyone
        raise error


def dump_params(engines, directory: str, rank: int) -> None:
    """DIR/rank<R>.pt: name -> tensor; DIR/rank<R>.shards.json: name -> [dim, index, parts, blocks]
    for each tensor-parallel shard (replicated parameters are not listed), and a fifth entry, the real
    length of the split dimension, for a padded one (a vocabulary table: its padding rows are dumped).
    ``engines``: the rank's (one per stage it runs)."""
    os.makedirs(directory, exist_ok=True)
    torch.save({k: v for e in engines for k, v in e.plan_named_parameters().items()},
               os.path.join(directory, f"rank{rank}.pt"))
    shards = {f"layers.{k}": list(info) + ([p.planc_shard_size] if hasattr(p, "planc_shard_size") else [])
              for e in engines for k, p in e.module.named_parameters() if (info := shard_info(p)) is not None}
    with open(os.path.join(directory, f"rank{rank}.shards.json"), "w") as f:
        json.dump(shards, f, indent=1, sort_keys=True)


def gradient_summary(described: list) -> str:
    """Every stage's gradient reduction in one line, from each rank's ``(stage, description)`` (None: idle),
    the first rank of a stage speaking for it: ``DESCRIPTION (stages 0, 2); OTHER (stage 1)``."""
    by_stage: dict[int, str] = {}
    for d in described:
        if d is not None:
            by_stage.setdefault(d[0], d[1])
    groups: dict[str, list[int]] = {}
    for s in sorted(by_stage):
        groups.setdefault(by_stage[s], []).append(s)
    return "; ".join(f"{text} (stage{'s' if len(ss) > 1 else ''} {', '.join(map(str, ss))})"
                     for text, ss in groups.items()) or "no stage trains"


def step_vector(share: float, engine, reports: bool, device) -> torch.Tensor:
    """This rank's part of the step's one world all-reduce: [loss share, lr, gradient norm (-1: not
    computed), loss scale used, skipped, next loss scale]; only the reporter adds the figures every stage
    rank shares (one of them: ``reports``)."""
    out = torch.zeros(6, dtype=torch.float64, device=device)
    out[0] = share
    if reports:
        r = engine.step_report
        out[1] = r["lr"]
        out[2] = r["norm"].to(out) if r["norm"] is not None else -1.0
        out[3] = r["scale"]
        out[4] = float(r["skipped"])
        out[5] = r["next_scale"]
    return out


# ---------------------------------------------------------------- build

@dataclass
class StageModel:
    """This rank's share of the model as built from the user's code (an idle rank: ``stage`` None and
    nothing else)."""
    stage: object = None
    layers: list | None = None          # every layer (those of other stages unbuilt or empty)
    loss_fn: CheckedLoss | None = None
    batches: object = None              # the user's data function
    initial: object = None              # the stage's fp32 weights before the cast (bf16/fp16), or None
    build_stats: dict | None = None     # the build's resident peak (share.Peak.report)
    peak: Peak | None = field(default=None, repr=False)
    more: list = field(default_factory=list)   # the rank's other stages (a mesh several stages share): theirs


def build(plan, out_dir: str, groups: dict, rank: int, clock, args=None) -> StageModel:
    """Collective: DeepSpeed's communication backend, then this rank's stage of the model; every rank's
    problems gathered (``fail_together``)."""
    if not plan.train.trainable:   # decided by the compiler; the same on every rank
        error = EngineError("the plan cannot train (planc compile said why):\n  "
                            + "\n  ".join(plan.train.not_trainable_because) + "\nrun it with --comm-only")
        error.same_on_every_rank = True
        raise error
    # DeepSpeed's communication backend starts collectively (its shared-memory ops wait for every
    # local rank), so idle ranks start it too, though they build no engine
    import deepspeed
    preload_built_op()   # DeepSpeed's built CPU op without its build lock (dsops.py)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False,
                               timeout=collective_timeout(plan))
    clock.mark("deepspeed init")
    stages = plan.stages_of(rank)
    model = StageModel(stages[0] if stages else None, more=[StageModel(st) for st in stages[1:]])
    problems = []
    for m in [model] + model.more if model.stage is not None else []:
        problems += _build_stage(m, plan, out_dir, groups, rank)
    if model.more:
        problems += several_stages_unsupported(plan, rank, args)
    fail_together(problems)
    clock.mark("model build")
    return model


def _build_stage(model: StageModel, plan, out_dir: str, groups: dict, rank: int) -> list[str]:
    """The stage's layers built, cast and shape-checked into ``model``; what needs the real world is checked
    before DeepSpeed builds anything. Returns this rank's problems (gathered by the caller)."""
    t, stage = plan.train, model.stage
    model_args, seed, micro_batch = dict(t.model.args), t.seed, t.micro_batch
    try:   # every user function before anything is built: a typo in one is one message, all ranks stop
        builder, loss_fn, batches = (hf_builder(out_dir, t, EngineError) if is_hf(ref) else load_function(out_dir, ref, k)
                                     for k, ref in (("model", t.model), ("loss", t.loss), ("data", t.data)))
    except EngineError as e:
        return [str(e)]
    # its calls counted and checked: a failure names the micro-batch (usererrors.CheckedLoss)
    model.loss_fn, model.batches = CheckedLoss(loss_fn, [out_dir], t.micro_batches), batches
    tp = None
    if accepts_tensor_parallel(builder):
        try:
            tp = context_from_plan(plan, groups, rank)
        except (ValueError, KeyError) as e:
            raise EngineError(f"rank {rank}: {e.args[0] if e.args else e}") from None
    torch.manual_seed(seed)   # a builder without `stage_layers` builds every layer alike; the rank keeps its stage's
    try:
        model.peak = Peak()
        model.layers = layers = build_stage(builder, model_args, tp, plan, stage)
        model.loss_fn.fn = vocab_loss(layers, model.loss_fn.fn, builtin=bool(getattr(t.loss, "builtin", False)))
    except ValueError as e:
        if tp is None:
            raise
        raise EngineError(f"rank {rank}: the model cannot be split over its tensor group of {tp.size}: "
                          f"{e}") from None
    lo, hi = stage.layers
    model.initial = cast_stage(layers[lo:hi], t.precision)   # bf16/fp16: the stage's layers in it
    model.build_stats = model.peak.report()   # the build's resident peak (before the shape check's forward)
    try:
        x, _ = next(batches(micro_batch, seed, **data_arguments(t)))
        a, b = stage.rows_of(rank)
        x = x[a:b]
        if x.is_floating_point():   # float inputs enter stage 0 in the plan's precision
            x = x.to(param_dtype(t.precision))
        return check_stage_shapes(plan, rank, layers[lo:hi], x, stage=stage)
    except (EngineError, ValueError, KeyError) as e:
        return [f"rank {rank}: {e}"]


# ---------------------------------------------------------------- the engine and the steps

class Trainer:
    """The steps of a training run on this rank (an idle rank: no engine, it adds nothing to the loss)."""

    def __init__(self, plan, model: StageModel, groups: dict, rank: int, out_dir: str, args):
        self.plan, self.model, self.groups, self.rank = plan, model, groups, rank
        self.out_dir, self.args = out_dir, args
        self.stage = model.stage
        self.engine = self.data = self.device = None
        self.engines: dict = {}   # stage -> its PlanEngine (several where the rank runs several stages)
        self.run = None           # what runs a step: the engine, or a ClassRun of the rank's engines
        self.tracer = Tracer(rank, self.stage.index if self.stage is not None else None) if args.trace else None

    def build_engine(self, ds_config: dict) -> None:
        """The stage's PlanEngine and its data, and the host NIC order (gloo: its counters are collective)."""
        plan, rank, stage, model, tracer = self.plan, self.rank, self.stage, self.model, self.tracer
        # gloo only: NCCL keeps its own stream order per communicator, which sends from a second thread
        # could break (docs/runtime.md, "The host NIC order")
        use_nic = dist.get_backend() == "gloo"
        counter = nicorder.open_counters(plan, rank) if use_nic else None   # collective
        hold_rate = nicorder.host_bandwidth(plan)     # bytes/s a NIC turn is held for: the compiled host link
        if stage is not None:
            t = plan.train
            drawn = model.batches(t.micro_batch, t.seed, **data_arguments(t))
            vocab = vocabulary_of(t.model)
            if vocab is not None and stage.index == min(s.index for s in plan.stages):   # where the ids enter the model
                drawn = ids_in_vocabulary(drawn, vocab, t.micro_batches)
            self.data = CountingIterator(drawn)   # counted: the position a checkpoint keeps
            if t.recomputes(stage.index):   # torch.utils.checkpoint reads torch._dynamo.config: now, not in step 0
                lazydynamo.load()
            self.engine = engine = PlanEngine.build(plan, self.groups, model.layers, model.loss_fn, self.data,
                                                    ds_config, tracer=tracer, initial=model.initial, stage=stage)
            self.engines = {stage.index: engine}
            for other in model.more:   # the rank's other stages: each its own engine, its own draw of the data
                other_data = CountingIterator(other.batches(t.micro_batch, t.seed, **data_arguments(t)))
                self.engines[other.stage.index] = PlanEngine.build(
                    plan, self.groups, other.layers, other.loss_fn, other_data, ds_config, tracer=tracer,
                    initial=other.initial, stage=other.stage)
                other.initial = None
            self.run = ClassRun(self.engines, plan, rank, tracer) if model.more else engine
            if self.args.memory_stats:   # training's resident peak counted from here (share.Peak)
                engine.saved, model.peak = {}, Peak()
            model.initial = None
            host = plan.cluster.host_of(rank)
            order = plan.pipeline.nic_order_of(host)
            if counter is not None and any(k[0] == rank for k in order):
                timeout = collective_timeout(plan).total_seconds()
                self.run.attach_nic(nicorder.NicOrder(rank, host, order, counter, timeout, hold_rate, tracer=tracer,
                                                    drain=plan.runtime.nic_drain))
        if rank == 0 and counter is not None:
            held = (f"each turn held for its bytes at {hold_rate / 1e6:g} MB/s, the host link the plan was compiled "
                    f"for (on faster links: recompile for them)") if hold_rate else "no hold"
            print(f"host NIC order: {sum(len(k) for _, k in plan.pipeline.nic_order)} cross-host sends per step, "
                  f"one at a time per host in the plan's order; {held}", flush=True)

    def announce(self, threads_line: str | None) -> None:
        """Collective: every stage's gradient reduction, every rank's backend and device; rank 0 prints them."""
        engine, rank = self.engine, self.rank
        self.device = engine.device if engine is not None else backend_device()   # an idle rank's: its backend's
        described = [None] * dist.get_world_size()
        dist.all_gather_object(described, ([(s, e.reduce_description) for s, e in self.engines.items()],
                                           f"{dist.get_backend()} {self.device}"))
        if rank == 0:
            if threads_line:
                print(threads_line, flush=True)
            stages = [d for ds, _ in described for d in ds] or [None]
            print(f"gradients: {gradient_summary(stages)}\n{devices_line(described)}", flush=True)

    def train(self, first: int, steps: int, checkpoints, clock) -> None:
        """Steps ``first`` to ``steps``: each one world all-reduce of the step's figures, rank 0's line, then
        ``checkpoints.after_step`` (collective when it saves)."""
        plan, rank, engine, stage, tracer = self.plan, self.rank, self.engine, self.stage, self.tracer
        loss_fn, data = self.model.loss_fn, self.data
        samples = plan.train.micro_batch * plan.train.micro_batches
        reporter = min(d for st in plan.stages for d in st.devices)   # every stage rank knows the step's figures
        fp16 = str(plan.train.precision) == "fp16"
        total = 0.0
        if rank == 0 and first >= steps:
            print(f"the checkpoint is at step {first}: nothing left to train for --steps {steps}", flush=True)
        for step in range(first, steps):
            t0 = time.perf_counter()
            t0_trace = tracer.now() if tracer is not None else 0.0
            if engine is not None:   # a failure of the user's code: one line naming where (usererrors.user_step)
                lo, hi = stage.layers
                loss_fn.new_step()
                with user_step(step, stage.index, self.model.layers[lo:hi], lo, [self.out_dir],
                               data_drawn=lambda: data.drawn):
                    share = self.run.train_batch()
            else:
                share = 0.0   # idle ranks only add nothing
            report = step_vector(share, engine, rank == reporter, self.device)
            try:
                # the loss devices' shares add up to the step's mean loss; the reporter adds the step's rate,
                # gradient norm, loss scale and whether it was skipped (the same on every stage rank)
                dist.all_reduce(report)
            except RuntimeError as e:
                raise EngineError(f"rank {rank} failed in the step {step} loss all-reduce over every rank: "
                                  f"{str(e).splitlines()[0]}") from e
            loss, lr, norm, scale, skipped, next_scale = report.tolist()
            # every rank sees it and they name the micro-batch together; an fp16 step skipped for overflow is not
            # the user's (its loss scale halves and the next step goes on)
            if not math.isfinite(loss) and not skipped:
                raise non_finite_loss(step, loss, rank, stage.index if stage is not None else None,
                                      loss_fn if engine is not None else None)
            elapsed = time.perf_counter() - t0
            if tracer is not None:
                tracer.complete(f"step {step}", t0_trace, tracer.now(), "main", step=step)
            total += elapsed
            clock.mark("first step")
            if rank == 0:
                print(f"step {step} loss {loss:.6f} time {elapsed:.4f} s {samples / elapsed:.1f} samples/s"
                      f" lr {lr:.6g}" + (f" grad_norm {norm:.6g}" if norm != -1.0 else "")
                      + (f" loss_scale {scale:.12g}" if fp16 else ""), flush=True)
                if skipped:   # with the scale the next step uses
                    print(f"step {step} skipped: overflow, loss scale {next_scale:.12g}", flush=True)
            checkpoints.after_step(step, steps, engine, data)
        trained = steps - first
        if rank == 0 and trained > 0:
            print(f"trained {trained} step(s) in {total:.3f} s: {trained * samples / total:.1f} samples/s", flush=True)

    def finish(self, clock) -> None:
        """What the run writes after its last step; ``--profile-startup`` gathers (collective)."""
        from .startup import profile_table, rank_line
        args, engine, rank, model = self.args, self.engine, self.rank, self.model
        if engine is not None and args.dump_params:
            dump_params(list(self.engines.values()), args.dump_params, rank)
        if self.tracer is not None:
            self.tracer.dump(args.trace)
        if engine is not None and args.memory_stats:
            os.makedirs(args.memory_stats, exist_ok=True)
            report = engine.memory_report()
            for other in list(self.engines.values())[1:]:   # the rank's other stages: their bytes added
                theirs = other.memory_report()
                report = {k: (v + theirs.get(k, 0) if isinstance(v, (int, float)) and k != "stage" else v)
                          for k, v in report.items()}
            with open(os.path.join(args.memory_stats, f"rank{rank}.json"), "w") as f:
                json.dump(dict(report, build=model.build_stats, rss_after_build=model.peak.base,
                               rss_training_peak=model.peak.hwm()), f, sort_keys=True)
        if args.profile_startup:   # after the last step: the gather changes nothing the steps did
            print(rank_line(rank, clock.record()), flush=True)
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, clock.record())
            if rank == 0:
                print(profile_table(records), flush=True)
