"""What the compiler chooses for the plan: device flops/memory, train timeout/save_every, stages cut by
planc (``stages = auto(N)``, ``layers auto``: planc.pipeline.cut) and ``schedule = auto``
(planc.pipeline.choose). Located errors for bad values are pinned in tests/golden/diagnostics/auto_*."""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from planc import ir
from planc.lang import load, load_text
from planc.lang.errors import PlanError
from planc.lang.format import summary, to_text
from planc.pipeline.choose import choose_schedule, stage_memory
from planc.pipeline.cut import apply_auto_stages, cut_layers, layer_costs
from planc.pipeline.schedules import build, peak_in_flight
from planc.model.probe import ModelProbe, MeasuredTransfer, check_against_model, probe_model

ROOT = Path(__file__).resolve().parents[2]
EX = str(ROOT / "examples")

CLUSTER = """\
cluster {
  level node x 2 : bandwidth 12.5 GB/s, latency 20 us
  level gpu  x 4 : bandwidth 150 GB/s,  latency 2 us
}
"""
MODEL = """\
model "m.py:build" { layers = 4 }
loss  "m.py:loss"
data  "m.py:batches"
"""


def ok(text: str, path: str = "<plan>") -> ir.Program:
    return load_text(textwrap.dedent(text), path)


def err(text: str) -> str:
    with pytest.raises(PlanError) as ei:
        load_text(textwrap.dedent(text), "t.plan")
    return ei.value.render()


def _strip(p: ir.Program) -> ir.Program:
    return dataclasses.replace(p, source_path="", source_sha256="", source_dir="")


def roundtrip(p: ir.Program) -> None:
    text = to_text(p)
    q = load_text(text, "canonical.plan")
    assert _strip(q) == _strip(p), text
    assert to_text(q) == text


# ---------------------------------------------------------------- cluster flops and memory

@pytest.mark.parametrize("written, value", [
    ("312 TFLOP/s", 312e12), ("1.5 PFLOP/s", 1.5e15), ("900 GFLOP/s", 900e9), ("7 FLOP/s", 7.0),
    ("2 MFLOP/s", 2e6), ("3 KFLOP/s", 3e3), ("312 TFLOPS", 312e12), ("19.5TFLOP/s", 19.5e12),
])
def test_cluster_flops_units(written, value):
    p = ok(f"cluster {{\n  level gpu x 2 : bandwidth 1 GB/s\n  flops = {written}\n}}\n")
    assert p.cluster.flops == pytest.approx(value, rel=1e-12) and p.cluster.memory is None


@pytest.mark.parametrize("written, value", [
    ("80 GB", 80e9), ("80 GiB", 80 * 1024**3), ("512 MiB", 512 * 1024**2), ("1 TB", 1e12), ("1 TiB", 1024**4),
    ("16384 B", 16384), ("640 KB", 640e3),
])
def test_cluster_memory_units(written, value):
    p = ok(f"cluster {{\n  level gpu x 2 : bandwidth 1 GB/s\n  memory = {written}\n}}\n")
    assert p.cluster.memory == pytest.approx(value, rel=1e-12) and p.cluster.flops is None


def test_cluster_flops_and_memory_with_levels_any_order_and_separators():
    p = ok("""
        cluster {
          flops = 312 TFLOP/s, memory = 80 GB
          level node x 2 : bandwidth 12.5 GB/s
          level gpu x 4 : bandwidth 150 GB/s,
                          latency 2 us
          host = node
        }
        parallel { data = 8 }
        """)
    assert (p.cluster.flops, p.cluster.memory) == (312e12, 80e9)
    assert p.cluster.levels[1].latency == pytest.approx(2e-6) and p.cluster.host_level == "node"
    assert "312 TFLOP/s, 80 GB memory each" in summary(p)
    roundtrip(p)


def test_cluster_defaults_unknown():
    p = ok(CLUSTER)
    assert p.cluster.flops is None and p.cluster.memory is None
    assert ir.Cluster((ir.Level("a", 1, None),), "a").memory is None


def test_flops_and_memory_stay_usable_as_names():
    p = ok(CLUSTER.replace("level gpu", "level memory") + "parallel { flops = 2, memory = 4 }\n")
    assert p.parallel.axis_names() == ("flops", "memory") and p.cluster.levels[1].name == "memory"
    # a keyword of one block is a name in another, after a separator too (LALR shared `_sep` before)
    q = ok(CLUSTER + "parallel { data = 2, host = 2,\n level = 2 }\n")
    assert q.parallel.axis_names() == ("data", "host", "level")


@pytest.mark.parametrize("item, needle", [
    ("flops = 312 GB/s", "'GB/s' is not a FLOP rate unit for flops"),
    ("flops = 312", "flops needs a unit"),
    ("flops = -1 TFLOP/s", "flops must be positive, got -1 TFLOP/s"),
    ("flops = 0 TFLOP/s", "flops must be positive"),
    ("memory = 80", "memory needs a unit"),
    ("memory = 80 us", "'us' is not a size unit for memory"),
    ("memory = -80 GB", "memory must be positive, got -80 GB"),
    ("memory = 80 GB\n  memory = 40 GB", "'memory' is set twice in this cluster"),
])
def test_cluster_flops_memory_errors_are_located(item, needle):
    out = err(f"cluster {{\n  level gpu x 2 : bandwidth 1 GB/s\n  {item}\n}}\n")
    assert needle in out and ("t.plan:3:" in out or "t.plan:4:" in out), out


def test_negative_latency_is_an_error_not_a_syntax_error():
    out = err("cluster { level a x 2 : bandwidth 1 GB/s, latency -3 us }\n")
    assert "latency must not be negative" in out and "t.plan:1:51:" in out


def _yaml_plan(tmp_path, body: str) -> Path:
    (tmp_path / "sys.yaml").write_text(textwrap.dedent(body))
    (tmp_path / "p.plan").write_text('cluster "sys.yaml"\nparallel { data = 8 }\n')
    return tmp_path / "p.plan"


@pytest.mark.parametrize("flops, memory, want", [
    ("312e12", "8.0e10", (312e12, 8e10)),                  # plain numbers in base units (YAML keeps 312e12 a string)
    ("312000000000000", "80000000000", (312e12, 8e10)),
    ('"312 TFLOP/s"', '"80 GB"', (312e12, 8e10)),
    ("19.5 TFLOP/s", "40GiB", (19.5e12, 40 * 1024**3)),
])
def test_cluster_yaml_flops_and_memory(tmp_path, flops, memory, want):
    path = _yaml_plan(tmp_path, f"""\
        levels:
          - {{name: node, fanout: 2, bandwidth: 100 Gb/s}}
          - {{name: gpu, fanout: 4, bandwidth: 150 GB/s}}
        flops: {flops}
        memory: {memory}
        """)
    p = load(path)
    assert (p.cluster.flops, p.cluster.memory) == pytest.approx(want, rel=1e-12)


def test_cluster_yaml_nested_and_absent(tmp_path):
    p = load(_yaml_plan(tmp_path, """\
        cluster:
          levels: [{name: gpu, fanout: 8, bandwidth: 1 GB/s}]
          memory: 1 GB
        """))
    assert (p.cluster.flops, p.cluster.memory) == (None, 1e9)


@pytest.mark.parametrize("line, needle", [
    ("flops: -5", "flops: must be a positive FLOP rate, got -5"),
    ("flops: 312 GB/s", "flops: expected a FLOP rate such as '312 TFLOP/s', got '312 GB/s'"),
    ("memory: 0", "memory: must be a positive size, got 0"),
    ("memory: [80]", "memory: expected a size (a number in base units or a quantity string), got [80]"),
    ("memory: .inf", "memory: expected a finite size"),
    ("memory: true", "memory: expected a size"),
])
def test_cluster_yaml_flops_memory_errors(tmp_path, line, needle):
    path = _yaml_plan(tmp_path, f"levels: [{{name: gpu, fanout: 8, bandwidth: 1 GB/s}}]\n{line}\n")
    with pytest.raises(PlanError) as ei:
        load(path)
    out = ei.value.render()
    assert needle in out and "cluster file 'sys.yaml'" in out and "p.plan:1:9:" in out, out


# ---------------------------------------------------------------- train timeout, save_every, schedule = auto

def test_train_timeout_save_every_and_auto_schedule():
    p = ok(CLUSTER + "parallel { data = 8 }\ntrain { timeout = 60 s, save_every = 5, schedule = auto }\n")
    assert (p.train.timeout, p.train.save_every, p.train.schedule) == (60.0, 5, ir.PipeSchedule.AUTO)
    assert (p.train.schedule_span.line, p.train.schedule_span.col) == (6, 52)
    roundtrip(p)


@pytest.mark.parametrize("written, seconds", [("250 ms", 0.25), ("2.5 s", 2.5), ("90000 us", 0.09), ("1e3 s", 1000.0)])
def test_train_timeout_units(written, seconds):
    p = ok(CLUSTER + f"train {{ timeout = {written} }}\n")
    assert p.train.timeout == pytest.approx(seconds, rel=1e-12)
    roundtrip(p)


def test_train_defaults_for_new_settings():
    p = ok(CLUSTER)
    assert (p.train.timeout, p.train.save_every) == (None, None)
    assert ir.PipeSchedule.AUTO not in ir.PipeSchedule.concrete() and len(ir.PipeSchedule.concrete()) == 6


@pytest.mark.parametrize("setting, needle", [
    ("timeout = -5 s", "timeout must be positive, got -5 s"),
    ("timeout = 0 s", "timeout must be positive"),
    ("timeout = 60", "timeout is a time with its unit, e.g. 'timeout = 60 s'"),
    ("timeout = 60 GB", "'GB' is not a time unit"),
    ("save_every = 0", "save_every must be at least 1, got 0"),
    ("save_every = -2", "save_every must be at least 1, got -2"),
    ("save_every = 2.5", "save_every must be a whole number, got 2.5"),
    ("save_every = 10 s", "save_every must be a whole number"),
    ("schedule = automatic", "schedule must be one of gpipe, 1f1b, eager_1f1b, interleaved_1f1b(virtual = V), "
                             "zb_h1, zbv or auto"),
])
def test_train_new_setting_errors_are_located(setting, needle):
    out = err(CLUSTER + f"train {{ {setting} }}\n")
    assert needle in out and "t.plan:5:" in out, out


# ---------------------------------------------------------------- stages = auto(N), layers auto

def test_stages_auto_on_the_pipe_axis():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\n"
           "transfer h from stage 0 to stage 1\n")
    assert p.stage_mode is ir.StageMode.PIPE_AXIS and p.auto_stages
    assert [(s.index, s.layers, s.auto_layers, s.mesh_axes) for s in p.stages] == [
        (0, None, True, ("data",)), (1, None, True, ("data",))]
    assert (p.stages[0].span.line, p.stages[0].span.col) == (9, 1)   # the `stages = auto(2)` statement
    assert "layers auto (cut at compile time)" in summary(p)
    assert "  stages = auto(2)\n" in to_text(p)
    roundtrip(p)


def test_stages_auto_without_a_count_takes_the_pipe_size():
    p = ok(CLUSTER + "parallel { pipe = 4, data = 2 }\n" + MODEL + "stages = auto\n")
    assert len(p.stages) == 4 and all(s.auto_layers for s in p.stages)
    q = ok(CLUSTER + "parallel { data = 8 }\n" + MODEL + "stages = auto(1)\n")
    assert len(q.stages) == 1 and q.stages[0].auto_layers


def test_stages_auto_with_explicit_meshes():
    p = ok(CLUSTER + MODEL + "stages = auto(2)\nstage 0 on devices 0..4 as (data = 4)\n"
           "stage 1 on devices 4..8 as (data = 2, tensor = 2)\ntransfer h from stage 0 to stage 1\n")
    assert p.stage_mode is ir.StageMode.EXPLICIT and p.auto_stages
    assert [(s.layers, s.auto_layers, s.mesh_shape) for s in p.stages] == [(None, True, (4,)), (None, True, (2, 2))]
    text = to_text(p)
    assert "  stage 0 : layers auto on devices 0..4 as (data = 4)\n" in text and "stages = auto" not in text
    roundtrip(p)


def test_layers_auto_on_explicit_and_derived_stages():
    p = ok(CLUSTER + MODEL + "stage 0 : layers auto on devices 0..2 as (2)\nstage 1 : layers auto on devices 2..8 as (2, 3)\n")
    assert p.auto_stages and [s.mesh_shape for s in p.stages] == [(2,), (2, 3)]
    roundtrip(p)
    q = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stage 0 : layers auto\nstage 1 : layers auto\n")
    assert q.auto_stages and len(q.stages) == 2
    roundtrip(q)


def test_transfer_layer_check_waits_for_the_cut():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\n"
           "transfer h from stage 0 to stage 1\ntransfer skip from stage 0 layer 3 to stage 1\n")
    assert p.transfers[1].src_layer == 3


@pytest.mark.parametrize("text, needle", [
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(0)\n",
     "t.plan:9:15: error: the number of stages in auto(N) must be at least 1, got 0"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(3)\n",
     "t.plan:9:15: error: stages = auto(3) but the 'pipe' axis has size 2"),
    (CLUSTER + "parallel { data = 8 }\n" + MODEL + "stages = auto(2)\n",
     "t.plan:9:15: error: stages = auto(2) needs a 'pipe' axis of size 2"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2.5)\n",
     "the number of stages in auto(N) must be a whole number, got 2.5"),
    (CLUSTER + MODEL + "stages = auto(2)\n", "t.plan:8:1: error: 'stages = auto(N)' takes its stages from the 'pipe' axis"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\nstages = auto(2)\n",
     "t.plan:6:1: error: 'stages = auto(N)' lets planc cut the model's layers into stages, but this plan has no model"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\nstage 0 : layers 0..2\nstage 1 : layers 2..4\n",
     "t.plan:10:18: error: with 'stages = auto(N)' planc chooses every stage's layers"),
    (CLUSTER + MODEL + "stages = auto(3)\nstage 0 on devices 0..4 as (4)\nstage 1 on devices 4..8 as (4)\n",
     "t.plan:8:15: error: stages = auto(3) cuts the model into 3 stages but 2 stage meshes are declared"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stage 0 : layers auto\nstage 1 : layers 2..4\n",
     "t.plan:10:18: error: either every stage's layers are 'auto' or none are"),
    (CLUSTER + "stage 0 : layers auto on devices 0..8 as (8)\n",
     "t.plan:5:18: error: 'layers auto' lets planc cut the model's layers into stages, but this plan has no model"),
    (CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\nstages = auto(2)\n",
     "t.plan:10:1: error: 'stages' may appear only once (first at line 9)"),
])
def test_auto_stage_errors_are_located(text, needle):
    assert needle in err(text)


def test_a_model_plan_without_stage_layers_suggests_auto():
    out = err(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL)
    assert "or let planc cut them ('stages = auto(2)')" in out
    out = err(CLUSTER + MODEL + "stage 0 on devices 0..8 as (8)\n")
    assert "'layers auto' to let planc cut them" in out


# ---------------------------------------------------------------- cut_layers: exact, against brute force

def brute_cut(costs, n, speeds=None, holds=()):
    """Every cut; the smallest slowest stage (exact), then the lexicographically smallest boundaries."""
    L = len(costs)
    speeds = speeds or [1] * n
    best = None
    for bounds in itertools.combinations(range(1, L), n - 1):
        edges = (0,) + bounds + (L,)
        ranges = list(zip(edges, edges[1:]))
        if any(not (ranges[s][0] <= l < ranges[s][1]) for s, l in holds):
            continue
        worst = max(sum(Fraction(c) for c in costs[a:b]) / Fraction(speeds[i]) for i, (a, b) in enumerate(ranges))
        if best is None or worst < best[0]:
            best = (worst, ranges)
    return None if best is None else best[1]


@st.composite
def cut_case(draw):
    L = draw(st.integers(1, 9))
    n = draw(st.integers(1, L))
    kind = draw(st.sampled_from(["int", "float", "zeros"]))
    if kind == "int":
        costs = draw(st.lists(st.integers(0, 20), min_size=L, max_size=L))
    elif kind == "zeros":
        costs = draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=L, max_size=L))
    else:
        costs = draw(st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=L, max_size=L))
    speeds = draw(st.one_of(st.none(), st.lists(st.sampled_from([1, 2, 3, 4, 8, 0.5]), min_size=n, max_size=n)))
    holds = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, L - 1)), max_size=2))
    return costs, n, speeds, holds


@settings(max_examples=400, deadline=None)
@given(cut_case())
def test_cut_layers_matches_brute_force(case):
    costs, n, speeds, holds = case
    want = brute_cut(costs, n, speeds, holds)
    if want is None:
        with pytest.raises(ValueError):
            cut_layers(costs, n, speeds=speeds, holds=holds)
        return
    got = cut_layers(costs, n, speeds=speeds, holds=holds)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(costs) and all(a < b for a, b in got)
    assert all(x[1] == y[0] for x, y in zip(got, got[1:]))


def test_cut_layers_examples_and_tie_break():
    assert cut_layers([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert cut_layers([1, 0, 0, 1], 2) == [(0, 1), (1, 4)]        # every cut ties at 1: the earliest
    assert cut_layers([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert cut_layers([1, 1, 1, 1, 1, 1], 2, speeds=[1, 2]) == [(0, 2), (2, 6)]   # stage 1 has twice the devices
    assert cut_layers([3, 3, 3], 3) == [(0, 1), (1, 2), (2, 3)]
    assert cut_layers([1, 1, 1, 1], 2, holds=[(0, 2)]) == [(0, 3), (3, 4)]
    assert cut_layers([7], 1) == [(0, 1)]


@pytest.mark.parametrize("args", [([1, 2], 3), ([1, 2], 0), ([1, -2], 1), ([1, math.inf], 1), ([], 1)])
def test_cut_layers_rejects_impossible_inputs(args):
    with pytest.raises(ValueError):
        cut_layers(*args)
    with pytest.raises(ValueError, match="pinned"):
        cut_layers([1, 1, 1], 2, holds=[(0, 2), (1, 0)])


def test_cut_layers_is_fast_enough_for_deep_models():
    costs = [(i * 7919) % 101 + 1 for i in range(400)]
    got = cut_layers(costs, 16)
    assert len(got) == 16 and got[-1][1] == 400


# ---------------------------------------------------------------- the probe counts FLOPs

def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "t.plan"
    path.write_text(textwrap.dedent(text).replace("EX", EX))
    return path


MLP_AUTO = """\
plan m {
  cluster {
    level node x 2 : bandwidth 12.5 GB/s
    level gpu x 4 : bandwidth 150 GB/s
    flops = 100 TFLOP/s
    memory = MEMORY
  }
  parallel { pipe = 2, data = 4 }
  model "EX/mlp.py:build" { layers = 6, hidden = 16, inputs = 8, outputs = 4 }
  loss "EX/mlp.py:loss"
  data "EX/mlp.py:batches"
  stages = auto(2)
  transfer h from stage 0 to stage 1
  train { micro_batch = 8, micro_batches = 4, schedule = auto }
}
"""


@pytest.fixture(scope="module")
def mlp_chain(tmp_path_factory):
    path = _write(tmp_path_factory.mktemp("mlp"), MLP_AUTO.replace("MEMORY", "80 GB"))
    program = load(path)
    return program, probe_model(program)


def test_probe_counts_mlp_flops_as_the_analytic_matmuls(mlp_chain):
    program, probe = mlp_chain
    rows, sizes = 8, [8, 16, 16, 16, 16, 16, 4]
    assert probe.chain and probe.transfers == () and not probe.graph_errors
    for i, (fwd, bwd) in enumerate(probe.layer_flops):
        n_in, n_out = sizes[i], sizes[i + 1]
        assert fwd == 2 * n_in * n_out * rows                       # y = x W^T + b
        # weights' gradient, and the input's for every layer but the one fed the data
        assert bwd == (1 if i == 0 else 2) * 2 * n_in * n_out * rows
    assert probe.layer_output_bytes == tuple(rows * n * 4 for n in sizes[1:])


def test_probe_flops_only_when_asked(tmp_path):
    path = _write(tmp_path, MLP_AUTO.replace("MEMORY", "80 GB").replace("    flops = 100 TFLOP/s\n", "")
                  .replace("stages = auto(2)", "stage 0 : layers 0..3\n  stage 1 : layers 3..6"))
    program = load(path)
    assert not program.auto_stages
    probe = probe_model(program)
    assert probe.layer_flops == () and not probe.chain and probe.measured("h").shape == (8, 16)
    assert probe_model(program, flops=True).layer_flops[1] == (2 * 16 * 16 * 8, 4 * 16 * 16 * 8)


def test_uncut_stages_are_not_inferred(mlp_chain):
    program, probe = mlp_chain
    with pytest.raises(PlanError, match="were not cut before inference"):
        check_against_model(program, probe)


# ---------------------------------------------------------------- apply_auto_stages

def test_apply_auto_stages_on_mlp_and_the_driver_sequence(mlp_chain):
    from planc.driver.compile import compile_program
    program, probe = mlp_chain
    cut, why = apply_auto_stages(program, probe)
    # costs 4096, 12288 x 4, 3072 over 4 devices each: 0..3 | 3..6 (28672 vs 27648)
    assert [s.layers for s in cut.stages] == [(0, 3), (3, 6)] and all(s.auto_layers for s in cut.stages)
    assert not cut.auto_stages
    assert why.startswith("cut 0..3 | 3..6 into 2 stages: slowest stage 0 with 7.17 kFLOP per device")
    assert "balance 0.98" in why and "at 100 TFLOP/s" in why
    probe2 = probe_model(cut)                           # the real dataflow of the cut stages
    assert probe2.measured("h").shape == (8, 16)
    schedule, reason = choose_schedule(cut, cut.stages, probe2)
    assert schedule is ir.PipeSchedule.EAGER_1F1B and reason.startswith("eager_1f1b: fits memory = 80 GB")
    final = dataclasses.replace(cut, train=dataclasses.replace(cut.train, schedule=schedule))
    compiled = compile_program(final, probe2, verify=True)
    assert [s["layers"] for s in compiled.plan_json["stages"]] == [[0, 3], [3, 6]]
    assert compiled.plan_json["pipeline"]["schedule"] == "eager_1f1b"


def test_apply_auto_stages_leaves_cut_programs_alone():
    p = ok(CLUSTER + "parallel { data = 8 }\n")
    assert apply_auto_stages(p, None) == (p, "")


def synthetic(flops, params=None, shapes=None, out_bytes=None, tensor_parallel=False, graph_errors=(), transfers=()):
    n = len(flops)
    return ModelProbe(
        layer_params=tuple(params or [10] * n),
        layer_shapes=tuple(shapes or [(8, 4)] * n),
        layer_dtypes=("f32",) * n,
        transfers=tuple(transfers),
        micro_batch=8,
        tensor_parallel=tensor_parallel,
        layer_output_bytes=tuple(out_bytes or [128] * n),
        layer_flops=tuple(flops),
        graph_errors=tuple(graph_errors),
        chain=True,
    )


def test_apply_auto_stages_divides_by_each_explicit_mesh():
    p = ok(CLUSTER + MODEL + "stages = auto(2)\nstage 0 on devices 0..2 as (data = 2)\n"
           "stage 1 on devices 2..8 as (data = 3, tensor = 2)\ntransfer h from stage 0 to stage 1\n")
    flops = [(10, 20)] * 8
    cut, why = apply_auto_stages(p, synthetic(flops))
    # no tensor-parallel opt-in: stage 1 shares work over data = 3 only: 30k/2 vs 30(8-k)/3 -> k = 3
    assert [s.layers for s in cut.stages] == [(0, 3), (3, 8)]
    cut, why = apply_auto_stages(p, synthetic(flops, tensor_parallel=True))
    assert [s.layers for s in cut.stages] == [(0, 2), (2, 8)] and "devices sharing each stage's work: 2, 6" in why


def test_apply_auto_stages_falls_back_to_parameters_and_pins_transfer_layers():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\n"
           "transfer h from stage 0 to stage 1\ntransfer skip from stage 0 layer 2 to stage 1\n")
    flops = [(0, 0), (100, 200), (100, 200), (100, 200), None]
    probe = synthetic(flops, params=[50, 1, 1, 1, 0], shapes=[(8, 2, 4)] * 5)
    costs, by_params, free = layer_costs(probe, 8)
    assert costs == [6 * 50 * 16, 300, 300, 300, 0] and by_params == [0] and free == [4]
    cut, why = apply_auto_stages(p, probe)
    assert [s.layers for s in cut.stages] == [(0, 3), (3, 5)]   # layer 2 pinned into stage 0
    assert "layer 0 reports 0 FLOPs: counted as 6 x parameters x rows" in why
    assert "layer 4 reports 0 FLOPs and hold no parameters" in why or "layer 4 reports 0 FLOPs" in why
    assert "pinned by transfers: layer 2 in stage 0" in why


@pytest.mark.parametrize("probe, needle", [
    (None, "compile without --no-probe"),
    ("chain", "it cuts by running the layers as a chain"),
    ("short", "cannot cut 1 layer into 2 stages"),
    ("uncounted", "did not count the layers' FLOPs"),
])
def test_apply_auto_stages_errors_are_located(probe, needle):
    p = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\ntransfer h from stage 0 to stage 1\n")
    probe = {None: None,
             "chain": synthetic([(1, 1)] * 4, graph_errors=["stage 0 layer 3 (Dec2) failed on inputs (f32[4, 8]): TypeError"]),
             "short": synthetic([(1, 1)]),
             "uncounted": dataclasses.replace(synthetic([(1, 1)] * 4), layer_flops=())}[probe]
    with pytest.raises(PlanError) as ei:
        apply_auto_stages(p, probe)
    d = ei.value.diagnostics[0]
    assert needle in d.message and (d.span.line, d.span.col) == (9, 1)


def test_apply_auto_stages_transfer_from_a_layer_past_the_model():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 4 }\n" + MODEL + "stages = auto(2)\n"
           "transfer h from stage 0 layer 9 to stage 1\n")
    with pytest.raises(PlanError, match="transfer 'h' is sent from layer 9, but the model has 4 layers"):
        apply_auto_stages(p, synthetic([(1, 1)] * 4))


def test_a_model_that_needs_skip_inputs_cannot_be_cut(tmp_path):
    path = _write(tmp_path, """\
        plan u {
          cluster { level node x 3 : bandwidth 12.5 GB/s
                    level gpu x 2 : bandwidth 150 GB/s }
          parallel { pipe = 3, data = 2 }
          model "EX/unet.py:build" { channels = 4, inputs = 2, length = 16 }
          loss "EX/unet.py:loss"
          data "EX/unet.py:batches"
          stages = auto(3)
          transfer down from stage 0 to stage 1
          transfer mid from stage 1 to stage 2
          transfer e2 from stage 0 layer 1 to stage 2
          transfer e1 from stage 0 layer 0 to stage 2
          train { micro_batch = 4 }
        }
        """)
    program = load(path)
    with pytest.raises(PlanError) as ei:
        apply_auto_stages(program, probe_model(program))
    d = ei.value.diagnostics[0]
    assert (d.span.line, d.span.col) == (8, 3)
    assert "layer 3 (Dec2) failed on inputs (f32[4, 8, 8])" in d.message and "write each stage's layers" in d.message


# ---------------------------------------------------------------- choose_schedule

def test_peak_in_flight_is_the_lists_bound():
    """From F until B, or until W where the schedule splits the backward (zb_h1, zbv)."""
    cases = [(s, S, B, 1) for s in ("gpipe", "1f1b", "eager_1f1b", "zb_h1") for S in range(1, 5) for B in range(1, 9)]
    cases += [("zbv", S, B, 1) for S in (2, 4, 6) for B in range(1, 9)]
    cases += [("interleaved_1f1b", P * V, B, V) for P in (1, 2, 3) for V in (2, 3) for B in range(P, 9, P)]
    for schedule, S, B, V in cases:
        lists = build(schedule, S, B, virtual=V).per_stage   # the compute orders
        for i, ops in enumerate(lists):
            end = "W" if any(k == "W" for k, _ in ops) else "B"
            live = peak = 0
            for kind, _ in ops:
                live += 1 if kind == "F" else -1 if kind == end else 0
                peak = max(peak, live)
            assert peak == peak_in_flight(schedule, S, i, B, V), (schedule, S, B, V, i)


def _with_memory(memory, micro_batches=8, optimizer="adam(lr = 1e-3)"):
    mem = f"  memory = {memory}\n" if memory else ""
    return ok("cluster {\n  level node x 2 : bandwidth 12.5 GB/s\n  level gpu x 4 : bandwidth 150 GB/s\n" + mem + "}\n"
              "parallel { pipe = 2, data = 4 }\n" + MODEL +
              "stage 0 : layers 0..2\nstage 1 : layers 2..4\ntransfer h : f32[8, 1000] from stage 0 to stage 1\n"
              f"train {{ micro_batches = {micro_batches}, schedule = auto, optimizer = {optimizer} }}\n")


# 4 layers of 1000 parameters, each returning 32000 bytes for the micro-batch; data = 4 per stage
PROBE = synthetic([(1, 1)] * 4, params=[1000] * 4, out_bytes=[32000] * 4,
                  transfers=[MeasuredTransfer("h", "f32", (8, 1000))])


def test_memory_estimate_per_stage():
    p = _with_memory("1 GB")
    m0, m1 = stage_memory(p, p.stages, PROBE)
    assert m0.static == m1.static == 2000 * 4 * (2 + 2)          # weights, gradients, two Adam moments (fp32)
    assert m0.activations(1) == 2 * 32000 / 4 and m1.activations(1) == (2 * 32000 + 32000) / 4   # + received
    p = _with_memory("1 GB", optimizer="sgd(lr = 0.1)")
    assert stage_memory(p, p.stages, PROBE)[0].static == 2000 * 4 * 2


def test_choose_schedule_prefers_eager_when_it_fits():
    p = _with_memory("1 GB")
    schedule, why = choose_schedule(p, p.stages, PROBE)
    assert schedule is ir.PipeSchedule.EAGER_1F1B and "fits memory = 1 GB on every stage" in why


def test_choose_schedule_falls_back_to_1f1b():
    # eager: stage 0 holds 3 in flight: 32000 + 3 x 16000 = 80000; 1f1b: 2 in flight: 64000
    p = _with_memory("79 KB")
    schedule, why = choose_schedule(p, p.stages, PROBE)
    assert schedule is ir.PipeSchedule.ONE_F_ONE_B
    assert why.startswith("1f1b: eager_1f1b would need 80 KB (parameters 8 KB, gradients 8 KB, optimizer 16 KB, "
                          "activations 48 KB: 3 micro-batches in flight x 16 KB) on stage 0")
    assert "more than memory = 79 KB" in why


def test_choose_schedule_errors_when_nothing_fits():
    p = _with_memory("50 KB")
    with pytest.raises(PlanError) as ei:
        choose_schedule(p, p.stages, PROBE)
    d = ei.value.diagnostics[0]
    assert "no schedule fits in memory = 50 KB per device" in d.message
    assert (d.span.line, d.span.col) == (13, 39)   # at `auto` of `schedule = auto`


def test_choose_schedule_without_a_limit_or_a_probe():
    p = _with_memory(None)
    assert choose_schedule(p, p.stages, PROBE)[0] is ir.PipeSchedule.EAGER_1F1B
    assert choose_schedule(p, p.stages, None)[0] is ir.PipeSchedule.EAGER_1F1B
    q = _with_memory("1 GB")
    schedule, why = choose_schedule(q, q.stages, None)
    assert schedule is ir.PipeSchedule.ONE_F_ONE_B and "--no-probe" in why


def test_choose_schedule_with_one_micro_batch_everything_is_the_same():
    p = _with_memory("60 KB", micro_batches=1)   # 32000 + 1 x 24000 on stage 1 either way
    assert choose_schedule(p, p.stages, PROBE)[0] is ir.PipeSchedule.EAGER_1F1B


def test_auto_choices_reach_plan_json_and_explain(tmp_path):
    """stages = auto(2) and schedule = auto through the real driver: concrete stages and schedule in
    plan.json, the reasons under `choices`, and `planc explain` prints them."""
    import json
    import subprocess
    import sys
    ex = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    src = tmp_path / "auto.plan"
    src.write_text(f"""
plan auto_both {{
  cluster {{
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu  x 2 : bandwidth 150 GB/s,  latency 2 us
    flops = 312 TFLOP/s
    memory = 80 GB
  }}
  parallel {{ pipe = 2, data = 2 }}
  model "{ex}:build" {{ layers = 4 }}
  loss  "{ex}:loss"
  data  "{ex}:batches"
  stages = auto(2)
  transfer h from stage 0 to stage 1
  reduce gradients over data
  train {{ micro_batch = 8, micro_batches = 4, steps = 2, schedule = auto, timeout = 60 s, save_every = 2,
          optimizer = sgd(lr = 0.1) }}
}}
""")
    r = subprocess.run([sys.executable, "-m", "planc", "compile", str(src), "-o", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert [s["layers"] for s in plan["stages"]] == [[0, 2], [2, 4]]
    predicted = plan["pipeline"]["predicted"]["schedules"]
    chosen = plan["train"]["schedule"]
    assert plan["pipeline"]["schedule"] == chosen
    assert predicted[chosen]["iteration"] == min(p["iteration"] for p in predicted.values()), predicted
    assert plan["train"]["timeout"] == 60.0 and plan["train"]["save_every"] == 2
    assert plan["cluster"]["flops"] == 312e12 and plan["cluster"]["memory"] == 80e9
    assert set(plan["choices"]) == {"stages", "schedule"}
    e = subprocess.run([sys.executable, "-m", "planc", "explain", str(src)], capture_output=True, text=True)
    assert e.returncode == 0 and "stages = auto: cut 0..2 | 2..4" in e.stdout and f"schedule = auto: {chosen}" in e.stdout
