"""The wheel ships grammar/ and templates/ and an installed planc finds them (not only a checkout)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("planc-*.whl")
    return whl


def test_wheel_contains_grammar_templates_and_runtime(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith("share/planc/grammar/planc.lark") for n in names)
    for t in ("train.py.j2", "ds_config.json.j2", "hostfile.j2", "launch.sh.j2", "README.md.j2"):
        assert any(n.endswith(f"share/planc/templates/{t}") for n in names), t
    assert "planc/runtime/reshard.py" in names and "planc/commands/cli.py" in names
    # the real cluster's calibration ships (its torch side too); the lab (benchmarks/) does not
    assert "planc/calibrate/__init__.py" in names and "planc/calibrate/microbench.py" in names
    assert not [n for n in names if n.startswith("benchmarks/")]
    assert "planc/runtime/microbench.py" not in names and "planc/runtime/gloocheck.py" not in names


def test_installed_wheel_compiles_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # dependencies (lark, jinja2, ...) come from the test environment, appended after the venv's own site
    site = Path(subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.check_output([str(py), "-c", "import planc; print(planc.__file__)"], text=True, cwd=tmp_path)
    assert where.startswith(str(venv)), where
    plan = ROOT / "plans" / "p2-running-example.plan"
    r = subprocess.run([str(py), "-m", "planc", "compile", str(plan), "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "train.py").is_file() and (tmp_path / "out" / "planc_runtime" / "reduce.py").is_file()
