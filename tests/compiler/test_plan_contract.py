"""Every plan the project ships or tests compiles to a plan.json that ``plan_contract`` accepts,
and ``plan_contract`` rejects each way a plan.json can break the contract.

``plan_contract`` is the outside checker PLAN_FORMAT.md says outside checkers may write: it was
written from PLAN_FORMAT.md, DESIGN.md and LANGUAGE.md alone and imports nothing of planc (not its
rank mapping, collective semantics, region arithmetic or NIC bound). The mutation tests below show
that each of its checks can fail: a checker that accepts everything would pass the first test."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

import plan_contract
from e2e_util import spelled

ROOT = Path(__file__).resolve().parents[2]
PLANS = sorted((ROOT / "plans").glob("*.plan")) + sorted(
    p for p in (ROOT / "tests" / "plans").glob("*.plan") if not p.stem.endswith("-spelled"))

# docs/plan-format.md: compiler.seconds is null unless asked for (byte-identical output); without
# the model probe there is no compute model, so the pipeline's predictions are null
EXPECTED_WARNINGS = ("compiler.seconds is None",)
UNPROBED_WARNINGS = ("pipeline: ", )


def _compile(path: Path, out: Path, probe: bool = False) -> Path:
    source = path if probe else spelled(path)
    c = compile_file(source, probe=probe)
    write_output(c.plan_json, c.program, out)
    return source


def _check(out: Path, plan_file: Path | None = None, probed: bool = False) -> tuple[list[str], list[str]]:
    violations, warnings = plan_contract.check(out, plan_file)
    expected = EXPECTED_WARNINGS + (() if probed else UNPROBED_WARNINGS)
    return violations, [w for w in warnings if not w.startswith(expected)]


@pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
def test_every_plan_meets_the_contract(path, tmp_path):
    source = _compile(path, tmp_path)
    violations, warnings = _check(tmp_path, source)
    assert violations == [], "\n".join(violations)
    assert warnings == [], "\n".join(warnings)


def test_a_probed_plan_meets_the_contract(tmp_path):
    """With the model probe: transfers inferred from the model, their backward routes sized by it."""
    path = ROOT / "tests" / "plans" / "mlp-three-stages-2-1-2.plan"
    _compile(path, tmp_path, probe=True)
    violations, warnings = _check(tmp_path, path, probed=True)
    assert violations == [] and warnings == [], "\n".join(violations + warnings)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["transfers"] and all("backward" in t for t in plan["transfers"])


# ------------------------------------------------------------------ the checker can fail

@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """plan.json of plans that between them have every section: a placement with a pipe axis and a
    broadcast transfer (gpt-2x4), explicit meshes of different sizes with per-stage reductions
    (mlp 2-1-2), several send/recv transfers across hosts (unet-skip), a hierarchical program
    over a group on two hosts (unet-skip-unequal)."""
    out = {}
    for name in ("plans/gpt-2x4.plan", "tests/plans/mlp-three-stages-2-1-2.plan", "plans/unet-skip.plan",
                 "tests/plans/unet-skip-unequal.plan"):
        d = tmp_path_factory.mktemp(Path(name).stem)
        _compile(ROOT / name, d)
        out[Path(name).stem] = json.loads((d / "plan.json").read_text())
    return out


def _mutated(compiled, name: str, tmp_path: Path, edit) -> list[str]:
    doc = copy.deepcopy(compiled[name])
    edit(doc)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    return _check(tmp_path)[0]


def _swap_coords(d):
    c = d["placement"]["coords"]
    i = next(k for k in range(1, len(c)) if c[k] != c[0])
    c[0], c[i] = c[i], c[0]


def _reduction(d):
    """The first reduction whose group spans two hosts."""
    hosts = d["cluster"]["hosts"]
    return next(r for r in d["reductions"] if r["groups"] and sum(
        1 for h in hosts if set(h) & set(r["groups"][0])) > 1)


def _flat_program(d):
    """One allreduce over each group: valid, not the program that was chosen."""
    r = _reduction(d)
    assert len(r["program"]["steps"]) > 1
    r["program"]["steps"] = [{"collective": "allreduce", "groups": r["groups"]}]
    d["groups"] = sorted({tuple(g) for g in d["groups"]} | {tuple(g) for g in r["groups"]})


def _drop_last_step(d):
    _reduction(d)["program"]["steps"].pop()


def _all_gather_first(d):
    _reduction(d)["program"]["steps"][0]["collective"] = "all_gather"


def _task_pair_on_one_nic(d):
    t = next(t for t in d["transfers"] if len(t["tasks"]) >= 2)
    t["tasks"][1]["start"] = t["tasks"][0]["start"]
    t["tasks"][1]["receivers"] = t["tasks"][0]["receivers"]


def _stage_meshes_overlap(d):
    """stage 1's first device replaced by stage 0's first, in its device list and its mesh."""
    a, b = d["stages"][0], d["stages"][1]
    old, new = b["devices"][0], a["devices"][0]

    def swap(m):
        return [swap(x) for x in m] if isinstance(m, list) else (new if m == old else m)
    b["devices"] = sorted(new if x == old else x for x in b["devices"])
    b["mesh"] = swap(b["mesh"])


def _send_after_its_gradient(d):
    """Stage 0 waits for micro-batch 0's gradient before it sends micro-batch 0's activations."""
    lst = d["pipeline"]["actions"][0]["list"]
    name = d["transfers"][0]["name"]
    a, b = lst.index(["SEND", 0, 0, name, "forward"]), lst.index(["RECV", 0, 0, name, "backward"])
    lst[a], lst[b] = lst[b], lst[a]


def _receive_late(d):
    lst = d["pipeline"]["actions"][1]["list"]
    recv = next(a for a in lst if a[0] == "RECV" and a[2] == 0 and a[4] == "forward")
    lst.remove(recv)
    lst.insert(lst.index(["F", 1, 0]) + 1, recv)


MUTATIONS = {
    "coords off the rank mapping": ("gpt-2x4", _swap_coords, "rank mapping"),
    "matrix column off its fanout": (
        "gpt-2x4", lambda d: d["placement"]["matrix"][0].__setitem__(0, d["placement"]["matrix"][0][0] * 2),
        "matrix"),
    "ranked worst first": ("gpt-2x4", lambda d: d["placement"]["ranked"].reverse()
                           if len(d["placement"]["ranked"]) > 2 else d["placement"]["ranked"].insert(
                               0, dict(d["placement"]["ranked"][0], predicted=1e9)), "ranked"),
    "hosts off the level numbering": ("gpt-2x4", lambda d: d["cluster"]["hosts"].reverse(), "level numbering"),
    "a program without its last step": ("unet-skip-unequal", _drop_last_step, "does not compute the sum"),
    "an all_gather of unreduced gradients": ("unet-skip-unequal", _all_gather_first, "does not compute the sum"),
    "an empty program": ("unet-skip-unequal", lambda d: _reduction(d)["program"].__setitem__("steps", []),
                         "empty program"),
    "reduction groups not the placement's": (
        "gpt-2x4", lambda d: d["reductions"][0].__setitem__("groups", [sorted(sum(d["reductions"][0]["groups"], []))]),
        "not those of the placement"),
    "a task dropped": ("unet-skip", lambda d: d["transfers"][0]["tasks"].pop(), "short of"),
    "a task sent twice": ("unet-skip", lambda d: d["transfers"][0]["tasks"].append(
        dict(d["transfers"][0]["tasks"][0], start=1e6)), "twice"),
    "a sender that does not hold the slice": (
        "unet-skip", lambda d: d["transfers"][0]["tasks"][0].__setitem__(
            "sender", d["transfers"][0]["tasks"][0]["receivers"][0]), "sender"),
    "two tasks on one NIC at once": ("unet-skip", _task_pair_on_one_nic, "overlap on host"),
    "a lower bound that is not the NIC bound": (
        "unet-skip", lambda d: d["transfers"][0].__setitem__("lower_bound", d["transfers"][0]["lower_bound"] / 2),
        "NIC bound"),
    "a makespan under the bound": ("unet-skip", lambda d: d["transfers"][0].__setitem__("makespan", 0.0),
                                   "< lower_bound"),
    "regions not the spec's": (
        "unet-skip", lambda d: d["transfers"][0]["src"].__setitem__("spec", "R S0 R"), "regions.src"),
    "a spec that uses a mesh dimension twice": (
        "gpt-2x4", lambda d: d["transfers"][0]["dst"].__setitem__("spec", "S0 S0 R"), "mesh dimension twice"),
    "stages that share a device": ("mlp-three-stages-2-1-2", _stage_meshes_overlap, "another stage"),
    "B before F": ("mlp-three-stages-2-1-2", lambda d: d["pipeline"]["actions"][0]["list"].reverse(), "before F"),
    "a micro-batch missing from a stage": (
        "mlp-three-stages-2-1-2", lambda d: d["pipeline"]["actions"][1]["list"].remove(["F", 1, 0]), "once"),
    "a send swapped with a receive (a hang)": ("mlp-three-stages-2-1-2", _send_after_its_gradient, "cannot all finish"),
    "a receive after the compute it feeds": ("mlp-three-stages-2-1-2", _receive_late, "after F1.0"),
    "a transfer without its backward": (
        "mlp-three-stages-2-1-2", lambda d: d["transfers"][0].pop("backward"), "backward"),
    "a missing section": ("unet-skip", lambda d: d.pop("transfers"), "missing required key 'transfers'"),
    "a section of the wrong type": ("unet-skip", lambda d: d.__setitem__("stages", "two"), "stages"),
    "the wrong format": ("unet-skip", lambda d: d.__setitem__("format", "planc/0"), "format"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_the_checker_rejects(case, compiled, tmp_path):
    name, edit, needle = MUTATIONS[case]
    violations = _mutated(compiled, name, tmp_path, edit)
    assert violations, f"{case}: accepted"
    assert any(needle in v for v in violations), f"{case}: {violations}"


def test_the_checker_accepts_a_valid_program_that_was_not_chosen(compiled, tmp_path):
    """The mutations above are caught for what they break, not for differing from planc's choice."""
    assert _mutated(compiled, "unet-skip-unequal", tmp_path, _flat_program) == []


def test_a_source_that_is_not_the_plan_is_named(compiled, tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps(compiled["unet-skip"]))
    other = tmp_path / "other.plan"
    other.write_text("plan other {\n}\n")
    violations, _ = plan_contract.check(tmp_path, other)
    assert any("sha256" in v for v in violations) and any("'other'" in v for v in violations), violations


def test_an_unreadable_plan_json_is_one_violation(tmp_path):
    assert plan_contract.check(tmp_path)[0][0].startswith("plan.json cannot be read")
    (tmp_path / "plan.json").write_text("{not json")
    assert len(plan_contract.check(tmp_path)[0]) == 1


@pytest.mark.parametrize("steps,ok", [
    ([("allreduce", [[0, 1, 2, 3]])], True),
    ([("reduce_scatter", [[0, 1, 2, 3]]), ("all_gather", [[0, 1, 2, 3]])], True),
    ([("reduce_scatter", [[0, 1], [2, 3]]), ("allreduce", [[0, 2], [1, 3]]), ("all_gather", [[0, 1], [2, 3]])], True),
    ([("reduce", [[0, 1, 2, 3]]), ("broadcast", [[0, 1, 2, 3]])], True),
    ([("reduce_scatter", [[0, 1], [2, 3]]), ("allreduce", [[0, 2], [1, 3]])], False),
    ([("allreduce", [[0, 1], [2, 3]]), ("allreduce", [[0, 1], [2, 3]])], False),   # counts a contribution twice
    ([("all_gather", [[0, 1, 2, 3]])], False),
    ([("reduce", [[0, 1, 2, 3]]), ("broadcast", [[1, 0, 2, 3]])], False),          # the root holds nothing
])
def test_collective_semantics(steps, ok):
    """DESIGN.md's collective semantics, on the checker's own simulator."""
    why = plan_contract.simulate_program([{"collective": c, "groups": g} for c, g in steps], [[0, 1, 2, 3]])
    assert (why is None) == ok, why


def _zero_plan(tmp_path) -> Path:
    """plans/gpt-2x4.plan (data 2 across the hosts) with ``zero = 1``: each stage's gradients reduce-scattered,
    its parameters all-gathered."""
    src = spelled(ROOT / "plans" / "gpt-2x4.plan")
    text = src.read_text().replace("train {", "train {\n    zero = 1", 1)
    path = src.parent / f"zero-contract-{tmp_path.name}.plan"   # beside it: the model path is relative
    out = tmp_path / "out"
    try:
        path.write_text(text)
        _compile(path, out)
    finally:
        path.unlink(missing_ok=True)
    return out


def test_zero_reduce_scatter_and_all_gather_targets_meet_the_contract(tmp_path):
    out = _zero_plan(tmp_path)
    violations, warnings = _check(out)
    assert violations == [], "\n".join(violations)
    plan = json.loads((out / "plan.json").read_text())
    targets = sorted(r.get("target", "allreduce") for r in plan["reductions"])
    assert targets.count("reduce_scatter") == targets.count("all_gather") >= 1


@pytest.mark.parametrize("mutation, message", [
    # two members swap the pieces they own: the steps leave each with the other's piece
    ("swap_scatter", "does not reach its target reduce_scatter"),
    # the all-gather starts from another assignment than the reduce-scatter left
    ("swap_gather", "do not pair up"),
    # owned ranges that overlap
    ("overlap", "does not give each group's members equal, disjoint ranges"),
])
def test_the_checker_rejects_broken_zero_targets(tmp_path, mutation, message):
    out = _zero_plan(tmp_path)
    plan = json.loads((out / "plan.json").read_text())
    kind = "all_gather" if mutation == "swap_gather" else "reduce_scatter"
    r = next(r for r in plan["reductions"] if r.get("target") == kind and r["groups"])
    ranges = r["owned"][0]
    if mutation == "overlap":
        ranges[1] = list(ranges[0])
    else:
        ranges[0], ranges[1] = ranges[1], ranges[0]
    (out / "plan.json").write_text(json.dumps(plan))
    violations, _ = plan_contract.check(out)
    assert any(message in v for v in violations), violations
