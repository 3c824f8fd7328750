"""Benchmark: how long placement + reduction synthesis take over a table of hierarchies.

``run()`` returns a markdown table (hierarchy, axes, matrices, programs, times).
It measures wall-clock time with ``time.perf_counter``, every case from empty
caches (so no case is timed on the synthesis an earlier one did); it is a
benchmark, never a test assertion. ``python -m benchmarks bench synthesis`` prints it, with a
progress bar on a terminal.

The P² systems are the two GPU clusters of the paper's evaluation as we read
it (the excerpt in shared/papers lost their description): 2 nodes x 16 A100
(NVSwitch) and 4 nodes x 8 V100 (NVLink), both on a data-centre network.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from planc import ir
from planc.placement import place
from planc.reduction import plan_reductions
from planc.commands.ui import progress

GB = 1e9


@dataclass(frozen=True, slots=True)
class Case:
    label: str
    levels: tuple[tuple[str, int, float, float], ...]   # name, fanout, bandwidth B/s, latency s
    host: str
    axes: tuple[tuple[str, int], ...]
    reduce_over: tuple[str, ...]
    grad_bytes: int = 64 << 20


CASES: tuple[Case, ...] = (
    Case("P² Fig. 2",
         (("rack", 1, None, 0.0), ("server", 2, 12.5 * GB, 20e-6), ("cpu", 2, 32 * GB, 5e-6), ("gpu", 4, 150 * GB, 2e-6)),
         "server", (("data", 4), ("param", 4)), ("data",)),
    Case("P² system A (A100)",
         (("node", 2, 12.5 * GB, 20e-6), ("gpu", 16, 300 * GB, 2e-6)),
         "node", (("data", 4), ("model", 8)), ("data",)),
    Case("P² system B (V100)",
         (("node", 4, 4 * GB, 30e-6), ("gpu", 8, 150 * GB, 2e-6)),
         "node", (("data", 8), ("model", 4)), ("data",)),
    Case("P² system B (V100), two reductions",
         (("node", 4, 4 * GB, 30e-6), ("gpu", 8, 150 * GB, 2e-6)),
         "node", (("data", 8), ("model", 4)), ("data", "model")),
    Case("512 devices",
         (("pod", 2, 2.5 * GB, 50e-6), ("rack", 4, 12.5 * GB, 20e-6), ("node", 8, 25 * GB, 10e-6), ("gpu", 8, 300 * GB, 2e-6)),
         "node", (("pipe", 4), ("data", 16), ("tensor", 8)), ("data",)),
    Case("4,096 devices",
         (("pod", 4, 2.5 * GB, 50e-6), ("rack", 4, 12.5 * GB, 20e-6), ("node", 4, 25 * GB, 10e-6),
          ("socket", 8, 100 * GB, 5e-6), ("gpu", 8, 300 * GB, 2e-6)),
         "node", (("pipe", 4), ("data", 16), ("tensor", 16), ("expert", 4)), ("data",)),
    Case("16,384 devices",
         (("pod", 4, 2.5 * GB, 50e-6), ("rack", 8, 12.5 * GB, 20e-6), ("node", 8, 25 * GB, 10e-6),
          ("socket", 8, 100 * GB, 5e-6), ("gpu", 8, 300 * GB, 2e-6)),
         "node", (("pipe", 8), ("data", 32), ("tensor", 16), ("expert", 4)), ("data",)),
)


def program_for(case: Case) -> ir.Program:
    cluster = ir.Cluster(tuple(ir.Level(n, f, bw, lat) for n, f, bw, lat in case.levels), case.host)
    parallel = ir.Parallel(tuple(ir.Axis(n, s) for n, s in case.axes), None)
    reductions = tuple(ir.Reduction("gradients" if i == 0 else f"r{i}", (axis,))
                       for i, axis in enumerate(case.reduce_over))
    return ir.Program(case.label, "<bench>", "0" * 64, ".", cluster, parallel, ir.StageMode.PIPE_AXIS,
                      (), reductions=reductions)


def _programs(program: ir.Program, placement, grad_bytes: int) -> str:
    """Reduction programs found valid for the chosen matrix, one count per reduction."""
    plans = plan_reductions(program, placement.coords, placement.stages, placement.matrix, {0: grad_bytes})
    return " + ".join(str(p.candidates) for p in plans)


def _slowest_synthesis(program: ir.Program, reduce_over, limit: int = 600) -> tuple[float, tuple[int, ...]]:
    """P²'s measure: synthesis alone with empty caches, for every distinct synthesis hierarchy
    among the first ``limit`` matrices; returns the slowest (seconds, factors)."""
    import importlib
    import itertools

    from planc.placement.matrices import enumerate_matrices
    from planc.reduction import matrix_positions
    syn = importlib.import_module("planc.reduction.synthesize")   # the module (the package re-exports the function)

    fanouts, sizes = program.cluster.fanouts, tuple(a.size for a in program.parallel.axes)
    shapes = {}
    for matrix in itertools.islice(enumerate_matrices(fanouts, sizes), limit):
        for axis in reduce_over:
            hierarchy, _ = matrix_positions(program.cluster, matrix, program.parallel.axis_names(), (axis,))
            shapes.setdefault(hierarchy.factors, hierarchy)
    worst = (0.0, ())
    for factors, hierarchy in sorted(shapes.items()):
        syn._named.cache_clear()
        syn._synthesize.cache_clear()
        start = time.perf_counter()
        syn.synthesize(hierarchy, program.synthesis.max_size, program.synthesis.collectives)
        worst = max(worst, (time.perf_counter() - start, factors))
    return worst


def clear_caches() -> None:
    """Empty every cache placement and reduction planning fill (synthesis, program costs, step costs)."""
    import importlib

    from planc import reduction
    from planc.placement import mapping
    from planc.reduction import costs
    syn = importlib.import_module("planc.reduction.synthesize")
    for f in (syn._named, syn._synthesize, mapping.program_costs, reduction._matrix_costs, reduction._pinned_costs):
        f.cache_clear()
    costs._STEP_CACHE.clear()
    costs._step_cache_devices = 0


def run(cases: tuple[Case, ...] = CASES) -> str:
    rows = ["| hierarchy | axes | matrices | programs | slowest synthesis (factors) | placement | "
            "placement + reductions planned |",
            "|---|---|---|---|---|---|---|"]
    for case in progress(cases, "synthesis bench", describe=lambda c: c.label):
        program = program_for(case)
        clear_caches()
        start = time.perf_counter()
        placement = place(program, {0: case.grad_bytes})
        placed = time.perf_counter() - start
        programs = _programs(program, placement, case.grad_bytes)
        seconds = time.perf_counter() - start
        slowest, factors = _slowest_synthesis(program, case.reduce_over)
        fanouts = " × ".join(f"{n} {f}" for n, f, _, _ in case.levels)
        axes = " × ".join(f"{n} {s}" for n, s in case.axes) + " (reduce " + ", ".join(case.reduce_over) + ")"
        matrices = f"{placement.candidates} ({placement.search}, {placement.evaluated} costed)"
        rows.append(f"| {case.label}: {fanouts} | {axes} | {matrices} | {programs} | "
                    f"{slowest:.3f} s ({'×'.join(map(str, factors))}) | {placed:.3f} s | {seconds:.3f} s |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(run(), end="")
