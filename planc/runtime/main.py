"""Program entry of a compiled output: ``deepspeed OUT/train.py [--comm-only] [--steps N] [--save DIR]
[--resume DIR]``.

Reads OUT/plan.json (every decision of the compiler, the model, loss and data
functions and the training regime included) and OUT/ds_config.json (batch sizes for DeepSpeed),
initializes the process group, runs the start-up checks, builds the DeepSpeed pipeline engine
(``PlanEngine``, a ``PipelineEngine`` subclass) from the copied model file and
trains; rank 0 prints ``step N loss X ... lr L`` (docs/training.md). With ``--save DIR`` every rank checkpoints every
``train.save_every`` steps and at the end; ``--resume DIR`` continues from a checkpoint
(``checkpoint``; docs/runtime.md "Checkpoints").

``_main`` is the sequence: read the plan and the arguments, find and check the checkpoint to resume from
(``ckpt_manager``), start the process group and its checks, build the stage's model and engine
(``trainer.build``, ``Trainer.build_engine``), restore, train (``Trainer.train``, saving through the
checkpoint manager), write what was asked for after the last step (``Trainer.finish``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from planc import plan as planfile

from .checkpoint import CheckpointError
from .ckpt_manager import CheckpointManager
from .commcheck import comm_only, contribution, pattern, plan_micro_batches  # noqa: F401 (re-exported)
from .dist_util import (GroupMissing, StartupError, choose_backend, collective_timeout, init_distributed,
                        limit_cpu_threads, startup_checks)
from .engine import EngineError
from .failwatch import FailureWatch, report_failure
from planc.plan import PlanFileError
from .reduce import ReductionError
from .share import build_only
from .startup import StartupClock
from .topology import create_groups
from .trainer import (Trainer, build, dump_params, gradient_summary, load_function, step_vector,  # noqa: F401
                      fail_together as _fail_together)                      # (re-exported)
from .usercode import (MissingFunction, accepts_tensor_parallel, build_layers, builtin_function,  # noqa: F401
                       data_arguments, hf_builder, is_hf, load_callable)   # (MissingFunction etc. re-exported)
from .usererrors import UserCodeError


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
    plan, ds_config, steps = _read_plan(out_dir, args)
    digest = planfile.digest(plan)
    _check_arguments(args, plan)
    checkpoints = CheckpointManager.before_start(plan, digest, args)
    clock.mark("plan read")
    groups, threads_line = _start(plan, digest, clock)
    rank = dist.get_rank()
    if args.comm_only or plan.train is None:
        comm_only(plan, groups, rank, steps)
        return _close()
    model = build(plan, out_dir, groups, rank, clock, args)
    if args.build_only:   # docs/memory.md, "Checking the model"
        build_only(rank, model.stage, model.layers if model.stage else None, model.initial, model.build_stats, plan)
        return _close()
    trainer = Trainer(plan, model, groups, rank, out_dir, args)
    trainer.build_engine(ds_config)
    first = checkpoints.restore(trainer.engine, trainer.data, rank)
    trainer.announce(threads_line)
    clock.mark("engine")
    trainer.train(first, steps, checkpoints, clock)
    trainer.finish(clock)
    return _close()


def _read_plan(out_dir: str, args):
    """OUT/plan.json, OUT/ds_config.json, and the step count to reach (``--steps``, else ``train.steps``)."""
    plan = planfile.load(os.path.join(out_dir, "plan.json"))
    with open(os.path.join(out_dir, "ds_config.json")) as f:
        ds_config = json.load(f)
    steps = args.steps if args.steps is not None else (plan.train.steps if plan.train is not None else 1)
    return plan, ds_config, steps


def _check_arguments(args, plan) -> None:
    """Options that need a training run, refused before anything starts."""
    if (args.save or args.resume) and (args.comm_only or plan.train is None):
        raise CheckpointError("--save and --resume need a training run (not --comm-only, and a plan with train)")
    if args.trace and (args.comm_only or plan.train is None):
        error = EngineError("--trace records training steps: it needs a training run (not --comm-only, and a "
                            "plan with train); --comm-only prints its own per-transfer times")
        error.same_on_every_rank = True
        raise error


def _start(plan, digest: str, clock):
    """The process group (the plan's backend and timeout), this rank's CPU threads and failure watch, the
    start-up checks, every communicator of the plan (collective). Returns the groups and the threads line."""
    global _WATCH
    if os.environ.get("PLANC_DUMP_STACKS_AFTER_S"):   # debugging a hang: every rank prints its stack
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["PLANC_DUMP_STACKS_AFTER_S"]), exit=False)
    init_distributed(backend=choose_backend(plan), timeout=collective_timeout(plan))
    clock.mark("process group")
    threads_line = limit_cpu_threads(dist.get_backend())   # before any compute (docs/runtime.md)
    _WATCH = FailureWatch(dist.get_rank())
    startup_checks(plan, digest)
    clock.mark("plan checks")
    groups = create_groups(plan, timeout=collective_timeout(plan))
    clock.mark("groups")
    return groups, threads_line


def _close() -> int:
    _WATCH.stop()              # the last collective: a finished rank 0 takes the store with it
    dist.barrier()
    dist.destroy_process_group()
    return 0
