"""Settings blocks: ``resharding``, ``synthesis``, ``train`` and the ``deepspeed`` overrides file.

Every setting has a default, so a wrong one is reported and replaced by its
default (or its cap) and checking goes on.
"""

from __future__ import annotations

from planc import budget, ir
from planc.lang import ast
from planc.lang.check.schedule import Choice, check_micro_batches
from planc.lang.check.training import check_clip, check_lr_schedule, check_optimizer, check_zero
from planc.lang.check.values import Diagnostics, did_you_mean, int_of, quantity
from planc.lang.units import SIZE, TIME
from planc.plan import Backend, InHost, Runtime

__all__ = ["check_resharding", "check_synthesis", "check_train", "check_deepspeed",
           "MAX_TRIALS", "MAX_DFS_BUDGET_S", "MAX_MICRO_BATCHES", "MAX_SYNTHESIS_SIZE"]

# Settings whose work grows linearly with their value at compile time are bounded by the budget
# (planc.budget, --budget NAME=N) so that no accepted plan makes `planc compile` run (or allocate)
# without end. These are the defaults:
MAX_TRIALS = budget.BOUNDS["trials"].default                 # each trial is a full pass over the jobs
MAX_DFS_BUDGET_S = budget.BOUNDS["dfs_seconds"].default      # dfs: a node count of budget x DFS_NODES_PER_SECOND
MAX_MICRO_BATCHES = budget.BOUNDS["micro_batches"].default   # 2 x micro_batches ops per stage, simulated
MAX_SYNTHESIS_SIZE = budget.BOUNDS["synthesis_size"].default  # P² finds useful programs by size 5


def _settings(errs: Diagnostics, block: ast.SettingsBlock | None, allowed: list[str]) -> dict[str, ast.KeyValue]:
    """The block's settings by key; unknown and repeated keys are reported and left out."""
    out: dict[str, ast.KeyValue] = {}
    if block is None:
        return out
    for kv in block.items:
        k = kv.key.value
        if k not in allowed:
            errs.add(f"unknown {block.kind} setting '{k}'; expected one of {', '.join(allowed)}", kv.key.span,
                     did_you_mean(k, allowed))
            continue
        if k in out:
            errs.add(f"'{k}' is set twice", kv.key.span)
            continue
        out[k] = kv
    return out


def _enum_value(errs: Diagnostics, kv: ast.KeyValue | None, enum, default):
    if kv is None:
        return default
    v = kv.value
    text = v.value if isinstance(v, ast.Name) else (v.text if isinstance(v, ast.Num) else None)
    choices = [e.value for e in enum]
    if text not in choices:
        near = [c for c in choices if text and c.lower() == str(text).lower()]   # FP32, GPIPE: case only
        hint = (f"did you mean '{near[0]}'? (spellings are lower case)" if near else
                did_you_mean(str(text), choices) if text else None)
        errs.add(f"{kv.key.value} must be one of {', '.join(choices)}", v.span, hint)
        return default
    return enum(text)


def _bool_setting(errs: Diagnostics, kv: ast.KeyValue | None, default: bool) -> bool:
    if kv is None:
        return default
    v = kv.value
    if isinstance(v, ast.Name) and v.value in ("true", "false"):
        return v.value == "true"
    errs.add(f"{kv.key.value} must be true or false", v.span)
    return default


def _int_setting(errs: Diagnostics, kv: ast.KeyValue | None, default: int, minimum: int = 1) -> int:
    if kv is None:
        return default
    if not isinstance(kv.value, ast.Num):
        errs.add(f"{kv.key.value} must be a whole number", kv.value.span)
        return default
    v = int_of(errs, kv.value, kv.key.value, minimum)
    return default if v is None else v


def _call_args(errs: Diagnostics, call: ast.Call, allowed: dict[str, str]) -> dict[str, object]:
    """The arguments of ``name(k = v, ...)``, each of kind ``time``, ``int`` or ``float`` (positive)."""
    out = {}
    for kv in call.args:
        k = kv.key.value
        if k not in allowed:
            errs.add(f"{call.name.value}() has no argument '{k}'; expected {', '.join(allowed) or 'none'}",
                     kv.key.span, did_you_mean(k, allowed))
            continue
        kind = allowed[k]
        v = kv.value
        if kind == "time":
            if isinstance(v, ast.Quantity):
                q = quantity(errs, v, TIME, "time")
            elif isinstance(v, ast.Num):
                q = v.value
            else:
                q = None
                errs.add(f"{k} must be a time, e.g. 1 s", v.span)
            if q is not None and q <= 0:
                errs.add(f"{k} must be positive", v.span)
                q = None
            if q is not None:
                out[k] = q
        elif kind == "int":
            if isinstance(v, ast.Num):
                iv = int_of(errs, v, k, 0)
                if iv is not None:
                    out[k] = iv
            else:
                errs.add(f"{k} must be a whole number", v.span)
        else:  # float
            if isinstance(v, ast.Num) and v.value > 0:
                out[k] = v.value
            else:
                errs.add(f"{k} must be a positive number", v.span)
    return out


def check_resharding(errs: Diagnostics, block: ast.SettingsBlock | None) -> ir.Resharding:
    s = _settings(errs, block, ["strategy", "chunks", "schedule"])
    strategy = _enum_value(errs, s.get("strategy"), ir.Strategy, ir.Strategy.AUTO)
    chunks = _int_setting(errs, s.get("chunks"), 64)
    res = dict(scheduler=ir.SchedulerKind.RANDOMIZED_GREEDY, dfs_budget_s=1.0, trials=64, seed=0)
    kv = s.get("schedule")
    if kv is not None:
        v = kv.value
        name = v.name.value if isinstance(v, ast.Call) else (v.value if isinstance(v, ast.Name) else None)
        choices = [e.value for e in ir.SchedulerKind]
        if name not in choices:
            errs.add("schedule must be naive, load_balance, dfs(budget = 1 s) or randomized_greedy(trials = 64, seed = 0)",
                     v.span, did_you_mean(str(name), choices) if name else None)
        else:
            res["scheduler"] = ir.SchedulerKind(name)
            if isinstance(v, ast.Call):
                allowed = {"dfs": {"budget": "time"}, "randomized_greedy": {"trials": "int", "seed": "int"}}.get(name, {})
                args = _call_args(errs, v, allowed)
                res["dfs_budget_s"] = args.get("budget", 1.0)
                res["trials"] = args.get("trials", 64)
                res["seed"] = args.get("seed", 0)
                if res["trials"] < 1:
                    errs.add("trials must be at least 1", v.span)
                elif res["trials"] > (most := int(budget.limit("trials"))):
                    errs.add(f"trials = {res['trials']} is too many (at most {most}, bound 'trials'; each trial "
                             "is a pass over every unit task)", v.span, budget.hint("trials", res["trials"]))
                    res["trials"] = most
                if res["dfs_budget_s"] > (most_s := budget.limit("dfs_seconds")):
                    errs.add(f"a dfs budget of {res['dfs_budget_s']:g} s is too large (at most "
                             f"{most_s:g} s, bound 'dfs_seconds')", v.span,
                             budget.hint("dfs_seconds", res["dfs_budget_s"]))
                    res["dfs_budget_s"] = most_s
    return ir.Resharding(strategy, chunks, res["scheduler"], float(res["dfs_budget_s"]), int(res["trials"]),
                         int(res["seed"]))


def check_synthesis(errs: Diagnostics, block: ast.SettingsBlock | None) -> ir.Synthesis:
    s = _settings(errs, block, ["max_size", "collectives"])
    most = int(budget.limit("synthesis_size"))
    max_size = _int_setting(errs, s.get("max_size"), min(5, most))   # the default, within the budget
    if max_size > most:
        errs.add(f"max_size {max_size} is too large (at most {most}; P² finds useful programs "
                 "by size 5)", s["max_size"].value.span, budget.hint("synthesis_size", max_size))
        max_size = most
    colls = tuple(ir.Collective)
    kv = s.get("collectives")
    if kv is not None:
        if not isinstance(kv.value, ast.ListValue) or not kv.value.items:
            errs.add("collectives is a non-empty list, e.g. [allreduce, reduce_scatter, all_gather]", kv.value.span)
        else:
            names = [c.value for c in ir.Collective]
            picked = []
            for it in kv.value.items:
                if not isinstance(it, ast.Name) or it.value not in names:
                    text = it.value if isinstance(it, ast.Name) else "this"
                    errs.add(f"'{text}' is not a collective; expected {', '.join(names)}", it.span,
                             did_you_mean(str(text), names))
                elif ir.Collective(it.value) not in picked:
                    picked.append(ir.Collective(it.value))
            if picked:
                colls = tuple(picked)
    return ir.Synthesis(max_size, colls)


def check_train(errs: Diagnostics, block: ast.SettingsBlock | None, parallel: ir.Parallel | None,
                stages: tuple[ir.Stage, ...], has_model: bool = False, choice: Choice | None = None) -> ir.Train:
    """Training settings; ``micro_batch`` must divide over every stage's data axis. ``choice``: the schedule,
    read already (``planc.lang.check.schedule.check_schedule``, before the stages); None: read it here."""
    s = _settings(errs, block, ["micro_batch", "micro_batches", "steps", "schedule", "optimizer", "lr_schedule",
                                "precision", "zero", "zero_prefetch", "zero_keep_gathered", "recompute", "clip", "seed",
                                "save_every", "timeout",
                                "sequence_parallel", *RUNTIME_KEYS])
    if choice is None:
        from planc.lang.check.schedule import check_schedule
        choice = check_schedule(errs, s.get("schedule"))
    seed = _int_setting(errs, s.get("seed"), 1234, minimum=0)
    steps = _int_setting(errs, s.get("steps"), 10)
    train = ir.Train(
        micro_batch=_int_setting(errs, s.get("micro_batch"), 8),
        micro_batches=_int_setting(errs, s.get("micro_batches"), 4),
        steps=steps,
        schedule=choice.schedule,
        virtual=choice.virtual,
        optimizer=check_optimizer(errs, s.get("optimizer")),
        precision=_enum_value(errs, s.get("precision"), ir.Precision, ir.Precision.FP32),
        seed=seed,
        timeout=_timeout(errs, s.get("timeout")),
        save_every=_int_setting(errs, s["save_every"], 1) if "save_every" in s else None,
        runtime=_runtime(errs, s),
        lr_schedule=check_lr_schedule(errs, s.get("lr_schedule"), steps),
        zero=check_zero(errs, s.get("zero")),
        zero_prefetch=_bool_setting(errs, s.get("zero_prefetch"), True),
        zero_keep_gathered=_bool_setting(errs, s.get("zero_keep_gathered"), False),
        recompute=_enum_value(errs, s.get("recompute"), ir.Recompute, ir.Recompute.NONE),
        clip=check_clip(errs, s.get("clip")),
        sequence_parallel=_bool_setting(errs, s.get("sequence_parallel"), True),
        schedule_span=s["schedule"].value.span if "schedule" in s else (block.span if block else ir.Train().schedule_span),
        setting_spans=tuple((k, v.value.span) for k, v in sorted(s.items())),
    )
    if train.micro_batches > (most := int(budget.limit("micro_batches"))):
        errs.add(f"micro_batches {train.micro_batches} is too many (at most {most}, bound 'micro_batches')",
                 s["micro_batches"].value.span, budget.hint("micro_batches", train.micro_batches))
    else:
        pipe = next((a.size for a in parallel.axes if a.name == ir.MeshAxis.PIPE), 1) if parallel else 1
        ops = 2 * max(len(stages), pipe, 1) * train.micro_batches
        if stages and choice.shares and has_model:
            meshes = len({(st.first_device, st.mesh_shape) for st in stages}) if stages[0].first_device is not None \
                else pipe
            check_micro_batches(errs, choice, train.micro_batches, meshes, s["micro_batches"].value.span
                                if "micro_batches" in s else choice.span if choice.span.line else
                                block.span if block else ir.Train().schedule_span)
        over = budget.exceeded("pipeline_ops", ops, f"{max(len(stages), pipe, 1)} stages x "
                               f"{train.micro_batches} micro-batches make", s["micro_batches"].value.span
                               if "micro_batches" in s else block.span if block else ir.Train().schedule_span)
        if over is not None:
            errs.items.append(over)

    if not any((st.zero if st.zero is not None else train.zero) == 3 for st in stages) and (
            written := [k for k in ("zero_prefetch", "zero_keep_gathered") if k in s]):
        errs.add(f"{written[0]} sets how zero = 3 stages gather their parameters, but no stage has zero = 3 "
                 "(set 'zero = 3' in the train block or 'zero 3' on a stage line)", s[written[0]].value.span)
    for st in stages:
        n = ir.axis_size(ir.stage_mesh(st, parallel), ir.MeshAxis.DATA)
        if "micro_batch" in s and n > 1 and train.micro_batch % n:
            errs.add(f"micro_batch {train.micro_batch} does not divide evenly over the data axis of size {n} "
                     f"(stage {st.index})", s["micro_batch"].value.span)
            break
        if "micro_batch" not in s and has_model and train.micro_batch < n:
            # the default leaves a rank of the data axis without a row (an uneven split only makes the
            # plan untrainable: planc.driver.compile.check_trainable)
            errs.add(f"the default micro_batch = {train.micro_batch} has fewer rows than stage {st.index}'s data "
                     f"axis of size {n} has ranks; set 'train {{ micro_batch = {n} }}' (or a multiple)",
                     block.span if block is not None else st.span if st.span.line or parallel is None
                     else parallel.span)
            break
    return train


RUNTIME_KEYS = ("backend", "recv_ahead", "grad_bucket", "reduce_bucket", "in_host", "shm_slot")


def _runtime(errs: Diagnostics, s: dict[str, ast.KeyValue]) -> Runtime:
    """The runtime settings of the train block (docs/language.md, "Runtime settings"); what is not set
    keeps the documented default of ``planc.plan.runtime``."""
    d = Runtime()
    return Runtime(
        backend=_enum_value(errs, s.get("backend"), Backend, d.backend),
        recv_ahead=_int_setting(errs, s.get("recv_ahead"), d.recv_ahead),
        grad_bucket_bytes=_size(errs, s.get("grad_bucket"), d.grad_bucket_bytes),
        reduce_bucket_bytes=_size(errs, s.get("reduce_bucket"), d.reduce_bucket_bytes),
        in_host=_enum_value(errs, s.get("in_host"), InHost, d.in_host),
        shm_slot_bytes=_size(errs, s.get("shm_slot"), d.shm_slot_bytes))


def _size(errs: Diagnostics, kv: ast.KeyValue | None, default: int) -> int:
    """``grad_bucket = 8 MiB``: a size with its unit, a whole number of bytes, at least one."""
    if kv is None:
        return default
    v = kv.value
    if not isinstance(v, ast.Quantity):
        errs.add(f"{kv.key.value} is a size with its unit, e.g. '{kv.key.value} = 8 MiB'", v.span)
        return default
    q = quantity(errs, v, SIZE, "size")
    if q is None:
        return default
    if q < 1 or q != int(q):
        errs.add(f"{kv.key.value} must be a whole number of bytes, at least 1, got {v.number.text} {v.unit}",
                 v.span)
        return default
    return int(q)


def _timeout(errs: Diagnostics, kv: ast.KeyValue | None) -> float | None:
    """``timeout = 60 s``: a positive time (seconds); None when not given."""
    if kv is None:
        return None
    v = kv.value
    if not isinstance(v, ast.Quantity):
        errs.add("timeout is a time with its unit, e.g. 'timeout = 60 s'", v.span)
        return None
    q = quantity(errs, v, TIME, "time")
    if q is not None and q <= 0:
        errs.add(f"timeout must be positive, got {v.number.text} {v.unit}", v.span)
        return None
    return q


def check_deepspeed(errs: Diagnostics, block: ast.DeepspeedDecl | None, file=None) -> str | None:
    """The DeepSpeed overrides file as written (merged by codegen, relative to the plan's folder), checked
    here so that ``planc check`` finds what the compile would refuse: a file that cannot be read, YAML that
    is not a mapping, ZeRO stages the planc engine cannot run, pipeline partitioning the transfers do not
    carry. ``file``: the loader's reading of it (a ``ClusterFile``); errors point at its YAML nodes."""
    if block is None:
        return None
    if file is None:
        return block.path.value
    if file.problem is not None:
        errs.add(file.problem, file.problem_span or block.path.span)
        return None
    where = f"DeepSpeed overrides '{file.name}'"
    doc = file.doc if file.doc is not None else {}
    if not isinstance(doc, dict):
        errs.add(f"{where} must be a mapping of DeepSpeed config keys, got {type(doc).__name__}",
                 file.at(fallback=block.path.span))
        return None
    # the training regime is the train block's (the planc runtime executes plan.json, not ds_config.json):
    # each DeepSpeed key that would set it names the train setting to write instead
    zero = doc.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, None, False):
        at = file.at("zero_optimization", "stage", fallback=block.path.span)
        if stage in (1, 2):
            errs.add(f"{where}: ZeRO stage {stage} is set in the plan, not in the DeepSpeed overrides: write "
                     f"'zero = {stage}' in the train block (and leave zero_optimization out)", at,
                     f"train {{ zero = {stage} }}")
        else:
            errs.add(f"{where}: ZeRO stage {stage!r} cannot run with pipeline parallelism (0, 1 or 2 only: "
                     "'zero = 1' or 'zero = 2' in the train block)", at)
    clip = doc.get("gradient_clipping")
    if clip not in (None, 0, 0.0, False):
        clip = clip if isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0 else "X"
        errs.add(f"{where}: gradient clipping is set in the plan, not in the DeepSpeed overrides: write "
                 f"'clip = {clip}' in the train block (it bounds the whole model's gradient norm; leave "
                 "gradient_clipping out or 0)", file.at("gradient_clipping", fallback=block.path.span),
                 f"train {{ clip = {clip} }}")
    for key, precision in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = doc.get(key)
        if isinstance(section, dict) and section.get("enabled") not in (None, False):
            errs.add(f"{where}: the precision is set in the plan, not in the DeepSpeed overrides: write "
                     f"'precision = {precision}' in the train block (and leave {key} out)",
                     file.at(key, "enabled", fallback=block.path.span), f"train {{ precision = {precision} }}")
    pipe = doc.get("pipeline")
    for key in ("pipe_partitioned", "grad_partitioned"):
        if isinstance(pipe, dict) and pipe.get(key):
            errs.add(f"{where}: pipeline.{key} must stay false (the plan's transfers carry whole data-parallel "
                     "slices)", file.at("pipeline", key, fallback=block.path.span))
    return block.path.value
