"""`planc explain --as megatron|deepspeed|torch`: planc's chosen placement in another tool's words.

Megatron-LM, DeepSpeed and torch all number ranks by one fixed order of whole axes: rank = a
row-major (mixed-radix) number of the axis coordinates, one axis the fastest. Megatron's
``order`` string lists the axes fastest first ("tp-cp-ep-dp-pp": consecutive ranks differ in
tp); DeepSpeed's ``ProcessTopology(axes, dims)`` and torch's ``init_device_mesh(shape,
mesh_dim_names)`` list them slowest first. planc's parallelism matrix may split an axis over
several cluster levels (DESIGN.md "Rank mapping"): when another axis's digit sits between two
digits of one axis, that axis's groups are strided in a way no fixed order gives, and we say so.

The order is found against the plan's own numbering (``placement.coords`` or each stage's mesh),
trying every order of the axes, so what is printed is what reproduces plan.json; the matrix
only supplies the reason when none does. Plans whose stages have their own meshes (``on devices``)
are explained per stage, each mesh a block of ranks from its first device.
"""

from __future__ import annotations

import itertools
import math

from planc import plan as planfile

TARGETS = ("megatron", "deepspeed", "torch")
MEGATRON_NAMES = {"tensor": "tp", "tp": "tp", "context": "cp", "cp": "cp", "data": "dp", "dp": "dp",
                  "pipe": "pp", "pp": "pp"}
MEGATRON_DEFAULT = ("tp", "cp", "ep", "dp", "pp")
DEEPSPEED_NAMES = {"tensor": "model"}       # DeepSpeed's pipeline topology calls tensor parallelism "model"


class ExplainAsError(ValueError):
    """The plan cannot be explained in the chosen vocabulary at all (not a placement it fails to express)."""


def find_order(sizes: list[int], coords: dict[int, tuple[int, ...]], offset: int = 0) -> list[int] | None:
    """Axis indices, slowest first, such that device = offset + row-major number of its coordinates
    in that order, for every device; ``None`` when no order does. Axes of size 1 go last."""
    big = [i for i, s in enumerate(sizes) if s > 1]
    ones = [i for i, s in enumerate(sizes) if s <= 1]
    if len(coords) != math.prod(sizes):
        return None
    for perm in itertools.permutations(big):
        if all(_number([x[i] for i in perm], [sizes[i] for i in perm]) == d - offset for d, x in coords.items()):
            return list(perm) + ones
    return None


def _number(digits: list[int], radices: list[int]) -> int:
    n = 0
    for x, r in zip(digits, radices):
        n = n * r + x
    return n


def split_reason(axes: list[str], matrix: list[list[int]], levels: list[str]) -> str | None:
    """Why no fixed order of whole axes gives the matrix's numbering: an axis whose digits (its
    factors on each level, outermost first) have another axis's digit between them."""
    seq = [(i, j) for j in range(len(levels)) for i in range(len(axes)) if matrix[i][j] > 1]
    for i, name in enumerate(axes):
        pos = [p for p, (a, _) in enumerate(seq) if a == i]
        for p, q in zip(pos, pos[1:]):
            if q != p + 1:
                k, lv = seq[p + 1]
                split = [f"{levels[j]} x{matrix[i][j]}" for j in range(len(levels)) if matrix[i][j] > 1]
                return (f"axis '{name}' is split across levels ({', '.join(split)}) and axis '{axes[k]}' "
                        f"(level {levels[lv]} x{matrix[k][lv]}) sits between its parts, so '{name}' ranks are "
                        "strided non-uniformly: no row-major order of whole axes numbers them this way")
    return None


def _grid_views(plan: planfile.Plan) -> list[dict]:
    """The rank grids to explain: the world (placement coordinates), or each stage's own mesh."""
    pl = planfile.Notes.read(plan).placement
    if plan.stage_mode is not planfile.StageMode.EXPLICIT and pl and pl.coords:
        axes = [n for n, _ in pl.axes]
        sizes = [size for _, size in pl.axes]
        coords = {d: tuple(x) for d, x in enumerate(pl.coords)}
        levels = [lv.name for lv in plan.cluster.levels]
        return [{"scope": "world", "first_rank": 0, "world": plan.cluster.devices, "axes": axes, "sizes": sizes,
                 "coords": coords, "why_not": split_reason(axes, [list(r) for r in pl.matrix], levels)}]
    views = []
    for s in plan.stages:
        mesh, names = s.mesh, list(s.mesh_axes)
        shape, coords = _shape_and_coords(mesh)
        if len(shape) != len(names):
            names = [f"dim{k}" for k in range(len(shape))]
        first = min(coords) if coords else 0
        views.append({"scope": f"stage {s.index}", "first_rank": first, "world": plan.cluster.devices, "axes": names,
                      "sizes": shape, "coords": coords,
                      "why_not": f"stage {s.index}'s mesh {mesh} is not the ranks {first}..{first + len(coords)} "
                                 "in row-major order of any ordering of its axes"})
    return views


def _shape_and_coords(mesh) -> tuple[list[int], dict[int, tuple[int, ...]]]:
    if not isinstance(mesh, list):
        return [], {int(mesh): ()}
    shape, coords = [len(mesh)], {}
    inner = None
    for k, sub in enumerate(mesh):
        s, c = _shape_and_coords(sub)
        inner = s if inner is None else inner
        for d, x in c.items():
            coords[d] = (k,) + x
    return shape + (inner or []), coords


def _mesh_list(view: dict, order: list[int]) -> list:
    """The rank list as a nested list indexed by the axes in ``order``."""
    sizes = [view["sizes"][i] for i in order]
    flat = [0] * math.prod(sizes)
    for d, x in view["coords"].items():
        flat[_number([x[i] for i in order], sizes)] = d
    def nest(vals, dims):
        if len(dims) <= 1:
            return vals
        step = len(vals) // dims[0]
        return [nest(vals[k * step:(k + 1) * step], dims[1:]) for k in range(dims[0])]
    return nest(flat, sizes) if sizes else flat


def _groups(view: dict) -> list[dict]:
    """Per axis of size > 1: how many groups, and the group of the first rank (ranks differing only there)."""
    out = []
    first = min(view["coords"], key=lambda d: view["coords"][d])
    x0 = view["coords"][first]
    for i, (name, size) in enumerate(zip(view["axes"], view["sizes"])):
        if size > 1:
            g = sorted((d for d, x in view["coords"].items()
                        if all(x[k] == x0[k] for k in range(len(x)) if k != i)), key=lambda d: view["coords"][d][i])
            out.append({"axis": name, "size": size, "groups": len(view["coords"]) // size, "first_group": g})
    return out


def _megatron(view: dict, order: list[int] | None) -> dict:
    unknown = [a for a, s in zip(view["axes"], view["sizes"]) if s > 1 and a not in MEGATRON_NAMES]
    if unknown:
        return {"expressible": False, "reason": f"axis {', '.join(repr(a) for a in unknown)} has no Megatron "
                "counterpart (Megatron's orders name tp, cp, ep, dp, pp; planc's tensor, context, data, pipe)"}
    if order is None:
        return {"expressible": False, "reason": view["why_not"]}
    sizes = {n: 1 for n in ("tp", "cp", "ep", "dp", "pp")}
    for a, s in zip(view["axes"], view["sizes"]):
        if a in MEGATRON_NAMES:
            sizes[MEGATRON_NAMES[a]] *= s
    fast_first = [MEGATRON_NAMES[view["axes"][i]] for i in reversed(order) if view["sizes"][i] > 1]
    order_s = "-".join(_full_order(fast_first))
    short = "-".join(fast_first) or "tp"
    if _same_relative(fast_first, MEGATRON_DEFAULT):
        how = "Megatron's default order (no flag needed)"
    elif sizes["cp"] == 1 and sizes["ep"] == 1 and _same_relative(fast_first, ("tp", "pp", "dp")):
        how = "--use-tp-pp-dp-mapping (order tp-pp-dp)"
    else:
        how = (f"not offered on Megatron-LM's command line: pass order=\"{order_s}\" to "
               "megatron.core.parallel_state.initialize_model_parallel")
    flags = (f"--tensor-model-parallel-size {sizes['tp']} --pipeline-model-parallel-size {sizes['pp']} "
             f"--context-parallel-size {sizes['cp']}")
    return {"expressible": True, "order": order_s, "order_axes": short, "sizes": sizes, "how": how,
            "flags": flags, "rank_offset": view["first_rank"]}


def _full_order(fast_first: list[str]) -> list[str]:
    """All five Megatron names: the ones that matter in their order, the size-1 ones where Megatron
    wants them (cp after tp, ep next to dp: RankGenerator rejects an order with ep away from dp)."""
    if _same_relative(fast_first, MEGATRON_DEFAULT):
        return list(MEGATRON_DEFAULT)
    full = list(fast_first)
    for name in ("tp", "dp", "pp"):
        if name not in full:
            full.append(name)
    if "cp" not in full:
        full.insert(full.index("tp") + 1, "cp")
    if "ep" not in full:
        full.insert(full.index("dp") + 1, "ep")
    return full


def _same_relative(names: list[str], ref) -> bool:
    """``names`` appear in ``ref``'s relative order."""
    idx = [list(ref).index(n) for n in names if n in ref]
    return len(idx) == len(names) and idx == sorted(idx)


def _deepspeed(view: dict, order: list[int] | None) -> dict:
    if order is None:
        return {"expressible": False, "reason": view["why_not"]}
    axes = [DEEPSPEED_NAMES.get(view["axes"][i], view["axes"][i]) for i in order]
    dims = [view["sizes"][i] for i in order]
    call = f"ProcessTopology(axes={axes!r}, dims={dims!r})".replace("'", '"')
    return {"expressible": True, "axes": axes, "dims": dims, "call": call, "rank_offset": view["first_rank"]}


def _torch(view: dict, order: list[int] | None) -> dict:
    names_planc = list(view["axes"])
    exact = _mesh_list(view, list(range(len(names_planc))))
    generic = (f"DeviceMesh(\"cuda\", torch.tensor({exact}), mesh_dim_names="
               f"{tuple(names_planc)!r})".replace("'", '"'))
    if order is None or len(view["coords"]) != view["world"]:
        reason = view["why_not"] if order is None else (
            f"init_device_mesh lays a mesh over the whole world ({view['world']} ranks); this one holds "
            f"ranks {view['first_rank']}..{view['first_rank'] + len(view['coords'])}")
        return {"expressible": False, "reason": reason, "device_mesh": generic, "mesh": exact,
                "mesh_dim_names": names_planc}
    shape = tuple(view["sizes"][i] for i in order)
    names = tuple(view["axes"][i] for i in order)
    call = f"init_device_mesh(\"cuda\", {shape!r}, mesh_dim_names={names!r})".replace("'", '"')
    return {"expressible": True, "call": call, "mesh": _mesh_list(view, order), "mesh_dim_names": list(names),
            "device_mesh": generic}


def explain_as_data(plan: planfile.Plan | dict, target: str) -> dict:
    """The plan's rank grids in ``target``'s vocabulary (the typed plan, or a plan.json document read once)."""
    if target not in TARGETS:
        raise ExplainAsError(f"--as {target!r}: choose one of {', '.join(TARGETS)}")
    plan = planfile.Plan.of(plan)
    views = _grid_views(plan)
    if not views:
        raise ExplainAsError(f"plan {plan.name} has neither a placement nor stage meshes to explain")
    out = []
    for v in views:
        order = find_order(v["sizes"], v["coords"], v["first_rank"])
        info = {"megatron": _megatron, "deepspeed": _deepspeed, "torch": _torch}[target](v, order)
        out.append({"scope": v["scope"], "ranks": [v["first_rank"], v["first_rank"] + len(v["coords"])],
                    "axes": v["axes"], "sizes": v["sizes"],
                    "slowest_first": None if order is None else [v["axes"][i] for i in order],
                    target: info, "groups": _groups(v)})
    return {"plan": plan.name, "as": target, "views": out}


def explain_as_renderables(data: dict, tty: bool = False) -> list:
    from planc.commands import ui   # rich: only to render; the data above needs nothing beyond the stdlib
    from planc.commands.ui import Col

    target = data["as"]
    title = {"megatron": "Megatron-LM", "deepspeed": "DeepSpeed", "torch": "torch.distributed"}[target]
    out: list = [f"plan {data['plan']} as {title}:"]
    for v in data["views"]:
        a, b = v["ranks"]
        info = v[target]
        axes = ", ".join(f"{n} {s}" for n, s in zip(v["axes"], v["sizes"]))
        out += ["", f"{v['scope']} (ranks {a}..{b}; axes {axes}):"]
        if not info["expressible"]:
            out.append(f"  no fixed {title} order expresses this placement: {info['reason']}")
            if target == "torch":
                out.append(f"  the same mesh, rank by rank: {info['device_mesh']}")
        elif target == "megatron":
            s = info["sizes"]
            out.append(f"  order \"{info['order']}\" (fastest first; {info['how']})")
            out.append("  sizes " + ", ".join(f"{n} {s[n]}" for n in MEGATRON_DEFAULT))
            out.append(f"  {info['flags']}")
            if info["rank_offset"]:
                out.append(f"  these ranks start at {info['rank_offset']}: RankGenerator(..., rank_offset="
                           f"{info['rank_offset']})")
        elif target == "deepspeed":
            out.append(f"  {info['call']}   (slowest axis first)")
            if info["rank_offset"]:
                out.append(f"  topology rank r is global rank {info['rank_offset']} + r")
        else:
            out.append(f"  {info['call']}")
            out.append(f"  rank list (mesh[{']['.join(info['mesh_dim_names'])}]): {info['mesh']}")
        if v["groups"]:
            out.append(ui.table([Col("axis"), Col("size", "right"), Col("groups", "right"),
                                 Col("group of the first rank", wrap=True)],
                                [[g["axis"], g["size"], g["groups"], str(g["first_group"])] for g in v["groups"]],
                                tty=tty))
    return out
