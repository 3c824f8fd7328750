"""A rank killed while DeepSpeed loads its JIT-built CPU op (the launcher kills the others when one fails)
leaves the build folder's lock file behind: every later launch on the machine waited on it forever. The
runtime imports the already built op directly (planc_runtime/dsops.py), so a stale lock does not stop a
launch. (The op is built by `make install` into the venv: tests/conftest.py keeps it there.)"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from e2e_util import ROOT, extensions_env, run_direct


@pytest.mark.slow
def test_a_stale_build_lock_does_not_stop_a_launch(tmp_path):
    from planc.commands.cli import main
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_env().get("TORCH_EXTENSIONS_DIR", "")
    built = Path(folder) / "deepspeed_shm_comm"
    if not (built / "deepspeed_shm_comm.so").is_file():
        pytest.skip(f"DeepSpeed's CPU op is not built in {built} (make install builds it)")
    extensions = tmp_path / "ext"
    shutil.copytree(built, extensions / "deepspeed_shm_comm")
    (extensions / "deepspeed_shm_comm" / "lock").touch()   # left by a rank killed mid-load
    out = tmp_path / "out"
    assert main(["compile", str(ROOT / "tests" / "plans" / "fault-2x1.plan"), "-o", str(out)]) == 0
    r = run_direct(out, "--steps", "1", env={"TORCH_EXTENSIONS_DIR": str(extensions)}, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step 0 loss" in r.stdout
    assert (extensions / "deepspeed_shm_comm" / "lock").exists()   # waited on by nobody, left as found
