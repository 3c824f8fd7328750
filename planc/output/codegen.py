"""Render a compiled plan into a launchable output directory.

``write_output(plan, program, out_dir)`` writes (``plan``: the typed ``planc.plan.Plan``)::

    OUT/plan.json  ds_config.json  train.py  launch.sh  hostfile  README.md
    OUT/planc_runtime/   (a copy of planc/runtime/)
    OUT/planc/plan/      (a copy of planc/plan/, the contract the runtime reads plan.json with)
    OUT/<model file>.py  (the plan's model, loss and data code, and the modules they import beside them:
                          planc.output.outputfiles)

The same inputs give byte-identical files: JSON with fixed key order and
indentation, templates rendered with StrictUndefined, files copied in sorted
order. Templates come from the checkout's top-level ``templates/`` or, in an
installed wheel, from ``<prefix>/share/planc/templates`` (``planc.resources``).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

import jinja2
import yaml

from planc import ir, resources
from planc.output.outputfiles import output_code_files
from planc.diagnostics import Diagnostic, PlanError, Span
from planc import plan as planfile

__all__ = ["write_output", "templates_dir", "ds_config", "CodegenError"]



CONTRACT_INIT = ('"""The part of planc a compiled output needs: the contract package ``planc.plan`` (plan.json as typed\n'
                 'records), copied here by ``planc compile``. Do not edit."""\n')


class CodegenError(PlanError):
    """The plan's files cannot be laid out in an output directory (a user error: exit 2, no traceback)."""

    def __init__(self, message: str, file: str = "planc compile"):
        super().__init__([Diagnostic(message, Span.unknown(file))])


def templates_dir() -> Path:
    """templates/ of a checkout, or <prefix>/share/planc/templates of an installed wheel."""
    try:
        return resources.templates_dir()
    except FileNotFoundError as e:
        raise CodegenError(str(e)) from None


def _version() -> str:
    try:
        return version("planc")
    except Exception:  # noqa: BLE001 - running from a checkout
        return "0.1.0"


def _rows_per_device(plan: planfile.Plan, micro_batch: int) -> int:
    """Rows of a micro-batch one device of stage 0 computes. Stages may differ: every rank's engine sets
    ``train_micro_batch_size_per_gpu`` to its own stage's rows (plan.json ``stages[].rows``) at start."""
    rows = plan.stages[0].rows if plan.stages else ()
    if not rows:
        return micro_batch
    _, (a, b) = rows[0]
    return b - a


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(plan: planfile.Plan | dict, program: ir.Program) -> dict:
    """ds_config.json of the plan (the typed plan, or a plan.json document read once) and its program."""
    plan = planfile.Plan.of(plan)
    train = program.train
    trainable = program.model is not None and (plan.train.trainable if plan.train is not None else True)
    per_device = _rows_per_device(plan, train.micro_batch) if trainable else train.micro_batch
    opt_params = {"lr": train.optimizer.lr, **dict(train.optimizer.params)}
    if "beta1" in opt_params or "beta2" in opt_params:   # the plan's beta1/beta2 are torch's (and DeepSpeed's) betas
        opt_params["betas"] = [opt_params.pop("beta1", 0.9), opt_params.pop("beta2", 0.999)]
    cfg = {
        "train_batch_size": train.micro_batch * train.micro_batches,
        "train_micro_batch_size_per_gpu": per_device,
        "gradient_accumulation_steps": train.micro_batches,
        # the optimizer as written, for tools that build a torch optimizer from ds_config (the lab's
        # stock-DeepSpeed and compute-only workers); the runtime builds plan.json's train.optimizer (every
        # argument, defaults filled in) and never reads this section
        "optimizer": {"type": {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}.get(train.optimizer.name,
                                                                                 train.optimizer.name),
                      "params": opt_params},
        # planc's engine runs the plan's precision (fp32 master weights, fp16 loss scaling), ZeRO-1 and
        # clipping itself (planc/runtime/regime.py): DeepSpeed's own must stay off. Its clipping defaults
        # to norm 1.0 and would clip each stage by its own gradients' norm, a silent gradient change.
        "zero_optimization": {"stage": 0},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        "steps_per_print": 1,
        "seed": train.seed,
        "gradient_clipping": 0.0,
    }
    if program.deepspeed_overrides:
        path = Path(program.source_dir) / program.deepspeed_overrides
        try:
            extra = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise CodegenError(f"cannot read DeepSpeed overrides '{program.deepspeed_overrides}': {e.strerror or e}",
                               program.source_path) from None
        except yaml.YAMLError as e:
            raise CodegenError(f"DeepSpeed overrides '{program.deepspeed_overrides}' are not valid YAML: "
                               f"{str(e).splitlines()[0]}", program.source_path) from None
        if not isinstance(extra, dict):
            raise CodegenError(f"{path}: DeepSpeed overrides must be a mapping of config keys")
        cfg = _merge(cfg, extra)   # its keys were checked with the plan (planc.lang.check.settings)
        for key in ("fp16", "bf16"):
            if isinstance(cfg.get(key), dict) and cfg[key].get("enabled"):
                raise CodegenError(f"DeepSpeed overrides '{program.deepspeed_overrides}': {key}.enabled: the "
                                   f"precision is the plan's (train {{ precision = ... }}), which planc's engine "
                                   f"runs itself with fp32 master weights; leave {key} out", program.source_path)
    return cfg


def _world_info(devices: int) -> str:
    """launch.sh's one-host ``--world_info`` for DeepSpeed's launch.py: what the `deepspeed` runner
    encodes for ``--num_nodes 1 --num_gpus N`` (runner.encode_world_info: JSON, URL-safe base64)."""
    import base64
    return base64.urlsafe_b64encode(json.dumps({"localhost": list(range(devices))}).encode()).decode()


def write_output(plan: planfile.Plan | dict, program: ir.Program, out_dir, text: str | None = None) -> Path:
    """Write OUT/; a folder that cannot be written is a user error naming it. ``plan``: the typed plan
    (``CompiledPlan.plan``; a plan.json document is read once with ``Plan.from_json``). ``text``: plan.json's
    text as the compiler verified it (``CompiledPlan.text``, the same plan as ``plan``); None: written from
    ``plan`` by the plan file's one writer."""
    plan = planfile.Plan.of(plan)
    try:
        return _write_output(plan, program, Path(out_dir), text)
    except OSError as e:
        raise CodegenError(f"cannot write the output folder {out_dir}: {e.strerror or e}"
                           + (f" ({e.filename})" if e.filename else "")) from None


def _write_output(plan: planfile.Plan, program: ir.Program, out: Path, text: str | None = None) -> Path:
    # everything is read and rendered before the folder is made: a compile that fails leaves no output
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)
    code = output_code_files(program)   # the named files and the modules they import beside them
    cluster, source, pipe = plan.cluster, dict(plan.head).get("source") or {}, plan.pipeline
    hosts, host_level = cluster.hosts, cluster.host_level
    ctx = {
        "name": plan.name,
        "version": _version(),
        "source_path": source.get("path", program.source_path),
        "source_sha256": source.get("sha256", program.source_sha256),
        "devices": cluster.devices,
        "hosts": [{"name": "localhost" if len(hosts) == 1 else f"{host_level}{i}", "slots": len(h)}
                  for i, h in enumerate(hosts)],
        "host_level": host_level,
        "stage_count": len(plan.stages),
        "schedule": str(pipe.schedule) if pipe is not None else "",
        "micro_batches": pipe.micro_batches if pipe is not None else 0,
        "model_files": sorted(code),
        "backend": str(plan.runtime.backend),
        "ds_config_json": json.dumps(ds_config(plan, program), indent=2),
        "compiler_bin": str(Path(sys.executable).parent),   # launch.sh looks for deepspeed here first
        "world_info": _world_info(cluster.devices),
    }
    files = {
        "plan.json": text if text is not None else planfile.dumps(plan),   # one writer
        "train.py": env.get_template("train.py.j2").render(ctx),
        "ds_config.json": env.get_template("ds_config.json.j2").render(ctx),
        "hostfile": env.get_template("hostfile.j2").render(ctx),
        "launch.sh": env.get_template("launch.sh.j2").render(ctx),
        "README.md": env.get_template("README.md.j2").render(ctx),
    }
    created = not out.exists()   # a folder that was there keeps its mode
    out.mkdir(parents=True, exist_ok=True)
    for name, text in sorted(files.items()):
        (out / name).write_text(text)
    for folder in ("planc_runtime", "planc"):
        if (out / folder).exists():
            shutil.rmtree(out / folder)
    rt = out / "planc_runtime"
    rt.mkdir()
    for src in sorted(resources.runtime_dir().glob("*.py")):
        shutil.copyfile(src, rt / src.name)
    # the contract the runtime reads plan.json with, as the package it is in the compiler (planc.plan);
    # OUT/ comes first on train.py's path, so the ranks import this copy, never an installed planc
    contract = out / "planc" / "plan"
    contract.mkdir(parents=True)
    (out / "planc" / "__init__.py").write_text(CONTRACT_INIT)
    for src in sorted(resources.contract_dir().glob("*.py")):
        shutil.copyfile(src, contract / src.name)
    for name, src in sorted(code.items()):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, out / name)
    written = [out / n for n in (*files, *code)] + [*rt.iterdir(), *(out / "planc").rglob("*")]
    resources.publish(*([out] if created else []), *sorted({p.parent for p in written} - {out}), *written)
    os.chmod(out / "launch.sh", resources.SCRIPT_MODE)
    return out
