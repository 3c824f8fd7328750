"""Engine pieces without processes: instruction expansion from the plan's per-stage lists, the
instruction map, the stage graph of a compiled plan, the probe CLI.

(Which specs a plan may train with is decided by the compiler, ``planc.driver.compile.check_trainable``;
tests/compiler/test_compile.py covers it.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule as ds

from planc.driver.compile import compile_file
from planc.runtime import engine as E
from planc.runtime.engine import PlanEngine, PlanSchedule, StageGraph
from planc.plan import Plan

ROOT = Path(__file__).resolve().parents[2]

# plans/unet-skip.plan, as written there: stage 0 = layers 0..2, 1 = 2..3, 2 = 3..6;
# (name, src stage, layer it sends (default: the stage's last), dst stage, shape) in declaration order
UNET_LAYERS = [(0, 2), (2, 3), (3, 6)]
UNET_TRANSFERS = [("down", 0, 1, 1, [4, 8, 8]), ("mid", 1, 2, 2, [4, 8, 8]),
                  ("e2", 0, 1, 2, [4, 8, 8]), ("e1", 0, 0, 2, [4, 4, 16])]


@pytest.fixture(scope="module")
def unet():
    from e2e_util import spelled
    return Plan.from_json(compile_file(spelled("unet-skip.plan"), probe=False).plan_json)


# The engine may open each operation's step with a marker (``BeginOp(index=i)``, which lets its
# receives run ahead); when it does, the marker must come first and carry the entry's position.
BEGIN = getattr(E, "BeginOp", None)


def _expand(sched):
    """Each step's instructions as (class name, kwargs), the leading BeginOp checked and removed."""
    out = []
    for i, step in enumerate(sched.steps()):
        cmds = [(type(c).__name__, c.kwargs) for c in step]
        if BEGIN is not None and i < len(sched.ops):
            assert isinstance(step[0], BEGIN) and cmds[0] == ("BeginOp", {"index": i}), cmds
            assert not any(isinstance(c, BEGIN) for c in step[1:]), cmds
            cmds = cmds[1:]
        out.append(cmds)
    return out


def test_instruction_expansion_follows_plan_lists():
    sched = PlanSchedule(["F0", "F1", "B0", "B1"], 2, 3, 0, [], ["e2", "e2s", "e1"], True)
    steps = _expand(sched)
    assert len(steps) == 5
    assert steps[0] == [("LoadMicroBatch", {"buffer_id": 0}), ("ForwardPass", {"buffer_id": 0}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e2"}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e2s"}),
                        ("SendActivation", {"buffer_id": 0, "transfer": "e1"})]
    assert steps[2] == [("RecvGrad", {"buffer_id": 0, "transfer": "e2"}),
                        ("RecvGrad", {"buffer_id": 0, "transfer": "e2s"}),
                        ("RecvGrad", {"buffer_id": 0, "transfer": "e1"}), ("BackwardPass", {"buffer_id": 0})]
    assert steps[-1] == [("ReduceGrads", {}), ("OptimizerStep", {})]
    mid = PlanSchedule(["F0", "B0"], 1, 3, 1, ["a", "b"], ["c"], False)
    assert _expand(mid) == [
        [("RecvActivation", {"buffer_id": 0, "transfer": "a"}), ("RecvActivation", {"buffer_id": 0, "transfer": "b"}),
         ("ForwardPass", {"buffer_id": 0}), ("SendActivation", {"buffer_id": 0, "transfer": "c"})],
        [("RecvGrad", {"buffer_id": 0, "transfer": "c"}), ("BackwardPass", {"buffer_id": 0}),
         ("SendGrad", {"buffer_id": 0, "transfer": "a"}), ("SendGrad", {"buffer_id": 0, "transfer": "b"})],
        [("ReduceGrads", {}), ("OptimizerStep", {})]]
    assert (mid.micro_batches, mid.stages, mid.stage_id, mid.num_pipe_buffers()) == (1, 3, 1, 1)


def test_compiled_per_stage_lists_expand_one_step_per_entry(unet):
    """Every stage of the compiled unet-skip plan: one instruction step per entry of its
    ``per_stage`` list, in that order, receiving and sending the stage's transfers by name."""
    g = StageGraph(unet)
    pipe = unet.pipeline
    assert pipe.micro_batches == 4 and len(pipe.per_stage) == 3
    last = g.num_stages - 1
    for s, ops in enumerate(pipe.per_stage):
        ins, outs = [t[0] for t in UNET_TRANSFERS if t[3] == s], [t[0] for t in UNET_TRANSFERS if t[1] == s]
        steps = _expand(PlanSchedule(ops, pipe.micro_batches, g.num_stages, s, g.incoming(s), g.outgoing(s),
                                     s in (0, last)))
        assert len(steps) == len(ops) + 1 and steps[-1] == [("ReduceGrads", {}), ("OptimizerStep", {})]
        for op, step in zip(ops, steps):
            m = int(op[1:])
            if op[0] == "F":
                want = ([("LoadMicroBatch", {"buffer_id": m})] if s in (0, last) else [])
                want += [("RecvActivation", {"buffer_id": m, "transfer": n}) for n in ins]
                want += [("ForwardPass", {"buffer_id": m})]
                want += [("SendActivation", {"buffer_id": m, "transfer": n}) for n in outs]
            else:
                want = [("RecvGrad", {"buffer_id": m, "transfer": n}) for n in outs]
                want += [("BackwardPass", {"buffer_id": m})]
                want += [("SendGrad", {"buffer_id": m, "transfer": n}) for n in ins]
            assert step == want, (s, op)


def test_instruction_map_covers_every_instruction(unet):
    want = {ds.LoadMicroBatch: PlanEngine._exec_load_micro_batch,
            ds.RecvActivation: PlanEngine._exec_recv_activations,
            ds.ForwardPass: PlanEngine._exec_forward_pass,
            ds.SendActivation: PlanEngine._exec_send_activations,
            ds.RecvGrad: PlanEngine._exec_recv_grads,
            ds.BackwardPass: PlanEngine._exec_backward_pass,
            ds.SendGrad: PlanEngine._exec_send_grads,
            ds.ReduceGrads: PlanEngine._exec_reduce_grads,
            ds.OptimizerStep: PlanEngine._exec_optimizer_step}   # the plan's regime (regime.py), not DeepSpeed's
    for cls, fn in want.items():   # each wrapped so a failure names rank, stage and instruction
        assert PlanEngine._INSTRUCTION_MAP[cls].__wrapped__ is fn, cls.__name__
    if BEGIN is not None:
        want[BEGIN] = PlanEngine._exec_begin_op
    assert PlanEngine._exec_optimizer_step is not E.PipelineEngine._exec_optimizer_step
    assert set(PlanEngine._INSTRUCTION_MAP) == set(want)
    # and every instruction a compiled plan's schedules emit has an entry
    g = StageGraph(unet)
    emitted = {type(c) for s, ops in enumerate(unet.pipeline.per_stage)
               for step in PlanSchedule(ops, 4, 3, s, g.incoming(s), g.outgoing(s), s in (0, 2)).steps()
               for c in step}
    assert emitted == set(want)
    assert emitted <= set(PlanEngine._INSTRUCTION_MAP)


def test_stage_graph_declaration_order(unet):
    g = StageGraph(unet)
    assert g.num_stages == 3 and [g.layers(s) for s in range(3)] == UNET_LAYERS
    names = [t[0] for t in UNET_TRANSFERS]
    assert [t.name for t in g.transfers] == names and list(g.by_name) == names
    for s in range(3):
        assert g.incoming(s) == [n for n, _, _, d, _ in UNET_TRANSFERS if d == s]
        assert g.outgoing(s) == [n for n, src, _, _, _ in UNET_TRANSFERS if src == s]
    assert g.incoming(2) == ["mid", "e2", "e1"] and g.outgoing(0) == ["down", "e2", "e1"]
    assert g.incoming(0) == [] and g.outgoing(2) == []
    for n, _, layer, _, shape in UNET_TRANSFERS:
        assert g.src_layer(g.by_name[n]) == layer, n
        assert list(g.by_name[n].shape) == shape


def test_probe_cli_reports_transfer_shapes():
    graph = {"stages": [list(r) for r in UNET_LAYERS],
             "transfers": [{"name": n, "src_stage": s, "src_layer": l, "dst_stage": d}
                           for n, s, l, d, _ in UNET_TRANSFERS]}
    r = subprocess.run([sys.executable, "-m", "planc.runtime.probe", str(ROOT / "examples" / "unet.py"), "build",
                        json.dumps({"channels": 4, "inputs": 2, "length": 16}), "4", "--graph", json.dumps(graph)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [t["name"] for t in out["transfers"]] == [t[0] for t in UNET_TRANSFERS]
    assert [t["shape"] for t in out["transfers"]] == [t[4] for t in UNET_TRANSFERS]
    assert out["params"] == sum(s["params"] for s in out["stages"])
    r = subprocess.run([sys.executable, "-m", "planc.runtime.probe", "nope.py", "build", "{}", "4"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("probe:")
