"""A measured timeline of one rank: what ran when, on which of its threads.

``train.py --trace DIR`` records, per rank, every pipeline instruction the
compute thread runs (``ForwardPass``, ``RecvActivation`` — which is the time
the compute thread *waited* for a receive —, ``SendGrad``, ...), every receive
the receive thread completes (from posting to arrival), every send from issue
to completion (the send reaper's wait), every gradient bucket's reduction and
every step, and writes them to ``DIR/trace-rank<R>.json`` in the Chrome trace
event format (open it in https://ui.perfetto.dev or chrome://tracing; the
files of all ranks can be loaded together: one process row per rank). Times
are wall-clock microseconds (``time.time_ns``), so the ranks of one machine
share an origin; across real hosts they are as close as the hosts' clocks.

``planc trace DIR`` summarises the files (``planc.runtime.trace.summarise``):
per rank, the step's time split into compute, waiting for receives, sending
and the rest — the measured counterpart of ``planc simulate``'s busy, bubble
and exposed-communication figures (docs/runtime.md, "Tracing"). ``planc trace
DIR --stalls`` (``stalls``) names, for every step much slower than the median,
the compute-thread instructions that held it up the longest.

Recording is off unless ``--trace`` is given; when on it costs two clock reads
and a list append per event, on the thread that runs the event.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from contextlib import contextmanager

__all__ = ["Tracer", "summarise", "stalls", "WAITS", "COMPUTE"]

# instruction names whose duration is the compute thread waiting for a peer's data
WAITS = ("RecvActivation", "RecvGrad")
# instruction names that are the stage's own computation
COMPUTE = ("ForwardPass", "BackwardPass", "WeightPass", "OptimizerStep")


def _now_us() -> float:
    return time.time_ns() / 1000.0


class Tracer:
    """Events of one rank, appended from any of its threads."""

    def __init__(self, rank: int, stage: int | None = None):
        self.rank, self.stage = rank, stage
        self._events: list[dict] = []
        self._lock = threading.Lock()

    @staticmethod
    def now() -> float:
        return _now_us()

    def complete(self, name: str, start_us: float, end_us: float, thread: str, **args) -> None:
        """An event that ran from ``start_us`` to ``end_us`` on ``thread``."""
        ev = {"name": name, "ph": "X", "ts": round(start_us, 1), "dur": round(max(0.0, end_us - start_us), 1),
              "pid": self.rank, "tid": thread}
        if args:
            ev["args"] = {k: v for k, v in args.items() if v is not None}
        with self._lock:
            self._events.append(ev)

    @contextmanager
    def span(self, name: str, thread: str, **args):
        t0 = _now_us()
        try:
            yield
        finally:
            self.complete(name, t0, _now_us(), thread, **args)

    def dump(self, directory: str) -> str:
        """Write ``directory/trace-rank<R>.json``; returns its path."""
        os.makedirs(directory, exist_ok=True)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank}" + (f" (stage {self.stage})" if self.stage is not None else
                                                         " (idle)")}}]
        with self._lock:
            events = sorted(self._events, key=lambda e: (e["ts"], e["tid"], e["name"]))
        path = os.path.join(directory, f"trace-rank{self.rank}.json")
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms",
                       "otherData": {"rank": self.rank, "stage": self.stage}}, f)
        return path


def load(directory: str) -> dict[int, dict]:
    """``{rank: trace file contents}`` of every ``trace-rank<R>.json`` in ``directory``."""
    out = {}
    names = sorted(n for n in os.listdir(directory) if n.startswith("trace-rank") and n.endswith(".json"))
    if not names:
        raise ValueError(f"{directory}: no trace-rank<R>.json files (run train.py with --trace {directory})")
    for n in names:
        path = os.path.join(directory, n)
        try:
            with open(path) as f:
                data = json.load(f)
            rank = int(data["otherData"]["rank"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a planc trace ({e})") from None
        out[rank] = data
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _steps(events: list[dict]) -> dict[int, dict]:
    """``{N: the main thread's "step N" event}`` of one rank's complete events."""
    return {int(e["name"][5:]): e for e in events
            if e["tid"] == "main" and e["name"].startswith("step ") and e["name"][5:].isdigit()}


def summarise(directory: str, skip_steps: int = 1) -> list[dict]:
    """Per rank, the mean over the traced steps (the first ``skip_steps`` left out, warm-up):
    step seconds, and the fractions of it the compute thread spent computing, waiting for
    receives, issuing sends and elsewhere (loading data, bookkeeping, the reduction's tail)."""
    rows = []
    for rank, data in sorted(load(directory).items()):
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
        steps = sorted(_steps(events).values(), key=lambda e: e["ts"])
        use = steps[skip_steps:] if len(steps) > skip_steps else steps
        if not use:
            continue
        acc = {"step": 0.0, "compute": 0.0, "wait": 0.0, "send": 0.0, "reduce": 0.0}
        for s in use:
            a, b = s["ts"], s["ts"] + s["dur"]
            inside = [e for e in events if e["tid"] == "compute" and a <= e["ts"] < b]   # a step's own events

            def busy(names) -> float:
                return _union([(e["ts"], min(b, e["ts"] + e["dur"])) for e in inside if e["name"] in names])
            acc["step"] += s["dur"]
            acc["compute"] += busy(COMPUTE)
            acc["wait"] += busy(WAITS)
            acc["send"] += busy(("SendActivation", "SendGrad"))
            acc["reduce"] += busy(("ReduceGrads",))
        n = len(use)
        step = acc["step"] / n
        row = {"rank": rank, "stage": data.get("otherData", {}).get("stage"), "steps": n, "step_s": step / 1e6}
        for k in ("compute", "wait", "send", "reduce"):
            row[k] = (acc[k] / n) / step if step > 0 else 0.0
        row["other"] = max(0.0, 1.0 - row["compute"] - row["wait"] - row["send"] - row["reduce"])
        rows.append(row)
    return rows


# compute-thread instructions that are the stage's work rather than a hold-up
_WORK = COMPUTE + ("LoadMicroBatch",)


def stalls(directory: str, skip_steps: int = 1, factor: float = 1.25, top: int = 3) -> dict:
    """The steps slower than ``factor`` x the median step, and what held each up.

    A step's time is the longest any rank recorded for it (``step N`` of the ``main`` thread; the
    ranks' steps end together at the step's last collective). For each slow step, the ``top``
    longest compute-thread instructions of any rank that are not the stage's own work (waits for
    receives, issuing sends, the reduction's tail, ...), with where in the step they began.
    Returns ``{"median_step_s", "factor", "steps": N, "slow": [{"step", "step_s", "holdups": [...]}]}``;
    each hold-up is ``{"rank", "stage", "instruction", "micro_batch", "transfer", "at_s", "dur_s"}``.
    """
    if factor <= 1.0:
        raise ValueError(f"--stalls factor must be above 1 (got {factor:g})")
    per_rank = {}
    for rank, data in sorted(load(directory).items()):
        events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
        per_rank[rank] = (data.get("otherData", {}).get("stage"), _steps(events),
                          [e for e in events if e["tid"] == "compute" and e["name"] not in _WORK])
    numbers = sorted({n for _, steps, _ in per_rank.values() for n in steps})[skip_steps:]
    if not numbers:
        return {"median_step_s": None, "factor": factor, "steps": 0, "slow": []}
    length = {n: max(steps[n]["dur"] for _, steps, _ in per_rank.values() if n in steps) for n in numbers}
    median = statistics.median(length.values())
    slow = []
    for n in numbers:
        if length[n] <= factor * median:
            continue
        holdups = []
        for rank, (stage, steps, others) in per_rank.items():
            s = steps.get(n)
            if s is None:
                continue
            a, b = s["ts"], s["ts"] + s["dur"]
            for e in others:
                if a <= e["ts"] < b:
                    args = e.get("args", {})
                    holdups.append({"rank": rank, "stage": stage, "instruction": e["name"],
                                    "micro_batch": args.get("micro_batch"), "transfer": args.get("transfer"),
                                    "at_s": (e["ts"] - a) / 1e6, "dur_s": min(e["dur"], b - e["ts"]) / 1e6})
        holdups.sort(key=lambda h: (-h["dur_s"], h["rank"], h["at_s"]))
        slow.append({"step": n, "step_s": length[n] / 1e6, "holdups": holdups[:top]})
    return {"median_step_s": median / 1e6, "factor": factor, "steps": len(numbers), "slow": slow}
