"""The placed stages as the plan file's records (``planc.plan.Stage``), and who counts the loss.

Each stage's mesh as written; in training plans also the micro-batch rows each device computes (its
slice along the ``data`` mesh dimension) and DeepSpeed's grid for the stage (``data_groups``: devices
equal on every mesh dimension but ``data``; ``model_groups``: devices equal on ``data``).
"""

from __future__ import annotations

from planc import ir, plan as planfile

__all__ = ["stage_record", "loss_devices"]

DATA_AXIS = ir.MeshAxis.DATA


def stage_record(s: ir.StageLayout, micro_batch: int | None, stage: ir.Stage | None = None) -> planfile.Stage:
    """Stage ``s`` as plan.json writes it; ``micro_batch`` None: no training (no rows, no grid). ``stage``:
    the program's, for its sequence parallelism (and why not, ``sequence_parallel_why``) and its own ``zero``."""
    devices = tuple(sorted(s.devices))
    mesh = (s.index, tuple(s.layers) if s.layers else None, devices, _as_lists(s.mesh()), tuple(s.axes), tuple(s.shape),
            tuple(s.devices))
    if micro_batch is None:
        return planfile.Stage(*mesh)
    data = s.axis_size(DATA_AXIS)
    k = s.axes.index(DATA_AXIS) if DATA_AXIS in s.axes else None
    rows = []
    for d in devices:
        i = s.position(d)[k] if k is not None else 0
        rows.append((d, (i * micro_batch // data, (i + 1) * micro_batch // data)))
    sp = stage is not None and stage.sequence_parallel
    why = (("sequence_parallel_why", stage.sequence_why),) if stage is not None and stage.sequence_why else ()
    zero = stage.zero if stage is not None else None   # `stage I ... zero N`: overrides train.zero
    return planfile.Stage(*mesh, tuple(rows), _split(s, k, along=True), _split(s, k, along=False), why, sp, zero)


def loss_devices(last: ir.StageLayout) -> tuple[int, ...]:
    """One device per row range of the last stage: the one at position 0 on every mesh dim but ``data``."""
    k = last.axes.index(DATA_AXIS) if DATA_AXIS in last.axes else None
    return tuple(sorted(d for d in last.devices if all(v == 0 for i, v in enumerate(last.position(d)) if i != k)))


def _split(s: ir.StageLayout, k: int | None, along: bool) -> tuple[tuple[int, ...], ...]:
    """along: devices equal on every mesh dim but ``k`` (a data group); else devices equal on ``k``."""
    groups: dict[tuple, list[int]] = {}
    for d in s.devices:
        pos = s.position(d)
        if along:
            key = tuple(v for i, v in enumerate(pos) if i != k)
        else:
            key = (pos[k],) if k is not None else ()
        groups.setdefault(key, []).append(d)
    return tuple(sorted(tuple(sorted(g)) for g in groups.values()))


def _as_lists(x):
    """The mesh as nested lists (plan.json ``mesh``)."""
    return [_as_lists(y) for y in x] if isinstance(x, tuple) else x
