"""`planc explain --draw FILE`: the cluster tree with each stage's mesh and the chosen groups.

The tree runs from the cluster (top) through every level's units to the devices (leaves, left to
right in rank order). Each device is a box filled with its stage's colour and labelled with its
rank and its coordinates on that stage's mesh; below the leaves, one row per reduction that moves
something draws each of its groups as a coloured bar through its members (a reduction whose groups
are single devices has nothing to draw and no row), one row the tensor groups, and one row per
transfer its unit tasks' sends, an arrow from each sender to each of its receivers. Hosts are the
units of the host level, outlined. matplotlib with the Agg backend (no display); PNG or SVG by the
file's suffix. In an SVG every device box is an element with id ``device-<rank>``, every group bar
``group-<r>-<g>`` (``r`` the reduction's index in plan.json), every tensor group ``tensor-<g>`` and
every send ``transfer-<t>-<k>``.
"""

from __future__ import annotations

from pathlib import Path

from planc import plan as planfile

SUFFIXES = (".png", ".svg")


class DrawError(ValueError):
    """The drawing cannot be made: a file type we do not write, or no matplotlib."""


def check_drawable(path) -> None:
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise DrawError(f"{path}: the file name must end in .png or .svg, not {suffix or '(no suffix)'!r}")
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise DrawError(f"{path}: folder {folder} does not exist")
    try:
        import matplotlib  # noqa: F401  (optional: planc[plot])
    except ImportError:
        raise DrawError("matplotlib is not installed; install it with: pip install 'planc[plot]'") from None


def draw(plan: planfile.Plan | dict, path) -> int:
    """Write the drawing of ``plan`` (the typed plan, or a plan.json document) to ``path``; returns the number
    of devices drawn."""
    check_drawable(path)
    plan = planfile.Plan.of(plan)
    import matplotlib   # optional (planc[plot]) and slow to import: only when drawing
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    c = plan.cluster
    levels = c.levels
    fanouts = [lv.fanout for lv in levels]
    n = c.devices
    depth = len(levels)
    stage_of, pos_of = {}, {}
    for s in plan.stages:
        for d in s.mesh_devices:
            stage_of[d], pos_of[d] = s.index, s.position(d)
    stage_cmap = plt.get_cmap("tab10")
    group_cmap = plt.get_cmap("Set2")
    reds = [(r, red) for r, red in enumerate(plan.reductions) if any(len(g) > 1 for g in red.groups)]
    tensor = [list(g) for g in plan.tensor_groups]
    sends = [(t, tr, sorted({(task.sender, d) for task in tr.forward.tasks for d in task.receivers
                             if d != task.sender})) for t, tr in enumerate(plan.transfers)]
    sends = [x for x in sends if x[2]]
    rows = len(reds) + bool(tensor) + len(sends)

    width = max(6.0, 0.55 * n + 1.5)
    height = 1.2 * depth + 1.6 + 0.45 * rows
    fig, ax = plt.subplots(figsize=(min(width, 40.0), height))
    ax.set_axis_off()

    # the tree: unit u of level j spans devices [u * block_j, (u + 1) * block_j)
    y_of = {j: depth - 1 - j for j in range(-1, depth)}       # -1 = the cluster root; devices at 0
    host_level = next((j for j, lv in enumerate(levels) if lv.name == c.host_level), None)
    block = [1] * depth
    for j in range(depth - 2, -1, -1):
        block[j] = block[j + 1] * fanouts[j + 1]
    root_x = (n - 1) / 2
    ax.text(root_x, y_of[-1] + 0.05, plan.name, ha="center", va="bottom", fontsize=10, weight="bold")
    for j in range(depth):
        units = n // block[j]
        parent_block = block[j - 1] if j > 0 else n
        for u in range(units):
            lo, hi = u * block[j], (u + 1) * block[j] - 1
            x = (lo + hi) / 2
            p = (u * block[j]) // parent_block
            px = (p * parent_block + (p + 1) * parent_block - 1) / 2
            top = 0.3 if j == depth - 1 else y_of[j] + 0.25        # the leaves are the device boxes at y = 0
            ax.plot([px, x], [y_of[j - 1], top], color="0.6", lw=0.8, zorder=1)
            if j < depth - 1:
                ax.text(x, y_of[j] + 0.25, f"{levels[j].name} {u}", ha="center", va="bottom", fontsize=7)
            if j == host_level:
                ax.add_patch(Rectangle((lo - 0.45, -0.45), hi - lo + 0.9, y_of[j] + 0.15 + 0.45, fill=False,
                                       ls="--", lw=0.8, ec="0.4", zorder=0))
                ax.text(lo - 0.4, y_of[j] + 0.02, f"host {u}", fontsize=6, color="0.3", va="bottom")
    # the devices
    for d in range(n):
        st = stage_of.get(d)
        colour = stage_cmap(st % 10) if st is not None else (0.85, 0.85, 0.85, 1.0)
        box = Rectangle((d - 0.4, -0.3), 0.8, 0.6, fc=colour, ec="black", lw=0.6, zorder=3)
        box.set_gid(f"device-{d}")
        ax.add_patch(box)
        ax.text(d, 0.0, str(d), ha="center", va="center", fontsize=7, zorder=4)
        if st is not None:
            ax.text(d, -0.38, f"s{st} {list(pos_of[d])}", ha="center", va="top", fontsize=5, zorder=4)
    def bars(y, groups, gid):   # each group a coloured bar through its members
        for g, members in enumerate(groups):
            colour = group_cmap(g % 8)
            off = (g % 3 - 1) * 0.08
            line, = ax.plot([min(members), max(members)], [y + off, y + off], color=colour, lw=2.5, zorder=2,
                            solid_capstyle="round")
            line.set_gid(gid(g))
            ax.plot(members, [y + off] * len(members), "o", color=colour, ms=4, mec="black", mew=0.4, zorder=3)

    # the chosen groups, one row per reduction that moves something, then the tensor groups, then the sends
    y_rows = (-0.95 - 0.45 * i for i in range(rows))
    for r, red in reds:
        y = next(y_rows)
        where = f" (stage {red.stage})" if red.stage is not None else ""
        ax.text(-0.6, y, f"reduce {red.name}{where}", ha="right", va="center", fontsize=6)
        bars(y, red.groups, lambda g, r=r: f"group-{r}-{g}")
    if tensor:
        y = next(y_rows)
        ax.text(-0.6, y, "tensor groups", ha="right", va="center", fontsize=6)
        bars(y, tensor, lambda g: f"tensor-{g}")
    for t, tr, pairs in sends:
        y = next(y_rows)
        ax.text(-0.6, y, f"transfer {tr.name} ({tr.src_stage} -> {tr.dst_stage})", ha="right",
                va="center", fontsize=6)
        colour = stage_cmap(tr.src_stage % 10)
        for k, (a, b) in enumerate(pairs):
            arrow = ax.annotate("", xy=(b, y), xytext=(a, y), zorder=2, arrowprops=dict(
                arrowstyle="->", color=colour, lw=0.9, connectionstyle=f"arc3,rad={0.25 if a < b else -0.25}"))
            arrow.arrow_patch.set_gid(f"transfer-{t}-{k}")
    legend = [Patch(fc=stage_cmap(s.index % 10), ec="black", label=f"stage {s.index} ({' x '.join(s.mesh_axes)})")
              for s in plan.stages]
    ax.legend(handles=legend, loc="upper right", fontsize=6, frameon=False)
    ax.set_xlim(-0.6 - (2.5 if rows else 0), n - 0.4)
    ax.set_ylim(-0.95 - 0.45 * rows, y_of[-1] + 0.5)
    fig.tight_layout()
    fig.savefig(path, format=Path(path).suffix.lower()[1:], dpi=120)
    plt.close(fig)
    return n
