"""`planc explain --schedule-csv FILE`: the plan's schedule as torch pipelining's compute-only CSV.

torch's ``PipelineScheduleMulti._load_csv(FILE)`` (format ``compute_only``) reads one row per pipeline
rank, each cell an action ``<stage><type><micro-batch>``: ``F`` forward, ``B`` a full backward, ``I``
the input-gradient backward and ``W`` the weight gradients of a split one. planc's ``B`` is torch's
``I`` where the stage also has ``W`` actions, else ``B``. Rows are the rank classes of plan.json
``pipeline.actions`` in order of their first stage (a rank of pipe coordinate p runs the class of stage p:
under interleaved_1f1b stages p, p + P, ..., under zbv p and 2P - 1 - p, all in one row), and a cell per
compute action in list order; torch adds the sends and receives itself (between two stages of one rank:
none, as a plan's ``local`` transfer).

Only a *uniform* plan can be written: torch's schedules run every stage on one rank of a pipeline
group, each rank the same number of stages, stage i's output feeding stage i + 1 alone. A plan whose
stage meshes differ in size, whose rank classes run different numbers of stages, or with a transfer other
than stage i to stage i + 1, is refused with the reason.
"""
from __future__ import annotations

import csv
import io

from planc import plan as planfile

__all__ = ["ScheduleCsvError", "schedule_csv"]


class ScheduleCsvError(ValueError):
    pass


def schedule_csv(plan: planfile.Plan) -> str:
    """The CSV text (rows end with ``\\r\\n``, as ``csv.writer`` writes them)."""
    if plan.pipeline is None:
        raise ScheduleCsvError("the plan has no pipeline (no model), so no schedule to write")
    sizes = {len(st.devices) for st in plan.stages}
    if len(sizes) > 1:
        raise ScheduleCsvError(f"torch's schedules run every stage on equal meshes; this plan's stages have "
                               f"{', '.join(str(len(st.devices)) for st in plan.stages)} devices")
    per = {len(c.stages) for c in plan.pipeline.actions}
    if len(per) > 1:
        raise ScheduleCsvError(f"torch's schedules run as many stages on every rank; this plan's rank classes run "
                               f"{', '.join(str(len(c.stages)) for c in plan.pipeline.actions)}")
    for t in plan.transfers:
        if t.dst_stage != t.src_stage + 1:
            raise ScheduleCsvError(f"transfer {t.name!r} goes from stage {t.src_stage} to stage {t.dst_stage}; "
                                   "torch's schedules only pass stage i's output to stage i + 1")
    rows = []
    for cls in sorted(plan.pipeline.actions, key=lambda c: min(c.stages)):
        split = {a.stage for a in cls.actions if a.kind == "W"}
        rows.append([f"{a.stage}{'I' if a.kind == 'B' and a.stage in split else a.kind}{a.micro_batch}"
                     for a in cls.compute()])
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()
