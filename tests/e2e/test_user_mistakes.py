"""A new user's mistakes in their own code stop before the launch (issue 37): ``planc check`` and ``planc
compile`` both exit 2 with a message located at the plan's line and naming the culprit (the user's file and
line, the stage and layer, the shapes); where only running can tell, the launch ends every rank with one
line and no traceback. The user's project is a small 1-D convolution model of their own, in a folder of
its own (not planc's examples)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planc.commands.cli import main
from tests.e2e_util import launch_sh, run_direct

MODEL = '''import torch
from torch import nn


class Conv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class Head(nn.Module):
    def __init__(self, features, outputs):
        super().__init__()
        self.fc = nn.Linear(features, outputs)

    def forward(self, x):
        return self.fc(x.mean(dim=1))


def build(channels=4, length=16, outputs=4, head_features=16):
    return [Conv(1, channels), Conv(channels, channels), Conv(channels, channels), Head(head_features, outputs)]


def loss(output, target):
    return nn.functional.mse_loss(output, target)


def batches(micro_batch, seed, length=16, outputs=4, **_):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randn(micro_batch, 1, length, generator=g)
        yield x, x[:, 0, :outputs] * 2
'''

PLAN = """plan conv1d_two {
  cluster {
    level node x 1
    level gpu  x 2 : bandwidth 10 GB/s, latency 2 us
    host = node
  }
  model "conv1d.py:build" { channels = 4, length = 16, outputs = 4, head_features = 16 }
  loss  "conv1d.py:loss"
  data  "conv1d.py:batches"
  stage 0 : layers 0..2 on devices 0..1 as (data = 1)
  stage 1 : layers 2..4 on devices 1..2 as (data = 1)
  transfer h from stage 0 to stage 1
  train {
    micro_batch = 4, micro_batches = 2, steps = 2
    schedule = 1f1b, optimizer = sgd(lr = 0.1), precision = fp32, seed = 1
  }
}
"""


def project(root: Path, model_edits=(), plan_edits=(), files=None) -> Path:
    """The user's folder: conv1d.py (with ``model_edits``), the plan (with ``plan_edits``), other ``files``."""
    root.mkdir(parents=True, exist_ok=True)
    model, plan = MODEL, PLAN
    for old, new in model_edits:
        assert old in model, old
        model = model.replace(old, new)
    for old, new in plan_edits:
        assert old in plan, old
        plan = plan.replace(old, new)
    (root / "conv1d.py").write_text(model)
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "conv.plan").write_text(plan)
    return root / "conv.plan"


def _line_of(plan: Path, start: str) -> int:
    return next(i for i, line in enumerate(plan.read_text().splitlines(), 1) if line.strip().startswith(start))


def check_and_compile(plan: Path, capsys, out: Path, extra=(), untrainable=False) -> tuple[str, str]:
    """``planc check`` and ``planc compile``: both exit 2, no traceback, no output written (but the
    communication-only output of a plan that cannot train, as compile writes it); their stderr."""
    texts = []
    for argv in (["check", *extra, str(plan)], ["compile", *extra, str(plan), "-o", str(out)]):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert "Traceback" not in err, err
        texts.append(err)
    assert out.exists() == untrainable
    return tuple(texts)


# (name, model edits, plan edits, the plan line it is located at, what the message must say)
MISTAKES = [
    ("loss_signature", [("def loss(output, target):\n    return nn.functional.mse_loss(output, target)",
                         "def loss(output):\n    return output.pow(2).mean()")], [], "loss",
     [r"the loss conv1d\.py:loss: is called as loss\(output, target\)", "too many positional arguments",
      r"defined at conv1d\.py:27"]),
    ("last_stage_layer", [], [("head_features = 16", "head_features = 8")], "stage 1",
     [r"stage 1 layer 3 \(Head\) fails on its input \(f32\[4, 4, 16\]", r"conv1d\.py:20 in forward",
      r"return self\.fc\(x\.mean\(dim=1\)\)", "mat1 and mat2 shapes cannot be multiplied"]),
    ("first_stage_layer", [("self.conv = nn.Conv1d(cin, cout, 3, padding=1)",
                            "self.conv = nn.Conv1d(cin + 1, cout, 3, padding=1)")], [], "stage 0",
     [r"stage 0 layer 0 \(Conv\) fails on its input \(f32\[4, 1, 16\]", r"conv1d\.py:11 in forward"]),
    ("loss_vector", [("mse_loss(output, target)", "mse_loss(output, target, reduction='none')")], [], "loss",
     [r"the loss conv1d\.py:loss: returned f32\[4, 4\], not a scalar", r"\.mean\(\)"]),
    ("loss_detached", [("mse_loss(output, target)", "mse_loss(output, target).item() * torch.ones(())")], [],
     "loss", ["does not depend on the output"]),
    ("loss_nan", [("mse_loss(output, target)", "mse_loss(output, target) * float('nan')")], [], "loss",
     ["is nan on the first micro-batch"]),
    ("data_dry", [("    while True:\n        x = torch.randn", "    for _ in range(1):\n        x = torch.randn")], [],
     "data", [r"the data conv1d\.py:batches: ran dry after 1 batch\(es\), but one step draws 2"]),
    ("data_rows", [("x = torch.randn(micro_batch, 1", "x = torch.randn(micro_batch * 2, 1")], [], "data",
     [r"batch 0's inputs has 8 rows \(f32\[8, 1, 16\]\), but the plan's micro_batch is 4"]),
    ("data_shapes_change", [("    while True:\n        x = torch.randn(micro_batch, 1, length, generator=g)",
                             "    while True:\n        length += 1\n"
                             "        x = torch.randn(micro_batch, 1, length, generator=g)")], [], "data",
     [r"batch 1 is \(f32\[4, 1, 18\], f32\[4, 4\]\) but batch 0 was \(f32\[4, 1, 17\], f32\[4, 4\]\)"]),
    ("data_not_a_pair", [("yield x, x[:, 0, :outputs] * 2", "yield x")], [], "data",
     [r"batch 0 is a Tensor, not a pair \(inputs, target\)"]),
    ("data_signature", [("def batches(micro_batch, seed, length=16, outputs=4, **_):",
                         "def batches(micro_batch, seed, length=16, outputs=4):")], [], "data",
     [r"is called as batches\(micro_batch, seed, channels=\.\.\., .*\), but got an unexpected keyword "
      r"argument 'channels'", r"add \*\*_"]),
    ("builder_returns_nothing", [("    return [Conv(1, channels)", "    [Conv(1, channels)")], [], "model",
     [r"could not build the model with conv1d\.py:build: the builder \(conv1d\.py:23\) returned None, not a list "
      r"of layers \(a missing `return`\?\)"]),
    ("builder_fails", [("def build(channels=4, length=16, outputs=4, head_features=16):\n",
                        "def build(channels=4, length=16, outputs=4, head_features=16):\n"
                        "    assert channels % 3 == 0, 'channels must be a multiple of 3'\n")], [], "model",
     [r"conv1d\.py:24 in build \(`assert channels % 3 == 0", "AssertionError: channels must be a multiple of 3"]),
    ("syntax_error", [("    def forward(self, x):\n        return self.fc", "    def forward(self x):\n        return self.fc")],
     [], "model", [r"conv1d\.py:19:22 \(`def forward\(self x\):`\): SyntaxError"]),
    # (a chain plan without its transfer line is no mistake: each stage's output goes to the next,
    # tests/compiler/test_chain_default.py)
    ("bad_model_path", [], [('model "conv1d.py:build"', 'model "models/conv1d.py:build"')], "model",
     [r"model file 'models/conv1d\.py' not found"]),
]


@pytest.mark.parametrize("name,model_edits,plan_edits,line,needles", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_check_and_compile_refuse_the_mistake_at_its_line(tmp_path, capsys, name, model_edits, plan_edits, line,
                                                           needles):
    plan = project(tmp_path / "proj", model_edits, plan_edits)
    check_err, compile_err = check_and_compile(plan, capsys, tmp_path / "out")
    at = f"{plan}:{_line_of(plan, line)}:"
    for err in (check_err, compile_err):
        first = err.splitlines()[0]
        assert first.startswith(at), (at, err)
        for needle in needles:
            assert re.search(needle, err), (needle, err)


def test_the_plan_without_mistakes_checks_and_compiles(tmp_path, capsys):
    """The project the mistakes are made in is right as written (so each refusal above is the mistake's)."""
    plan = project(tmp_path / "proj")
    assert main(["check", str(plan)]) == 0
    assert main(["compile", str(plan), "-o", str(tmp_path / "out")]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_no_probe_checks_the_plan_text_only(tmp_path, capsys):
    """``planc check --no-probe`` is the front end alone: a mistake only the model shows passes it; one in
    the plan text does not."""
    plan = project(tmp_path / "proj", plan_edits=[("head_features = 16", "head_features = 8")])
    assert main(["check", "--no-probe", str(plan)]) == 0
    plan = project(tmp_path / "proj2", plan_edits=[("micro_batch = 4", "micro_batch = 4, micro_batchs = 2")])
    assert main(["check", "--no-probe", str(plan)]) == 2
    assert "micro_batches" in capsys.readouterr().err


def test_a_syntax_error_is_located_without_the_probe(tmp_path, capsys):
    """compile --no-probe reads the model file's imports (planc.output.outputfiles): a file that does not parse is
    an error at the model line naming the file, line and column."""
    plan = project(tmp_path / "proj", [("def loss(output, target):", "def loss(output, target)")],
                   [("transfer h from", "transfer h : f32[4, 4, 16] from")])
    rc = main(["compile", "--no-probe", str(plan), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith(f"{plan}:{_line_of(plan, 'model')}:"), err
    assert re.search(r"model file conv1d\.py: conv1d\.py:27:25 \(`def loss\(output, target\)`\): SyntaxError", err)


# ---------------------------------------------------------------- the output, launched

# the plan's code is model.py, which imports the model from a helper beside it and a package under it
HELPER_MODEL = '''from conv1d import Conv, Head, batches, loss  # noqa: F401 (the plan's data and loss)
from parts.sizes import head_features
from parts import extra


def build(channels=4, length=16, outputs=4, mode="none"):
    layers = [Conv(1, channels), Conv(channels, channels), Conv(channels, channels),
              Head(head_features(length), outputs)]
    return extra.maybe_failing(layers, mode)
'''
PARTS = {
    "parts/__init__.py": "",
    "parts/sizes.py": "def head_features(length):\n    return length\n",
    "parts/extra.py": '''import torch


class FailsInStepOne(torch.nn.Module):
    """The last layer, failing on its 5th call: the start-up check is the 1st, each step 2 more."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 5:
            raise ValueError(f"cannot pool {tuple(x.shape)} on call {self.calls}")
        return self.inner(x)


def maybe_failing(layers, mode):
    if mode == "layer":
        layers[-1] = FailsInStepOne(layers[-1])
    return layers
''',
}
MODES = '''

def batches_for(micro_batch, seed, length=16, outputs=4, mode="none", **_):
    """Fine for the probe's 2 batches and the start-up check's 1; then as ``mode`` says."""
    g = torch.Generator().manual_seed(seed)
    k = 0
    while mode != "dry" or k < 3:
        x = torch.randn(micro_batch, 1, length, generator=g)
        if mode == "nan" and k >= 3:
            x = x * float("nan")
        k += 1
        yield x, x[:, 0, :outputs] * 2
'''


def helper_project(root: Path, mode: str = "none") -> Path:
    plan = project(root, model_edits=[("def batches(", MODES + "\n\ndef batches(")],
                   plan_edits=[('"conv1d.py:build" { channels = 4, length = 16, outputs = 4, head_features = 16 }',
                                f'"model.py:build" {{ channels = 4, length = 16, outputs = 4, mode = "{mode}" }}'),
                               ('"conv1d.py:loss"', '"model.py:loss"'),
                               ('"conv1d.py:batches"', '"conv1d.py:batches_for"')],
                   files={"model.py": HELPER_MODEL, **PARTS})
    return plan


def _compile(plan: Path, out: Path):
    r = subprocess.run([sys.executable, "-m", "planc", "compile", str(plan), "-o", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.slow
def test_the_output_runs_where_the_plans_folder_is_absent(tmp_path):
    """The output holds the modules the plan's code imports beside it (planc.output.outputfiles): compiled, the
    source folder moved away, OUT/ trains alone."""
    src = tmp_path / "proj"
    plan = helper_project(src)
    out = tmp_path / "out"
    _compile(plan, out)
    for name in ("model.py", "conv1d.py", "parts/__init__.py", "parts/sizes.py", "parts/extra.py"):
        assert (out / name).read_text() == (src / name).read_text(), name
    shutil.move(str(src), str(tmp_path / "elsewhere"))
    r = run_direct(out, "--steps", "2")      # the output's files are the subject, not the launcher
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^step 1 loss \d", r.stdout, re.M), r.stdout[-2000:]
    assert "BASE_SEED=1 " in r.stdout   # DeepSpeed's seed is the plan's
    assert "gradients: none (no data-parallel peers) (stages 0, 1)" in r.stdout


RUNTIME = [
    ("layer", r"step 1, micro-batch 1 \(forward pass\), stage 1, layer 3 \(FailsInStepOne\): parts/extra\.py:14 in "
              r"forward \(`raise ValueError\(.*\)`\): ValueError: cannot pool \(4, 4, 16\) on call 5"),
    ("dry", r"step 1, stage \d: the data generator ran dry after 3 batch\(es\): make it endless"),
    ("nan", r"step 1: the loss is nan: the plan's loss, first at micro-batch 1 on stage 1 \(rank 1\)"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,line", RUNTIME, ids=[m for m, _ in RUNTIME])
def test_a_failure_only_running_shows_ends_every_rank_with_one_line(tmp_path, mode, line):
    """Past the probe and the start-up check, a failure of the user's code in a step ends every rank with
    one line naming the step, micro-batch, stage, layer, file and line; exit non-zero, no traceback."""
    plan = helper_project(tmp_path / "proj", mode)
    out = tmp_path / "out"
    _compile(plan, out)
    r = launch_sh(out, "--steps", "3", timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-4000:]
    said = [m for m in re.findall(r"^planc: rank \d+: (.*)$", text, re.M)]
    assert any(re.search(line, s) for s in said), text[-3000:]
    assert not re.search(r"^step 2 loss", text, re.M)


# ---------------------------------------------------------------- messages


def test_a_transfer_backwards_without_a_type_says_it_goes_back(tmp_path, capsys):
    plan = project(tmp_path / "proj", plan_edits=[("transfer h from stage 0 to stage 1",
                                                   "transfer h from stage 1 to stage 0")])
    check_err, _ = check_and_compile(plan, capsys, tmp_path / "out")
    assert check_err.startswith(f"{plan}:{_line_of(plan, 'transfer h')}:"), check_err
    assert "transfer 'h' goes from stage 1 back to stage 0" in check_err
    assert "write 'transfer h from stage 0 to stage 1'" in check_err


def test_half_precision_is_honoured_and_checks(tmp_path, capsys):
    """bf16 was the setting the runtime could not honour (reported at the setting); it trains now."""
    plan = project(tmp_path / "proj", plan_edits=[("precision = fp32", "precision = bf16")])
    assert main(["check", str(plan)]) == 0, capsys.readouterr().err


def test_explain_check_and_compile_warn_of_idle_devices_and_explain_says_nothing_to_reduce(tmp_path, capsys):
    plan = project(tmp_path / "proj", plan_edits=[
        ("level gpu  x 2", "level gpu  x 4"), ("on devices 0..1 as (data = 1)", "on devices 0..2 as (data = 2)"),
        ("on devices 1..2 as (data = 1)", "on devices 2..3 as (data = 1)"),
        ("  train {", "  reduce gradients over data\n  train {")])
    assert main(["explain", str(plan)]) == 0
    out = " ".join(capsys.readouterr().out.split())   # the lines as one text (a narrow terminal wraps them)
    assert "warning: 1 of the cluster's 4 devices are idle (device 3): no stage runs on them" in out
    assert "reduce gradients over data (stage 1)" in out
    assert "nothing to reduce: stage 1 has data = 1 (one device holds each gradient; no communication)" in out
    warning = (f"{plan}: warning: 1 of the cluster's 4 devices are idle (device 3): no stage runs on them, yet a "
               "launch starts a rank on each; give them to a stage (a larger data axis) or use a smaller cluster")
    assert main(["check", "--no-cache", str(plan)]) == 0   # check and compile warn as explain does
    assert capsys.readouterr().err.splitlines() == [warning]
    assert main(["compile", str(plan), "-o", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.splitlines() == [warning]


def test_rank_0s_gradient_line_covers_every_stage():
    from planc.runtime.main import gradient_summary
    described = [(0, "planc program allreduce(slice=root, form=inside), bucketed"), (0, "other rank of stage 0"),
                 (1, "none (no data-parallel peers)"), None, (2, "planc program allreduce(slice=root, form=inside), "
                                                                "bucketed")]
    assert gradient_summary(described) == ("planc program allreduce(slice=root, form=inside), bucketed (stages 0, 2); "
                                           "none (no data-parallel peers) (stage 1)")
    assert gradient_summary([None, None]) == "no stage trains"


def test_launch_sh_says_how_to_get_deepspeed(tmp_path):
    """launch.sh runs the deepspeed on PATH, else the one next to the Python that compiled the plan; with
    neither it says how to put one there (exit 2) instead of bash's 'command not found'."""
    plan = project(tmp_path / "proj")
    out = tmp_path / "out"
    _compile(plan, out)
    script = (out / "launch.sh").read_text()
    assert f'BIN="{Path(sys.executable).parent}"' in script
    (out / "launch.sh").write_text(re.sub(r'^BIN=".*"$', f'BIN="{tmp_path / "nothing"}"', script, flags=re.M))
    r = subprocess.run(["bash", str(out / "launch.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    if shutil.which("deepspeed", path="/usr/bin:/bin"):
        pytest.skip("a system-wide deepspeed is on /usr/bin")
    assert r.returncode == 2, r.stderr
    assert "'deepspeed' is neither next to the Python that compiled this plan" in r.stderr
    assert "export PATH=/path/to/venv/bin:$PATH" in r.stderr
    # one next to the compiling Python, none on PATH: that one runs
    fake = tmp_path / "venvbin"
    fake.mkdir()
    (fake / "deepspeed").write_text("#!/usr/bin/env bash\necho \"launcher $0\" >&2\nexit 7\n")
    (fake / "deepspeed").chmod(0o755)
    (out / "launch.sh").write_text(re.sub(r'^BIN=".*"$', f'BIN="{fake}"', script, flags=re.M))
    r = subprocess.run(["bash", str(out / "launch.sh")], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": "false"})
    assert r.returncode == 7 and f"launcher {fake}/deepspeed" in r.stderr, r.stderr


@pytest.mark.slow
def test_the_start_up_check_names_the_layer_and_the_users_line(tmp_path):
    """Compiled without the probe (so nothing ran the model), a last-stage layer that cannot take its input
    stops every rank at the start-up check with the layer, its class and the user's file and line."""
    plan = project(tmp_path / "proj", plan_edits=[("head_features = 16", "head_features = 8"),
                                                  ("transfer h from", "transfer h : f32[4, 4, 16] from")])
    out = tmp_path / "out"
    assert main(["compile", "--no-probe", str(plan), "-o", str(out)]) == 0
    r = launch_sh(out, "--steps", "1", timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert re.search(r"stage 1: its layers fail on the planned inputs \[\(4, 4, 16\)\]: layer 3 \(Head\): "
                     r"conv1d\.py:20 in forward \(`return self\.fc\(x\.mean\(dim=1\)\)`\): RuntimeError: mat1 and "
                     r"mat2 shapes cannot be multiplied", text), text[-3000:]


IDS = '''import torch


def batches(micro_batch, seed, seq=8):
    n = 0
    while True:   # ids inside the vocabulary, but for the second micro-batch of step 1
        ids = torch.full((micro_batch, seq), 5, dtype=torch.int64)
        if n == 3:
            ids[1, 4] = 300
        n += 1
        yield ids, ids.clone()
'''


@pytest.mark.slow
def test_a_token_id_past_the_vocabulary_in_a_later_batch_ends_the_launch_with_one_line(tmp_path):
    """The probe sees the first batch only; the runtime checks every batch's token ids against a Hugging
    Face model's vocabulary and names the step, micro-batch, stage and id (not the embedding's traceback)."""
    pytest.importorskip("transformers")
    (tmp_path / "ids.py").write_text(IDS)
    plan = tmp_path / "p.plan"
    plan.write_text("""plan ids {
  cluster {
    level node x 1 : bandwidth 1 GB/s, latency 50 us
    level cpu x 2 : bandwidth 10 GB/s, latency 2 us
    host = node
  }
  model hf "LlamaForCausalLM" { hidden_size = 32, intermediate_size = 64, num_hidden_layers = 2, num_attention_heads = 4, num_key_value_heads = 2, vocab_size = 256 }
  data "ids.py:batches" { seq = 8 }
  stage 0 : layers 0..2 on devices 0..1 as (data = 1)
  stage 1 : layers 2..4 on devices 1..2 as (data = 1)
  train { micro_batch = 2, micro_batches = 2, steps = 3, optimizer = sgd(lr = 0.1), seed = 1 }
}
""")
    out = tmp_path / "out"
    _compile(plan, out)
    r = launch_sh(out, timeout=240)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-4000:]
    line = ("step 1, micro-batch 1, stage 0: the data's token id 300 is outside the model's vocabulary 0..255 "
            "(vocab_size = 256)")
    said = re.findall(r"^planc: rank (\d+): (.*)$", text, re.M)
    assert ("0", line) in said, text[-3000:]   # the other rank only echoes it (failwatch)
    assert all(s == line or s.startswith(f"ending: rank 0: {line}") for _, s in said), said
    assert re.search(r"^step 0 loss", text, re.M) and not re.search(r"^step 1 loss", text, re.M)
