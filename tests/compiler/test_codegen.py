"""Output directory: files, determinism, ds_config arithmetic, hostfile, runtime copy."""

import dataclasses
import json
import subprocess
import sys

import pytest

from planc.output import codegen
from planc.driver.compile import compile_file

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from e2e_util import ROOT, spelled  # noqa: E402


def _gpt():
    c = compile_file(spelled("gpt-2x4.plan"), probe=False)
    return c.program, c.plan_json


def _tree(path):
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def test_output_files_and_byte_identical(tmp_path):
    p, plan = _gpt()
    codegen.write_output(plan, p, tmp_path / "a")
    codegen.write_output(plan, p, tmp_path / "b")
    a, b = _tree(tmp_path / "a"), _tree(tmp_path / "b")
    assert a == b
    for name in ("plan.json", "ds_config.json", "train.py", "launch.sh", "hostfile", "README.md",
                 "gpt.py", "planc_runtime/engine.py", "planc_runtime/main.py", "planc_runtime/probe.py",
                 "planc/__init__.py", "planc/plan/__init__.py", "planc/plan/file.py", "planc/plan/vocab.py"):
        assert name in a, name
    # the output carries the contract, not the compiler: nothing of planc but planc/plan/
    assert {k.split("/")[1] for k in a if k.startswith("planc/") and k.count("/") > 1} == {"plan"}
    assert not any(k.startswith("planc_runtime/plan") for k in a)
    assert not any("__pycache__" in k for k in a)
    assert json.loads(a["plan.json"]) == plan


def test_the_output_is_readable_by_all_whatever_the_umask(tmp_path):
    """Under a private umask (0077) the output's files are still 0644 (launch.sh 0755) and its folders 0755: a
    shared launch folder is read by other users and machines."""
    import os
    import stat
    p, plan = _gpt()
    old = os.umask(0o077)
    try:
        out = codegen.write_output(plan, p, tmp_path / "out")
    finally:
        os.umask(old)
    modes = {str(f.relative_to(out)): stat.S_IMODE(f.stat().st_mode) for f in [out, *out.rglob("*")]}
    assert modes.pop("launch.sh") == 0o755 and modes.pop(".") == 0o755
    assert {k: m for k, m in modes.items() if m != (0o755 if (out / k).is_dir() else 0o644)} == {}
    assert "planc_runtime/engine.py" in modes and "planc/plan" in modes


def test_ds_config_batch_arithmetic(tmp_path):
    p, plan = _gpt()
    cfg = json.loads((codegen.write_output(plan, p, tmp_path) / "ds_config.json").read_text())
    assert cfg["train_micro_batch_size_per_gpu"] == 4          # micro_batch 8 / data 2
    assert cfg["gradient_accumulation_steps"] == 8
    assert cfg["train_batch_size"] == 64                       # 4 x 8 x data 2
    assert cfg["optimizer"] == {"type": "Adam", "params": {"lr": 0.001}}
    assert cfg["zero_optimization"] == {"stage": 0}
    assert cfg["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}


def test_overrides_are_merged(tmp_path):
    p, plan = _gpt()
    (tmp_path / "ds.yaml").write_text("zero_optimization:\n  stage: 0\nsteps_per_print: 10\n")
    p = dataclasses.replace(p, source_dir=str(tmp_path), deepspeed_overrides="ds.yaml",
                            model=dataclasses.replace(p.model, path=str(ROOT / "examples" / "gpt.py")),
                            loss=dataclasses.replace(p.loss, path=str(ROOT / "examples" / "gpt.py")),
                            data=dataclasses.replace(p.data, path=str(ROOT / "examples" / "gpt.py")))
    cfg = json.loads((codegen.write_output(plan, p, tmp_path / "o") / "ds_config.json").read_text())
    assert cfg["zero_optimization"] == {"stage": 0} and cfg["steps_per_print"] == 10
    # what the engine cannot run is refused with the plan (planc check), tests/compiler/test_compile.py


def test_hostfile_and_launcher(tmp_path):
    p, plan = _gpt()
    out = codegen.write_output(plan, p, tmp_path)
    lines = [l for l in (out / "hostfile").read_text().splitlines() if l and not l.startswith("#")]
    assert lines == ["node0 slots=4", "node1 slots=4"]
    launch = (out / "launch.sh").read_text()
    assert "--num_gpus 8" in launch and "DS_ACCELERATOR=cpu" in launch and "torch.cuda.is_available()" in launch
    assert "PLANC_MASTER_PORT" in launch and "--master_port" in launch
    one = dict(plan, cluster=dict(plan["cluster"], hosts=[list(range(8))]))
    out1 = codegen.write_output(one, p, tmp_path / "one")
    assert (out1 / "hostfile").read_text().strip() == "localhost slots=8"


def test_train_py_is_thin_and_parses_args(tmp_path):
    p, plan = _gpt()
    out = codegen.write_output(plan, p, tmp_path)
    text = (out / "train.py").read_text()
    assert "planc_runtime.entry import run" in text and len(text.splitlines()) < 15
    r = subprocess.run([sys.executable, str(out / "train.py"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--comm-only" in r.stdout


def test_templates_found():
    assert (codegen.templates_dir() / "train.py.j2").is_file()


def test_runtime_imports_only_torch_deepspeed_stdlib_and_the_contract():
    import ast
    allowed = {"torch", "deepspeed", "__future__"}
    for f in sorted((ROOT / "planc" / "runtime").glob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            # the Hugging Face modules (hf*.py) import transformers (and its safetensors) inside functions,
            # never at module level
            if (f.name.startswith("hf") and node not in tree.body and isinstance(node, (ast.Import, ast.ImportFrom))
                    and (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name or "")
                    .split(".")[0] in ("transformers", "safetensors")):
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                top = node.module.split(".")[0]
            elif isinstance(node, ast.Import):
                top = node.names[0].name.split(".")[0]
            else:
                continue
            if top == "planc":   # the contract package only, copied beside it (OUT/planc/plan/)
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                assert name == "planc.plan" or (name == "planc" and names == ["plan"]), f"{f.name} imports {name}"
                continue
            assert top in allowed or top in sys.stdlib_module_names, f"{f.name} imports {top}"


def test_code_files_that_cannot_be_laid_out_are_errors_at_their_line_and_leave_no_output(tmp_path):
    from planc.lang.errors import PlanError
    p, plan = _gpt()
    gone = dataclasses.replace(p, loss=dataclasses.replace(p.loss, path="nothere/gpt.py"))
    with pytest.raises(PlanError) as e:
        codegen.write_output(plan, gone, tmp_path / "o1")
    (d,) = e.value.diagnostics
    assert "loss file 'nothere/gpt.py' not found" in d.message and d.span == p.loss.span and d.span.line > 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "gpt.py").write_text("def batches(*a, **k):\n    yield None\n")
    clash = dataclasses.replace(p, data=dataclasses.replace(p.data, path=str(tmp_path / "other" / "gpt.py")))
    with pytest.raises(PlanError) as e:
        codegen.write_output(plan, clash, tmp_path / "o2")
    (d,) = e.value.diagnostics
    assert "two code files share the name 'gpt.py'" in d.message and d.span == p.data.span
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_no_clipping_and_adams_betas_in_ds_config(tmp_path):
    """DeepSpeed clips to norm 1.0 unless told: the generated config says 0.0. The plan's
    ``betas = (b1, b2)`` is torch's ``betas`` pair."""
    from planc.lang import load_text
    from planc.runtime.dataflow import build_optimizer
    import torch
    p, plan = _gpt()
    cfg = codegen.ds_config(plan, p)
    assert cfg["gradient_clipping"] == 0.0
    text = spelled("gpt-2x4.plan").read_text().replace("optimizer = adam(lr = 1e-3)",
                                                         "optimizer = adam(lr = 1e-3, betas = (0.8, 0.999), eps = 1e-6)")
    assert "betas = (0.8, 0.999)" in text
    q = load_text(text, str(spelled("gpt-2x4.plan")))
    params = codegen.ds_config(plan, q)["optimizer"]["params"]
    assert {**params, "betas": list(params["betas"])} == {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-6}
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"optimizer": {"type": "Adam", "params": params}})
    assert opt.defaults["betas"] == (0.8, 0.999) and opt.defaults["eps"] == 1e-6
