"""Every construct of LANGUAGE.md parses and means what the page says (front end only)."""

from __future__ import annotations

import textwrap

import pytest

from planc import ir
from planc.lang import load, load_text
from planc.lang.errors import PlanError

CLUSTER = """\
cluster {
  level node x 2 : bandwidth 12.5 GB/s, latency 20 us
  level gpu  x 4 : bandwidth 150 GB/s,  latency 2 us
  host = node
}
"""
MODEL = """\
model "m.py:build" { layers = 4, hidden = 64, name = "gpt", tie = true, sizes = [1, 2] }
loss  "m.py:loss"
data  "m.py:batches"
"""


def ok(text: str, path: str = "<plan>") -> ir.Program:
    return load_text(textwrap.dedent(text), path)


def err(text: str) -> str:
    with pytest.raises(PlanError) as ei:
        load_text(textwrap.dedent(text), "t.plan")
    return ei.value.render()


# ---------------------------------------------------------------- cluster

def test_inline_cluster_levels_units_and_host():
    p = ok(CLUSTER + "parallel { data = 8 }\n")
    node, gpu = p.cluster.levels
    assert (node.name, node.fanout, node.bandwidth, node.latency) == ("node", 2, 12.5e9, 20e-6)
    assert (gpu.name, gpu.fanout, gpu.bandwidth, gpu.latency) == ("gpu", 4, 150e9, 2e-6)
    assert p.cluster.host_level == "node" and p.cluster.devices == 8


@pytest.mark.parametrize("q, bps", [
    ("100 Gb/s", 12.5e9), ("800 Mb/s", 1e8), ("1 TB/s", 1e12), ("5 MB/s", 5e6),
    ("3 KB/s", 3e3), ("7 B/s", 7.0), ("12.5GB/s", 12.5e9),
])
def test_bandwidth_units(q, bps):
    p = ok(f"cluster {{ level a x 2 : bandwidth {q} }}\n")
    assert p.cluster.levels[0].bandwidth == pytest.approx(bps, rel=1e-12)


@pytest.mark.parametrize("q, s", [("1 s", 1.0), ("3 ms", 3e-3), ("20 us", 20e-6), ("5 ns", 5e-9), ("2.5e1 us", 25e-6)])
def test_time_units(q, s):
    p = ok(f"cluster {{ level a x 2 : bandwidth 1 GB/s, latency {q} }}\n")
    assert p.cluster.levels[0].latency == pytest.approx(s, rel=1e-12)


def test_latency_defaults_to_zero_and_single_unit_level_needs_no_bandwidth():
    p = ok("cluster {\n level rack x 1\n level gpu x 2 : bandwidth 1 GB/s\n}\n")
    assert p.cluster.levels[0].bandwidth is None and p.cluster.levels[1].latency == 0.0
    assert p.cluster.host_level == "gpu"  # default host: the first level with N > 1


def test_level_attributes_after_a_comma_continue_the_previous_level():
    p = ok("""
        cluster {
          level node x 2 : bandwidth 10 GB/s,
                           latency 5 us
          level gpu x 2 : bandwidth 100 GB/s
        }
        """)
    assert p.cluster.levels[0].latency == pytest.approx(5e-6)
    assert p.cluster.host_level == "node"


def test_cluster_yaml_file(tmp_path):
    (tmp_path / "sys.yaml").write_text(textwrap.dedent("""\
        levels:
          - {name: node, fanout: 2, bandwidth: 100 Gb/s, latency: 20 us}
          - {name: gpu, fanout: 4, bandwidth: "150 GB/s", latency: 2us}
        host: node
        """))
    (tmp_path / "p.plan").write_text('cluster "sys.yaml"\nparallel { data = 2, tensor = 4 }\n')
    p = load(tmp_path / "p.plan")
    assert [(l.name, l.fanout) for l in p.cluster.levels] == [("node", 2), ("gpu", 4)]
    assert p.cluster.levels[0].bandwidth == pytest.approx(12.5e9)
    assert p.cluster.levels[1].latency == pytest.approx(2e-6)
    assert p.cluster.host_level == "node"
    assert p.name == "p"  # no `plan NAME { }` wrapper: named after the file


def test_cluster_yaml_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("levels: [{name: a, fanout: 2}]\n")
    (tmp_path / "p.plan").write_text('cluster "bad.yaml"\n')
    with pytest.raises(PlanError, match="needs a bandwidth"):
        load(tmp_path / "p.plan")
    (tmp_path / "q.plan").write_text('cluster "missing.yaml"\n')
    with pytest.raises(PlanError, match="cluster file 'missing.yaml' not found"):
        load(tmp_path / "q.plan")
    (tmp_path / "junk.yaml").write_text("levels: [\n")
    (tmp_path / "r.plan").write_text('cluster "junk.yaml"\n')
    with pytest.raises(PlanError, match="cannot read cluster file"):
        load(tmp_path / "r.plan")


# ---------------------------------------------------------------- parallel

def test_parallel_place_auto():
    p = ok(CLUSTER + "parallel {\n pipe = 2\n data = 2\n tensor = 2\n place = auto\n}\n")
    assert p.parallel.axis_names() == ("pipe", "data", "tensor") and p.parallel.matrix is None
    assert p.pipe_axis == "pipe"


def test_parallel_place_matrix_wrapped_over_lines():
    p = ok(CLUSTER + """parallel {
      data = 4
      tensor = 2
      place = [[2, 2],
               [1,
                2]]
    }
    """)
    assert p.parallel.matrix == ((2, 2), (1, 2))


def test_parallel_items_separated_by_commas():
    p = ok(CLUSTER + "parallel { data = 2, tensor = 4, place = [[2, 1], [1, 4]] }\n")
    assert p.parallel.matrix == ((2, 1), (1, 4))


# ---------------------------------------------------------------- model / loss / data, derived stages

def test_model_loss_data_and_derived_stages():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 2, tensor = 2 }\n" + MODEL + """
stage 0 : layers 0..3
stage 1 : layers 3..6
transfer hidden : f32[8, 32, 64] from stage 0 as S0 R R to stage 1 as S0 R S1
reduce gradients over data
""")
    assert (p.model.path, p.model.function) == ("m.py", "build")
    assert dict(p.model.args) == {"layers": 4, "hidden": 64, "name": "gpt", "tie": True, "sizes": (1, 2)}
    assert (p.loss.function, p.data.function) == ("loss", "batches")
    assert p.stage_mode is ir.StageMode.PIPE_AXIS
    assert [(s.index, s.layers, s.mesh_axes) for s in p.stages] == [
        (0, (0, 3), ("data", "tensor")), (1, (3, 6), ("data", "tensor"))]
    t = p.transfers[0]
    assert (t.dtype, t.shape, t.src_layer) == ("f32", (8, 32, 64), None)
    assert t.src_spec == ir.ShardingSpec(((0,), (), ())) and t.dst_spec == ir.ShardingSpec(((0,), (), (1,)))
    r = p.reductions[0]
    assert (r.name, r.axes, r.mode, r.shape) == ("gradients", ("data",), ir.ReductionMode.SYNTHESIZE, None)


def test_explicit_stages_with_layers_and_transfer_layer():
    p = ok(CLUSTER + MODEL + """
stage 0 : layers 0..2 on devices 0..4 as (2, 2)
stage 1 : layers 2..4 on devices 4..8 as (4, 1)
transfer skip : bf16[8, 16] from stage 0 layer 0 as S0 S1 to stage 1 as S01 R
""")
    assert p.stage_mode is ir.StageMode.EXPLICIT and p.parallel is None
    s0, s1 = p.stages
    assert (s0.first_device, s0.mesh_shape, s0.mesh_axes, s0.explicit_devices) == (0, (2, 2), ("m0", "m1"), (0, 1, 2, 3))
    assert (s1.first_device, s1.mesh_shape) == (4, (4, 1))
    t = p.transfers[0]
    assert t.src_layer == 0 and t.dst_spec == ir.ShardingSpec(((0, 1), ()))


def test_explicit_named_mesh_dimensions_and_reduce_over_them():
    p = ok(CLUSTER + """
stage 0 on devices 0..4 as (data = 2, tensor = 2)
stage 1 on devices 4..8 as (data = 4, tensor = 1)
transfer x : f32[8, 4] from stage 0 as S(data,tensor) R to stage 1 as S(data) S(tensor)
reduce w over data : f32[1024]
""")
    assert p.stages[0].mesh_axes == ("data", "tensor")
    assert p.transfers[0].src_spec == ir.ShardingSpec(((0, 1), ()))
    assert p.transfers[0].dst_spec == ir.ShardingSpec(((0,), (1,)))
    assert p.reductions[0].axes == ("data",)


def test_transfer_type_and_specs_may_be_omitted_with_a_model():
    p = ok(CLUSTER + "parallel { pipe = 2, data = 2, tensor = 2 }\n" + MODEL + """
stage 0 : layers 0..3
stage 1 : layers 3..6
transfer hidden from stage 0 to stage 1
transfer skip from stage 0 layer 1 as S(data) R R to stage 1
transfer typed : f32[8, 32, 64] from stage 0 to stage 1 as S0 R R
""")
    hidden, skip, typed = p.transfers
    assert (hidden.dtype, hidden.shape, hidden.src_spec, hidden.dst_spec) == (None, None, None, None)
    assert not hidden.complete and typed.dst_spec is not None and typed.src_spec is None
    assert skip.src_layer == 1 and skip.src_spec == ir.ShardingSpec(((0,), (), ())) and skip.shape is None
    # the spans say where each part is written, or where it would be
    assert (hidden.type_span.line, hidden.type_span.col) == (13, 10)            # the name
    assert (hidden.src_spec_span.col, hidden.src_spec_span.end_col) == (22, 29)  # `stage 0`
    assert (skip.src_spec_span.col, typed.type_span.col) == (39, 18)
    with pytest.raises(ValueError, match="transfer 'hidden' has no type yet"):
        hidden.nbytes
    from planc.lang.format import summary, to_text
    text = to_text(p)
    assert "  transfer hidden from stage 0 to stage 1\n" in text
    assert "  transfer skip from stage 0 layer 1 as S0 R R to stage 1\n" in text
    assert load_text(text).transfers == p.transfers and to_text(load_text(text)) == text
    assert "transfer   hidden (type measured on the model): stage 0 (derived) -> stage 1 (derived)" in summary(p)


def test_untyped_transfer_spec_count_is_checked_later():
    """Without a shape the front end checks the spec's form and axes only; planc.model.infer checks the rest."""
    p = ok(CLUSTER + "parallel { pipe = 2, data = 2, tensor = 2 }\n" + MODEL + """
stage 0 : layers 0..3
stage 1 : layers 3..6
transfer hidden from stage 0 as S0 R to stage 1 as R R R R R
""")
    assert len(p.transfers[0].src_spec.dims) == 2 and len(p.transfers[0].dst_spec.dims) == 5


def test_without_a_model_every_transfer_part_is_required():
    out = err(CLUSTER + """
stage 0 on devices 0..4 as (2, 2)
stage 1 on devices 4..8 as (2, 2)
transfer a from stage 0 as S0 R to stage 1 as R R
transfer b : f32[8, 4] from stage 0 to stage 1 as R R
transfer c : f32[8, 4, 2] from stage 0 as R R R to stage 1
""")
    assert "t.plan:9:10: error: transfer 'a' needs its type" in out
    assert "t.plan:10:29: error: transfer 'b' needs its source layout, e.g. 'stage 0 as S0 R'" in out
    assert "t.plan:11:52: error: transfer 'c' needs its destination layout, e.g. 'stage 1 as S0 R R'" in out


def test_comm_only_stages_without_layers():
    p = ok(CLUSTER + "stage 0 on devices 0..8 as (2, 4)\n")
    assert p.model is None and p.stages[0].layers is None and p.stages[0].mesh_shape == (2, 4)


def test_idle_devices_outside_explicit_stages_are_allowed():
    p = ok(CLUSTER + "stage 0 on devices 2..3 as (1)\nstage 1 on devices 5..7 as (2)\n")
    assert [s.explicit_devices for s in p.stages] == [(2,), (5, 6)]


# ---------------------------------------------------------------- sharding spec forms

@pytest.mark.parametrize("written, dims", [
    ("S0 R R", ((0,), (), ())),
    ("S0RR", ((0,), (), ())),
    ("S01 R R", ((0, 1), (), ())),
    ("RS01 R", ((), (0, 1), ())),
    ("R R S1", ((), (), (1,))),
    ("S(m0,m1) R R", ((0, 1), (), ())),
    ("S(m1) R S(m0)", ((1,), (), (0,))),
    ("R S1S0", ((), (1,), (0,))),
])
def test_spec_forms(written, dims):
    p = ok(CLUSTER + f"stage 0 on devices 0..4 as (2, 2)\nstage 1 on devices 4..8 as (2, 2)\n"
           f"transfer t : f32[8, 8, 8] from stage 0 as {written} to stage 1 as R R R\n")
    assert p.transfers[0].src_spec == ir.ShardingSpec(dims)


@pytest.mark.parametrize("dtype", ["f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool"])
def test_dtypes(dtype):
    p = ok(CLUSTER + f"parallel {{ data = 8 }}\nreduce w over data : {dtype}[16, 2]\n")
    assert p.reductions[0].dtype == dtype and p.reductions[0].shape == (16, 2)


# ---------------------------------------------------------------- reductions

def test_reductions_allreduce_program_across_lines_and_standalone():
    p = ok(CLUSTER + """parallel { data = 4, tensor = 2 }
reduce grads over data, tensor using allreduce : f32[1024]
reduce w over data using reduce_scatter(slice=gpu, form=inside);
    allreduce(slice = gpu, form = parallel(root));
    all_gather(slice=gpu, form=inside) : f16[64, 64]
reduce v over tensor using reduce(slice=gpu, form=master(node)); broadcast(slice=gpu, form=master(node)) : f32[8]
""")
    g, w, v = p.reductions
    assert g.mode is ir.ReductionMode.ALLREDUCE and g.axes == ("data", "tensor") and g.shape == (1024,)
    assert w.mode is ir.ReductionMode.PROGRAM and w.shape == (64, 64)
    assert ir.program_text(w.program) == ("reduce_scatter(slice=gpu, form=inside); "
                                          "allreduce(slice=gpu, form=parallel(root)); all_gather(slice=gpu, form=inside)")
    assert [i.form for i in v.program] == [ir.FormKind.MASTER, ir.FormKind.MASTER]


# ---------------------------------------------------------------- settings blocks

def test_resharding_synthesis_train_deepspeed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # plan text without a file: its paths are relative to the working directory
    (tmp_path / "ds.yaml").write_text("steps_per_print: 10\n")
    p = ok(CLUSTER + "parallel { data = 8 }\n" + """
resharding { strategy = send_recv, chunks = 8, schedule = dfs(budget = 250 ms) }
synthesis { max_size = 4, collectives = [allreduce, reduce_scatter, all_gather] }
train {
  micro_batch = 16
  micro_batches = 2, steps = 3
  schedule = 1f1b
  optimizer = sgd(lr = 0.1, momentum = 0.9)
  precision = bf16
  seed = 7
}
deepspeed "ds.yaml"
""")
    rs = p.resharding
    assert (rs.strategy, rs.chunks, rs.scheduler, rs.dfs_budget_s) == (ir.Strategy.SEND_RECV, 8, ir.SchedulerKind.DFS, 0.25)
    assert p.synthesis.max_size == 4 and p.synthesis.collectives == (
        ir.Collective.ALLREDUCE, ir.Collective.REDUCE_SCATTER, ir.Collective.ALL_GATHER)
    t = p.train
    assert (t.micro_batch, t.micro_batches, t.steps, t.schedule, t.precision, t.seed) == (
        16, 2, 3, ir.PipeSchedule.ONE_F_ONE_B, ir.Precision.BF16, 7)
    assert t.optimizer == ir.Optimizer("sgd", 0.1, (("momentum", 0.9),))
    assert p.deepspeed_overrides == "ds.yaml"


@pytest.mark.parametrize("sched, kind", [
    ("naive", ir.SchedulerKind.NAIVE), ("load_balance", ir.SchedulerKind.LOAD_BALANCE),
    ("dfs(budget = 1 s)", ir.SchedulerKind.DFS),
    ("randomized_greedy(trials = 5, seed = 3)", ir.SchedulerKind.RANDOMIZED_GREEDY),
])
def test_resharding_schedules(sched, kind):
    p = ok(CLUSTER + f"parallel {{ data = 8 }}\nresharding {{ strategy = auto, schedule = {sched} }}\n")
    assert p.resharding.scheduler is kind
    if kind is ir.SchedulerKind.RANDOMIZED_GREEDY:
        assert (p.resharding.trials, p.resharding.seed) == (5, 3)


@pytest.mark.parametrize("s", ["gpipe", "1f1b", "eager_1f1b"])
def test_pipeline_schedules(s):
    p = ok(CLUSTER + f"parallel {{ data = 8 }}\ntrain {{ schedule = {s}, optimizer = adam(lr = 1e-3) }}\n")
    assert p.train.schedule == s and p.train.optimizer.lr == 1e-3


def test_defaults():
    p = ok(CLUSTER + "parallel { data = 8 }\n")
    assert p.resharding == ir.Resharding() and p.synthesis == ir.Synthesis() and p.train == ir.Train()


# ---------------------------------------------------------------- lexical choices documented in docs/language.md

def test_plan_wrapper_comments_blank_lines_and_crlf():
    text = "# head\r\n\r\nplan demo {  # c\r\n" + CLUSTER.replace("\n", "\r\n") + "\r\n  parallel { data = 8 }\r\n}\r\n"
    assert ok(text).name == "demo"


def test_name_from_file_without_wrapper():
    assert ok(CLUSTER, "/x/gpt-2x4.plan").name == "gpt_2x4"
    assert ok(CLUSTER, "/x/8way.plan").name == "_8way"
    assert ok(CLUSTER).name == "plan"


def test_block_order_is_free():
    p = ok("parallel { data = 8 }\nreduce w over data : f32[8]\n" + CLUSTER)
    assert p.parallel.axis_names() == ("data",)


def test_statements_are_separated_by_newlines():
    with pytest.raises(PlanError, match="unexpected 'parallel'"):
        load_text(CLUSTER.rstrip("\n") + " parallel { data = 8 }\n")


def test_keywords_stay_usable_as_names():
    p = ok(CLUSTER + "parallel { data = 4, layers = 2 }\nreduce reduce over data : f32[4]\n")
    assert p.parallel.axis_names() == ("data", "layers") and p.reductions[0].name == "reduce"


@pytest.mark.parametrize("setting, needle", [
    ("resharding { schedule = randomized_greedy(trials = 999999999999999999) }", "trials = 999999999999999999 is too many"),
    ("resharding { schedule = dfs(budget = 1e9 s) }", "dfs budget of 1e+09 s is too large"),
    ("train { micro_batches = 999999999999 }", "micro_batches 999999999999 is too many"),
])
def test_settings_that_would_make_compile_run_forever_are_errors(setting, needle):
    """Each of these was accepted and made `planc compile` run (or allocate) without end."""
    text = "cluster { level node x 2 : bandwidth 1 GB/s }\nparallel { data = 2 }\n" + setting + "\n"
    with pytest.raises(PlanError) as e:
        load_text(text, "big.plan")
    out = e.value.render()
    assert needle in out and "big.plan:3:" in out


def test_a_broken_parallel_block_is_one_error_not_a_cascade():
    """Stages, transfers and reductions that depend on a parallel block the check could not make are not
    reported again as missing stages, missing axes or a missing parallel block."""
    body = MODEL + """stage 0 : layers 0..2
stage 1 : layers 2..4
transfer h from stage 0 to stage 1
reduce gradients over data
"""
    for parallel, want in [("parallel { pipe = 2, data = 3 }", "axis sizes multiply to 6"),
                           ("parallel { pipe = 2, data = 4, place = [[2, 1], [2, 1]] }", "multiplies to 2, but the axis size is 4")]:
        text = err(CLUSTER + parallel + "\n" + body)
        assert want in text
        for follow_on in ("there is no stage", "is not an axis", "add a 'parallel' block"):
            assert follow_on not in text, text
    # with no parallel block at all the stages still say what is missing
    assert "add a 'parallel' block" in err(CLUSTER + body)


def test_each_optimizer_takes_its_own_keys():
    base = CLUSTER + "parallel { data = 8 }\ntrain { optimizer = OPT }\n"
    assert ok(base.replace('OPT', "adam(lr = 0.1, betas = (0.8, 0.9), eps = 1e-6, weight_decay = 0.01)")).train.optimizer
    assert ok(base.replace('OPT', "sgd(lr = 0.1, momentum = 0.9, weight_decay = 0.01)")).train.optimizer
    for opt, key in [("adam(lr = 0.1, momentum = 0.9)", "momentum"), ("sgd(lr = 0.1, beta1 = 0.5)", "beta1"),
                     ("sgd(lr = 0.1, betas = (0.5, 0.5))", "betas"), ("sgd(lr = 0.1, eps = 1e-8)", "eps")]:
        text = err(base.replace('OPT', opt))
        assert key in text and "error" in text, text
