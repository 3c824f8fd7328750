"""How the runtime executes a plan is the plan's: plan.json ``runtime`` (written by the compiler, covered
by the digest), set from the train block or documented defaults, never from the environment."""

import ast
import re
import sys
from pathlib import Path

import pytest

from planc.output import codegen
from planc.driver.compile import compile_file
from planc.lang import load_text
from planc.lang.errors import PlanError
from planc import plan as planfile
from planc.plan import (DEFAULT_GRAD_BUCKET_BYTES, DEFAULT_RECV_AHEAD, DEFAULT_REDUCE_BUCKET_BYTES,
                        DEFAULT_SHM_SLOT_BYTES, Backend, InHost, Runtime)

sys.path.insert(0, str(Path(__file__).parent))
from e2e_util import ROOT, spelled  # noqa: E402

RUNTIME = ROOT / "planc" / "runtime"
# environment variables the runtime may read: diagnostics and launch plumbing only (docs/runtime.md,
# "Environment"); none changes what a rank computes or the order in which it communicates
DIAGNOSTICS = {"PLANC_DEBUG", "PLANC_DUMP_STACKS_AFTER_S", "PLANC_SHM_DIR"}
# once read, now the plan's: train { timeout } (plan.json train.timeout), train { shm_slot } (runtime.shm_slot_bytes)
GONE = {"PLANC_COLLECTIVE_TIMEOUT_S", "PLANC_SHM_SLOT_BYTES"}


def _with_train(text: str, extra: str) -> Path:
    return text.replace("    seed = 1234\n", f"    seed = 1234\n{extra}")


def _compiled(tmp_path, extra: str = ""):
    src = spelled("gpt-2x4.plan")
    path = tmp_path / "p.plan"
    path.write_text(_with_train(src.read_text(), extra).replace("../../examples/", str(ROOT / "examples") + "/"))
    return compile_file(path, probe=False)


def test_defaults_are_written_into_plan_json(tmp_path):
    plan = _compiled(tmp_path).plan_json
    assert plan["runtime"] == {"backend": "auto", "recv_ahead": DEFAULT_RECV_AHEAD,
                               "grad_bucket_bytes": DEFAULT_GRAD_BUCKET_BYTES,
                               "reduce_bucket_bytes": DEFAULT_REDUCE_BUCKET_BYTES, "in_host": "shared_memory",
                               "shm_slot_bytes": DEFAULT_SHM_SLOT_BYTES, "nic_drain": True,
                               "signal_transfers": False}
    assert list(plan)[-1] == "runtime"


def test_train_block_settings_reach_the_plan_and_its_digest(tmp_path):
    base = _compiled(tmp_path)
    c = _compiled(tmp_path, "    backend = gloo\n    recv_ahead = 2\n    grad_bucket = 1 MiB\n"
                            "    reduce_bucket = 4 MB\n    in_host = backend\n    shm_slot = 64 KiB\n")
    rt = planfile.Plan.from_json(c.plan_json).runtime
    assert rt == Runtime(Backend.GLOO, 2, 1 << 20, 4_000_000, InHost.BACKEND, shm_slot_bytes=64 << 10)
    digest = planfile.digest(planfile.Plan.from_json(c.plan_json))
    assert digest != planfile.digest(planfile.Plan.from_json(base.plan_json))


@pytest.mark.parametrize("setting, message", [
    ("recv_ahead = 0", "recv_ahead"),
    ("grad_bucket = 8", "grad_bucket is a size with its unit, e.g. 'grad_bucket = 8 MiB'"),
    ("reduce_bucket = 0.5 B", "reduce_bucket must be a whole number of bytes, at least 1, got 0.5 B"),
    ("in_host = shm", "in_host must be one of shared_memory, backend"),
    ("backend = NCCL2", "backend must be one of auto, gloo, nccl"),
    ("shm_slot = 0 MiB", "shm_slot must be a whole number of bytes, at least 1, got 0 MiB"),
    ("shm_slot = -8 KiB", "shm_slot must be a whole number of bytes, at least 1, got -8 KiB"),
    ("shm_slot = 4096", "shm_slot is a size with its unit, e.g. 'shm_slot = 8 MiB'"),
])
def test_bad_runtime_settings_are_located(setting, message):
    src = _with_train(spelled("gpt-2x4.plan").read_text(), f"    {setting}\n")
    with pytest.raises(PlanError) as ei:
        load_text(src, "p.plan")
    d = ei.value.diagnostics[0]
    assert message in d.message
    line = src.splitlines().index(f"    {setting}") + 1
    assert d.span.line == line and d.span.col > 4


def test_plan_json_runtime_is_validated_by_the_reader(tmp_path):
    doc = _compiled(tmp_path).plan_json
    for key, value, why in (("recv_ahead", 0, "runtime.recv_ahead: 0 is below 1"),
                            ("in_host", "tcp", "runtime.in_host: 'tcp' is not one of"),
                            ("nic_drain", "yes", "runtime.nic_drain: expected true or false"),
                            ("shm_slot_bytes", 0, "runtime.shm_slot_bytes: 0 is below 1")):
        bad = dict(doc, runtime=dict(doc["runtime"], **{key: value}))
        with pytest.raises(planfile.PlanFileError, match=re.escape(why)):
            planfile.Plan.from_json(bad)
    absent = {k: v for k, v in doc.items() if k != "runtime"}   # a hand-written plan: the defaults
    assert planfile.Plan.from_json(absent).runtime == Runtime()


@pytest.mark.parametrize("backend", ["auto", "gloo", "nccl"])
def test_launch_script_follows_the_plans_backend(tmp_path, backend):
    c = _compiled(tmp_path, f"    backend = {backend}\n")
    launch = (codegen.write_output(c.plan_json, c.program, tmp_path / "out") / "launch.sh").read_text()
    assert "PLANC_BACKEND" not in launch
    probes_cuda = "torch.cuda.is_available()" in launch
    assert probes_cuda == (backend != "gloo")
    assert ("export DS_ACCELERATOR=cpu" in launch) == (backend != "nccl")
    assert ("has no CUDA device" in launch) == (backend == "nccl")
    # over the hostfile with PLANC_MULTI_HOST=1, whatever the backend
    assert 'if [ "${PLANC_MULTI_HOST:-0}" = "1" ]; then HOSTS=(--hostfile "$HERE/hostfile"); fi' in launch
    import subprocess
    assert subprocess.run(["bash", "-n", str(tmp_path / "out" / "launch.sh")]).returncode == 0


def _environment_reads(path: Path) -> set[str]:
    """Names of environment variables a module reads (os.environ.get / [] / getenv with a literal)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            if isinstance(f, ast.Attribute) and (
                    (f.attr == "get" and ast.unparse(f.value).endswith("environ"))
                    or (f.attr == "getenv" and ast.unparse(f.value) == "os")):
                names.add(node.args[0].value)
            if isinstance(f, ast.Name) and f.id == "getenv":    # from os import getenv
                names.add(node.args[0].value)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ") and isinstance(
                node.slice, ast.Constant):
            names.add(node.slice.value)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith("_ENV")
                                                for t in node.targets) and isinstance(node.value, ast.Constant):
            names.add(node.value.value)
    return {n for n in names if isinstance(n, str) and n.startswith("PLANC_")}


def test_the_runtime_reads_no_behaviour_from_the_environment(tmp_path):
    # the runtime and the contract it reads plan.json with (both run on every rank)
    read = {str(p.relative_to(ROOT)): _environment_reads(p)
            for p in sorted(RUNTIME.glob("*.py")) + sorted((ROOT / "planc" / "plan").glob("*.py"))}
    undocumented = {name: sorted(names - DIAGNOSTICS) for name, names in read.items() if names - DIAGNOSTICS}
    assert not undocumented, f"PLANC_* variables read outside the documented diagnostics: {undocumented}"
    assert set().union(*read.values()) >= {"PLANC_DEBUG", "PLANC_SHM_DIR"}, "the scan finds nothing"
    probe = tmp_path / "reads.py"     # the scan sees each way of reading the environment
    probe.write_text("import os\nfrom os import getenv\nos.environ.get('PLANC_A')\nos.getenv('PLANC_B')\n"
                     "getenv('PLANC_C')\nos.environ['PLANC_D']\n")
    assert _environment_reads(probe) == {"PLANC_A", "PLANC_B", "PLANC_C", "PLANC_D"}
    documented = (ROOT / "docs" / "runtime.md").read_text()
    for name in DIAGNOSTICS:
        assert name in documented, f"{name} is not documented in docs/runtime.md"
    for name in GONE:   # the plan's now: read nowhere, and not in the table of what the runtime reads
        assert not any(name in names for names in read.values()), name
        assert f"| `{name}" not in documented, f"docs/runtime.md still lists {name}"
