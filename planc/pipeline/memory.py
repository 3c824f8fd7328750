"""One device's memory under a pipeline schedule, estimated: what certainly stays.

``stage_memory`` gives, per stage, the static bytes (parameters, gradients and optimizer state) and
the activation bytes one micro-batch leaves until its backward; ``planc.pipeline.choose`` weighs them
against ``cluster.memory`` (its module docstring has the model) and the simulator's input
(``planc.pipeline.siminput``) carries the activations of each stage.
"""

from __future__ import annotations

import math

from planc import ir

__all__ = ["PRECISION_BYTES", "degree", "stage_memory"]

PRECISION_BYTES = {ir.Precision.FP32: 4, ir.Precision.FP16: 2, ir.Precision.BF16: 2}


def degree(program: ir.Program, st, axis: str) -> int:
    """The size of mesh axis ``axis`` of a placed ``ir.StageLayout`` or of a program's ``ir.Stage``."""
    if hasattr(st, "axis_size"):          # a placed ir.StageLayout
        return st.axis_size(axis)
    return ir.axis_size(program.stage_mesh(st.index), axis)


def _optimizer_states(opt: ir.Optimizer) -> int:
    if opt.name == "adam":
        return 2
    return 1 if dict(opt.params).get("momentum", 0.0) else 0


def _layer_bytes(probe, i: int) -> int:
    if i < len(probe.layer_output_bytes) and probe.layer_output_bytes[i] is not None:
        return probe.layer_output_bytes[i]
    shape = probe.layer_shapes[i] if i < len(probe.layer_shapes) else None
    dtype = probe.layer_dtypes[i] if i < len(probe.layer_dtypes) else None
    if shape is None or dtype not in ir.DTYPE_BYTES:
        return 0
    return math.prod(shape) * ir.DTYPE_BYTES[dtype]


def _transfer_bytes(t: ir.Transfer, probe) -> int:
    if t.shape is not None and t.dtype is not None:
        return t.nbytes
    m = probe.measured(t.name)
    if m is None or m.shape is None or m.dtype not in ir.DTYPE_BYTES:
        return 0
    return math.prod(m.shape) * ir.DTYPE_BYTES[m.dtype]


def stage_memory(program: ir.Program, stages, probe) -> list[tuple[int, float, float]]:
    """Per stage (index order): ``(index, static bytes, activation bytes per micro-batch)`` of one device
    (see ``planc.pipeline.choose``'s docstring)."""
    ordered = sorted(stages, key=lambda s: s.index)
    n = len(probe.layer_params)
    per_param = PRECISION_BYTES[program.train.precision] * (2 + _optimizer_states(program.train.optimizer))
    out = []
    for st in ordered:
        a, b = st.layers if st.layers is not None else (0, n)
        tensor = degree(program, st, ir.MeshAxis.TENSOR)
        try:
            params = sum(probe.params_per_device(tensor)[a:b])
        except KeyError:   # not probed at this degree: the unsplit count, an upper bound
            params = sum(probe.layer_params[a:b])
        act = sum(_layer_bytes(probe, i) for i in range(a, min(b, n)))
        act += sum(_transfer_bytes(t, probe) for t in program.transfers if t.dst_stage == st.index)
        out.append((st.index, float(params * per_param), act / degree(program, st, ir.MeshAxis.DATA)))
    return out
