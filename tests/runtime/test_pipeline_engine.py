"""Engine pieces without processes: instruction expansion from the plan's action lists, the
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
from planc.plan import Action, Direction, Plan, RankClass

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


# The engine opens each turn's step with a marker (``BeginOp(index=i)``, which lets its receives run
# ahead) where the turn begins: before its first receive, else before its compute.
BEGIN = getattr(E, "BeginOp", None)
FWD, BWD = Direction.FORWARD, Direction.BACKWARD


def act(kind, stage, m=None, transfer=None, direction=None):
    return Action(kind, stage, m, transfer, direction)


def _expand(sched):
    """Each step's instructions as (class name, kwargs), its one BeginOp checked (index, place) and removed."""
    out = []
    turns = sched.rank_class.turns()
    for i, step in enumerate(sched.steps()):
        cmds = [(type(c).__name__, c.kwargs) for c in step]
        if i < len(turns):
            at = [k for k, c in enumerate(step) if isinstance(c, BEGIN)]
            assert at == [turns[i].begin] and cmds[at[0]] == ("BeginOp", {"index": i}), cmds
            del cmds[at[0]]
        else:
            assert not any(isinstance(c, BEGIN) for c in step), cmds
        out.append(cmds)
    return out


def _sched(stage, acts, stages=3, micro_batches=2, loads=False):
    return PlanSchedule(RankClass((stage,), tuple(acts)), micro_batches, stages, stage, {stage} if loads else set())


def test_instruction_expansion_follows_the_action_list():
    outs = ["e2", "e2s", "e1"]
    acts = [act("F", 0, 0)] + [act("SEND", 0, 0, t, FWD) for t in outs] + [act("F", 0, 1)] + \
        [act("SEND", 0, 1, t, FWD) for t in outs] + \
        [x for m in (0, 1) for x in [act("RECV", 0, m, t, BWD) for t in outs] + [act("B", 0, m)]] + [act("REDUCE", 0)]
    steps = _expand(_sched(0, acts, loads=True))
    assert len(steps) == 5
    assert steps[0] == [("LoadMicroBatch", {"buffer_id": 0}), ("ForwardPass", {"buffer_id": 0})]
    assert steps[1] == [("SendActivation", {"buffer_id": 0, "transfer": t}) for t in outs] + \
        [("LoadMicroBatch", {"buffer_id": 1}), ("ForwardPass", {"buffer_id": 1})]
    assert steps[2] == [("SendActivation", {"buffer_id": 1, "transfer": t}) for t in outs] + \
        [("RecvGrad", {"buffer_id": 0, "transfer": t}) for t in outs] + [("BackwardPass", {"buffer_id": 0})]
    assert steps[3] == [("RecvGrad", {"buffer_id": 1, "transfer": t}) for t in outs] + \
        [("BackwardPass", {"buffer_id": 1})]
    assert steps[-1] == [("ReduceGrads", {}), ("OptimizerStep", {})]
    mid = _sched(1, [act("RECV", 1, 0, "a", FWD), act("RECV", 1, 0, "b", FWD), act("F", 1, 0),
                     act("SEND", 1, 0, "c", FWD), act("RECV", 1, 0, "c", BWD), act("B", 1, 0),
                     act("SEND", 1, 0, "a", BWD), act("SEND", 1, 0, "b", BWD), act("REDUCE", 1)], micro_batches=1)
    assert _expand(mid) == [
        [("RecvActivation", {"buffer_id": 0, "transfer": "a"}), ("RecvActivation", {"buffer_id": 0, "transfer": "b"}),
         ("ForwardPass", {"buffer_id": 0})],
        [("SendActivation", {"buffer_id": 0, "transfer": "c"}), ("RecvGrad", {"buffer_id": 0, "transfer": "c"}),
         ("BackwardPass", {"buffer_id": 0})],
        [("SendGrad", {"buffer_id": 0, "transfer": "a"}), ("SendGrad", {"buffer_id": 0, "transfer": "b"}),
         ("ReduceGrads", {}), ("OptimizerStep", {})]]
    assert (mid.micro_batches, mid.stages, mid.stage_id, mid.num_pipe_buffers()) == (1, 3, 1, 1)


def test_the_list_runs_as_written():
    """A send listed after a receive is issued after that receive's wait; the turn begins at the receive."""
    sched = _sched(1, [act("RECV", 1, 0, "a", FWD), act("F", 1, 0), act("RECV", 1, 0, "c", BWD),
                       act("SEND", 1, 0, "c", FWD), act("B", 1, 0), act("SEND", 1, 0, "a", BWD), act("REDUCE", 1)],
                   micro_batches=1)
    steps = [[type(c).__name__ for c in step] for step in sched.steps()]
    assert steps[1] == ["BeginOp", "RecvGrad", "SendActivation", "BackwardPass"]


def test_compiled_action_lists_expand_in_their_order(unet):
    """Every stage of the compiled unet-skip plan: its actions, in order, one instruction each (a forward
    of the first and last stage loads its micro-batch first; the reduce is the gradient reduction and the
    optimizer step), and a forward receives exactly the stage's incoming transfers (this file's reading of
    the plan), a backward its outgoing ones."""
    pipe = unet.pipeline
    assert pipe.micro_batches == 4 and len(pipe.actions) == 3
    name = {("RECV", FWD): "RecvActivation", ("RECV", BWD): "RecvGrad", ("SEND", FWD): "SendActivation",
            ("SEND", BWD): "SendGrad"}
    for s, cls in enumerate(pipe.actions):
        assert cls.stages == (s,)
        ins, outs = [t[0] for t in UNET_TRANSFERS if t[3] == s], [t[0] for t in UNET_TRANSFERS if t[1] == s]
        flat = [c for step in _expand(PlanSchedule(cls, 4, 3, s, {s} & {0, 2})) for c in step]
        want = []
        for a in cls.actions:
            if a.kind == "F":
                want += ([("LoadMicroBatch", {"buffer_id": a.micro_batch})] if s in (0, 2) else [])
                want.append(("ForwardPass", {"buffer_id": a.micro_batch}))
            elif a.kind == "B":
                want.append(("BackwardPass", {"buffer_id": a.micro_batch}))
            elif a.kind == "REDUCE":
                want += [("ReduceGrads", {}), ("OptimizerStep", {})]
            else:
                want.append((name[a.kind, a.direction], {"buffer_id": a.micro_batch, "transfer": a.transfer}))
        assert flat == want, s
        for t in cls.turns():
            got = sorted(r.transfer for r in t.recvs)
            assert got == sorted(ins if t.compute.kind == "F" else outs), (s, t.compute.text())


def test_instruction_map_covers_every_instruction(unet):
    want = {ds.LoadMicroBatch: PlanEngine._exec_load_micro_batch,
            ds.RecvActivation: PlanEngine._exec_recv_activations,
            ds.ForwardPass: PlanEngine._exec_forward_pass,
            ds.SendActivation: PlanEngine._exec_send_activations,
            ds.RecvGrad: PlanEngine._exec_recv_grads,
            ds.BackwardPass: PlanEngine._exec_backward_pass,
            E.WeightPass: PlanEngine._exec_weight_pass,
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
    emitted = {type(c) for s, cls in enumerate(unet.pipeline.actions)
               for step in PlanSchedule(cls, 4, 3, s, {s} & {0, 2}).steps() for c in step}
    assert emitted == set(want) - {E.WeightPass}     # no W in eager_1f1b
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
