"""The compiler's side of a Hugging Face model (``model hf "ARCH" { ... }`` / ``model hf "dir"``): what the
probe is asked (``planc.runtime.hf_probe`` answers, on the meta device), where its failures point in the
plan, the tensor-degree check, the model folder in the output and plan.json's model record.

No torch and no transformers here: the compiler reads the probe's answer (the config after defaults).
"""
from __future__ import annotations

import hashlib
import re
from importlib import metadata
from pathlib import Path

from planc import ir
from planc import plan as planfile
from planc.diagnostics import Diagnostic, PlanError

__all__ = ["is_hf", "model_folder", "request_fields", "failure", "check_tensor_degrees", "output_folder",
           "folder_files", "model_record", "loss_record", "layer_listing", "COPY_LIMIT_BYTES"]

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
# a model folder up to this size is copied into the output (which then runs alone); a larger one is
# referenced by its absolute path (the launch machines must see it there)
COPY_LIMIT_BYTES = 1 << 30
_TAG = re.compile(r"probe\[hf-(arch|folder|pp|key:([A-Za-z0-9_]*))\]: (.*)")


def is_hf(program: ir.Program) -> bool:
    return isinstance(program.model, ir.HfModel)


def model_folder(program: ir.Program) -> Path | None:
    """The model folder of ``model hf "dir"``, resolved against the plan's folder; a folder that is missing
    or has no config.json is an error at the string."""
    m = program.model
    if not isinstance(m, ir.HfModel) or m.folder is None:
        return None
    path = (Path(program.source_dir) / m.folder).resolve()
    if not path.is_dir():
        raise PlanError(Diagnostic(f"model folder '{m.folder}' not found (looked for {path})", m.ref_span))
    if not (path / "config.json").is_file():
        raise PlanError(Diagnostic(f"model folder '{m.folder}' has no config.json (a Hugging Face model folder "
                                   "holds its config, and its weights when it has some)", m.ref_span))
    return path


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes() if p.is_file() else b"")
    return h.hexdigest()


def request_fields(program: ir.Program) -> dict:
    """The probe request's ``hf`` part: the architecture and the plan's keys, or the folder (absolute). It
    also names transformers' version and the digest of the runtime's HF modules, so a cached answer is
    not served to another version of either."""
    m = program.model
    folder = model_folder(program)
    spec = ({"folder": str(folder), "config_digest": _digest(folder / "config.json")} if folder is not None
            else {"architecture": m.architecture, "keys": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in m.config}})
    spec["versions"] = {"transformers": _version("transformers"),
                        "runtime": _digest(*(RUNTIME / f for f in ("hf.py", "hf_probe.py", "probe_measure.py")))}
    return spec


def failure(program: ir.Program, stderr: str) -> Diagnostic | None:
    """The located diagnostic of a probe failure tagged ``hf-...``; None for any other failure."""
    last = (stderr.strip().splitlines() or [""])[-1]
    tagged = _TAG.match(last)
    if tagged is None:
        return None
    part, key, why = tagged.groups()
    m = program.model
    if key is not None:
        return Diagnostic(why, m.key_span(key) if key else m.span)
    if part == "arch" and "did you mean" not in why:
        why += f' (a model folder is written as a path: "./{m.architecture}")'
    return Diagnostic(why, m.ref_span if part in ("arch", "folder") else m.span)


def _stage_has_decoder_layers(stage: ir.Stage, layers: int) -> bool:
    if stage.layers is None:
        return True
    a, b = stage.layers
    return a < layers + 1 and b > 1


def check_tensor_degrees(program: ir.Program, config: dict) -> None:
    """Every stage holding decoder layers on a ``tensor`` axis of size k > 1 must split the attention heads,
    the key/value heads and the MLP's intermediate size into k equal parts (the tp plan shards them)."""
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads") or heads
    sizes = [("attention heads (num_attention_heads)", heads), ("key/value heads (num_key_value_heads)", kv),
             ("MLP width (intermediate_size)", config.get("intermediate_size"))]
    layers = int(config.get("num_hidden_layers") or 0)
    errs = []
    for s in sorted(program.stages, key=lambda s: s.index):
        k = ir.axis_size(program.stage_mesh(s.index), ir.MeshAxis.TENSOR)
        if k <= 1 or not _stage_has_decoder_layers(s, layers):
            continue
        bad = [f"{n} {what}" for what, n in sizes if isinstance(n, int) and n % k]
        if bad:
            errs.append(Diagnostic(f"stage {s.index} splits its decoder layers over a 'tensor' axis of {k}, but the "
                                   f"model's {' and '.join(bad)} do not divide by {k} "
                                   f"({program.model.label}; each device must hold whole heads)",
                                   s.span if s.span.line else program.model.span))
    if errs:
        raise PlanError(errs)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def output_folder(program: ir.Program) -> str | None:
    """Where plan.json's model record finds the folder: its name inside OUT/ (copied there), or its absolute
    path when it holds more than ``COPY_LIMIT_BYTES``. None without a folder."""
    folder = model_folder(program)
    if folder is None:
        return None
    return str(folder) if _size(folder) > COPY_LIMIT_BYTES else folder.name


def folder_files(program: ir.Program) -> dict[str, Path]:
    """OUT/-relative name -> source file of every file of the model folder copied into the output."""
    folder = model_folder(program)
    name = output_folder(program)
    if folder is None or Path(name).is_absolute():
        return {}
    return {f"{name}/{p.relative_to(folder).as_posix()}": p for p in sorted(folder.rglob("*")) if p.is_file()}


def model_record(program: ir.Program, probe) -> planfile.HfModel:
    """plan.json's ``train.model``: the probe's config after defaults (without a probe: the plan's keys,
    which the runtime completes with the same defaults)."""
    m = program.model
    hf = dict(getattr(probe, "hf", None) or ())
    keys = tuple((k, list(v) if isinstance(v, tuple) else v) for k, v in m.config)
    config = tuple(sorted(hf["config"].items())) if hf else keys
    arch = hf.get("architecture") or m.architecture or ""
    folder = output_folder(program)
    # without a probe the compiler cannot ask transformers: sdpa, which every family the docs list supports
    return planfile.HfModel(arch, config, hf.get("attn_implementation", "sdpa"), keys, folder,
                            bool(hf.get("weights")), vocab_record(program, probe))


def vocab_record(program: ir.Program, probe) -> planfile.VocabSplit | None:
    """plan.json ``train.model.hf.vocab``: the rows the embedding table (layer 0) and ``lm_head`` (the last
    layer) are padded to for the tensor stages that split them by vocabulary (``planc.plan.padded_vocab``:
    a multiple of the holding stage's tensor degree; of the least common multiple of both holders' when
    the model ties them, ``probe.tied``); None when no holding stage has a ``tensor`` axis, or no probe."""
    hf = dict(getattr(probe, "hf", None) or ())
    vocab = (hf.get("config") or {}).get("vocab_size")
    n = len(getattr(probe, "layer_params", ()) or ())
    if not isinstance(vocab, int) or n < 2:
        return None
    degree = {}
    for s in program.stages:
        a, b = s.layers if s.layers is not None else (0, n)
        for i in (0, n - 1):
            if a <= i < b:
                degree[i] = ir.axis_size(program.stage_mesh(s.index), ir.MeshAxis.TENSOR)
    k0, k1 = degree.get(0, 1), degree.get(n - 1, 1)
    if max(k0, k1) <= 1:
        return None
    tied = any({0, n - 1} <= {int(layer) for layer, _ in holders} for holders, _ in probe.tied)
    if tied:
        rows = planfile.padded_vocab(vocab, (k0, k1))
        return planfile.VocabSplit(vocab, rows, rows)
    return planfile.VocabSplit(vocab, planfile.padded_vocab(vocab, (k0,)), planfile.padded_vocab(vocab, (k1,)))


def layer_listing(probe) -> tuple:
    """plan.json ``train.layers`` of a probed Hugging Face model (each layer's name, parameters and
    [forward, backward] FLOPs for one micro-batch; ``planc explain`` lists them); empty otherwise."""
    hf = getattr(probe, "hf", None) or {}
    return (("layers", list(hf["layers"])),) if hf.get("layers") else ()


def loss_record(program: ir.Program) -> planfile.CodeRef:
    """The loss of a Hugging Face model's plan: the plan's, else the runtime's causal-LM loss."""
    if program.loss is not None:
        return planfile.CodeRef(Path(program.loss.path).name, program.loss.function)
    return planfile.CodeRef("", "causal_lm_loss", (), True)
