"""Program entry of a compiled output: ``deepspeed OUT/train.py [--comm-only] [--steps N] [--save DIR]
[--resume DIR]``.

Reads OUT/plan.json (every decision of the compiler, the model, loss and data
functions and the training regime included) and OUT/ds_config.json (batch sizes for DeepSpeed),
initializes the process group, runs the start-up checks, builds the DeepSpeed pipeline engine
(``PlanEngine``, a ``PipelineEngine`` subclass) from the copied model file and
trains; rank 0 prints ``step N loss X ... lr L`` (docs/training.md). With ``--save DIR`` every rank checkpoints every
``train.save_every`` steps and at the end; ``--resume DIR`` continues from a checkpoint
(``checkpoint``; docs/runtime.md "Checkpoints").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from planc import plan as planfile

from . import checkpoint, lazydynamo, nicorder
from .commcheck import comm_only, contribution, pattern, plan_micro_batches  # noqa: F401 (re-exported)
from .checkpoint import CheckpointError, CountingIterator
from .dist_util import (GroupMissing, StartupError, backend_device, choose_backend, collective_timeout, devices_line,
                        init_distributed, limit_cpu_threads, startup_checks)
from .dsops import preload_built_op
from .engine import EngineError, PlanEngine, check_stage_shapes
from .failwatch import FailureWatch, report_failure
from planc.plan import PlanFileError
from .reduce import ReductionError
from .regime import cast_stage, param_dtype
from .startup import StartupClock, profile_table, rank_line
from .tensor_parallel import context_from_plan, shard_info
from .topology import create_groups
from .trace import Tracer
from .hf_vocab import loss_for as vocab_loss
from .share import Peak, build_only, build_stage
from .usercode import (MissingFunction, accepts_tensor_parallel, build_layers, builtin_function,  # noqa: F401
                       data_arguments, hf_builder, is_hf, load_callable)   # (MissingFunction etc. re-exported)
from .usererrors import CheckedLoss, UserCodeError, ids_in_vocabulary, non_finite_loss, user_step, vocabulary_of


def load_function(out_dir: str, ref, what: str = "function"):
    """A code reference of plan.json ``train`` (``planfile.CodeRef``), from the output folder; a missing
    file or function is an EngineError that names it (``what``: the plan's word for it, e.g. ``loss``)."""
    try:   # a builtin: one of the runtime's own (plan.json {"builtin": NAME})
        return (builtin_function(ref.function) if getattr(ref, "builtin", False)
                else load_callable(os.path.join(out_dir, ref.file), ref.function))
    except (FileNotFoundError, MissingFunction) as e:
        raise EngineError(f"the plan's {what} {ref.file}:{ref.function}: {e}") from None


def dump_params(engine, directory: str, rank: int) -> None:
    """DIR/rank<R>.pt: name -> tensor; DIR/rank<R>.shards.json: name -> [dim, index, parts, blocks]
    for each tensor-parallel shard (replicated parameters are not listed), and a fifth entry, the real
    length of the split dimension, for a padded one (a vocabulary table: its padding rows are dumped)."""
    os.makedirs(directory, exist_ok=True)
    torch.save(dict(engine.plan_named_parameters()), os.path.join(directory, f"rank{rank}.pt"))
    shards = {f"layers.{k}": list(info) + ([p.planc_shard_size] if hasattr(p, "planc_shard_size") else [])
              for k, p in engine.module.named_parameters() if (info := shard_info(p)) is not None}
    with open(os.path.join(directory, f"rank{rank}.shards.json"), "w") as f:
        json.dump(shards, f, indent=1, sort_keys=True)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="train.py", description="Run a planc-compiled training plan.")
    p.add_argument("--comm-only", action="store_true",
                   help="run only the plan's transfers and reductions on random data, and time them")
    p.add_argument("--steps", type=int, default=None,
                   help="override train.steps (the step count to reach: a resumed run trains the rest)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="write a checkpoint to DIR/step<N> every train.save_every steps and after the last step")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the checkpoint DIR (a DIR/step<N> folder, or the one DIR/latest names)")
    p.add_argument("--weights-only", action="store_true", help="with --resume: the checkpoint's weights alone "
                   "(a fresh optimizer, step 0, fresh data), e.g. under a plan of another global batch")
    p.add_argument("--dump-params", default=None, metavar="DIR", help="after training, save each rank's stage "
                   "parameters to DIR/rank<R>.pt (its tensor-parallel shards' positions: DIR/rank<R>.shards.json)")
    p.add_argument("--memory-stats", default=None, metavar="DIR", help="after training, write each stage rank's "
                   "memory by part, measured (docs/memory.md), to DIR/rank<R>.json")
    p.add_argument("--trace", default=None, metavar="DIR", help="record every instruction, receive, send and "
                   "gradient bucket of every step in DIR/trace-rank<R>.json (Chrome trace; `planc trace DIR`)")
    p.add_argument("--build-only", action="store_true", help="build each rank's share of the model, print its "
                   "bytes and build peak beside the plan's memory model, and exit")
    p.add_argument("--profile-startup", action="store_true",
                   help="time each start-up phase (imports, process group, checks, groups, DeepSpeed, model, "
                        "engine, first step) on every rank; rank 0 prints them all after the last step")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _fail_together(problems: list[str], headline: str = "the plan cannot train") -> None:
    """All ranks learn every rank's problems and stop with the same message."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    every = [p for ps in gathered for p in ps]
    if every:
        error = EngineError(f"{headline}:\n  " + "\n  ".join(dict.fromkeys(every)))
        error.same_on_every_rank = True   # gathered from all ranks: rank 0 says it for everyone
        raise error


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


# Failures the runtime plans for and words itself: one line per rank, exit 2, no traceback
# (PLANC_DEBUG=1 shows it). Anything else is a bug and keeps its traceback.
EXPECTED = (StartupError, GroupMissing, EngineError, PlanFileError, ReductionError, CheckpointError, OSError,
            json.JSONDecodeError, UserCodeError)


_WATCH: FailureWatch | None = None     # this rank's watch for other ranks' failures (failwatch.py)


def main(argv=None, out_dir: str | None = None) -> int:
    try:
        return _main(argv, out_dir)
    except EXPECTED as e:
        if os.environ.get("PLANC_DEBUG") == "1":
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        if _WATCH is not None:
            _WATCH.stop()
        if rank == 0 or not getattr(e, "same_on_every_rank", False):
            print(f"planc: rank {rank}: {message}", file=sys.stderr, flush=True)
        if not getattr(e, "same_on_every_rank", False):
            report_failure(rank, message)      # a rank that waits in nothing learns of it (failwatch.py)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    except BaseException as e:                 # a bug (it keeps its traceback): the others still learn of it
        if _WATCH is not None:
            _WATCH.stop()
        if dist.is_initialized():
            report_failure(dist.get_rank(), f"{type(e).__name__}: {e}")
        raise


def _main(argv=None, out_dir: str | None = None) -> int:
    clock = StartupClock()
    clock.mark("imports")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out_dir = out_dir or os.path.dirname(os.path.abspath(sys.argv[0]))
    plan = planfile.load(os.path.join(out_dir, "plan.json"))
    with open(os.path.join(out_dir, "ds_config.json")) as f:
        ds_config = json.load(f)
    steps = args.steps if args.steps is not None else (plan.train.steps if plan.train is not None else 1)
    digest = planfile.digest(plan)
    if (args.save or args.resume) and (args.comm_only or plan.train is None):
        raise CheckpointError("--save and --resume need a training run (not --comm-only, and a plan with train)")
    if args.trace and (args.comm_only or plan.train is None):
        error = EngineError("--trace records training steps: it needs a training run (not --comm-only, and a "
                            "plan with train); --comm-only prints its own per-transfer times")
        error.same_on_every_rank = True
        raise error
    resume_from = manifest = None
    if args.resume or args.weights_only:   # checked before the process group starts: every rank finds the same problem
        resume_from = checkpoint.resolve(args.resume)
        manifest = checkpoint.check(resume_from, plan, weights_only=args.weights_only)
    clock.mark("plan read")

    if os.environ.get("PLANC_DUMP_STACKS_AFTER_S"):   # debugging a hang: every rank prints its stack
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["PLANC_DUMP_STACKS_AFTER_S"]), exit=False)
    init_distributed(backend=choose_backend(plan), timeout=collective_timeout(plan))
    clock.mark("process group")
    threads_line = limit_cpu_threads(dist.get_backend())   # before any compute (docs/runtime.md)
    global _WATCH
    _WATCH = FailureWatch(dist.get_rank())
    startup_checks(plan, digest)
    clock.mark("plan checks")
    rank = dist.get_rank()
    groups = create_groups(plan, timeout=collective_timeout(plan))
    clock.mark("groups")

    if args.comm_only or plan.train is None:
        comm_only(plan, groups, rank, steps)
        return _close()
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
    stage = plan.stage_of(rank)
    engine, problems, data, initial, build_stats = None, [], None, None, None
    if stage is not None:
        t = plan.train
        model_args, seed, micro_batch = dict(t.model.args), t.seed, t.micro_batch
        try:   # every user function before anything is built: a typo in one is one message, all ranks stop
            builder, loss_fn, batches = (hf_builder(out_dir, t, EngineError) if is_hf(ref) else load_function(out_dir, ref, k)
                                         for k, ref in (("model", t.model), ("loss", t.loss), ("data", t.data)))
        except EngineError as e:
            problems = [str(e)]
        else:   # its calls counted and checked: a failure names the micro-batch (usererrors.CheckedLoss)
            loss_fn = CheckedLoss(loss_fn, [out_dir], t.micro_batches)
        if not problems:
            tp = None
            if accepts_tensor_parallel(builder):
                try:
                    tp = context_from_plan(plan, groups, rank)
                except (ValueError, KeyError) as e:
                    raise EngineError(f"rank {rank}: {e.args[0] if e.args else e}") from None
            torch.manual_seed(seed)   # a builder without `stage_layers` builds every layer alike; the rank keeps its stage's
            try:
                peak = Peak()
                layers = build_stage(builder, model_args, tp, plan, stage)
                loss_fn.fn = vocab_loss(layers, loss_fn.fn, builtin=bool(getattr(t.loss, "builtin", False)))
            except ValueError as e:
                if tp is None:
                    raise
                raise EngineError(f"rank {rank}: the model cannot be split over its tensor group of {tp.size}: "
                                  f"{e}") from None
            # what needs the real world is checked before DeepSpeed builds anything, and gathered so that
            # all ranks stop together with one message
            lo, hi = stage.layers
            initial = cast_stage(layers[lo:hi], t.precision)   # bf16/fp16: the stage's layers in it
            build_stats = peak.report()   # the build's resident peak (before the shape check's forward)
            try:
                x, _ = next(batches(micro_batch, seed, **data_arguments(t)))
                a, b = stage.rows_of(rank)
                x = x[a:b]
                if x.is_floating_point():   # float inputs enter stage 0 in the plan's precision
                    x = x.to(param_dtype(t.precision))
                problems = check_stage_shapes(plan, rank, layers[lo:hi], x)
            except (EngineError, ValueError, KeyError) as e:
                problems = [f"rank {rank}: {e}"]
    _fail_together(problems)
    clock.mark("model build")
    if args.build_only:   # docs/memory.md, "Checking the model"
        build_only(rank, stage, layers if stage else None, initial, build_stats, plan)
        return _close()

    tracer = Tracer(rank, stage.index if stage is not None else None) if args.trace else None
    # gloo only: NCCL keeps its own stream order per communicator, which sends from a second thread
    # could break (docs/runtime.md, "The host NIC order")
    use_nic = dist.get_backend() == "gloo"
    counter = nicorder.open_counters(plan, rank) if use_nic else None   # collective
    hold_rate = nicorder.host_bandwidth(plan)     # bytes/s a NIC turn is held for: the compiled host link
    if stage is not None:
        drawn = batches(micro_batch, seed, **data_arguments(t))
        vocab = vocabulary_of(t.model)
        if vocab is not None and stage.index == min(s.index for s in plan.stages):   # where the ids enter the model
            drawn = ids_in_vocabulary(drawn, vocab, t.micro_batches)
        data = CountingIterator(drawn)   # counted: the position a checkpoint keeps
        if t.recomputes(stage.index):   # torch.utils.checkpoint reads torch._dynamo.config: imported here, not in step 0
            lazydynamo.load()
        engine = PlanEngine.build(plan, groups, layers, loss_fn, data, ds_config, tracer=tracer, initial=initial)
        if args.memory_stats:   # training's resident peak counted from here (share.Peak)
            engine.saved, peak = {}, Peak()
        initial = None
        host = plan.cluster.host_of(rank)
        order = plan.pipeline.nic_order_of(host)
        if counter is not None and any(k[0] == rank for k in order):
            engine.attach_nic(nicorder.NicOrder(rank, host, order, counter, collective_timeout(plan).total_seconds(),
                                                hold_rate, tracer=tracer, drain=plan.runtime.nic_drain))
    if rank == 0 and counter is not None:
        held = (f"each turn held for its bytes at {hold_rate / 1e6:g} MB/s, the host link the plan was compiled "
                f"for (on faster links: recompile for them)") if hold_rate else "no hold"
        print(f"host NIC order: {sum(len(k) for _, k in plan.pipeline.nic_order)} cross-host sends per step, "
              f"one at a time per host in the plan's order; {held}", flush=True)
    first, problems, read_s = 0, [], 0.0
    if resume_from is not None:
        try:   # collective (DCP reads each rank's rectangles of the checkpoint under this plan)
            first, read_s = checkpoint.restore(resume_from, manifest, plan, engine, data, args.weights_only)
        except CheckpointError as e:
            problems = [str(e)]
        _fail_together(problems, f"cannot resume from {resume_from}")
        if rank == 0:
            print(checkpoint.resumed_line(resume_from, manifest, digest, args.weights_only, read_s), flush=True)
    device = engine.device if engine is not None else backend_device()   # an idle rank's: its backend's
    described = [None] * dist.get_world_size()   # every stage's gradient reduction, every rank's backend and device
    dist.all_gather_object(described, ((stage.index, engine.reduce_description) if engine is not None else None,
                                       f"{dist.get_backend()} {device}"))
    if rank == 0:
        if threads_line:
            print(threads_line, flush=True)
        print(f"gradients: {gradient_summary([d for d, _ in described])}\n{devices_line(described)}", flush=True)
    clock.mark("engine")
    samples = plan.train.micro_batch * plan.train.micro_batches
    reporter = min(d for st in plan.stages for d in st.devices)   # every stage rank knows the step's figures
    fp16 = str(plan.train.precision) == "fp16"
    total = 0.0
    save_every = plan.train.save_every
    if rank == 0 and first >= steps:
        print(f"the checkpoint is at step {first}: nothing left to train for --steps {steps}", flush=True)
    for step in range(first, steps):
        t0 = time.perf_counter()
        t0_trace = tracer.now() if tracer is not None else 0.0
        if engine is not None:   # a failure of the user's code: one line naming where (usererrors.user_step)
            loss_fn.new_step()
            with user_step(step, stage.index, layers[lo:hi], lo, [out_dir], data_drawn=lambda: data.drawn):
                share = engine.train_batch()
        else:
            share = 0.0   # idle ranks only add nothing
        report = step_vector(share, engine, rank == reporter, device)
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
        if args.save and (step + 1 == steps or (save_every and (step + 1) % save_every == 0)):
            t_save = time.perf_counter()
            saved = checkpoint.save(args.save, step + 1, plan, digest, engine, data)
            if rank == 0:
                print(f"checkpoint step {step + 1} saved to {saved} in {time.perf_counter() - t_save:.3f} s", flush=True)
    trained = steps - first
    if rank == 0 and trained > 0:
        print(f"trained {trained} step(s) in {total:.3f} s: {trained * samples / total:.1f} samples/s", flush=True)

    if engine is not None and args.dump_params:
        dump_params(engine, args.dump_params, rank)
    if tracer is not None:
        tracer.dump(args.trace)
    if engine is not None and args.memory_stats:
        os.makedirs(args.memory_stats, exist_ok=True)
        with open(os.path.join(args.memory_stats, f"rank{rank}.json"), "w") as f:
            json.dump(dict(engine.memory_report(), build=build_stats, rss_after_build=peak.base,
                           rss_training_peak=peak.hwm()), f, sort_keys=True)
    if args.profile_startup:   # after the last step: the gather changes nothing the steps did
        print(rank_line(rank, clock.record()), flush=True)
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, clock.record())
        if rank == 0:
            print(profile_table(records), flush=True)
    return _close()


def _close() -> int:
    _WATCH.stop()              # the last collective: a finished rank 0 takes the store with it
    dist.barrier()
    dist.destroy_process_group()
    return 0
