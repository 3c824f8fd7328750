"""A compiled output with another runtime decision: how the lab measures a choice side by side.

The runtime reads every decision from plan.json and nothing from the environment, so a bench that
measures the same plan with and without something (signal-only transfers, the host NIC order,
in-host steps through shared memory) runs a copy of the output folder whose plan.json differs in
exactly that field, written by the plan file's one writer (the digest changes with it, and every
rank of the launch reads the same copy).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from planc import plan as planfile

__all__ = ["variant", "with_timeout"]


def variant(out: Path | str, name: str, *, drop_nic_order: bool = False, **runtime) -> Path:
    """``OUT-name/``: a copy of the output folder ``out`` whose plan.json has the ``runtime`` fields
    given (``planfile.Runtime``'s names) and, with ``drop_nic_order``, no host NIC order. Made
    again on every call (an earlier copy is replaced)."""
    dest = _copy(out, name)
    plan = planfile.load(dest / "plan.json")
    plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, **runtime))
    if drop_nic_order and plan.pipeline is not None:
        plan = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, nic_order=()))
    (dest / "plan.json").write_text(planfile.dumps(plan))
    return dest


def with_timeout(out: Path | str, seconds: float) -> Path:
    """``OUT-timeout<S>/``: a copy of ``out`` whose ranks end within ``seconds`` of a collective that does not
    complete (plan.json ``train.timeout``, or ``runtime.timeout`` for a plan without a model): the
    collective timeout is the plan's, read from nowhere else. ``out`` itself where it holds that already."""
    out = Path(out)
    plan = planfile.load(out / "plan.json")
    if plan.timeout == float(seconds):
        return out
    dest = _copy(out, f"timeout{float(seconds):g}")
    if plan.train is not None:
        plan = dataclasses.replace(plan, train=dataclasses.replace(plan.train, timeout=float(seconds)))
    else:
        plan = dataclasses.replace(plan, runtime=dataclasses.replace(plan.runtime, timeout=float(seconds)))
    (dest / "plan.json").write_text(planfile.dumps(plan))
    return dest


def _copy(out: Path | str, name: str) -> Path:
    """``OUT-name/``: a fresh copy of the output folder (an earlier copy replaced), without logs or caches."""
    out = Path(out)
    dest = out.parent / f"{out.name}-{name}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("logs", "__pycache__"))
    return dest
