"""Every program the synthesizer emits is lowered by the compiler and executed by the runtime.

For two two-level hierarchies (2 hosts x 2 and x 4 devices) and one three-level one (2 x 2 x 2),
every valid program of the synthesizer (P²'s enumeration, up to 4 steps on two levels and 3 on
three: reduce ... broadcast,
master and parallel forms, reduce_scatter ... all_gather) is pinned in one plan with ``reduce NAME
over data using PROGRAM``, compiled by the real compiler (lowering, regions, the independent
checker), and plan.json's reductions are run by ``ReductionExecutor`` on 8 gloo ranks, half of them
with in-host steps through shared memory. Every rank's result must equal the sum, computed here,
of every member's input; inputs depend on the element's position, so a piece reduced into the
wrong place is caught.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_runtime_harness as H  # noqa: E402

from planc import ir  # noqa: E402
from planc.driver.compile import compile_file  # noqa: E402
from planc.reduction.hierarchy import Hierarchy  # noqa: E402
from planc.reduction.synthesize import synthesize  # noqa: E402

HIERARCHIES = {   # name -> (cluster levels, devices, the synthesizer's max_size)
    "2x2": ((("node", 2), ("gpu", 2)), 4, 4),
    "2x4": ((("node", 2), ("gpu", 4)), 8, 4),
    "2x2x2": ((("pod", 2), ("node", 2), ("gpu", 2)), 8, 3),   # 43 programs (161 at 4: the suite's time)
}
SIZE = 1001        # elements: odd, so every program's buckets are padded to its unit


def _plan_text(name: str, levels, devices: int, programs) -> str:
    cluster = "\n".join(f"    level {n} x {f} : bandwidth {10 ** (i + 1)} GB/s, latency 5 us"
                        for i, (n, f) in enumerate(levels))
    host = levels[-2][0]
    reductions = "\n".join(f"  reduce p{i} over data using {ir.program_text(p)} : f32[{SIZE}]"
                           for i, p in enumerate(programs))
    return (f"plan synthesized_{name.replace('x', '_')} {{\n  cluster {{\n{cluster}\n    host = {host}\n  }}\n"
            f"  stage 0 on devices 0..{devices} as (data = {devices})\n{reductions}\n}}\n")


def _compiled_plans(tmp_path) -> list[dict]:
    plans = []
    for name, (levels, devices, max_size) in HIERARCHIES.items():
        programs = synthesize(Hierarchy(levels), max_size)
        path = tmp_path / f"{name}.plan"
        path.write_text(_plan_text(name, levels, devices, programs))
        plan = compile_file(path, probe=False).plan_json
        texts = [r["program"]["text"] for r in plan["reductions"]]
        assert texts == [ir.program_text(p) for p in programs], name   # pinned, lowered as written
        plans.append(plan)
    return plans


def executor_worker(rank, world, plans):
    import torch
    import torch.distributed as dist

    from planc import plan as contract
    from planc.runtime.main import contribution
    from planc.runtime.reduce import ReductionExecutor
    pool: dict = {}
    done = 0
    for doc in plans:
        plan = contract.Plan.from_json(doc)
        groups = {}
        for g in plan.groups:                  # the plan's groups, communicators reused across plans
            if g not in pool:
                pool[g] = dist.new_group(ranks=list(g))
            groups[g] = pool[g] if rank in g else None
        for i, red in enumerate(plan.reductions):
            group = red.group_of(rank)
            if group is None:
                continue
            ex = ReductionExecutor(red, groups, rank, bucket_bytes=1024 if i % 3 == 0 else None,
                                   host_of=plan.cluster.host_of, shared_memory=i % 2 == 0)
            out = ex.run(contribution(SIZE, rank))
            want = sum(contribution(SIZE, d) for d in group)
            if not torch.equal(out, want):
                wrong = (out != want).nonzero().flatten()[:5].tolist()
                raise AssertionError(f"{plan.name} {red.name} `{red.text}`: rank {rank} differs at {wrong}")
            done += 1
    return done


def test_every_synthesized_program_runs_and_sums(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANC_SHM_DIR", str(tmp_path))    # the segments this test makes, and nothing left
    plans = _compiled_plans(tmp_path)
    programs = [r for p in plans for r in p["reductions"]]
    collectives = {s["collective"] for r in programs for s in r["program"]["steps"]}
    assert collectives == {str(c) for c in ir.Collective}, collectives
    texts = " ".join(r["program"]["text"] for r in programs)
    assert "form=master" in texts and "form=parallel" in texts and "form=inside" in texts
    assert max(r["program"]["unit"] for r in programs) >= 4        # nested cuts: quarters and finer
    counts = H.run_ranks(executor_worker, 8, plans)
    expected = {k: sum(1 for r in programs if any(k in g for g in r["groups"])) for k in range(8)}
    assert {k: int(v) for k, v in counts.items()} == expected
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("planc-red-")]
