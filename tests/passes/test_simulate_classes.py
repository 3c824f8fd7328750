"""The iteration simulator on rank classes of several stages (interleaved_1f1b, zbv: one compute stream per
mesh) and on a split backward (W), against closed forms derived here by hand."""

import pytest

from planc import ir
from planc.pipeline.schedules import build
from planc.pipeline.simulate import SimInput, SimReduction, SimTask, SimTransfer, StageCompute, predict, predict_schedule


def cluster(devices, bw=1e9):
    return ir.Cluster((ir.Level("node", devices, bw, 0.0),), "node")


def meshes_input(S, where, f, b, w=None, nbytes=0.0):
    """S stages of one layer each, stage s on device ``where(s)``; a chain of transfers (local, no tasks,
    where both stages are on one device). ``w``: the weight-gradient share of the backward ``b``."""
    comp = tuple(StageCompute((f,), (b,), (0.0,), weight=() if w is None else (w,)) for _ in range(S))
    trs = []
    for s in range(S - 1):
        a, z = where(s), where(s + 1)
        local = a == z
        trs.append(SimTransfer(f"t{s}", s, s + 1, () if local else (SimTask(a, (z,), nbytes, "send_recv"),),
                               () if local else (SimTask(z, (a,), nbytes, "send_recv"),), local))
    devices = max(where(s) for s in range(S)) + 1
    return SimInput(cluster(devices), tuple((where(s),) for s in range(S)), comp, tuple(trs))


@pytest.mark.parametrize("S, B", [(2, 4), (4, 8), (3, 3)])
def test_1f1b_bubble(S, B):
    """f = 1, b = 2, free communication: (B + S - 1)(f + b), bubble (S - 1) / (B + S - 1)."""
    p = predict_schedule(meshes_input(S, lambda s: s, 1.0, 2.0), "1f1b", B)
    assert p.iteration == pytest.approx((B + S - 1) * 3.0)
    assert all(st.bubble == pytest.approx((S - 1) / (B + S - 1)) for st in p.stages)


@pytest.mark.parametrize("S, B", [(2, 4), (4, 8), (4, 4), (3, 6)])
def test_zb_h1_leaves_a_third_of_1f1bs_bubble(S, B):
    """f = 1, b = 2 of which w = 1 (b = w): ZB-H1's bubble is (S - 1)(f + b - w) = 2 (S - 1) ... per the
    paper (S - 1)(T_F + T_B - T_W) with T_B = 1 the input-gradient pass: (S - 1) x 1, a third of 1F1B's
    (S - 1)(f + b) = 3 (S - 1). Every stage computes 3B."""
    p = predict_schedule(meshes_input(S, lambda s: s, 1.0, 2.0, w=1.0), "zb_h1", B)
    assert p.iteration == pytest.approx(3.0 * B + (S - 1) * 1.0)
    one = predict_schedule(meshes_input(S, lambda s: s, 1.0, 2.0, w=1.0), "1f1b", B)
    assert (p.iteration - 3.0 * B) * 3 == pytest.approx(one.iteration - 3.0 * B)
    # from F to W a stage holds up to 1F1B's first stage's peak
    assert max(st.peak_in_flight for st in p.stages) == min(B, S)


@pytest.mark.parametrize("P, V, B", [(2, 2, 4), (4, 2, 8), (2, 3, 6)])
def test_interleaved_bubble(P, V, B):
    """A model of f = 1, b = 2 per 1F1B stage cut into V stages per device (each f / V, b / V), stage s on
    device s mod P: each device computes B (f + b) = 3B and the pipeline fills and drains once through
    stages of 1 / V the size: (P - 1)(f + b) / V. The devices of a class compute on one stream: its stages
    report the same busy fraction."""
    p = predict_schedule(meshes_input(P * V, lambda s: s % P, 1.0 / V, 2.0 / V), "interleaved_1f1b", B, virtual=V)
    assert p.iteration == pytest.approx(3.0 * B + (P - 1) * 3.0 / V)
    one = predict_schedule(meshes_input(P, lambda s: s, 1.0, 2.0), "1f1b", B)
    assert (p.iteration - 3.0 * B) * V == pytest.approx(one.iteration - 3.0 * B)
    busy = {s.stage: s.busy for s in p.stages}
    for s in range(P * V):
        assert busy[s] == pytest.approx(busy[s % P])
        assert busy[s] == pytest.approx(3.0 * B / p.iteration)


def test_zbv_with_a_local_transfer():
    """zbv on P = 2 meshes (stages 0, 3 on device 0; 1, 2 on device 1; t1 from stage 1 to 2 is local: no
    tasks, no flow), half stages of f = b = w = 0.5: each mesh computes 2 x B x 1.5 = 3B, the last mesh
    waits one f for the first forward: 3B + 0.5. With a slow link the local transfer still costs nothing:
    only t0 and t2 move bytes."""
    where = {0: 0, 1: 1, 2: 1, 3: 0}.__getitem__
    B = 8
    p = predict_schedule(meshes_input(4, where, 0.5, 1.0, w=0.5), "zbv", B)
    assert p.iteration == pytest.approx(3.0 * B + 0.5)
    slow = predict_schedule(meshes_input(4, where, 0.5, 1.0, w=0.5, nbytes=1.0), "zbv", B, timeline=True)
    moved = {name for name, *_ in slow.transfers}
    assert moved == {"t0", "t2"}


def test_gradients_are_ready_at_the_last_w():
    """One stage on two devices (data 2), two layers of f = 1, b = 2 (w = 1 each), layer 1's gradients one
    bucket reduced in 1.5 s. 1f1b: the bucket is full when layer 1's backward ends (t = 2 + 2), its reduction
    ends at 5.5, hidden by layer 0's backward (to 6). zb_h1: B runs the input gradients (1 + 1) to 4, W layer
    1's weight gradients to 5, then layer 0's to 6; the reduction starts at 5 and ends at 6.5."""
    comp = (StageCompute((1.0, 1.0), (2.0, 2.0), (0.0, 1.5e9), weight=(1.0, 1.0)),)
    sim = SimInput(cluster(2), ((0, 1),), comp, (), (SimReduction(0, (("allreduce", ((0, 1),)),)),),
                   bucket_bytes=1e18)
    assert predict(sim, build("1f1b", 1, 1).actions).iteration == pytest.approx(6.0)
    assert predict(sim, build("zb_h1", 1, 1).actions).iteration == pytest.approx(6.5)


def test_classes_sharing_devices_are_refused():
    """Two rank classes on one device cannot both run (one compute stream): a located ValueError, not a hang."""
    sim = meshes_input(2, lambda s: 0, 1.0, 2.0)
    with pytest.raises(ValueError, match="on the same devices"):
        predict(sim, build("1f1b", 2, 2, sim.transfers).actions)
