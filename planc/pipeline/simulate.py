"""Event simulation of per-stage instruction lists over a transfer graph.

Execution model (the runtime engine's): each stage runs its list in order;
sends are buffered (a stage never waits for its receiver); receives block.
``F(s, m)`` needs ``F(src, m)`` for every transfer ``src -> s``;
``B(s, m)`` needs ``B(dst, m)`` for every transfer ``s -> dst`` (the gradient
of each output comes back over the same transfer). Skip transfers to
non-adjacent stages are ordinary edges. Lists that can never finish raise
:class:`DeadlockError` naming the blocked instructions.
"""

from __future__ import annotations

from dataclasses import dataclass

Op = tuple[str, int]


class DeadlockError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Timeline:
    start: dict            # (stage, op) -> start time
    finish: dict           # (stage, op) -> finish time
    makespan: float
    peak_in_flight: tuple[int, ...]   # per stage


def simulate(per_stage, edges, forward: float = 1.0, backward: float = 2.0, comm: float = 0.0) -> Timeline:
    """Run every stage's list; times are in units of ``forward``."""
    n = len(per_stage)
    inputs = {s: sorted({a for a, b in edges if b == s}) for s in range(n)}
    outputs = {s: sorted({b for a, b in edges if a == s}) for s in range(n)}
    for a, b in edges:
        if not (0 <= a < n and 0 <= b < n) or a == b:
            raise ValueError(f"bad transfer edge {a} -> {b} for {n} stages")
    pos = [0] * n
    clock = [0.0] * n
    start: dict = {}
    finish: dict = {}
    total = sum(len(ops) for ops in per_stage)
    while len(finish) < total:
        progressed = False
        for s in range(n):
            while pos[s] < len(per_stage[s]):
                kind, m = per_stage[s][pos[s]]
                if kind == "F":
                    deps = [(src, ("F", m)) for src in inputs[s]]
                    cost = forward
                else:
                    deps = [(dst, ("B", m)) for dst in outputs[s]] + [(s, ("F", m))]
                    cost = backward
                if any(d not in finish for d in deps):
                    break
                ready = max([clock[s]] + [finish[d] + (comm if d[0] != s else 0.0) for d in deps])
                start[(s, (kind, m))] = ready
                finish[(s, (kind, m))] = clock[s] = ready + cost
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = ", ".join(f"stage {s}: {k}{m}" for s in range(n) if pos[s] < len(per_stage[s])
                                for k, m in [per_stage[s][pos[s]]])
            raise DeadlockError(f"pipeline lists deadlock; blocked at {blocked}")
    peaks = []
    for ops in per_stage:
        live = peak = 0
        for kind, _ in ops:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return Timeline(start, finish, max(finish.values(), default=0.0), tuple(peaks))
