"""The training settings (LANGUAGE.md, "Training settings"; docs/language.md): each accepted form reaches
plan.json as written, defaults filled in (compiled plans read back with ``planc.plan.load``), and each bad
input is an error located at what is wrong (front end only)."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from planc import ir
from planc import plan as planfile
from planc.driver.compile import compile_file, dump_plan
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc.lang.format import summary, to_text

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mlp.py"

CLUSTER = """\
cluster {
  level gpu x 4 : bandwidth 10 GB/s, latency 2 us
}
"""
MODEL = f"""\
model "{MLP}:build" {{ layers = 4, hidden = 16, inputs = 8, outputs = 4 }}
loss  "{MLP}:loss"
data  "{MLP}:batches"
"""
STAGES = """\
parallel { pipe = 2, data = 2 }
stage 0 : layers 0..2
stage 1 : layers 2..4
transfer h from stage 0 to stage 1
reduce gradients over data
"""


def plan_text(train: str, cluster: str = CLUSTER, stages: str = STAGES) -> str:
    return cluster + MODEL + stages + f"train {{\n  micro_batch = 4, micro_batches = 2, steps = 6\n{train}\n}}\n"


def compiled_train(tmp_path: Path, text: str) -> planfile.Plan:
    """Compile ``text`` and read its plan.json back with the contract's validating reader."""
    (tmp_path / "p.plan").write_text(text)
    c = compile_file(tmp_path / "p.plan")
    (tmp_path / "plan.json").write_text(dump_plan(c.plan_json))
    return planfile.load(tmp_path / "plan.json")


def ok(text: str) -> ir.Program:
    return load_text(textwrap.dedent(text), "t.plan")


def errors(text: str) -> tuple[PlanError, str]:
    with pytest.raises(PlanError) as ei:
        load_text(text, "t.plan")
    return ei.value, ei.value.render()


def error_at(text: str, message: str, culprit: str, hint: str | None = None) -> None:
    """``text`` fails with ``message`` located at the (last) occurrence of ``culprit``."""
    e, rendered = errors(text)
    assert "Traceback" not in rendered
    (line_no, line), = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if culprit in ln][-1:]
    col = line.rindex(culprit) + 1
    found = [d for d in e.diagnostics if message in d.message]
    assert found, rendered
    d = found[0]
    assert (d.span.line, d.span.col) == (line_no, col), rendered
    assert d.span.end_col - d.span.col == len(culprit), rendered
    if hint is not None:
        assert d.hint is not None and hint in d.hint, rendered


# ---------------------------------------------------------------- accepted, as plan.json writes them

def test_every_training_setting_reaches_plan_json(tmp_path):
    cluster = CLUSTER.replace("}", "  flops = 100 TFLOP/s\n  flops bf16 = 989 TFLOP/s\n  flops fp16 = 900 TFLOP/s\n}")
    stages = STAGES.replace("stage 0 : layers 0..2", "stage 0 : layers 0..2 recompute")
    plan = compiled_train(tmp_path, plan_text("""\
  optimizer = adamw(lr = 0.01, betas = (0.8,
                                        0.95))
  lr_schedule = warmup_cosine(warmup = 2, min_ratio = 0.1)
  precision = bf16, zero = 1, clip = 1.5""", cluster, stages))
    t = plan.train
    assert t.optimizer.to_json() == {"name": "adamw", "lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-8,
                                     "weight_decay": 0.01}
    assert t.lr_schedule == planfile.LrSchedule("warmup_cosine", 2, 6, 0.1)   # total = steps
    assert (str(t.precision), t.zero, t.recompute, t.clip) == ("bf16", 1, (True, False), 1.5)
    assert t.norm_group == (0, 1, 2, 3) and t.loss_scale is None
    extra = dict(plan.cluster.extra)
    assert extra["flops"] == 100e12 and extra["flops_by_precision"] == {"bf16": 989e12, "fp16": 900e12}


def test_defaults_reach_plan_json(tmp_path):
    plan = compiled_train(tmp_path, plan_text(""))
    t = plan.train
    assert t.optimizer.to_json() == {"name": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                     "weight_decay": 0.0}
    assert t.lr_schedule == planfile.LrSchedule() and t.lr_schedule.to_json() == {"name": "constant"}
    assert (str(t.precision), t.zero, t.recompute, t.clip, t.loss_scale, t.norm_group) == (
        "fp32", 0, (False, False), None, None, ())
    assert "flops_by_precision" not in dict(plan.cluster.extra)


def test_sgd_fp16_and_recompute_everywhere(tmp_path):
    plan = compiled_train(tmp_path, plan_text("""\
  optimizer = sgd(lr = 0.1, momentum = 0.9)
  lr_schedule = warmup_cosine(warmup = 1, total = 4)
  precision = fp16, recompute = full"""))
    t = plan.train
    assert t.optimizer.to_json() == {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0}
    assert t.lr_schedule == planfile.LrSchedule("warmup_cosine", 1, 4, 0.0)   # total as written
    assert str(t.precision) == "fp16" and t.loss_scale == planfile.LossScale()   # fp16: dynamic loss scaling
    assert t.recompute == (True, True) and t.norm_group == (0, 1, 2, 3)


def test_recompute_with_stages_auto_is_the_train_setting(tmp_path):
    """``stages = auto(N)`` has no stage line to mark: ``recompute = full`` covers the cut's stages."""
    stages = "parallel { pipe = 2, data = 2 }\nstages = auto(2)\nreduce gradients over data\n"
    plan = compiled_train(tmp_path, plan_text("  optimizer = adam(lr = 0.01, betas = (0.5, 0.6)), recompute = full",
                                              stages=stages))
    assert plan.train.recompute == (True, True)
    assert plan.train.optimizer.to_json()["betas"] == [0.5, 0.6]


@pytest.mark.parametrize("line, layers", [
    ("stage 0 : layers 0..2 recompute\nstage 1 : layers 2..4", (True, None)),
    ("stage 0 : layers 0..2 on devices 0..2 as (data = 2)\nstage 1 : layers 2..4 on devices 2..4 as (data = 2) recompute",
     (None, True)),
    ("stage 0 : layers auto recompute\nstage 1 : layers auto recompute", (True, True)),
    ("stage 0 : layers auto on devices 0..2 as (2) recompute\nstage 1 : layers auto on devices 2..4 as (2)", (True, None)),
    ("stages = auto(2)\nstage 0 on devices 0..2 as (2)\nstage 1 on devices 2..4 as (2) recompute", (None, True)),
])
def test_stage_recompute_forms(line, layers):
    p = ok(CLUSTER + MODEL + "parallel { pipe = 2, data = 2 }\n" + line + "\n")
    assert tuple(s.recompute for s in p.stages) == layers
    assert p.train.recompute is ir.Recompute.NONE
    assert summary(p).count("recomputes its forward") == sum(1 for x in layers if x)   # planc check says so


def test_recompute_stays_a_name_where_a_name_stands():
    """``recompute`` is a keyword only at the end of a stage line (the contextual lexer)."""
    p = ok(CLUSTER + "model \"m.py:build\" { recompute = true }\nloss \"m.py:loss\"\ndata \"m.py:batches\"\n"
           "parallel { pipe = 2, data = 2 }\nstage 0 : layers 0..1\nstage 1 : layers 1..2\n"
           "transfer recompute from stage 0 to stage 1\ntrain { recompute = full }\n")
    assert p.model.args == (("recompute", True),) and p.transfers[0].name == "recompute"
    assert p.train.recompute is ir.Recompute.FULL


@pytest.mark.parametrize("opt, name, params", [
    ("sgd", "sgd", ()),
    ("adamw", "adamw", ()),
    ("sgd(lr = 0.5, momentum = 0, weight_decay = 0.001)", "sgd", (("momentum", 0.0), ("weight_decay", 0.001))),
    ("adam(lr = 0, betas = (0, 0.5), eps = 0)", "adam", (("betas", (0.0, 0.5)), ("eps", 0.0))),
    ("adamw(weight_decay = 0, betas = (0.9, 0.98))", "adamw", (("betas", (0.9, 0.98)), ("weight_decay", 0.0))),
])
def test_optimizers_keep_what_is_written(opt, name, params):
    """ir.Optimizer holds the arguments as written; plan.json fills in the rest (planc.driver.assemble)."""
    o = ok(CLUSTER + f"parallel {{ data = 4 }}\ntrain {{ optimizer = {opt} }}\n").train.optimizer
    assert (o.name, o.params) == (name, params)
    full = planfile.Optimizer.make(o.name, o.lr, **dict(o.params))
    assert set(dict(full.args)) == set(planfile.OPTIMIZER_DEFAULTS[name])


def test_flops_per_precision_in_a_cluster_file(tmp_path):
    (tmp_path / "c.yaml").write_text("levels:\n  - {name: gpu, fanout: 4, bandwidth: 10 GB/s}\n"
                                     "flops: {fp32: 312e12, bf16: \"989 TFLOP/s\"}\n")
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\nparallel { data = 4 }\n')
    from planc.lang import load
    c = load(tmp_path / "p.plan").cluster
    assert c.flops is None and c.flops_by_precision == (("bf16", 989e12), ("fp32", 312e12))
    assert c.flops_for("bf16") == 989e12 and c.flops_for("fp16") is None


def test_calibrate_summary_reads_either_flops_form():
    """planc calibrate writes one measured rate; a file edited to one rate per precision summarises too."""
    from planc.calibrate.clusterfile import summary
    doc = {"levels": [{"name": "host", "fanout": 1}], "calibration": {"fit": {}}, "flops": 2e9}
    assert "device: 2 GFLOP/s" in summary(doc)
    doc["flops"] = {"fp32": 2e9, "bf16": 8e9}
    assert "device: 8 GFLOP/s in bf16, 2 GFLOP/s in fp32" in summary(doc)


@pytest.mark.parametrize("yaml_flops, message, where", [
    ("{bf61: 1e12}", "flops: 'bf61' is not a precision", (3, 15)),   # at its value (YAML marks values)
    ("{bf16: -1}", "flops.bf16: must be a positive FLOP rate", (3, 15)),
    ("{bf16: 1 GB/s}", "flops.bf16: expected a FLOP rate", (3, 15)),
    ("{}", "flops: an empty mapping", (3, 8)),
])
def test_bad_flops_per_precision_in_a_cluster_file(tmp_path, yaml_flops, message, where):
    (tmp_path / "c.yaml").write_text(f"levels:\n  - {{name: gpu, fanout: 4, bandwidth: 10 GB/s}}\nflops: {yaml_flops}\n")
    (tmp_path / "p.plan").write_text('cluster "c.yaml"\nparallel { data = 4 }\n')
    from planc.lang import load
    with pytest.raises(PlanError) as ei:
        load(tmp_path / "p.plan")
    (d,) = ei.value.diagnostics
    assert message in d.message and d.span.file.endswith("c.yaml") and (d.span.line, d.span.col) == where


def test_canonical_text_prints_every_setting():
    p = ok(CLUSTER.replace("}", "  flops bf16 = 989 TFLOP/s\n}") + MODEL + """\
parallel { pipe = 2, data = 2 }
stage 0 : layers auto
stage 1 : layers auto recompute
train {
  steps = 8, optimizer = adam(lr = 0.001, betas = (0.8, 0.9), eps = 1e-6)
  lr_schedule = warmup_cosine(warmup = 3), precision = fp16, zero = 1, clip = 2.5
}
""")
    text = to_text(p)
    for want in ("flops bf16 = 989000000000000 FLOP/s", "stage 0 : layers auto\n", "stage 1 : layers auto recompute",
                 "optimizer = adam(lr = 0.001, betas = (0.8, 0.9), eps = 1e-06)",
                 "lr_schedule = warmup_cosine(warmup = 3, total = 8, min_ratio = 0)",
                 "precision = fp16, zero = 1, recompute = none", "clip = 2.5"):
        assert want in text, text
    q = load_text(text, "t.plan")
    assert dataclasses.replace(q, source_sha256="") == dataclasses.replace(p, source_sha256="")
    assert to_text(q) == text


# ---------------------------------------------------------------- errors, located

BASE = CLUSTER + "parallel { data = 4 }\n"


@pytest.mark.parametrize("train, message, culprit, hint", [
    # optimizer
    ("optimizer = adam(lr = 0.1, beta1 = 0.9)", "not 'beta1'", "beta1", "betas = (b1, b2)"),
    ("optimizer = adamw(beta2 = 0.99)", "not 'beta2'", "beta2", "betas = (b1, b2)"),
    ("optimizer = adam(betas = (0.9))", "betas takes two numbers (b1, b2), got 1", "(0.9)", "betas = (b1, b2)"),
    ("optimizer = adam(betas = (0.9, 0.99, 0.999))", "got 3", "(0.9, 0.99, 0.999)", None),
    ("optimizer = adam(betas = [0.9, 0.99])", "betas is a pair of numbers in parentheses", "[0.9, 0.99]", None),
    ("optimizer = adam(betas = 0.9)", "betas is a pair of numbers in parentheses", "0.9", None),
    ("optimizer = adam(betas = (0.9, 1.5))", "betas[1] must be in [0, 1), got 1.5", "1.5", None),
    ("optimizer = adamw(betas = (1, 0.5))", "betas[0] must be in [0, 1), got 1", "1", None),
    ("optimizer = adam(betas = (-0.1, 0.5))", "betas[0] must be in [0, 1), got -0.1", "-0.1", None),
    ("optimizer = adam(betas = (fast, 0.5))", "betas[0] must be a number", "fast", None),
    ("optimizer = sgd(lr = -0.1)", "lr must not be negative, got -0.1", "-0.1", None),
    ("optimizer = adam(eps = -1e-8)", "eps must not be negative", "-1e-8", None),
    ("optimizer = adamw(weight_decay = -0.01)", "weight_decay must not be negative", "-0.01", None),
    ("optimizer = sgd(momentum = 1.0)", "momentum must be in [0, 1), got 1.0", "1.0", None),
    ("optimizer = sgd(momentum = -0.5)", "momentum must be in [0, 1)", "-0.5", None),
    ("optimizer = sgd(lr = 1 GB)", "lr must be a number", "1 GB", None),
    ("optimizer = sgd(lr = \"0.1\")", "lr must be a number", '"0.1"', None),
    ("optimizer = sgd(betas = (0.9, 0.99))", "sgd() has no argument 'betas'", "betas", None),
    ("optimizer = adamw(momentum = 0.9)", "adamw() has no argument 'momentum'", "momentum", None),
    ("optimizer = adam(wieght_decay = 0.1)", "has no argument 'wieght_decay'", "wieght_decay",
     "did you mean 'weight_decay'?"),
    ("optimizer = sgd(lr = 1, lr = 2)", "'lr' is given twice", "lr", None),
    ("optimizer = adma(lr = 1)", "optimizer must be sgd(", "adma", "did you mean 'adam'?"),
    ("optimizer = AdamW(lr = 1)", "optimizer must be sgd(", "AdamW", "did you mean 'adamw'? (spellings are lower case)"),
    ("optimizer = 0.1", "optimizer must be sgd(", "0.1", None),
    # lr_schedule
    ("lr_schedule = warmup_cosine(warmup = 20)", "warmup 20 is more than total 10 (the train block's steps)", "20",
     None),
    ("lr_schedule = warmup_cosine(warmup = 5, total = 4)", "warmup 5 is more than total 4:", "5", None),
    ("lr_schedule = warmup_cosine(total = 0)", "total must be at least 1, got 0", "0", None),
    ("lr_schedule = warmup_cosine(warmup = 2.5)", "warmup must be a whole number", "2.5", None),
    ("lr_schedule = warmup_cosine(warmup = -1)", "warmup must be at least 0", "-1", None),
    ("lr_schedule = warmup_cosine(min_ratio = 1.5)", "min_ratio must be in [0, 1], got 1.5", "1.5", None),
    ("lr_schedule = warmup_cosine(min_ratio = -0.5)", "min_ratio must be in [0, 1]", "-0.5", None),
    ("lr_schedule = warmup_cosine(warm = 2)", "warmup_cosine() has no argument 'warm'", "warm",
     "did you mean 'warmup'?"),
    ("lr_schedule = cosine", "lr_schedule must be constant or warmup_cosine(", "cosine",
     "did you mean 'warmup_cosine'?"),
    ("lr_schedule = Constant", "lr_schedule must be constant", "Constant", "did you mean 'constant'? (spellings"),
    ("lr_schedule = constant(warmup = 1)", "constant takes no arguments", "warmup = 1", None),
    # precision, zero, recompute, clip
    ("precision = fp8", "precision must be one of fp32, fp16, bf16", "fp8", None),
    ("precision = Bf16", "precision must be one of fp32, fp16, bf16", "Bf16", "did you mean 'bf16'? (spellings"),
    ("zero = 4", "zero must be 0, 1, 2 or 3 (1: fp32 master weights", "4", None),
    ("zero = 0.5", "zero must be 0, 1, 2 or 3", "0.5", None),
    ("zero = one", "zero must be 0, 1, 2 or 3", "one", None),
    ("zero = 2, zero_keep_gathered = true", "zero_keep_gathered sets how zero = 3 stages gather their parameters, "
     "but no stage has zero = 3", "true", None),
    ("zero_prefetch = false", "zero_prefetch sets how zero = 3 stages gather", "false", None),
    ("zero = 3, zero_prefetch = maybe", "zero_prefetch must be true or false", "maybe", None),
    ("recompute = selective", "recompute must be one of none, full", "selective", None),
    ("recompute = ful", "recompute must be one of none, full", "ful", "did you mean 'full'?"),
    ("recompute = FULL", "recompute must be one of none, full", "FULL", "did you mean 'full'? (spellings"),
    ("clip = 0", "clip must be a positive number, got 0", "0", None),
    ("clip = -1.5", "clip must be a positive number, got -1.5", "-1.5", None),
    ("clip = none", "clip (the bound on the global gradient norm) must be a number", "none", None),
    ("clip = 1 GB", "must be a number", "1 GB", None),
    # keys
    ("lr_schedul = constant", "unknown train setting 'lr_schedul'", "lr_schedul", "did you mean 'lr_schedule'?"),
    ("recompte = full", "unknown train setting 'recompte'", "recompte", "did you mean 'recompute'?"),
    ("clip = 1, clip = 2", "'clip' is set twice", "clip", None),
])
def test_bad_training_settings_are_located(train, message, culprit, hint):
    error_at(BASE + f"train {{ {train} }}\n", message, culprit, hint)


def test_every_bad_setting_is_reported_at_once():
    e, rendered = errors(BASE + "train {\n  optimizer = adam(beta1 = 0.9, eps = -1)\n  zero = 5, clip = 0\n"
                               "  lr_schedule = warmup_cosine(min_ratio = 2), recompute = some\n}\n")
    assert len(e.diagnostics) == 6, rendered


@pytest.mark.parametrize("item, message, culprit, hint", [
    ("flops bf61 = 1 TFLOP/s", "'bf61' is not a precision", "bf61", "did you mean 'bf16'?"),
    ("flops FP16 = 1 TFLOP/s", "'FP16' is not a precision", "FP16", "did you mean 'fp16'? (spellings"),
    ("flops bf16 = 989", "flops needs a unit", "989", None),
    ("flops bf16 = 9 GB/s", "'GB/s' is not a FLOP rate unit", "9 GB/s", None),
    ("flops bf16 = 0 TFLOP/s", "flops must be positive", "0 TFLOP/s", None),
    ("flops bf16 = 9 TFLOPz", "unknown unit 'TFLOPz'; did you mean 'TFLOPS'? a FLOP rate takes", "TFLOPz", None),
    ("flops bf16 = 1 TFLOP/s\n  flops bf16 = 2 TFLOP/s", "'flops bf16' is set twice", "flops bf16 = 2 TFLOP/s", None),
])
def test_bad_flops_per_precision_are_located(item, message, culprit, hint):
    error_at(CLUSTER.replace("}", f"  {item}\n}}") + "parallel { data = 4 }\n", message, culprit, hint)


def test_flops_per_precision_inline():
    c = ok(CLUSTER.replace("}", "  flops 100 TFLOP/s\n  flops fp32 = 150 TFLOP/s\n  flops bf16 989 TFLOP/s\n}")).cluster
    assert c.flops == 100e12 and c.flops_by_precision == (("bf16", 989e12), ("fp32", 150e12))
    assert (c.flops_for("bf16"), c.flops_for("fp32"), c.flops_for("fp16")) == (989e12, 150e12, 100e12)


@pytest.mark.parametrize("yaml, message, where", [
    ("zero_optimization:\n  stage: 1\n", "write 'zero = 1' in the train block", (2, 10)),
    ("zero_optimization:\n  stage: 2\n", "ZeRO stage 2 is set in the plan, not in the DeepSpeed overrides: write "
     "'zero = 2' in the train block (and leave zero_optimization out)", (2, 10)),
    ("gradient_clipping: 0.5\n", "write 'clip = 0.5' in the train block", (1, 20)),
    ("bf16:\n  enabled: true\n", "write 'precision = bf16' in the train block", (2, 12)),
    ("fp16: {enabled: true, loss_scale: 0}\n", "write 'precision = fp16' in the train block", (1, 17)),
])
def test_deepspeed_overrides_name_the_train_setting(tmp_path, yaml, message, where):
    (tmp_path / "ds.yaml").write_text(yaml)
    (tmp_path / "p.plan").write_text(BASE + 'deepspeed "ds.yaml"\n')
    from planc.lang import load
    with pytest.raises(PlanError) as ei:
        load(tmp_path / "p.plan")
    (d,) = ei.value.diagnostics
    assert message in d.message and d.span.file.endswith("ds.yaml") and (d.span.line, d.span.col) == where


def test_deepspeed_overrides_that_leave_the_regime_alone_pass(tmp_path):
    (tmp_path / "ds.yaml").write_text("zero_optimization: {stage: 0}\ngradient_clipping: 0\nbf16: {enabled: false}\n"
                                      "steps_per_print: 5\n")
    (tmp_path / "p.plan").write_text(BASE + 'deepspeed "ds.yaml"\n')
    from planc.lang import load
    assert load(tmp_path / "p.plan").deepspeed_overrides == "ds.yaml"
