"""`planc explain --as megatron|deepspeed|torch`, checked against models of the other tools' rank
numbering written here from their documented semantics (Megatron's RankGenerator), or the tools
themselves (DeepSpeed's ProcessTopology, torch's row-major mesh), never against planc's code."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from planc.driver.compile import compile_file
from planc.commands.explain_as import explain_as_data, explain_as_renderables
from planc.commands.ui import render

from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = {"tensor": "tp", "data": "dp", "pipe": "pp"}

PLAN = """
plan as_{tag} {{
  cluster {{
    level node x 2 : bandwidth 12.5 GB/s, latency 20 us
    level gpu  x 4 : bandwidth 150 GB/s, latency 2 us
  }}
  parallel {{ {axes}, place = {matrix} }}
  reduce grads over data : f32[1024]
  reduce acts over tensor : f32[256]
}}
"""


def megatron_ranks(order: str, sizes: dict[str, int]) -> dict[int, dict[str, int]]:
    """Megatron's numbering for an ``order`` string: the rank is a mixed-radix number of the
    coordinates, the first name of the order the fastest (stride 1), each next name's stride the
    product of the sizes before it. Returns each rank's coordinate per name."""
    names = order.split("-")
    world = math.prod(sizes.get(n, 1) for n in names)
    out = {}
    for r in range(world):
        rest, coord = r, {}
        for n in names:
            coord[n] = rest % sizes.get(n, 1)
            rest //= sizes.get(n, 1)
        out[r] = coord
    return out


def megatron_groups(order: str, sizes: dict[str, int], name: str) -> list[list[int]]:
    """RankGenerator.get_ranks(name): the ranks equal on every other name form a group; members in
    rank order, groups in order of their first rank."""
    groups = defaultdict(list)
    for r, c in megatron_ranks(order, sizes).items():
        groups[tuple((n, x) for n, x in c.items() if n != name)].append(r)
    return sorted(sorted(g) for g in groups.values())


def _plan(tmp_path, tag, axes, matrix):
    src = tmp_path / f"{tag}.plan"
    src.write_text(PLAN.format(tag=tag, axes=", ".join(f"{a} = {s}" for a, s in axes), matrix=matrix))
    return compile_file(src, probe=False).plan_json


@pytest.mark.parametrize("matrix, how", [
    ("[[2, 1], [1, 2], [1, 2]]", "default order"),            # pipe across nodes, tensor fastest
    ("[[1, 2], [2, 1], [1, 2]]", "--use-tp-pp-dp-mapping"),    # data across nodes
    ("[[1, 2], [1, 2], [2, 1]]", "initialize_model_parallel"),  # tensor across nodes: a custom order
])
def test_megatron_order_reproduces_the_placement(tmp_path, matrix, how):
    plan = _plan(tmp_path, "m", [("pipe", 2), ("data", 2), ("tensor", 2)], matrix)
    view = explain_as_data(plan, "megatron")["views"][0]
    info = view["megatron"]
    assert info["expressible"] and how in info["how"], info
    assert sorted(info["order"].split("-")) == ["cp", "dp", "ep", "pp", "tp"]
    sizes = info["sizes"]
    assert (sizes["tp"], sizes["dp"], sizes["pp"], sizes["cp"], sizes["ep"]) == (2, 2, 2, 1, 1)
    # every device's coordinates under the printed order are planc's
    names = [MEGATRON[a["name"]] for a in plan["placement"]["axes"]]
    ref = megatron_ranks(info["order"], sizes)
    for d, coord in enumerate(plan["placement"]["coords"]):
        assert [ref[d][n] for n in names] == coord, d
    # and Megatron's groups are the plan's reduction groups and stage meshes
    by_name = {r["name"]: sorted(map(sorted, r["groups"])) for r in plan["reductions"]}
    assert megatron_groups(info["order"], sizes, "dp") == by_name["grads"]
    assert megatron_groups(info["order"], sizes, "tp") == by_name["acts"]
    stage_devices = [sorted(itertools.chain.from_iterable(s["mesh"])) for s in plan["stages"]]
    for g in megatron_groups(info["order"], sizes, "pp"):      # one member per stage, same mesh position
        assert [next(i for i, devs in enumerate(stage_devices) if d in devs) for d in g] == [0, 1]
    text = render(*explain_as_renderables(explain_as_data(plan, "megatron")))
    assert f'order "{info["order"]}"' in text and "--tensor-model-parallel-size 2" in text


def test_megatron_cannot_express_a_split_axis(tmp_path):
    """tensor x data on node x gpu with data split over both levels and tensor's digit between its
    parts: data groups {0, 1, 4, 5} are no arithmetic progression of any order."""
    plan = _plan(tmp_path, "split", [("tensor", 2), ("data", 4)], "[[1, 2], [2, 2]]")
    coords = plan["placement"]["coords"]
    for order in ("tp-dp", "dp-tp"):                       # independently: no Megatron order numbers it so
        ref = megatron_ranks(order, {"tp": 2, "dp": 4})
        assert any([ref[d]["tp"], ref[d]["dp"]] != c for d, c in enumerate(coords)), order
    data = explain_as_data(plan, "megatron")
    info = data["views"][0]["megatron"]
    assert not info["expressible"]
    assert "axis 'data' is split across levels (node x2, gpu x2)" in info["reason"]
    assert "axis 'tensor' (level gpu x2) sits between its parts" in info["reason"]
    text = " ".join(render(*explain_as_renderables(data)).split())
    assert "no fixed Megatron-LM order expresses this placement: axis 'data' is split" in text
    for target in ("deepspeed", "torch"):                  # the same verdict in every vocabulary
        assert not explain_as_data(plan, target)["views"][0][target]["expressible"]
    # torch can still build the mesh rank by rank
    mesh = explain_as_data(plan, "torch")["views"][0]["torch"]["mesh"]
    for d, (t, x) in enumerate(coords):
        assert mesh[t][x] == d


def test_deepspeed_topology_numbers_ranks_as_the_plan(tmp_path):
    from deepspeed.runtime.pipe.topology import ProcessTopology

    plan = _plan(tmp_path, "ds", [("pipe", 2), ("data", 2), ("tensor", 2)], "[[1, 2], [1, 2], [2, 1]]")
    info = explain_as_data(plan, "deepspeed")["views"][0]["deepspeed"]
    assert info["expressible"] and info["call"].startswith("ProcessTopology(axes=[")
    topo = ProcessTopology(axes=info["axes"], dims=info["dims"])
    planc_names = [a["name"] for a in plan["placement"]["axes"]]
    for d, coord in enumerate(plan["placement"]["coords"]):
        c = topo.get_coord(d)._asdict()
        assert [c["model" if n == "tensor" else n] for n in planc_names] == coord, d


def test_torch_mesh_is_row_major_over_the_printed_names(tmp_path):
    import torch

    plan = _plan(tmp_path, "pt", [("pipe", 2), ("data", 2), ("tensor", 2)], "[[1, 2], [2, 1], [1, 2]]")
    info = explain_as_data(plan, "torch")["views"][0]["torch"]
    assert info["expressible"] and info["call"].startswith('init_device_mesh("cuda", (')
    shape = [plan["placement"]["axes"][[a["name"] for a in plan["placement"]["axes"]].index(n)]["size"]
             for n in info["mesh_dim_names"]]
    mesh = torch.arange(plan["cluster"]["devices"]).reshape(shape)    # what init_device_mesh lays out
    assert mesh.tolist() == info["mesh"]
    planc_names = [a["name"] for a in plan["placement"]["axes"]]
    for d, coord in enumerate(plan["placement"]["coords"]):
        idx = tuple(coord[planc_names.index(n)] for n in info["mesh_dim_names"])
        assert int(mesh[idx]) == d


def test_explicit_stages_are_explained_per_stage():
    plan = compile_file(ROOT / "plans" / "alpacomm-2x4.plan", probe=False).plan_json
    data = explain_as_data(plan, "torch")
    assert [v["scope"] for v in data["views"]] == [f"stage {s['index']}" for s in plan["stages"]]
    for v, s in zip(data["views"], plan["stages"]):
        assert v["torch"]["mesh"] == s["mesh"]              # the exact rank list of the stage's mesh
        assert not v["torch"]["expressible"] and "whole world" in v["torch"]["reason"]
    meg = explain_as_data(plan, "megatron")["views"][0]["megatron"]
    assert not meg["expressible"] and "'m0', 'm1' has no Megatron counterpart" in meg["reason"]
    ds = explain_as_data(plan, "deepspeed")["views"][1]["deepspeed"]
    assert ds["expressible"] and ds["rank_offset"] == 8 and ds["dims"] == [2, 4]


def test_cli_as_json_and_text():
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(spelled("gpt-2x4.plan")),
                        "--no-probe", "--as", "deepspeed", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["as"] == "deepspeed" and data["views"][0]["scope"] == "world"
    r = subprocess.run([sys.executable, "-m", "planc", "explain", str(spelled("gpt-2x4.plan")),
                        "--no-probe", "--as", "mpi"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice: 'mpi'" in r.stderr
