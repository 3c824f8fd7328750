"""End-to-end: plans whose stages sit on meshes of different sizes (tests/plans/*.plan).

Each plan is compiled by the real compiler, its output's ranks started directly (``e2e_util.run_direct``:
train.py once per device as a per-host launcher does, CPU/gloo, idle devices included), trained 3 steps
with SGD (Adam divides by sqrt(v) and hides gradient-scale errors), and every stage rank's
parameters compared with ``independent_reference``: the whole model trained in this process
with plain torch, knowing nothing of planc's runtime.

Every plan has a two-level cluster with slow host links (100 MB/s, 50 us) and the data axis of
at least one stage crossing hosts; where that stage has 2+ devices on each of 2 hosts the
synthesized gradient program must be hierarchical (reduce_scatter inside the hosts, allreduce
across, all_gather inside). Scenario table: ``PLANS`` below. Plus: 32 micro-batches must not
grow a stage's live activations beyond what its schedule allows (``--memory-stats``).

Slow tests: 6 launches of 6-10 ranks (~25-50 s each, almost all of it start-up: the steps take ~1 s).
Run them with ``.venv/bin/pytest -m slow tests/e2e/test_e2e_unequal.py -n 2``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from dataclasses import dataclass

import pytest

from planc.output.codegen import write_output
from planc.driver.compile import compile_file

from schedule_util import compute_lists
from e2e_util import (ROOT, _load_callable, assert_controls_fail, compare_dumps, data_degree, independent_reference,
                      run_direct, schedule_bound, stage_gradient_program, stage_ranks)

PLANS_DIR = ROOT / "tests" / "plans"
STEPS = 3
SCHEDULES = ["1f1b", "eager_1f1b"]
HIERARCHICAL = ["reduce_scatter", "allreduce", "all_gather"]


@dataclass(frozen=True)
class Scenario:
    ranks: int                    # devices = launched processes
    sizes: tuple[int, ...]        # devices per stage, by stage index
    idle: tuple[int, ...]         # devices in no stage
    crossing: tuple[int, ...]     # stages whose data groups span 2+ hosts
    hierarchical: tuple[int, ...]  # of those, the ones with 2+ devices of each group on each host
    tensor_layers: tuple[int, ...] = ()   # GPT blocks sharded over a `tensor` axis of size 2


PLANS = {
    # data 2 (host 0) -> data 4 (2 on host 1, 2 on host 2)
    "mlp-data2-to-data4.plan": Scenario(9, (2, 4), (2, 3, 8), crossing=(1,), hierarchical=(1,)),
    # 1 device -> (data 2, tensor 2); data groups {1,3} {2,4}: one device per host
    "gpt-1-to-data2-tensor2.plan": Scenario(6, (1, 4), (5,), crossing=(1,), hierarchical=(),
                                            tensor_layers=(2,)),
    # 2 -> 1 -> 2 devices, both data-2 stages across two hosts (one device per host)
    "mlp-three-stages-2-1-2.plan": Scenario(6, (2, 1, 2), (5,), crossing=(0, 2), hierarchical=()),
    # (data 4, tensor 2) GPT stage -> 1 device
    "gpt-tensor-to-single.plan": Scenario(10, (8, 1), (0,), crossing=(0,), hierarchical=(0,),
                                          tensor_layers=(1, 2)),
    # U-Net: data 4 (2 + 2 on two hosts) -> 1 -> data 2, skips from stage 0 to stage 2
    "unet-skip-unequal.plan": Scenario(8, (4, 1, 2), (1,), crossing=(0,), hierarchical=(0,)),
}

MEMORY_PLAN = "mlp-three-stages-2-1-2.plan"
MEMORY_MICRO_BATCHES = 32


# ---------------------------------------------------------------- helpers

def variant(tmp_path, plan_name, schedule=None, edits=()):
    """tests/plans/<plan_name> copied into tmp_path with its model paths made absolute, optionally
    another train schedule and ``edits`` ((pattern, replacement) regex substitutions)."""
    text = (PLANS_DIR / plan_name).read_text().replace('"../../examples/', f'"{ROOT}/examples/')
    if schedule is not None:
        text, n = re.subn(r"schedule = (gpipe|1f1b|eager_1f1b)\b", f"schedule = {schedule}", text)
        assert n == 1
    for pattern, repl in edits:
        text, n = re.subn(pattern, repl, text)
        assert n >= 1, pattern
    path = tmp_path / plan_name
    path.write_text(text)
    return path


@functools.lru_cache(maxsize=None)
def compiled(name):
    """compile_file of tests/plans/<name>, once per test process: the fast tests below only read it."""
    return compile_file(PLANS_DIR / name)


def compile_to(tmp_path, plan_path):
    c = compile_file(plan_path)
    out = tmp_path / "out"
    write_output(c.plan_json, c.program, out)
    return c, out


def hosts_of(plan, group):
    return {h for h, devs in enumerate(plan["cluster"]["hosts"]) for d in group if d in devs}


def check_layout(plan, sc: Scenario):
    """The plan's stages, idle devices and data groups are the scenario's (compile-time facts)."""
    assert plan["cluster"]["devices"] == sc.ranks
    stages = sorted(plan["stages"], key=lambda st: st["index"])
    assert tuple(len(st["devices"]) for st in stages) == sc.sizes
    assert sorted(set(range(sc.ranks)) - set(stage_ranks(plan))) == list(sc.idle)
    for s in sc.crossing:
        groups, _ = stage_gradient_program(plan, s)
        assert groups and all(len(hosts_of(plan, g)) >= 2 for g in groups), (s, groups)


def check_hierarchical(plan, stage):
    """``stage``'s gradients entry has the synthesized hierarchical program: reduce_scatter inside
    each host, allreduce across hosts, all_gather inside each host."""
    groups, program = stage_gradient_program(plan, stage)
    steps = program["steps"]
    assert [s["collective"] for s in steps] == HIERARCHICAL, (
        f"stage {stage}: synthesized {program['text']!r} for its data groups {groups}")
    devices = {d for g in groups for d in g}
    mine = [[g for g in s["groups"] if set(g) <= devices] for s in steps]
    assert all(mine), mine
    assert all(len(hosts_of(plan, g)) == 1 for g in mine[0] + mine[2])   # inside a host
    assert all(len(hosts_of(plan, g)) >= 2 for g in mine[1])             # across hosts


def losses_of(stdout):
    return [float(x) for x in re.findall(r"step \d+ loss ([-0-9.e+]+)", stdout)]


def train_and_compare(tmp_path, plan_path, sc: Scenario, steps=STEPS, extra=()):
    c, out = compile_to(tmp_path, plan_path)
    plan = json.loads((out / "plan.json").read_text())
    check_layout(plan, sc)
    assert not c.untrainable, "compile reports the plan untrainable: " + "; ".join(d.message for d in c.untrainable)
    r = run_direct(out, "--steps", str(steps), "--dump-params", str(tmp_path / "dump"), *extra)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert c.program.train.optimizer.name == "sgd", "SGD: the parameters see a gradient scale"
    losses = losses_of(r.stdout)

    def compare(ref_losses, ref_state, _record):
        assert losses == pytest.approx(ref_losses, rel=1e-4, abs=1e-6), "losses"
        return compare_dumps(tmp_path / "dump", stage_ranks(plan), ref_state, rtol=1e-5, atol=1e-6)

    # the reference's dataflow is the plan text's (not plan.json's); the controls (gradients x2, a data
    # rank's rows missing) must fail the same comparison
    sharded = compare(*independent_reference(plan, out, steps, source=plan_path), None)
    assert_controls_fail(compare, plan, out, steps, source=plan_path, data_parts=data_degree(plan))
    return plan, r, sharded


# ---------------------------------------------------------------- fast: compile and reference only

@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_checks_and_compiles(name):
    """Each plan passes `planc check` and compile_file; its layout is the scenario's.
    (Untrainable diagnostics are allowed here: the runtime for unequal stages may lag behind.)"""
    from planc.commands.cli import main
    assert main(["check", str(PLANS_DIR / name)]) == 0
    c = compiled(name)
    assert c.program.train.optimizer.name == "sgd"
    check_layout(c.plan_json, PLANS[name])


@pytest.mark.parametrize("name", sorted(n for n, sc in PLANS.items() if sc.hierarchical))
def test_cross_host_data_axis_gets_hierarchical_program(name):
    plan = compiled(name).plan_json
    for s in PLANS[name].hierarchical:
        check_hierarchical(plan, s)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_independent_reference_runs_on_each_plan(name):
    """The reference alone, 1 step, on each plan's dataflow (transfers, skips, tuple outputs)."""
    plan = compiled(name).plan_json
    losses, state = independent_reference(plan, ROOT / "examples", 1, source=PLANS_DIR / name)
    assert len(losses) == 1 and losses[0] > 0
    n_layers = max(st["layers"][1] for st in plan["stages"])
    assert {k.split(".")[1] for k in state} == {str(i) for i in range(n_layers)}


def test_independent_reference_reads_the_dataflow_from_the_plan_text(tmp_path):
    """The reference's stage cut and transfer taps are the plan text's, never plan.json's: a plan.json wired
    otherwise (stage 2's inputs in another order, a tap moved, the cut moved: what a compiler bug would
    write) trains the reference exactly as before, and the same change made in the text changes its numbers."""
    import copy

    import torch

    from e2e_util import plan_dataflow
    src = PLANS_DIR / "unet-skip-unequal.plan"
    plan = compiled("unet-skip-unequal.plan").plan_json
    assert plan_dataflow(src) == ([(0, 0, 2), (1, 2, 3), (2, 3, 6)],
                                  [("down", 0, None, 1), ("mid", 1, None, 2), ("e2", 0, 1, 2), ("e1", 0, 0, 2)])
    want, want_state = independent_reference(plan, ROOT / "examples", 1, source=src)
    wrong = copy.deepcopy(plan)
    t = {x["name"]: x for x in wrong["transfers"]}
    wrong["transfers"] = [t["down"], t["e2"], t["mid"], t["e1"]]   # stage 2 would get (e2, mid, e1)
    t["e2"]["src"]["layer"] = 0
    wrong["stages"][0]["layers"], wrong["stages"][1]["layers"] = [0, 1], [1, 3]
    got, got_state = independent_reference(wrong, ROOT / "examples", 1, source=src)
    assert got == want and all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    text = src.read_text()
    mid, e2 = (next(line for line in text.splitlines() if line.strip().startswith(f"transfer {n} ")) for n in ("mid", "e2"))
    swapped = tmp_path / "swapped.plan"
    swapped.write_text(text.replace(mid, "@@").replace(e2, mid).replace("@@", e2))
    assert [n for n, *_ in plan_dataflow(swapped)[1]] == ["down", "e2", "mid", "e1"]
    other, _ = independent_reference(plan, ROOT / "examples", 1, source=swapped)
    assert other != want


def test_independent_reference_matches_runtime_reference():
    """plans/unet-skip.plan (skips from stage 0 to stage 2): the independent reference trains exactly
    like planc's own run_reference (same losses, same parameters)."""
    import torch
    from planc.runtime.engine import build_optimizer, run_reference
    plan = compile_file(ROOT / "plans" / "unet-skip.plan").plan_json
    ours, our_state = independent_reference(plan, ROOT / "examples", STEPS, source=ROOT / "plans" / "unet-skip.plan")

    train, examples = plan["train"], ROOT / "examples"
    args, seed = train["model"]["args"], train["seed"]
    torch.manual_seed(seed)
    layers = _load_callable(examples, train["model"])(**args)
    opt = build_optimizer([p for l in layers for p in l.parameters()],
                          {"optimizer": {"type": "SGD", "params": {"lr": train["optimizer"]["lr"]}}})
    data = _load_callable(examples, train["data"])(train["micro_batch"], seed, **args)
    try:   # the runtime reads plan.json into a typed Plan (planc/plan/) where it has one
        from planc.plan import Plan
        runtime_plan = Plan.from_json(plan)
    except ImportError:
        runtime_plan = plan
    theirs = run_reference(layers, runtime_plan, _load_callable(examples, train["loss"]), data,
                           train["micro_batches"], STEPS, opt)
    their_state = {f"layers.{i}.{k}": v.detach() for i, l in enumerate(layers) for k, v in l.named_parameters()}

    assert ours == pytest.approx(theirs, rel=1e-6)
    assert set(our_state) == set(their_state)
    for k, v in our_state.items():
        assert v.equal(their_state[k]), k


def test_schedule_bound():
    assert schedule_bound(["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]) == 2
    assert schedule_bound(["F0", "B0", "F1", "B1"]) == 1
    assert schedule_bound([f"F{m}" for m in range(4)] + [f"B{m}" for m in range(4)]) == 4


# ---------------------------------------------------------------- slow: real launches

# One schedule per scenario, alternating (the suite's time budget: each launch is 6-10 processes);
# both schedules run unequal meshes, skips and tensor parallelism across the five
SCHEDULE_OF = {name: SCHEDULES[i % len(SCHEDULES)] for i, name in enumerate(PLANS)}


@pytest.mark.slow
@pytest.mark.parametrize("name,schedule", list(SCHEDULE_OF.items()))
def test_unequal_stages_match_reference(tmp_path, name, schedule):
    sc = PLANS[name]
    big = name == MEMORY_PLAN    # this launch also shows that large gradients are not clipped
    edits = large_gradient_edits(tmp_path) if big else ()
    plan, r, sharded = train_and_compare(tmp_path, variant(tmp_path, name, schedule, edits), sc)
    assert plan["pipeline"]["schedule"] == schedule
    if big:
        assert json.loads((tmp_path / "out" / "ds_config.json").read_text())["gradient_clipping"] == 0.0
    for s in sc.hierarchical:
        check_hierarchical(plan, s)
    # in-host gradient steps run through the host's shared memory (gloo), and only those (rank 0's gradients
    # line speaks for every stage, each stage's first rank for it);
    # a /dev/shm too small for the segments (a container's 64 MB) keeps gloo and says why
    assert "gradients: " in r.stdout
    shm, kept_gloo = "in-host steps through shared memory" in r.stdout, "in-host steps over gloo (" in r.stdout
    roomy = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 1 << 30
    speakers = [min(int(d) for d in st["devices"]) for st in plan["stages"]]
    assert (shm or kept_gloo) == any(in_host_steps(plan, d) for d in speakers) and not (shm and kept_gloo), \
        r.stdout[-2000:]
    assert not (roomy and kept_gloo), r.stdout[-2000:]
    # a block has 6 sharded parameters (qkv weight and bias, proj weight, fc1 weight and bias, fc2
    # weight), each in 2 parts; embeddings, norms, head and the other stages' layers stay whole
    assert {int(k.split(".")[1]) for k in sharded} == set(sc.tensor_layers), sorted(sharded)
    assert len(sharded) == 6 * len(sc.tensor_layers) and all(parts == 2 for _, parts, _ in sharded.values())
    if sc.tensor_layers:
        b = sc.tensor_layers[0]
        assert sharded[f"layers.{b}.qkv.weight"] == (0, 2, 3) and sharded[f"layers.{b}.mlp.2.weight"] == (1, 2, 1)


def in_host_steps(plan: dict, rank: int) -> bool:
    """Whether ``rank``'s gradient program (a synthesized one) has a step on a group inside one host."""
    for red in plan["reductions"]:
        if red.get("mode") != "allreduce" and any(rank in g for g in red["groups"]):
            return any(rank in g and len(g) > 1 and len(hosts_of(plan, g)) == 1
                       for step in red["program"]["steps"] for g in step["groups"])
    return False


def check_traces(plan: dict, directory, steps: int) -> None:
    """``--trace``: every rank wrote its timeline; each stage rank's compute thread ran exactly its
    plan.json list, step after step, in order; every receive and send of the list is there."""
    from planc.runtime.trace import load, summarise
    traces = load(str(directory))
    assert sorted(traces) == list(range(plan["cluster"]["devices"]))
    per_stage = compute_lists(plan)
    for st in plan["stages"]:
        ops = per_stage[st["index"]]
        incoming = [t["name"] for t in plan["transfers"] if t["dst"]["stage"] == st["index"]]
        outgoing = [t["name"] for t in plan["transfers"] if t["src"]["stage"] == st["index"]]
        for rank in st["devices"]:
            ev = [e for e in traces[rank]["traceEvents"] if e.get("ph") == "X"]
            ran = [("F" if e["name"] == "ForwardPass" else "B") + str(e["args"]["micro_batch"])
                   for e in sorted(ev, key=lambda e: e["ts"]) if e["name"] in ("ForwardPass", "BackwardPass")]
            assert ran == list(ops) * steps, f"rank {rank} ran {ran[:12]}… against its list {ops[:12]}…"
            recvs = [e for e in ev if e["tid"] == "recv"]
            assert len(recvs) == steps * len(ops) // 2 * (len(incoming) + len(outgoing)), (rank, len(recvs))
            assert {e["tid"] for e in ev} >= {"compute", "main"}
            steps_seen = [e for e in ev if e["tid"] == "main"]
            assert [e["name"] for e in sorted(steps_seen, key=lambda e: e["ts"])] == [f"step {i}" for i in range(steps)]
            for e in ev:   # everything a step did lies inside it
                if e["tid"] == "compute":
                    assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1
                               for s in steps_seen), e
    for row in summarise(str(directory)):
        parts = [row[k] for k in ("compute", "wait", "send", "reduce", "other")]
        assert all(0 <= x <= 1 for x in parts) and sum(parts) <= 1 + 1e-6, row
        if row["stage"] is not None:
            assert row["compute"] > 0 and row["step_s"] > 0, row


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["eager_1f1b"])   # the schedule with the most in flight
def test_many_micro_batches_stay_within_schedule_bound(tmp_path, schedule):
    """32 micro-batches: no stage rank holds more micro-batches (saved input, output, received
    gradient, or a receive posted ahead) than its schedule's bound computed here from plan.json
    plus the receives the runtime posts ahead (planc_runtime.comm.DEFAULT_AHEAD operations); a
    send stays in flight until its receiver posts it, so sends in flight are bounded by the
    deepest stage's bound plus that window. Neither grows with the micro-batch count."""
    from planc.runtime.comm import DEFAULT_AHEAD
    sc = PLANS[MEMORY_PLAN]
    path = variant(tmp_path, MEMORY_PLAN, schedule,
                   edits=[(r"micro_batches = \d+", f"micro_batches = {MEMORY_MICRO_BATCHES}")])
    stats, traces = tmp_path / "memory", tmp_path / "trace"
    plan, r, _ = train_and_compare(tmp_path, path, sc, steps=2,
                                   extra=("--memory-stats", str(stats), "--trace", str(traces)))
    check_traces(plan, traces, steps=2)
    assert plan["pipeline"]["micro_batches"] == MEMORY_MICRO_BATCHES
    per_stage = compute_lists(plan)
    bounds = {st["index"]: schedule_bound(per_stage[st["index"]]) for st in plan["stages"]}
    assert all(b < MEMORY_MICRO_BATCHES for b in bounds.values()), bounds
    written = sorted(int(f.stem[4:]) for f in stats.glob("rank*.json"))
    assert written == stage_ranks(plan), f"memory stats from ranks {written}"
    stats_of = {rank: json.loads((stats / f"rank{rank}.json").read_text()) for rank in written}
    table = {rank: dict(stats_of[rank], bound=bounds[st["index"]]) for st in plan["stages"] for rank in st["devices"]}
    deepest = max(bounds.values())
    assert deepest + DEFAULT_AHEAD < MEMORY_MICRO_BATCHES
    for st in plan["stages"]:
        bound = bounds[st["index"]]
        for rank in st["devices"]:
            got = stats_of[rank]
            assert got["stage"] == st["index"], (rank, table)
            assert 1 <= got["peak_live_micro_batches"] <= bound + DEFAULT_AHEAD, f"rank {rank} holds too many: {table}"
            assert got["peak_pending_sends"] <= deepest + DEFAULT_AHEAD, f"rank {rank}: too many sends in flight: {table}"


def large_gradient_edits(tmp_path) -> list[tuple[str, str]]:
    """Edits of the MLP plans that make a loss whose gradients have a norm far above 1 (DeepSpeed's default
    gradient_clipping is 1.0, and its norm would be each stage's own): a run then matches plain torch SGD,
    which clips nothing, only if the generated ds_config.json says gradient_clipping 0.0 (before it did,
    every parameter was off after one step). Each layer also holds a parameter its forward never uses,
    and SGD has momentum and weight decay: torch leaves such a parameter alone (its ``.grad`` is None),
    and so must the runtime, whose gradients are views into reduced buckets (before, they were zeroed
    views, and weight decay moved them). One launch of the parametrized test below carries it."""
    text = (ROOT / "examples" / "mlp.py").read_text()
    for old, new in (("    return nn.functional.mse_loss(output, target)",
                      "    return 1000.0 * nn.functional.mse_loss(output, target)"),
                     ("        self.act = act\n", "        self.act = act\n        self.spare = nn.Parameter(torch.ones(n_out))\n")):
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "big.py").write_text(text)
    return [(r'"[^"]*/examples/mlp\.py:', f'"{tmp_path}/big.py:'),
            (r"sgd\(lr = [0-9.e-]+\)", "sgd(lr = 1e-4, momentum = 0.9, weight_decay = 1.0)")]


SKIP_MODEL = '''import torch
from torch import nn


class Pass(nn.Module):
    def forward(self, x):
        return x


class In(nn.Module):
    def __init__(self, ids):
        super().__init__()
        self.ids = ids
        self.l = nn.Embedding(10, 6) if ids else nn.Linear(4, 6)

    def forward(self, x):
        return self.l(x).mean(1) if self.ids else torch.tanh(self.l(x))


class Comb(nn.Module):
    def forward(self, raw, h):
        return torch.cat([raw.float() / 3, h], dim=1)


def build(ids=False):
    return [Pass(), In(ids), nn.Linear(6, 6), Comb(), nn.Linear(11 if ids else 10, 2)]


def loss(out, y):
    return nn.functional.mse_loss(out, y)


def batches(micro_batch, seed, ids=False, **_):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 10, (micro_batch, 5), generator=g) if ids else torch.randn(micro_batch, 4, generator=g)
        yield x, torch.stack([x.float().mean(1), x.float()[:, 0] * x.float()[:, 1]], dim=1)
'''


@pytest.mark.slow
@pytest.mark.parametrize("ids", [True])   # float features (False) take the same path; one launch keeps the suite short
def test_a_skip_of_the_raw_input_trains(tmp_path, ids):
    """Stage 0 sends its raw input (no gradient: float features, or i64 token ids) as a skip to stage 2:
    its backward has nothing to differentiate for that transfer. It crashed the first backward; now the
    run matches plain torch SGD step for step."""
    import torch
    (tmp_path / "skipin.py").write_text(SKIP_MODEL)
    (tmp_path / "skipin.plan").write_text(f"""plan skipin {{
  cluster {{ level node x 1 : bandwidth 1 GB/s
            level cpu x 5 : bandwidth 10 GB/s }}
  model "skipin.py:build" {{ ids = {'true' if ids else 'false'} }}
  loss  "skipin.py:loss"
  data  "skipin.py:batches"
  stage 0 : layers 0..2 on devices 0..2 as (data = 2)
  stage 1 : layers 2..3 on devices 2..3 as (data = 1)
  stage 2 : layers 3..5 on devices 3..5 as (data = 2)
  transfer raw from stage 0 layer 0 to stage 2
  transfer h from stage 0 to stage 1
  transfer h2 from stage 1 to stage 2
  reduce gradients over data
  train {{ micro_batch = 4, micro_batches = 3, steps = 3, schedule = eager_1f1b, optimizer = sgd(lr = 0.1), seed = 21 }}
}}
""")
    _, out = compile_to(tmp_path, tmp_path / "skipin.plan")
    r = run_direct(out, "--steps", "3")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    fn = {k: _load_callable(tmp_path, {"file": "skipin.py", "function": k}) for k in ("build", "loss", "batches")}
    torch.manual_seed(21)
    layers = fn["build"](ids)
    opt = torch.optim.SGD([p for l in layers for p in l.parameters()], lr=0.1)
    data, want = fn["batches"](4, 21, ids), []
    for _ in range(3):
        total = 0.0
        for _ in range(3):
            x, y = next(data)
            raw = layers[0](x)
            loss = fn["loss"](layers[4](layers[3](raw, layers[2](layers[1](raw)))), y) / 3
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        want.append(total)
    assert losses_of(r.stdout) == pytest.approx(want, rel=1e-4, abs=1e-6), r.stdout[-2000:]
