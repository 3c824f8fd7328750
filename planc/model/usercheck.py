"""The user's code at compile time: what the probe is asked to exercise (``planc.runtime.usererrors``), and
where in the plan a failure of the user's code is reported.

The probe subprocess ends a failure with one tagged line on stderr, ``probe[PART]: WHY``:

- ``model``, ``data``, ``loss``: the file could not be loaded, or the builder or the data function failed
  (at the plan's ``model``, ``data`` or ``loss`` line);
- ``data-use``, ``loss-use``: the function ran and broke the runtime's contract (a generator that yields the
  wrong shapes or runs dry, a loss that is called with the wrong arguments or returns a vector);
- ``stage:N``: a layer of stage N failed on its planned input, forward or backward (at that stage's line).
"""
from __future__ import annotations

import re

from planc import ir
from planc.diagnostics import Diagnostic

__all__ = ["exercise_request", "probe_failure"]

_TAG = re.compile(r"probe\[(model|data|loss|data-use|loss-use|stage:\d+)\]: (.*)")


def exercise_request(program: ir.Program, chain: bool) -> dict | None:
    """The probe request's ``exercise``: one step's micro-batches and each stage's rows per device (the
    smallest share of a micro-batch along its ``data`` axis). None where there is nothing to exercise: a
    plan without training code, or stages not cut yet (the layers then run as a chain, which a model with
    skip inputs cannot)."""
    if chain or program.model is None or program.loss is None or program.train is None:
        return None
    stages = sorted(program.stages, key=lambda s: s.index)
    mb = program.train.micro_batch
    return {"micro_batches": program.train.micro_batches,
            "rows": [max(1, mb // ir.axis_size(program.stage_mesh(s.index), ir.MeshAxis.DATA)) for s in stages]}


def probe_failure(program: ir.Program, stderr: str) -> Diagnostic:
    """The located diagnostic of a probe that exited non-zero, from its last stderr line."""
    last = (stderr.strip().splitlines() or ["(no output)"])[-1]
    tagged = _TAG.match(last)
    part, why = tagged.groups() if tagged else ("model", last)
    model = program.model
    if part.startswith("stage:"):
        index = int(part.split(":")[1])
        stage = next((s for s in program.stages if s.index == index), None)
        return Diagnostic(why, stage.span if stage is not None else model.span)
    ref = {"data": program.data, "data-use": program.data, "loss": program.loss, "loss-use": program.loss}.get(part)
    if ref is None:   # the model's part, or a plan without that line (the model file's defaults)
        return Diagnostic(f"could not build the model with {model.path}:{model.function}: {why}", model.span)
    doing = {"data": "could not get a batch from", "loss": "could not load the loss",
             "data-use": "the data", "loss-use": "the loss"}[part]
    return Diagnostic(f"{doing} {ref.path}:{ref.function}: {why}", ref.span)
