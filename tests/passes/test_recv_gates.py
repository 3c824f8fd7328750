"""When the receive thread posts a stage's receives (``planc.plan.gates.post_gates``), the one rule
the runtime, the simulator and the deadlock check share: never later than ``ahead`` operations
before the consumer, a backward's gradients from its micro-batch's forward on, queue order kept,
and the receives posted ahead bounded by the schedule plus the window."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from planc.pipeline.schedules import op_text, stage_ops
from planc.plan.gates import post_gates


@settings(max_examples=300, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "eager_1f1b"]), stages=st.integers(1, 5),
       data=st.data(), micro_batches=st.integers(1, 12), ahead=st.integers(0, 6))
def test_gates_keep_order_window_and_bound(schedule, stages, data, micro_batches, ahead):
    stage = data.draw(st.integers(0, stages - 1))
    ops = [op_text(o) for o in stage_ops(schedule, stages, stage, micro_batches)]
    # a middle stage receives for every op; the first only for B, the last only for F
    receives = [(o[0] == "F" and stage > 0) or (o[0] == "B" and stage < stages - 1) for o in ops]
    gates = post_gates(ops, ahead, receives)
    forward_at = {int(o[1:]): j for j, o in enumerate(ops) if o[0] == "F"}
    assert len(gates) == len(ops)
    assert all(a <= b for a, b in zip(gates, gates[1:])), "queue order: gates never decrease"
    for j, (o, g) in enumerate(zip(ops, gates)):
        assert 0 <= g <= j
        if receives[j]:
            assert g <= max(0, j - ahead), "never later than the window"
            if o[0] == "B":
                earlier = max([gates[k] for k in range(j) if receives[k]], default=0)
                assert g <= max(earlier, forward_at[int(o[1:])]), "a gradient is posted from its forward on"
    for i in range(len(ops)):   # what is posted beyond the op being computed: the window or in-flight gradients
        for j in range(i + 1, len(ops)):
            if receives[j] and gates[j] <= i:
                assert j <= i + ahead or (ops[j][0] == "B" and forward_at[int(ops[j][1:])] <= i), (i, j, gates)


def test_gates_on_a_first_stage_of_eager_1f1b():
    ops = [op_text(o) for o in stage_ops("eager_1f1b", 3, 0, 8)]
    assert ops == ["F0", "F1", "F2", "F3", "F4", "B0", "F5", "B1", "F6", "B2", "F7", "B3", "B4", "B5", "B6", "B7"]
    gates = post_gates(ops, 4, [o[0] == "B" for o in ops])
    # B m is posted when F m begins (the old rule, op j - 4, posted B4 only when B1 began)
    assert [g for o, g in zip(ops, gates) if o[0] == "B"] == [0, 1, 2, 3, 4, 6, 8, 10]
    # the ops with nothing to receive never hold the queue back
    assert gates[6] == gates[5] and gates[8] == gates[7]
    # with no gradient rule at all the window alone decides: the old j - ahead
    assert post_gates(["F0", "F1", "F2", "F3"], 1) == [0, 0, 1, 2]
