"""`planc simulate`: the Gantt chart of one simulated iteration, and the schedules side by side.

:func:`draw` writes a PNG or SVG with matplotlib (Agg, no display): one row per
stage for compute (its first device; all devices of a stage run the same
list), one row per host link direction for traffic; bars coloured by
micro-batch, backward bars hatched, reductions grey; a marker where each
transfer instance completes. :func:`table` is the plain-text comparison of
the schedules. :func:`plan_input` rebuilds the simulator's input from a
compiled plan.json (its ``pipeline.predicted`` compute model).
"""

from __future__ import annotations

from pathlib import Path

from planc import ir
from planc.pipeline.simulate import SimInput, StageCompute, sim_input

__all__ = ["plan_input", "draw", "table"]


def cluster_of(plan: dict) -> ir.Cluster:
    c = plan["cluster"]
    levels = tuple(ir.Level(lv["name"], lv["fanout"], lv["bandwidth"], lv.get("latency", 0.0),
                            both_ways=lv.get("both_ways")) for lv in c["levels"])
    return ir.Cluster(levels, c["host_level"], c.get("flops"), c.get("memory"), c.get("cores"), c.get("cores_level"),
                      c.get("op_overhead"), c.get("step_overhead"))


def plan_input(plan: dict) -> SimInput:
    """The simulator's input of a compiled plan.json; a ``ValueError`` when it holds no compute model
    (compiled with --no-probe, or not trainable)."""
    pred = (plan.get("pipeline") or {}).get("predicted")
    if not pred:
        raise ValueError("the plan holds no compute model (pipeline.predicted): compile it with the model probe "
                         "(without --no-probe) and as a trainable plan")
    compute = [StageCompute.from_json(s) for s in pred["stages"]]
    return sim_input(cluster_of(plan), plan["stages"], plan["transfers"], plan["reductions"], compute,
                     plan.get("runtime"), (plan.get("train") or {}).get("zero", 0), (plan.get("train") or {}).get("zero3"),
                     (plan.get("train") or {}).get("recompute") or ())


def _t(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.4g} {unit}"
    return f"{s / 1e-9:.4g} ns"


HEADERS = ("schedule", "iteration", "bubble", "exposed comm", "peak activations")


def table_rows(rows: list[tuple[str, object]], chosen: str | None = None) -> list[list[str]]:
    """Per schedule (name, Prediction): its iteration, worst stage bubble, exposed communication and
    largest per-device peak of activations; the plan's own schedule marked."""
    out = []
    for name, p in rows:
        bubble = max((s.bubble for s in p.stages), default=0.0)
        peak = max((s.peak_activation_bytes for s in p.stages), default=0.0)
        out.append([name + (" (plan)" if name == chosen else ""), _t(p.iteration), f"{bubble:.1%}",
                    _t(p.exposed_communication), _bytes(peak)])
    return out


def table(rows: list[tuple[str, object]], chosen: str | None = None):
    """The schedules side by side: a rich table (``planc.commands.ui``), or plain text without it."""
    body = table_rows(rows, chosen)
    try:
        from planc.commands import ui   # rich: only when a table is shown, and optional (plain text without)
    except ImportError:
        ui = None
    if ui is not None:
        return ui.table([ui.Col(HEADERS[0])] + [ui.Col(h, "right") for h in HEADERS[1:]], body)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(HEADERS)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(HEADERS, widths)))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in body]
    return "\n".join(lines)


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def draw(pred, sim: SimInput, path, title: str = "") -> dict:
    """Write the chart of ``pred`` (a :func:`planc.pipeline.simulate.predict` run with ``timeline=True``)
    to ``path`` (.png or .svg); returns the number of bars drawn per kind."""
    import matplotlib   # optional (planc[plot]) and slow to import: only when drawing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"{path}: the timeline is written as .png or .svg")
    first = {devs[0]: s for s, devs in enumerate(sim.stage_devices) if devs}
    bars: dict[tuple, list[float]] = {}
    for s, d, kind, m, a, b in pred.compute:          # the last backward comes per layer: one bar per op
        if first.get(d) != s:
            continue
        span = bars.setdefault((s, kind, m), [a, b])
        span[0], span[1] = min(span[0], a), max(span[1], b)
    host = sim.cluster.host_index
    links = sorted({link for link, *_ in pred.traffic if link[0] == host})
    rows = [f"stage {s}" for s in range(len(sim.stage_devices))] + [
        f"host {u} {'out' if direction == 0 else 'in'}" for _, u, direction in links]
    tab = plt.get_cmap("tab10")
    palette = [tab(i) for i in range(10) if i != 7]    # tab10 without its grey (grey: reductions)

    def cmap(m):
        return palette[m]
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(rows)))
    scale, unit = ((1e3, "ms") if pred.iteration >= 1e-3 else (1e6, "us"))
    for (s, kind, m), (a, b) in bars.items():
        ax.barh(s, (b - a) * scale, left=a * scale, height=0.8, color=cmap(m % len(palette)), edgecolor="black",
                linewidth=0.3, hatch="//" if kind == "B" else None)
    traffic = 0
    for link, a, b, what in pred.traffic:
        if link[0] != host:
            continue
        row = len(sim.stage_devices) + links.index(link)
        m = what[3] if what and what[0] == "transfer" else None
        ax.barh(row, max(b - a, 0.0) * scale, left=a * scale, height=0.6, edgecolor="black", linewidth=0.2,
                color=cmap(m % len(palette)) if m is not None else "0.6",
                hatch="//" if what and what[0] == "transfer" and what[2] == "backward" else None)
        traffic += 1
    stage_row = {}
    for ti, t in enumerate(sim.transfers):
        stage_row[t.name] = (t.dst_stage, t.src_stage)
    for name, direction, m, a, b in pred.transfers:
        row = stage_row[name][0 if direction == "forward" else 1]
        ax.plot([b * scale], [row + 0.45], marker="v", color=cmap(m % len(palette)), markersize=5,
                markeredgecolor="black", markeredgewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"{title}: predicted iteration {_t(pred.iteration)}, exposed communication "
                 f"{_t(pred.exposed_communication)}  (colour: micro-batch; hatched: backward; grey: gradient "
                 "reduction; v: transfer arrives)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    drawn = {"patches": len(ax.patches), "markers": len(ax.lines)}   # what the axes really hold
    plt.close(fig)
    return {"compute_bars": len(bars), "traffic_bars": traffic, "transfer_marks": len(pred.transfers), **drawn}
