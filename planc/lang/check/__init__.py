"""Semantic checks: AST → ``ir.Program``.

The driver :func:`check` runs one check per construct, in order, each given
what it depends on explicitly (the checked cluster, parallel block and stages)
and the :class:`~planc.lang.check.values.Diagnostics` it reports to. All
errors found are raised together as one ``PlanError`` (sorted by position); a
check that cannot run because an earlier part is broken is skipped rather than
reported twice. Nothing here reads files: the loader (:mod:`planc.lang`) reads
a cluster file and resolves the plan's folder, and passes them in as
:class:`PlanInputs`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from planc import ir
from planc.lang import ast
from planc.lang.check.cluster import MAX_DEVICES, check_cluster
from planc.lang.check.code import check_code
from planc.lang.check.parallel import check_parallel
from planc.lang.check.reductions import check_reductions
from planc.lang.check.schedule import check_schedule
from planc.lang.check.settings import (MAX_DFS_BUDGET_S, MAX_MICRO_BATCHES, MAX_TRIALS, check_deepspeed,
                                       check_resharding, check_synthesis, check_train)
from planc.lang.check.stages import check_stages
from planc.lang.check.transfers import check_transfers, spec_divide_error, spec_length_error
from planc.lang.check.values import MAX_DIGITS, Diagnostics
from planc.lang.errors import Diagnostic, PlanError
from planc.lang.inputs import ClusterFile, PlanInputs, read_inputs
from planc.span import Span

__all__ = ["check", "PlanInputs", "ClusterFile", "spec_length_error", "spec_divide_error",
           "MAX_DEVICES", "MAX_DIGITS", "MAX_TRIALS", "MAX_DFS_BUDGET_S", "MAX_MICRO_BATCHES"]

# statements that may appear once, by the name used in "may appear only once"
_SINGLE_BLOCKS = {ast.ClusterBlock: "cluster", ast.ParallelBlock: "parallel", ast.DeepspeedDecl: "deepspeed",
                  ast.StagesAuto: "stages"}
_REPEATED = (ast.StageDecl, ast.TransferDecl, ast.ReduceDecl)


def check(tree: ast.PlanFile, path: str, text: str, inputs: PlanInputs | None = None,
          found: tuple[Diagnostic, ...] = ()) -> ir.Program:
    """Check a parsed plan. ``found``: diagnostics the parser already collected; ``inputs``
    defaults to what :func:`planc.lang.read_inputs` gathers for ``tree``."""
    if inputs is None:
        inputs = read_inputs(tree, path)
    errs = Diagnostics(list(found))
    by_kind = _statements(errs, tree)

    def first(kind: str):
        return by_kind.get(kind, [None])[0]

    cluster = check_cluster(errs, first("cluster"), inputs.cluster_file)
    parallel = check_parallel(errs, first("parallel"), cluster)
    model = check_code(errs, first("model"))
    loss = check_code(errs, first("loss"))
    data = check_code(errs, first("data"))
    if model is not None:
        for what, ref in (("loss", loss), ("data", data)):
            if ref is None and not (what == "loss" and isinstance(model, ir.HfModel)):   # HF: its causal-LM loss
                errs.add(f"a plan with a model needs a '{what} \"file.py:function\"' line", first("model").span)
    choice = check_schedule(errs, _setting(first("train"), "schedule"))   # before the stages it places
    if "parallel" in by_kind and parallel is None and not any(d.devices is not None for d in by_kind.get(
            "StageDecl", [])):   # a broken parallel block, said already: its stages cannot be checked
        stage_mode, stages = ir.StageMode.PIPE_AXIS, ()
    else:
        stage_mode, stages = check_stages(errs, by_kind.get("StageDecl", []), cluster, parallel, model is not None,
                                          tree.span, first("stages"), choice)
    # stages that could not be made (an error said why): what refers to them is checked once they are
    lost = errs.found and not stages and bool(by_kind.get("StageDecl") or first("stages"))
    transfers = () if lost else check_transfers(errs, by_kind.get("TransferDecl", []), stages, parallel,
                                                model is not None or "model" in by_kind, text)
    reductions = () if lost else check_reductions(errs, by_kind.get("ReduceDecl", []), cluster, parallel, stages,
                                                  stage_mode, "model" in by_kind)
    resharding = check_resharding(errs, first("resharding"))
    synthesis = check_synthesis(errs, first("synthesis"))
    train = check_train(errs, first("train"), parallel, stages, model is not None, choice)
    deepspeed = check_deepspeed(errs, first("deepspeed"), inputs.deepspeed_file)

    if errs.found or cluster is None:
        if cluster is None and "cluster" not in by_kind:
            errs.add("a plan needs a 'cluster { ... }' block", tree.span if tree.span.line else Span(1, 1, 1, 2, path))
        sources = {path: text}
        items = errs.items
        for yf, decl, kind in ((inputs.cluster_file, "cluster", "cluster file"),
                               (inputs.deepspeed_file, "deepspeed", "DeepSpeed overrides file")):
            if yf is not None and yf.path and yf.text is not None:   # errors in a YAML file show its line
                sources[yf.path] = yf.text
                b = first(decl)   # and say which plan line named the file
                named = (b.file if decl == "cluster" else b.path).span
                note = f"in the {kind} named at {path}:{named.line}:{named.col}: {decl} \"{yf.name}\""
                items = [dataclasses.replace(d, hint=d.hint or note) if d.span.file == yf.path else d for d in items]
        raise PlanError(items, sources)
    return ir.Program(
        name=tree.name.value if tree.name else _name_from_path(path),
        source_path=path,
        source_sha256=hashlib.sha256(text.encode()).hexdigest(),
        source_dir=inputs.source_dir,
        cluster=cluster,
        parallel=parallel,
        stage_mode=stage_mode,
        stages=stages,
        transfers=transfers,
        reductions=reductions,
        model=model, loss=loss, data=data,
        resharding=resharding,
        synthesis=synthesis,
        train=train,
        deepspeed_overrides=deepspeed,
    )


def _statements(errs: Diagnostics, tree: ast.PlanFile) -> dict[str, list[ast.Statement]]:
    """Statements by kind, in source order; a second block of a kind that may appear once is reported."""
    seen: dict[str, Span] = {}
    by_kind: dict[str, list] = {}
    for st in tree.statements:
        if isinstance(st, _REPEATED):
            kind = type(st).__name__
        else:
            kind = _SINGLE_BLOCKS.get(type(st)) or getattr(st, "kind", None)
            if kind is not None:
                if kind in seen:
                    errs.add(f"'{kind}' may appear only once (first at line {seen[kind].line})", st.span)
                    continue
                seen[kind] = st.span
        by_kind.setdefault(kind, []).append(st)
    return by_kind


def _setting(block, key: str):
    """The first ``key = value`` of a settings block (None: no block, or not set); the block's own check
    reports repeats and unknown keys."""
    if not isinstance(block, ast.SettingsBlock):
        return None
    return next((kv for kv in block.items if kv.key.value == key), None)


def _name_from_path(path: str) -> str:
    """A plan without `plan NAME { }` is named after its file: 'gpt-2x4.plan' -> 'gpt_2x4'."""
    if not path or path.startswith("<"):
        return "plan"
    name = re.sub(r"\W", "_", Path(path).stem, flags=re.ASCII) or "plan"
    return "_" + name if name[0].isdigit() else name
