"""The model probe pass: build the user's model once, in a subprocess (torch lives there, not in the
compiler), and measure what each layer really is, so transfers and reductions are sized from the model
rather than from what the plan declares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from planc import ir
from planc.lang.errors import Diagnostic, PlanError

PRECISION_BYTES = {ir.Precision.FP32: 4, ir.Precision.FP16: 2, ir.Precision.BF16: 2}
PROBE_TIMEOUT_S = 300


@dataclass(frozen=True, slots=True)
class ModelProbe:
    """What the model really is: parameters and output shape of each layer for one whole micro-batch."""

    layer_params: tuple[int, ...]
    layer_shapes: tuple[tuple[int, ...] | None, ...]

    def stage_param_bytes(self, stages, precision: ir.Precision) -> dict[int, int]:
        out = {}
        for s in stages:
            a, b = s.layers if s.layers is not None else (0, len(self.layer_params))
            out[s.index] = sum(self.layer_params[a:b]) * PRECISION_BYTES[precision]
        return out


def probe_model(program: ir.Program) -> ModelProbe:
    """Build the model in a subprocess (torch lives there, not in the compiler) and measure it."""
    model = program.model
    path = Path(program.source_dir) / model.path
    if not path.is_file():
        raise PlanError(Diagnostic(f"model file '{model.path}' not found (looked for {path})", model.span))
    req = {
        "model_file": str(path), "function": model.function, "args": dict(model.args),
        "data_file": str(Path(program.source_dir) / program.data.path) if program.data else None,
        "data_function": program.data.function if program.data else None,
        "micro_batch": program.train.micro_batch, "seed": program.train.seed,
    }
    env = dict(os.environ, PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="")
    try:
        proc = subprocess.run([sys.executable, "-m", "planc.runtime.probe", json.dumps(req)], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise PlanError(Diagnostic(f"building the model took longer than {PROBE_TIMEOUT_S} s "
                                   "(use --no-probe to skip sizing it)", model.span)) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PlanError(Diagnostic(f"could not build the model with {model.path}:{model.function}: {last}", model.span))
    try:
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PlanError(Diagnostic("the model probe printed no result", model.span)) from None
    return ModelProbe(tuple(int(x) for x in doc["layer_params"]),
                      tuple(tuple(s) if s is not None else None for s in doc["layer_shapes"]))


def check_against_model(program: ir.Program, probe: ModelProbe) -> None:
    """Stage ranges cover the model's layers; every transfer's declared shape is what its layer produces."""
    errs: list[Diagnostic] = []
    n = len(probe.layer_params)
    staged = [s for s in program.stages if s.layers is not None]
    if staged:
        end = max(s.layers[1] for s in staged)
        if end != n:
            last = max(staged, key=lambda s: s.layers[1])
            errs.append(Diagnostic(f"the stages cover layers 0..{end} but the model has {n} layers (0..{n})", last.span))
    for t in program.transfers:
        src = program.stage(t.src_stage)
        if src.layers is None:
            continue
        layer = t.src_layer if t.src_layer is not None else src.layers[1] - 1
        if layer >= n:
            continue
        got = probe.layer_shapes[layer]
        if got is not None and tuple(got) != tuple(t.shape):
            errs.append(Diagnostic(f"transfer '{t.name}' declares {t.dtype}{list(t.shape)} but stage {t.src_stage} "
                                   f"layer {layer} produces {list(got)} for a micro-batch of {program.train.micro_batch}",
                                   t.span))
    if errs:
        raise PlanError(errs)


