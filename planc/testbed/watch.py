"""Watching a testbed launch from outside: rank 0's step lines, failed ranks, ranks' peak memory,
and the DeepSpeed launcher command (helpers of ``netns.Testbed.launch``)."""
from __future__ import annotations

import os
import re
from pathlib import Path

STEP_RE = re.compile(r"step (\d+) comm ([0-9.]+) s \(verified")                  # train.py --comm-only
TRAIN_STEP_RE = re.compile(r"step (\d+) loss (\S+) time ([0-9.]+) s [0-9.]+ samples/s")   # train.py

class _StepWatch:
    """Follows rank 0's log while it is written and calls ``on_step(n, seconds)`` per step line."""

    def __init__(self, logdir: Path, pattern: str, on_step):
        self.logdir, self.pattern, self.on_step = logdir, pattern, on_step
        self.f, self.buf = None, ""

    def poll(self) -> None:
        if self.on_step is None:
            return
        if self.f is None:
            found = sorted(self.logdir.glob(self.pattern))
            if not found:
                return
            self.f = open(found[-1], errors="replace")
        self.buf += self.f.read()
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            m = STEP_RE.search(line) or TRAIN_STEP_RE.search(line)
            if m:
                self.on_step(int(m.group(1)), float(m.group(2) if m.re is STEP_RE else m.group(3)))

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


_RANK_FAILED_RE = re.compile(r"exits with return code = (-?\d+)")


def _rank_failed(logdir: Path) -> bool:
    """Whether a DeepSpeed launcher has reported a failed rank (it then kills its own ranks)."""
    for f in logdir.glob("host*.log"):
        try:
            if _RANK_FAILED_RE.search(f.read_text(errors="replace")):
                return True
        except OSError:
            pass
    return False


def deepspeed_command(python: str) -> list[str]:
    """The ``deepspeed`` launcher next to ``python`` (a virtual environment's), else DeepSpeed's runner module."""
    exe = Path(python).parent / "deepspeed"
    if exe.is_file() and os.access(exe, os.X_OK):
        return [str(exe)]
    return [python, "-u", "-c", "import sys; from deepspeed.launcher.runner import main; sys.exit(main())"]


def _sample_hwm(launched, script: str, hwm: dict[int, int]) -> None:
    """Peak resident memory (VmHWM, kB) of every running rank process below ``launched``, by RANK."""
    try:
        import psutil
    except ImportError:   # pragma: no cover - psutil comes with DeepSpeed
        return
    for p in launched:
        if p.poll() is not None:
            continue
        try:
            procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        except psutil.Error:
            continue
        for q in procs:
            try:
                if script not in q.cmdline():
                    continue
                rank = q.environ().get("RANK")
                with open(f"/proc/{q.pid}/status") as f:
                    kb = next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
            except (psutil.Error, OSError, ValueError):
                continue
            if rank is not None and kb is not None:
                hwm[int(rank)] = max(hwm.get(int(rank), 0), kb)
