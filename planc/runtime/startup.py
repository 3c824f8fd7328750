"""Where a rank's start-up goes: ``train.py --profile-startup`` (issue 45). Standard library only.

    PHASES                           the phases in the order a rank passes them
    clock = StartupClock()           made first thing in ``main``; its origin is the process's own
                                     start (Linux: /proc), so the interpreter's start and every
                                     import count (the phase "imports")
    clock.mark(phase)                the wall time a phase ended (one mark per phase, in order)
    clock.record() -> dict           {"start": wall time the process started, "ends": {phase: wall time}}
    durations(record) -> [(phase, s)]  each phase's length, from the one before it (the process start first)
    rank_line(rank, record) -> str   one rank's phases in one line (each rank prints its own)
    profile_table(records) -> str    rank 0's summary of every rank's record: per phase the median
                                     and the slowest rank, and each rank's time to its first step

Nothing here changes what a rank does: without the flag nothing is gathered or printed. With it,
every rank's record is gathered after the last step (one all_gather_object, after training) and
rank 0 prints the table; each rank also prints its own line to its log.
"""
from __future__ import annotations

import os
import time

__all__ = ["PHASES", "StartupClock", "durations", "profile_table", "process_start", "rank_line"]

# a phase ends at its mark; "imports" is the interpreter's start and every import up to main.py's body
PHASES = ("imports", "plan read", "process group", "plan checks", "groups", "deepspeed init",
          "model build", "engine", "first step")


def process_start() -> float | None:
    """The wall time this process started (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])   # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])      # seconds after boot, to 10 ms (btime is whole seconds)
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupClock:
    """Wall-clock marks of one rank's start-up phases (``PHASES``)."""

    def __init__(self, start: float | None = None):
        now = time.time()
        self.start = start if start is not None else (process_start() or now)
        self.ends: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown start-up phase {phase!r} (one of {', '.join(PHASES)})")
        self.ends.setdefault(phase, time.time())

    def record(self) -> dict:
        return {"start": self.start, "ends": dict(self.ends)}


def durations(record: dict) -> list[tuple[str, float]]:
    """Each phase's seconds, measured from the end of the phase before it that was marked."""
    out, last = [], record["start"]
    for phase in PHASES:
        end = record["ends"].get(phase)
        if end is None:
            continue
        out.append((phase, max(0.0, end - last)))
        last = end
    return out


def rank_line(rank: int, record: dict) -> str:
    parts = ", ".join(f"{p} {s:.2f}" for p, s in durations(record))
    first = record["ends"].get("first step")
    total = f"; to the end of the first step {first - record['start']:.2f} s" if first is not None else ""
    return f"startup rank {rank}: {parts} (s){total}"


def profile_table(records: list[dict]) -> str:
    """Per phase the median and the slowest rank's seconds; then the launch's start-up: from the first
    rank's process start to the last rank's end of its first step (the step included)."""
    per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
    for rec in records:
        for phase, s in durations(rec):
            per_phase[phase].append(s)
    lines = ["startup phases over %d ranks (s): median / slowest" % len(records)]
    for phase in PHASES:
        xs = sorted(per_phase[phase])
        if xs:
            lines.append(f"  {phase:<15} {xs[len(xs) // 2]:7.2f} {xs[-1]:7.2f}")
    starts = [r["start"] for r in records]
    firsts = [r["ends"]["first step"] for r in records if "first step" in r["ends"]]
    if firsts:
        lines.append(f"startup to the first step's end: {max(firsts) - min(starts):.2f} s "
                     f"(first process start to last rank's first step; start {min(starts):.3f})")
    return "\n".join(lines)

