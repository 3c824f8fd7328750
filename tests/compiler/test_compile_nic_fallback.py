"""The host NIC order is an optimisation: when the order the simulation kept could hang the lists
under rendezvous semantics (planc.pipeline.deadlock, which models the runtime's receive-thread queues
that the iteration simulator does not), the compiler drops it, says so in plan.json ``choices``, and
the plan it writes passes the check; a plan without an order that hangs is still an error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from planc.driver.compile import RendezvousHang, compile_file

ROOT = Path(__file__).resolve().parents[2]

# the calibrated testbed's links at 2500 Mbit/s with every device on its own cores (GPU-like): the
# order the simulation keeps for this U-Net makes rank 0's receive thread wait for a gradient rank 2's
# NIC thread holds back behind a forward send rank 0's own NIC thread holds back
CLUSTER = """\
levels:
- {name: host, fanout: 3, bandwidth: 298561250.0, latency: 0.0, both_ways: 269906875.0}
- {name: device, fanout: 2, bandwidth: 1679840000.0, latency: 0.000260813}
host: host
flops: 129303000000.0
"""


def _plan(tmp_path: Path) -> Path:
    text = (ROOT / "plans/unet-wide.plan").read_text()
    text = re.sub(r"  cluster \{.*?\n  \}\n", '  cluster "c.yaml"\n', text, flags=re.S)
    text = text.replace('"../examples/', f'"{ROOT}/examples/')
    text = text.replace("channels = 8, inputs = 2, length = 4096", "channels = 256, inputs = 2, length = 256")
    (tmp_path / "c.yaml").write_text(CLUSTER)
    src = tmp_path / "u.plan"
    src.write_text(text)
    return src


def test_a_nic_order_that_could_hang_is_dropped_and_said(tmp_path):
    from planc.pipeline.deadlock import check_rendezvous

    c = compile_file(_plan(tmp_path), probe=True)
    pj = c.plan_json
    why = pj["choices"]["nic_order"]
    assert why.startswith("none: the host NIC order the simulation kept could hang the lists")
    assert "its NIC thread holds that send for its turn" in why and why.endswith("the plan runs without one")
    assert "nic_order" not in pj["pipeline"]
    assert not any(s["nic_ordered"] for s in pj["pipeline"]["predicted"]["schedules"].values())
    assert check_rendezvous(c.plan) == [] and check_rendezvous(c.plan, backend="gloo") == []
    json.dumps(pj)


def test_a_hang_without_a_nic_order_is_an_error_at_the_schedule(tmp_path, monkeypatch):
    """A plan whose lists could hang with no NIC order to drop: a located error (the schedule as
    written), never a traceback."""
    import planc.driver.compile as compile_mod
    from planc.lang.errors import PlanError

    monkeypatch.setattr(compile_mod, "check_rendezvous",
                        lambda plan, ahead=4, backend="nccl", **kw: ["rank 0 waits for rank 1"])
    from e2e_util import spelled

    src = spelled("gpt-bench-2x2.plan")         # the transfers typed: no probe, so no simulation, no order
    text = src.read_text()
    with pytest.raises(PlanError) as e:
        compile_file(src, probe=False)
    d = e.value.diagnostics[0]
    assert isinstance(e.value, RendezvousHang) and not e.value.nic_ordered
    assert d.message == "the plan could hang when launched:\n  rank 0 waits for rank 1\n  rank 0 waits for rank 1"
    line = next(i for i, t in enumerate(text.splitlines(), 1) if "schedule = eager_1f1b" in t)
    assert d.span.line == line and d.span.file.endswith("gpt-bench-2x2-spelled.plan")
