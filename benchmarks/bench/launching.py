"""A compiled output's own ``launch.sh`` run by a bench: CPU ranks (gloo), this interpreter's environment's
``deepspeed`` and Python first on PATH; a failed launch is an error naming the bench and the output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def launch_sh(out: Path, *args, bench: str, timeout: float = 600) -> str:
    """``bash OUT/launch.sh ARGS``; rank 0's output (launch.sh follows its log)."""
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH="", PYTHON=sys.executable,
               PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(["bash", str(out / "launch.sh"), *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=out)
    if r.returncode != 0:
        raise RuntimeError(f"benchmarks bench {bench}: the launch of {out.name} {' '.join(map(str, args))} failed:\n"
                           f"{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r.stdout
