"""The front end on the pipeline schedules (LANGUAGE.md, "Pipeline schedules"): interleaved_1f1b(virtual = V),
zb_h1 and zbv, the stage counts they need on a `pipe` axis, shared explicit meshes, and the canonical text.
The refusals' exact text is pinned by the goldens (tests/golden/diagnostics/sched_*.plan)."""
from __future__ import annotations

import pytest

from planc import ir
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.lang.format import to_text

HEAD = """cluster {
  level node x 2 : bandwidth 12.5 GB/s
  level gpu  x 4 : bandwidth 150 GB/s
}
model "m.py:build" { layers = 4 }
loss  "m.py:loss"
data  "m.py:batches"
"""


def load(body: str) -> ir.Program:
    return load_text(HEAD + body, "p.plan")


def error(body: str) -> str:
    with pytest.raises(PlanError) as ei:
        load(body)
    return "\n".join(d.message for d in ei.value.diagnostics)


@pytest.mark.parametrize("written, schedule, virtual", [
    ("interleaved_1f1b(virtual = 2)", "interleaved_1f1b", 2), ("interleaved_1f1b(virtual = 3)", "interleaved_1f1b", 3),
    ("zb_h1", "zb_h1", 1), ("zbv", "zbv", 1), ("1f1b", "1f1b", 1)])
def test_the_forms_are_read(written, schedule, virtual):
    per = {"interleaved_1f1b": virtual, "zbv": 2}.get(schedule, 1)
    p = load(f"parallel {{ pipe = 2, data = 4 }}\nstages = auto({2 * per})\n"
             f"train {{ schedule = {written}, micro_batch = 8, micro_batches = 6 }}\n")
    assert (p.train.schedule, p.train.virtual) == (ir.PipeSchedule(schedule), virtual)
    assert len(p.stages) == 2 * per
    again = load_text(to_text(p), "again.plan")    # the canonical text writes the schedule back
    assert (again.train.schedule, again.train.virtual) == (p.train.schedule, p.train.virtual)


def test_stages_auto_without_a_count_takes_the_schedules():
    p = load("parallel { pipe = 2, data = 4 }\nstages = auto\ntrain { schedule = interleaved_1f1b(virtual = 3), "
             "micro_batch = 8, micro_batches = 4 }\n")
    assert len(p.stages) == 6 and all(s.auto_layers for s in p.stages)
    assert len(load("parallel { pipe = 2, data = 4 }\nstages = auto\ntrain { schedule = zbv, micro_batch = 8 }\n")
               .stages) == 4


def test_stage_lines_under_interleaved():
    p = load("parallel { pipe = 2, data = 4 }\n" + "".join(f"stage {i} : layers {i}..{i + 1}\n" for i in range(4))
             + "train { schedule = interleaved_1f1b(virtual = 2), micro_batch = 8 }\n")
    assert [s.index for s in p.stages] == [0, 1, 2, 3]


def test_shared_explicit_meshes():
    meshes = ["0..4", "4..8", "0..4", "4..8"]
    p = load("".join(f"stage {i} : layers {i}..{i + 1} on devices {d} as (data = 4)\n" for i, d in enumerate(meshes))
             + "train { schedule = interleaved_1f1b(virtual = 2), micro_batch = 8 }\n")
    assert p.stages[0].explicit_devices == p.stages[2].explicit_devices
    v = ["0..4", "4..8", "4..8", "0..4"]
    p = load("".join(f"stage {i} : layers {i}..{i + 1} on devices {d} as (data = 4)\n" for i, d in enumerate(v))
             + "train { schedule = zbv, micro_batch = 8 }\n")
    assert p.stages[1].explicit_devices == p.stages[2].explicit_devices


@pytest.mark.parametrize("body, words", [
    ("parallel { pipe = 2, data = 4 }\nstages = auto(4)\ntrain { schedule = zb_h1, micro_batch = 8 }\n",
     "the stages are the pipe coordinates"),
    ("parallel { pipe = 2, data = 4 }\nstages = auto(2)\ntrain { schedule = zbv, micro_batch = 8 }\n",
     "needs stages = auto(4)"),
    ("parallel { pipe = 2, data = 4 }\nstages = auto(6)\ntrain { schedule = interleaved_1f1b(virtual = 2), "
     "micro_batch = 8 }\n", "needs stages = auto(4)"),
    ("parallel { pipe = 4, data = 2 }\nstages = auto(8)\ntrain { schedule = interleaved_1f1b(virtual = 2), "
     "micro_batch = 8, micro_batches = 6 }\n", "micro_batches must be a multiple of 4, got 6 (e.g. 4, 8)"),
    ("parallel { pipe = 2, data = 4 }\nstages = auto(4)\ntrain { schedule = interleaved_1f1b(virtual = two) }\n",
     "virtual must be a whole number"),
])
def test_refusals(body, words):
    assert words in error(body)


def test_a_plan_without_a_model_keeps_one_stage_per_coordinate():
    p = load_text("cluster { level node x 4 : bandwidth 1 GB/s }\nparallel { pipe = 2, data = 2 }\n"
                  "train { schedule = zbv }\n", "p.plan")
    assert len(p.stages) == 2
